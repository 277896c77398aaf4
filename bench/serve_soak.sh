#!/usr/bin/env bash
# The server under a long load (issue 43's soak): CLIENTS streaming clients in a closed loop
# for SOAK_SECONDS (bench/serve_load.py --duration, the `chat` workload's requests), the server's
# resident memory sampled every second; then /metrics must show every KV block free, and
# SIGTERM must stop the server with exit 0 (its block manager's check after the shutdown).
# Every request must complete or be refused (429 / 503); none may fail.
#
#   bash bench/serve_soak.sh [OUT_DIR]     (env: M, CLIENTS=64, SOAK_SECONDS=120, MAX_OUTPUT=256,
#                                          BACKEND=cpu, SERVE_FLAGS="--kv-cache-memory 1GiB")
#
# The host's KV cache is zeroed lazily: its pages become resident as blocks are first used,
# and the block manager's LRU free queue reaches every block in turn, so resident memory
# grows until the whole pool has been touched. A pool that the load fills early (1 GiB: ~23k
# tokens of SmolLM2's f32 cache, against ~25k for 64 requests of the chat mix) makes "flat"
# mean flat after that, which is what the check below compares (the second tenth of the run
# with the last).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/serve-soak}
mkdir -p "$out"
M=${M:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CLIENTS=${CLIENTS:-64}
SOAK_SECONDS=${SOAK_SECONDS:-120}
MAX_OUTPUT=${MAX_OUTPUT:-256}
BACKEND=${BACKEND:-cpu}
port=8472
flags=(--backend "$BACKEND" --model "$M" --port $port)
[ "$BACKEND" = cpu ] && flags+=(--precision fast)
# shellcheck disable=SC2206
flags+=(${SERVE_FLAGS:---kv-cache-memory 1GiB})
target/release/pagedattn serve "${flags[@]}" >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q listening "$out/server.log" && break
  sleep 0.1
done
# Resident memory (VmRSS, kB) every second while the load runs.
(while kill -0 $pid 2>/dev/null; do
  echo "$(date +%s) $(awk '/^VmRSS/ {print $2}' /proc/$pid/status)"
  sleep 1
done) >"$out/rss.txt" &
sampler=$!
python3 bench/serve_load.py --url "http://127.0.0.1:$port" --duration "$SOAK_SECONDS" \
  --max-concurrency "$CLIENTS" --requests 1000 --max-output "$MAX_OUTPUT" --first-token 17 \
  --json "$out/load.json"
metrics=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())")
echo "$metrics" >"$out/metrics.txt"
used=$(echo "$metrics" | awk '/^pagedattn:kv_cache_blocks_used/ {print $2}')
kill -TERM $pid
code=0
wait $pid || code=$?
kill $sampler 2>/dev/null || true
trap - EXIT
python3 - "$out" "$used" "$code" <<'PY'
import json, sys
out, used, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
s = json.load(open(f"{out}/load.json"))["results"][0]["summary"]
rss = [int(l.split()[1]) / 1024 for l in open(f"{out}/rss.txt") if len(l.split()) == 2]
tenth = max(len(rss) // 10, 1)
early, late = max(rss[tenth:2 * tenth] or rss), max(rss[-tenth:])
print(f"soak: {s['requests']} requests: {s['completed']} completed, {s['refused']} refused, "
      f"{s['failed']} failed; {s['output_tokens']} tokens, {s['output_throughput']:.1f} out tok/s")
print(f"soak: resident memory {rss[0]:.0f} MiB at start, {early:.0f} MiB after the first tenth, "
      f"{late:.0f} MiB at the end (peak {max(rss):.0f} MiB)")
print(f"soak: KV blocks in use after the load: {used:.0f}; server exit code {code}")
problems = []
if s["failed"]:
    problems.append(f"{s['failed']} requests failed")
if used != 0:
    problems.append(f"{used:.0f} blocks still in use")
if code != 0:
    problems.append(f"the server exited {code}")
if late > early * 1.05 + 8:
    problems.append(f"memory grew from {early:.0f} to {late:.0f} MiB")
if problems:
    sys.exit("soak: FAILED: " + "; ".join(problems))
print("soak: passed")
PY
