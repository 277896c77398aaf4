#!/usr/bin/env bash
# Two builds of the CLI on the `chat` workload of the 8B shape, alternating (old, new, old,
# new) in one call, per GPU count: tokens/s, the run's and the process's seconds, median time
# to first token and per output token, the first prefill step, the slowest decode step and
# how many times the CUDA graphs were captured (a build without that count prints None).
#
#   OUT=/tmp/ab bash bench/chat_ab.sh OLD_BINARY NEW_BINARY [GPU_COUNTS, default "1 2"]
#
# On the GPU machine; reports under $OUT.
set -uo pipefail
old=$1 new=$2
out=${OUT:-/tmp/chat-ab}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
for n in ${3:-1 2}; do
    for bin in "$old" "$new" "$old" "$new"; do
        name=$(basename "$bin")
        start=$(date +%s.%N)
        timeout 150 "$bin" run --backend cuda --synthetic llama3-8b --tensor-parallel "$n" \
            --no-verify --json >"$out/chat-$name-$n.json" 2>"$out/chat-$name-$n.err"
        end=$(date +%s.%N)
        python3 - "$out/chat-$name-$n.json" "$name" "$n" "$start" "$end" <<'PY'
import json, sys
path, name, n, start, end = sys.argv[1:]
r = json.load(open(path))
s, steps = r["summary"], r["steps"]
prefills = [x for x in steps if x["prefill_tokens"] > 0]
decodes = [x for x in steps if x["prefill_tokens"] == 0]
print(f"{name:14s} GPUs {n}: {s['generated_tokens'] / r['seconds']:7.0f} tok/s, "
      f"run {r['seconds']:.3f} s, process {float(end) - float(start):.1f} s, "
      f"ttft med {s['time_to_first_token']['median_s'] * 1e3:.0f} ms, "
      f"tpot med {s['time_per_output_token']['median_s'] * 1e3:.2f} ms, "
      f"first prefill {prefills[0]['seconds'] * 1e3:.0f} ms, "
      f"decode max {max(x['seconds'] for x in decodes) * 1e3:.1f} ms, "
      f"captures {r.get('cuda_graph_captures')}")
PY
    done
done
