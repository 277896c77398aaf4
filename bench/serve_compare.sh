#!/usr/bin/env bash
# pagedattn serve against llama.cpp's llama-server under the same load, back to back on this
# machine (BENCHMARKS.md, "Serving"): bench/serve_load.py's `chat` requests (streamed, greedy,
# ignore_eos) at each rate, one request at a time, and a soak-free saturation point; for
# llama-server each `--parallel` of the sweep (its context -c = parallel x 2048, as each slot
# gets -c / parallel). Then the server's cost: the saturation load through `pagedattn serve`
# (streamed and not) and the same requests through `pagedattn run --trace`, alternated REPEAT
# times.
#
#   bash bench/serve_compare.sh [OUT_DIR]      (env: M, LLAMA_BIN, REQUESTS, MAX_OUTPUT,
#                                               RATES, PARALLEL, REPEAT, THREADS, BACKEND,
#                                               PROCESSES, SWEEP=0: the saturation pairs only)
#
# Needs target/release/pagedattn, llama-server (tools/build-llama-server.sh; not for a GPU
# run: PARALLEL= skips it) and aiohttp. Writes OUT_DIR/*.json and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/serve-compare}
mkdir -p "$out"
M=${M:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_BIN=${LLAMA_BIN:-target/llama.cpp/bin}
REQUESTS=${REQUESTS:-64}
MAX_OUTPUT=${MAX_OUTPUT:-128}
RATES=${RATES:-0.5 1 2 inf}
PARALLEL=${PARALLEL-8 16 32}
REPEAT=${REPEAT:-3}
THREADS=${THREADS:-$(nproc)}
BACKEND=${BACKEND:-cpu}
# ours: --precision fast is the int8 path llama.cpp's Q4_1 products compare with (host only).
ours_flags=(--backend "$BACKEND" --model "$M")
[ "$BACKEND" = cpu ] && ours_flags+=(--precision fast)
rate_flags=()
for r in $RATES; do rate_flags+=(--rate "$r"); done
# PROCESSES client processes share each rate's requests (a GPU server outruns one).
load=(python3 bench/serve_load.py --requests "$REQUESTS" --max-output "$MAX_OUTPUT" --first-token 17
  --processes "${PROCESSES:-1}")
port=8471

wait_up() { # url: until /v1/models answers (60 s)
  for _ in $(seq 600); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1] + '/v1/models', timeout=1)" "$1" \
      2>/dev/null && return 0
    sleep 0.1
  done
  echo "serve_compare: $1 did not come up" >&2
  return 1
}

# One server's runs: the rate sweep, one request at a time, and (ours) the saturation load.
measure() { # name, then the server's command
  local name=$1
  shift
  "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$port"
  "${load[@]}" --url "http://127.0.0.1:$port" --warmup 2 "${rate_flags[@]}" \
    --write-trace "$out/trace.jsonl" --json "$out/$name-rates.json"
  "${load[@]}" --url "http://127.0.0.1:$port" --requests 16 --rate inf --max-concurrency 1 \
    --seed 1 --json "$out/$name-alone.json"
  kill -TERM $pid
  wait $pid || true
}

if [ "${SWEEP:-1}" = 0 ]; then
  PARALLEL=
  "${load[@]}" --write-trace "$out/trace.jsonl" --dry-run
else
  measure ours target/release/pagedattn serve "${ours_flags[@]}" --port $port
fi
for p in $PARALLEL; do
  measure "llama-server-p$p" "$LLAMA_BIN/llama-server" -m "$M" --host 127.0.0.1 --port $port \
    -t "$THREADS" --parallel "$p" --cont-batching -c $((p * 2048))
done

# The server's cost at saturation: the same requests, all at once, through the server
# (streamed, then not streamed: a fresh server each, so that no prompt is in its prefix
# cache) and through `run`, alternated.
for i in $(seq "$REPEAT"); do
  for mode in serve-sat plain-sat; do
    target/release/pagedattn serve "${ours_flags[@]}" --port $port >"$out/ours-sat.log" 2>&1 &
    pid=$!
    wait_up "http://127.0.0.1:$port"
    flag=()
    [ $mode = plain-sat ] && flag=(--no-stream)
    "${load[@]}" --url "http://127.0.0.1:$port" --rate inf "${flag[@]}" \
      --json "$out/$mode-$i.json" >/dev/null
    kill -TERM $pid
    wait $pid || true
  done
  target/release/pagedattn run "${ours_flags[@]}" --no-verify --trace "$out/trace.jsonl" --json \
    >"$out/run-sat-$i.json"
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
def rows(path):
    return [r["summary"] for r in json.load(open(path))["results"]]
print("| server | rate | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |")
print("|---|---:|---:|---:|---:|---:|")
for path in sorted(glob.glob(f"{out}/*-rates.json")) + sorted(glob.glob(f"{out}/*-alone.json")):
    name = os.path.basename(path).rsplit("-", 1)[0]
    for s in rows(path):
        rate = "one at a time" if path.endswith("alone.json") else s["rate"]
        f = lambda m: f"{s[m]['p50']:.1f} / {s[m]['p99']:.1f}"
        print(f"| {name} | {rate} | {s['output_throughput']:.1f} | {f('ttft_ms')} | {f('tpot_ms')} | {f('itl_ms')} |")
serve = [rows(p)[0]["output_throughput"] for p in sorted(glob.glob(f"{out}/serve-sat-*.json"))]
plain = [rows(p)[0]["output_throughput"] for p in sorted(glob.glob(f"{out}/plain-sat-*.json"))]
run = []
for p in sorted(glob.glob(f"{out}/run-sat-*.json")):
    r = json.load(open(p))
    run.append(sum(len(g) for q in r["requests"] for g in q["generated"]) / r["seconds"])
if serve and run:
    print(f"\nsaturation: serve {', '.join(f'{x:.1f}' for x in serve)} out tok/s; run "
          f"{', '.join(f'{x:.1f}' for x in run)}; median ratio "
          f"{statistics.median(serve) / statistics.median(run):.3f}")
if plain and run:
    print(f"not streamed: serve {', '.join(f'{x:.1f}' for x in plain)} out tok/s; median ratio "
          f"{statistics.median(plain) / statistics.median(run):.3f}")
PY
