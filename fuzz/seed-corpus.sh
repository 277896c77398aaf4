#!/usr/bin/env bash
# Seeds the replay reader's working corpus (fuzz/corpus/replay_reader/, not committed) with the
# repository's replay files: the committed test cases and the example mixed batch. They are in
# the repository already, so they are copied here rather than committed twice.
set -euo pipefail
cd "$(dirname "$0")"
dir=corpus/replay_reader
mkdir -p "$dir"
for f in ../tests/replay-cases/*.case.safetensors ../examples/mixed_batch.safetensors; do
  cp "$f" "$dir/seed-$(basename "$f")"
done
echo "seeded $dir with $(ls ../tests/replay-cases/*.case.safetensors | wc -l) replay cases and the example"
