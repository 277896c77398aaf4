#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-batched-bench and llama-bench (CPU only) from the
# llama.cpp source that the PyPI sdist of llama-cpp-python 0.3.36 vendors (build 0c1e570, the
# peer BENCHMARKS.md was measured against), into target/llama.cpp/bin/. Each step is skipped
# when its output is already there, so a second run only reports.
#   bash tools/build-llama-server.sh
# Needs a C++17 compiler and make; cmake comes from PyPI when there is none on PATH.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dir="$root/target/llama.cpp"
src="$dir/src"                     # the whole sdist: its .git/modules gives the vendored commit
llama="$src/vendor/llama.cpp"
build="$dir/build"
bin="$dir/bin"
targets=(llama-server llama-batched-bench llama-bench)
mkdir -p "$dir"

# 1. The sdist. `--no-binary llama-cpp-python` rather than `:all:`: with `:all:` pip also builds
# the sdist's build dependencies (cmake, ninja) from source just to read its metadata.
if [ ! -f "$llama/CMakeLists.txt" ]; then
    sdist="$dir/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$sdist" ]; then
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            --dest "$dir" "llama-cpp-python==$version"
    fi
    echo "$sha256  $sdist" | sha256sum --check --quiet
    rm -rf "$src.part" && mkdir -p "$src.part"
    # --no-same-owner: files owned by the archive's uid make git refuse the repository
    # ("dubious ownership"), and the build would then report commit "unknown".
    tar -xzf "$sdist" -C "$src.part" --strip-components=1 --no-same-owner
    rm -rf "$src" && mv "$src.part" "$src"
fi

# 2. cmake (llama.cpp needs >= 3.14; this sdist's UI script >= 3.18).
cmake=cmake
if ! command -v cmake >/dev/null; then
    cmake="$dir/venv/bin/cmake"
    if [ ! -x "$cmake" ]; then
        python3 -m venv "$dir/venv"
        "$dir/venv/bin/pip" install --quiet "cmake>=3.18,<5"
    fi
fi

# 3. Configure. GGML_NATIVE: the host's own instruction set, as our engine's runtime detection
# gets. Static libraries, so the binaries copied to bin/ need nothing from the build tree.
# LLAMA_CURL is gone in this version (it only warns) but keeps older trees from needing libcurl;
# no OpenSSL (no HTTPS needed); the server's web UI neither built with npm nor downloaded
# prebuilt (the build must not reach the network; the API does not need it).
if [ ! -f "$build/CMakeCache.txt" ]; then
    "$cmake" -S "$llama" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
fi

# 4. Build only the three tools (make is a no-op when they are up to date).
"$cmake" --build "$build" --config Release -j"$(nproc)" --target "${targets[@]}"
mkdir -p "$bin"
for t in "${targets[@]}"; do cp -p "$build/bin/$t" "$bin/$t"; done

echo "binaries: $bin/{$(IFS=,; echo "${targets[*]}")}"
"$bin/llama-server" --version 2>&1 | grep -E '^(version|built with)' || true
