#!/usr/bin/env bash
# Per-kernel GPU time of the engine's decode steps on the GPU model, through Nsight Compute:
# one request (B = 1) and 256 requests of 128 prompt tokens (B = 256), without CUDA graphs (ncu
# profiles launches), a window of $LAUNCHES kernel launches (default 660: two decode steps of
# SmolLM2; 720 for two of the 8B shape's) after the prefill. Prints, per kernel name, total
# and mean time and its share. MODEL is a GGUF file or folder, or a `--synthetic` shape's
# name (`llama3-8b`); BATCHES (default "1 256") picks the runs; TP (default 1) the GPUs.
#
#   bench/gpu-profile-decode.sh MODEL [PAGEDATTN_BINARY]     (on the GPU machine)
#
# Needs ncu (`--clock-control none`: the GPU's clocks stay as they are) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
bin=${2:-gpu-bin/pagedattn}
launches=${LAUNCHES:-660}
if [ -e "$model" ]; then which=(--model "$model"); else which=(--synthetic "$model"); fi
tp=(--tensor-parallel "${TP:-1}")
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
work=$(mktemp -d)
"$bin" run --backend cuda "${which[@]}" --trace "$(python3 -c "
import sys; sys.path.insert(0, 'bench'); import traces; print(traces.fixed_shape_trace(1, 8, 2))")" --no-verify >/dev/null
python3 -c "
import sys, shutil; sys.path.insert(0, 'bench'); import traces
shutil.move(traces.fixed_shape_trace(256, 128, 24), '$work/b256.jsonl')
shutil.move(traces.fixed_shape_trace(1, 128, 40), '$work/b1.jsonl')"

summarize() {
    python3 - "$1" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
k, t = rows[head].index("Kernel Name"), rows[head].index("gpu__time_duration.sum")
grid = rows[head].index("Grid Size")
# The row after the header holds the units; ncu writes thousands with commas ("4,032").
scale = {"ns": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "nsecond": 1.0}[rows[head + 1][t]]
total, count = collections.defaultdict(float), collections.Counter()
for r in rows[head + 2:]:
    try:
        v = scale * float(r[t].replace(",", ""))
    except (IndexError, ValueError):
        continue
    # By name and grid: cuBLAS runs one kernel name for products of different shapes.
    name = f"{r[k][:48]} {r[grid]}"
    total[name] += v
    count[name] += 1
all_ns = sum(total.values())
print(f"{sum(count.values())} kernels, {all_ns / 1e3:.1f} us")
for name, v in sorted(total.items(), key=lambda x: -x[1])[:20]:
    print(f"{v / 1e3:9.1f} us {100 * v / all_ns:5.1f}%  x{count[name]:4d}  mean {v / count[name] / 1e3:6.2f} us  {name}")
PY
}

profile() {
    local name=$1 skip=$2
    shift 2
    "$ncu" --clock-control none --launch-skip "$skip" --launch-count "$launches" --csv --page raw \
        --metrics gpu__time_duration.sum "$bin" run --backend cuda "${which[@]}" "${tp[@]}" \
        --no-verify --no-cuda-graphs "$@" >"$work/$name.csv" 2>"$work/$name.err"
    echo "=== $name"
    summarize "$work/$name.csv"
}
for b in ${BATCHES:-1 256}; do
    case $b in
        1) profile B=1 3000 --trace "$work/b1.jsonl" ;;
        256) profile B=256 6000 --trace "$work/b256.jsonl" --max-seqs 256 --max-batched-tokens 8192 ;;
        *) echo "BATCHES: 1 or 256" >&2; exit 2 ;;
    esac
done
rm -rf "$work"
