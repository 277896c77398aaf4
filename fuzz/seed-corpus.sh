#!/usr/bin/env bash
# Seeds the replay reader's working corpus (fuzz/corpus/replay_reader/, not committed) with the
# repository's replay files: the committed test cases and the example mixed batch. They are in
# the repository already, so they are copied here rather than committed twice. Seeds the GGUF
# target's with sixteen inputs that each stand for a mutated tiny Llama (a zero byte, then
# the mutation's seed: fuzz_targets/gguf_reader.rs).
set -euo pipefail
cd "$(dirname "$0")"
dir=corpus/replay_reader
mkdir -p "$dir"
for f in ../tests/replay-cases/*.case.safetensors ../examples/mixed_batch.safetensors; do
  cp "$f" "$dir/seed-$(basename "$f")"
done
echo "seeded $dir with $(ls ../tests/replay-cases/*.case.safetensors | wc -l) replay cases and the example"
dir=corpus/gguf_reader
mkdir -p "$dir"
for seed in $(seq 0 15); do
  printf "\\x00\\x$(printf %02x "$seed")\\x00\\x00\\x00\\x00\\x00\\x00\\x00" >"$dir/seed-tiny-llama-$seed"
done
