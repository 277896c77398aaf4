#!/usr/bin/env bash
# Runs a command under tools/kernel-trace/trace.c (a CUPTI kernel timeline: the stand-in for an
# Nsight Systems trace on the GPU hosts, whose nsys cannot make reports) and summarizes its CUDA
# graph launches, one row per step and GPU (summarize.py).
#
#   tools/kernel-trace/run.sh TRACE.csv COMMAND [ARGS...]      (on the GPU machine)
#
# Builds the library with the machine's CUPTI header (CUDA toolkit or PyTorch's wheel).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$1
shift
header=$(find /usr/local/cuda/ /usr/local/cuda/extras/CUPTI/include /usr/include \
    "$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || echo /nonexistent)" \
    -name cupti_activity.h 2>/dev/null | head -1 || true)
[ -n "$header" ] || { echo "kernel-trace: no cupti_activity.h on this machine" >&2; exit 1; }
include=$(dirname "$header")
library=$(find "$include/.." "$include/../.." /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | head -1 || true)
[ -n "$library" ] || { echo "kernel-trace: no libcupti.so near $include" >&2; exit 1; }
# The newest kernel record the header declares (its layout is the library's).
record=$(grep -ho 'CUpti_ActivityKernel[0-9]*;' "$include"/cupti_activity*.h | tr -d ';' | sort -V | tail -1)
build=$(mktemp -d)
gcc -O2 -shared -fPIC -I"$include" -I/usr/local/cuda/include -DKERNEL_RECORD="$record" "$here/trace.c" \
    -o "$build/libkerneltrace.so" "$library" -Wl,-rpath,"$(dirname "$library")"
echo "kernel-trace: $record from $include, $library" >&2
# The command's own output goes beside the trace.
CUDA_INJECTION64_PATH="$build/libkerneltrace.so" KERNEL_TRACE_OUT="$out" "$@" >"$out.stdout"
python3 "$here/summarize.py" "$out"
