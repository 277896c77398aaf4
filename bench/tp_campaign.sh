#!/usr/bin/env bash
# Issue 46's checks and measurements on a machine of 2 (or 4) GPUs, in two device calls of at
# most 10 minutes, full logs under $OUT (default /tmp/tp-campaign):
#
#   bash bench/tp_campaign.sh check   the tensor-parallel tests (N = 2 and 4 against one GPU,
#                                      a failing rank), the README's `--tensor-parallel 2`
#                                      command (verified), NCCL's all-reduce latency (PyTorch)
#   bash bench/tp_campaign.sh speed   the 8B shape's decode step at B = 1 and 64 on 1, 2 (4)
#                                      GPUs, and the `chat` workload's tokens/s on 1 and 2
#   bash bench/tp_campaign.sh trace   a kernel timeline of the 8B shape's B = 1 decode steps on
#                                      GPUS (default: every count), tools/kernel-trace
#   bash bench/tp_campaign.sh soak    the tensor-parallel tests RUNS times (default 10), 60 s
#                                      each; a run past that has every thread's stack taken
#                                      by cuda-gdb (carry engine_tests built with
#                                      `strip --strip-debug`: symbols kept) before it is killed
#
# Needs gpu-bin/pagedattn and gpu-bin/engine_tests (built here, as NOTES.md's "The GPU machine"
# says) and the kernel cache's directory in PAGEDATTN_CACHE_DIR (kernels compile at first use
# otherwise). NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0, the machine's setting).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?check, speed, trace or soak}
out=${OUT:-/tmp/tp-campaign}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
bin=gpu-bin/pagedattn
gpus=$(nvidia-smi -L | wc -l)
counts=1,2
[ "$gpus" -ge 4 ] && counts=1,2,4
echo "$gpus GPUs; counts $counts"
case $part in
check)
    nvidia-smi topo -m >"$out/topo.txt" 2>&1
    (cd crates/pagedattn-engine && timeout 300 ../../gpu-bin/engine_tests --include-ignored \
        --nocapture --test-threads 1 tensor_parallel::) >"$out/tests.log" 2>&1
    echo "tests: exit $?"; grep -E "^test |test result|GPUs:|served:" "$out/tests.log"
    timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py \
        >"$out/allreduce.md" 2>"$out/allreduce.err"
    echo "allreduce: exit $?"; cat "$out/allreduce.md"
    timeout 200 "$bin" run --backend cuda --tensor-parallel 2 --synthetic llama3-8b \
        >"$out/readme.log" 2>&1
    echo "README command: exit $?"; tail -8 "$out/readme.log"
    ;;
speed)
    timeout 420 python3 bench/engine_gpu.py --pagedattn "$bin" --synthetic llama3-8b \
        --batches 1,64 --repeats 1 --pp 128 --tg 64 --tensor-parallel "$counts" \
        >"$out/decode.md" 2>"$out/decode.err"
    echo "decode: exit $?"; cat "$out/decode.md"
    for n in 1 2; do
        timeout 150 "$bin" run --backend cuda --synthetic llama3-8b --tensor-parallel "$n" \
            --no-verify --json >"$out/chat-$n.json" 2>"$out/chat-$n.err"
        echo "chat on $n GPU(s): exit $?"
        python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
g = r['summary']['generated_tokens']
print(f'  {g} tokens in {r[\"seconds\"]:.2f} s: {g / r[\"seconds\"]:,.0f} tokens/s')" "$out/chat-$n.json"
    done
    ;;
trace)
    steps=$(python3 -c "
import sys; sys.path.insert(0, 'bench'); import traces; print(traces.fixed_shape_trace(1, 128, 64))")
    for n in ${GPUS:-${counts//,/ }}; do
        timeout 200 tools/kernel-trace/run.sh "$out/trace-$n.csv" "$bin" run --backend cuda \
            --synthetic llama3-8b --tensor-parallel "$n" --trace "$steps" --no-verify \
            >"$out/trace-$n.md" 2>"$out/trace-$n.err"
        echo "trace on $n GPU(s): exit $?"; cat "$out/trace-$n.md"; tail -3 "$out/trace-$n.err"
        gzip -f "$out/trace-$n.csv"
    done
    ;;
soak)
    for i in $(seq 1 "${RUNS:-10}"); do
        (cd crates/pagedattn-engine && exec ../../gpu-bin/engine_tests --include-ignored \
            --nocapture --test-threads 1 tensor_parallel::) >"$out/soak-$i.log" 2>&1 &
        pid=$!
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "run $i: still running after 60 s; stacks in soak-$i.stacks"
            timeout 90 cuda-gdb -p "$pid" -batch -ex "info threads" -ex "thread apply all bt 30" \
                >"$out/soak-$i.stacks" 2>&1
            kill -9 "$pid"
        fi
        wait "$pid"
        echo "run $i: exit $? $(grep -o 'test result.*' "$out/soak-$i.log")"
    done
    ;;
*) echo "check, speed, trace or soak" >&2; exit 2 ;;
esac
