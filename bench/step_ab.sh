#!/usr/bin/env bash
# Two builds of the CLI on the engine's fixed-shape decode (bench/engine_gpu.py: B sequences
# of PP prompt tokens, TG generated), alternating old, new, new, old in one call, so that the
# GPU's state and clocks weigh on both alike: the median decode step per batch size.
#
#   SYNTHETIC=smollm2 BATCHES=1,64 bash bench/step_ab.sh OLD_BINARY NEW_BINARY
#
# SYNTHETIC names the shape (`pagedattn run --synthetic`; or MODEL a file), REPEATS (default
# 3) the runs per build and batch, PP and TG (128, 128) the trace, OLD_ENV and NEW_ENV
# variables (NAME=VALUE, space-separated) each side runs with (one build against itself with
# an environment switch: pass the same binary twice). On the GPU machine.
set -uo pipefail
old=$1 new=$2
if [ -n "${MODEL:-}" ]; then model=(--model "$MODEL"); else model=(--synthetic "${SYNTHETIC:-smollm2}"); fi
for side in old new new old; do
    if [ $side = old ]; then bin=$old vars=${OLD_ENV:-}; else bin=$new vars=${NEW_ENV:-}; fi
    echo "== $side: $(basename "$bin") ${vars}"
    # shellcheck disable=SC2086 # the variables split into NAME=VALUE words
    env $vars python3 bench/engine_gpu.py --pagedattn "$bin" "${model[@]}" --batches "${BATCHES:-1,64}" \
        --repeats "${REPEATS:-3}" --pp "${PP:-128}" --tg "${TG:-128}" | tail -n +3 |
        awk -F'|' '{printf "  B %s: decode step %s ms, forward %s ms, %s tokens/s, graph steps %s\n", $2, $7, $8, $5, $10}'
done
