#!/usr/bin/env bash
# The GPU suite, in two halves.
#
#   tools/gpu-suite.sh build [all] here (cargo): builds the release CLI and every test
#                                  executable of the workspace and copies the ones `run`
#                                  needs (with `all`: every one), debug info stripped, into
#                                  gpu-bin/ (git-ignored) under stable names: gpu-bin/pagedattn,
#                                  gpu-bin/test-cuda, gpu-bin/test-api, ... (unit tests:
#                                  gpu-bin/test-<crate>-lib, test-<bin>-bin), and the Python
#                                  wheel (maturin; `pip install maturin` first) as
#                                  gpu-bin/pagedattn-*.whl.
#   tools/gpu-suite.sh run [all]   on the GPU machine (no cargo), from the repository root with
#                                  gpu-bin/ carried: `pagedattn info`, the kernel cache filled
#                                  for the GPU's architecture (`pagedattn compile-kernels
#                                  --cache`: every attention variant, in parallel, so that no
#                                  test waits for NVRTC), the cuda tests (test-cuda), the cuda
#                                  attention tests against the reference (test-cuda_attention),
#                                  the CUDA-graph test (test-cuda_graph), the replay cases
#                                  through `pagedattn forward --backend cuda --check`, the engine's built-in
#                                  workloads on cuda (verified), SmolLM2's golden tokens
#                                  and the bf16 GPU model against f32, the Hugging Face
#                                  families against transformers, tensor parallelism (the
#                                  `golden`, `gpu_model`, `hf` and `tensor_parallel` modules of
#                                  test-engine_tests: the last's tests of 2 or 4 GPUs pass over
#                                  a machine with fewer, saying "skipped"; the GGUF at
#                                  PAGEDATTN_SMOLLM2, default models/, must be there), the Python
#                                  package (the wheel pip-installed into a fresh venv that also
#                                  sees the machine's torch; pytest and transformers from the
#                                  machine or from the wheels in GPU_SUITE_WHEELS, default
#                                  .whl/): the README's Python example on cuda and the pytest
#                                  suite on CUDA tensors, with no LD_LIBRARY_PATH; the three binaries
#                                  under compute-sanitizer (memcheck, initcheck, racecheck); with
#                                  `all`, every other test executable too (test-long_context's
#                                  GPU tests among them).
#   tools/gpu-suite.sh tests [all] the same without the sanitizers; `sanitizers`: only them
#                                  (the two halves fit separate device calls of 10 minutes);
#                                  `python`: only the Python package's tests; `engine`: only
#                                  the engine's part (its workloads, golden, gpu_model, hf,
#                                  tensor_parallel;
#                                  needs gpu-bin/pagedattn and gpu-bin/test-engine_tests).
#
# The tests that need a GPU are `#[ignore]`d (`cargo test` without one lists them as ignored,
# and they fail saying why where no GPU is usable): `run` passes `--include-ignored` to every
# test executable, so that they run with the others.
#
# `run` writes each part's full log to $OUT/ (else /tmp/pagedattn-gpu-suite/): at most 9
# files (each sanitizer's log holds the three binaries' runs; the other test executables share
# other-tests.log). It prints one summary line per part last and exits non-zero if any part
# failed. A test left ignored, or an NVRTC test that skips (no libnvrtc), fails its part: this
# half exists to exercise the GPU.
#
# Settings of `run`: GPU_SUITE_TIMEOUT (seconds per part, default 400: the kernel cache takes
# ~210-240 s on an H100 with 16 cores; a sanitizer part runs
# the three binaries, each within it), GPU_SUITE_SANITIZERS (default "memcheck initcheck racecheck";
# empty for none), GPU_SUITE_SANITIZER_CASES (random cases per setting or property under a
# sanitizer, default 6; the plain runs use the tests' defaults).
#
# SmolLM2's GGUF (98 MB) is over the device tool's carry limit (64 MiB with the tree): carry
# it in two calls on a machine kept warm (what the calls leave outside the tree stays there):
# `split -b 50000000 models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/part.`; call 1 carries
# gpu-bin/part.aa and copies it to /tmp/keep/; call 2, within the idle release, carries
# gpu-bin/part.ab and runs `cat /tmp/keep/part.aa gpu-bin/part.ab >
# models/SmolLM2-135M-Instruct.Q4_1.gguf` before the `engine` part (or its golden and
# gpu_model tests alone).

set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
BIN=gpu-bin

build() {
    set -e
    local all=${1:-}
    cargo build --release -p pagedattn-cli
    local json
    json=$(mktemp)
    cargo test --release --workspace --no-run --message-format=json >"$json"
    rm -rf "$BIN"
    mkdir -p "$BIN"
    # "<executable> <stable name>" for every test executable and the CLI binary.
    python3 - "$json" >"$json.list" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if m["profile"]["test"]:
        kind = t["kind"][0]
        name = "test-" + t["name"] + ("" if kind == "test" else "-" + kind)
    elif "bin" in t["kind"] and t["name"] == "pagedattn":
        name = "pagedattn"
    else:
        continue
    print(m["executable"], name)
EOF
    while read -r exe name; do
        # Without `all`, the binaries `run` needs: every test executable together (~66 MB)
        # is more than the device tool carries (64 MiB with the working tree).
        case "$all:$name" in
        all:* | *:test-cuda | *:test-cuda_attention | *:test-cuda_graph | *:test-engine_tests | *:pagedattn) ;;
        *) continue ;;
        esac
        # Symbols stay (backtraces name functions); line tables go, to keep gpu-bin small
        # enough to carry.
        strip --strip-debug -o "$BIN/$name" "$exe"
        echo "$BIN/$name"
    done <"$json.list"
    rm -f "$json" "$json.list"
    python3 -m maturin build --release -m crates/pagedattn-python/Cargo.toml -o "$BIN" \
        2>&1 | tail -1
    [ -x "$BIN/test-cuda" ] && [ -x "$BIN/test-cuda_attention" ] && [ -x "$BIN/pagedattn" ] || {
        echo "gpu-suite build: test-cuda, test-cuda_attention or pagedattn is missing from $BIN" >&2
        exit 1
    }
    du -sh "$BIN"
}

SUMMARY=()
FAILED=0

# record PART VERDICT DETAIL
record() {
    SUMMARY+=("$1: $2 ($3)")
    [ "$2" = PASS ] || FAILED=1
}

# The verdict of a libtest run from its log and exit status: "VERDICT|detail".
test_verdict() {
    local log=$1 status=$2 result passed failed ignored skipped
    result=$(grep -E '^test result: ' "$log" | tail -1)
    passed=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$result")
    failed=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<"$result")
    # Ignored tests did not run (a run without --include-ignored). A GPU test that finds no
    # usable GPU fails by itself; an NVRTC test skips for want of libnvrtc, which counts here.
    # (A test written for machines without a GPU skips here by design and does not count.)
    ignored=$(sed -nE 's/.* ([0-9]+) ignored.*/\1/p' <<<"$result")
    skipped=$(grep -c 'SKIPPED (libnvrtc' "$log")
    if [ "$status" = 124 ]; then
        echo "FAIL|timed out after ${TIMEOUT}s"
    elif [ -z "$result" ]; then
        echo "FAIL|no test result, exit status $status"
    elif [ "$status" != 0 ] || [ "${failed:-1}" != 0 ]; then
        echo "FAIL|${passed:-?} passed, ${failed:-?} failed"
    elif [ "${ignored:-0}" != 0 ]; then
        echo "FAIL|${passed} passed, $ignored ignored (not run)"
    elif [ "$skipped" != 0 ]; then
        echo "FAIL|${passed} passed, $skipped skipped: $(grep -m1 -o 'SKIPPED (libnvrtc.*' "$log")"
    else
        echo "PASS|${passed} passed"
    fi
}

# The engine's part (run, tests, or alone as `engine`): its log is engine.log.
engine_tests() {
    # The engine on cuda: every built-in workload of the synthetic model with every attention
    # call recomputed by `reference` (the decoder's on the GPU model, and once on the host
    # model) and of every Hugging Face family's folder, then SmolLM2's greedy tokens against
    # transformers' and its bf16 GPU model against f32 (the GGUF at PAGEDATTN_SMOLLM2,
    # default models/; its absence fails the part), and every family's logits and greedy
    # tokens against transformers' goldens with attention on the GPU (`hf`). The output
    # goes to engine.log.
    local workload served=0 refused=0 part_log status verdict log="$out/engine.log"
    # The Hugging Face families' folders (tests/hf-models) each serve their kind's workload.
    for workload in chat long-context shared-prefix encoder encoder-decoder "chat --model-on host" \
        "chat --model tests/hf-models/llama" "chat --model tests/hf-models/mistral" \
        "chat --model tests/hf-models/qwen2" "chat --model tests/hf-models/gemma2" \
        "chat --model tests/hf-models/bloom" "encoder --model tests/hf-models/bert" \
        "chat --model tests/hf-models/opt" "encoder-decoder --model tests/hf-models/bart"; do
        echo "==== pagedattn run --backend cuda --workload $workload --verify" >>"$log"
        # (word splitting on purpose: the last entry carries an option)
        # shellcheck disable=SC2086
        if timeout "$TIMEOUT" "$BIN/pagedattn" run --backend cuda --workload $workload \
            --requests 8 --max-new-tokens 16 --verify >>"$log" 2>&1; then
            served=$((served + 1))
        else
            refused=$((refused + 1))
        fi
    done
    if [ "$refused" = 0 ]; then
        record "engine workloads" PASS "$served workloads served on cuda, every attention call verified"
    else
        record "engine workloads" FAIL "$served served, $refused failed"
    fi
    for part in golden gpu_model hf tensor_parallel; do
        part_log=$(mktemp)
        PAGEDATTN_REQUIRE_MODEL=1 PAGEDATTN_SMOLLM2=${PAGEDATTN_SMOLLM2:-models/SmolLM2-135M-Instruct.Q4_1.gguf} \
            timeout "$TIMEOUT" "$BIN/test-engine_tests" "$part::" --include-ignored --nocapture --test-threads=1 >"$part_log" 2>&1
        status=$?
        verdict=$(test_verdict "$part_log" "$status")
        record "engine $part" "${verdict%%|*}" "${verdict#*|}"
        { echo "==== $part: exit status $status"; cat "$part_log"; } >>"$log"
        rm -f "$part_log"
    done
}

# run PARTS [all]: PARTS is everything, tests (no sanitizers) or sanitizers.
run() {
    parts=$1
    all=${2:-}
    out=${OUT:-/tmp/pagedattn-gpu-suite}
    TIMEOUT=${GPU_SUITE_TIMEOUT:-400}
    mkdir -p "$out"
    local exe needed="test-cuda test-cuda_attention test-cuda_graph pagedattn"
    [ "$parts" = engine ] && needed="pagedattn test-engine_tests"
    [ "$parts" = python ] && needed=""
    for exe in $needed; do
        [ -x "$BIN/$exe" ] || {
            echo "gpu-suite run: $BIN/$exe not found: run 'tools/gpu-suite.sh build' first and carry $BIN" >&2
            exit 2
        }
    done
    # No LD_LIBRARY_PATH for NVRTC: the library finds it itself, in the CUDA toolkit or in
    # Python's NVIDIA wheels (what `pip install torch` brings), as a user's machine needs.
    # Kernels compile once per machine, then come from this cache.
    export PAGEDATTN_CACHE_DIR=${PAGEDATTN_CACHE_DIR:-/tmp/pagedattn-kernels}
    export RUST_BACKTRACE=1
    if [ "$parts" = sanitizers ]; then
        sanitizers
        finish
    fi
    if [ "$parts" = python ]; then
        python_tests
        finish
    fi
    if [ "$parts" = engine ]; then
        engine_tests
        finish
    fi

    # The CLI lists each backend as `backend NAME ...`; the cuda one must be available. Its
    # details name the architecture the kernels are compiled for.
    local log="$out/info.log" status line arch verdict
    "$BIN/pagedattn" info >"$log" 2>&1
    status=$?
    line=$(grep -m1 '^backend cuda' "$log" | cut -c1-160)
    if [ "$status" = 0 ] && [ -n "$line" ] && ! grep -q unavailable <<<"$line"; then
        record "pagedattn info" PASS "$line"
    else
        record "pagedattn info" FAIL "exit status $status: ${line:-no cuda backend listed}"
    fi
    arch=$(grep -o -m1 'kernels for sm_[0-9]*a\?' "$log" | cut -d' ' -f3)

    # Every kernel into the cache for this GPU; the output joins info.log.
    if [ -n "$arch" ]; then
        echo "==== pagedattn compile-kernels --arch $arch --cache" >>"$log"
        timeout "$TIMEOUT" "$BIN/pagedattn" compile-kernels --arch "$arch" --cache >>"$log" 2>&1
        status=$?
        line=$(grep -m1 "^$arch: " "$log" | cut -c1-160)
        if [ "$status" = 0 ] && [ -n "$line" ]; then
            record "kernel cache" PASS "$line"
        else
            record "kernel cache" FAIL "exit status $status: ${line:-no summary}"
        fi
    else
        record "kernel cache" FAIL "no architecture in the output of pagedattn info"
    fi

    # Without the NVRTC check of every kernel for sm_80 and sm_90a: the kernel cache above
    # compiled every program for this GPU, and CI's compile-kernels compiles both
    # architectures (here it would take minutes of GPU time).
    log="$out/cuda-tests.log"
    timeout "$TIMEOUT" "$BIN/test-cuda" --include-ignored --test-threads=1 \
        --skip kernels_compile_for_sm80_and_sm90a >"$log" 2>&1
    status=$?
    verdict=$(test_verdict "$log" "$status")
    record "cuda tests" "${verdict%%|*}" "${verdict#*|}"

    log="$out/cuda-attention-tests.log"
    timeout "$TIMEOUT" "$BIN/test-cuda_attention" --include-ignored --test-threads=1 >"$log" 2>&1
    status=$?
    verdict=$(test_verdict "$log" "$status")
    record "cuda attention tests" "${verdict%%|*}" "${verdict#*|}"

    log="$out/cuda-graph-test.log"
    timeout "$TIMEOUT" "$BIN/test-cuda_graph" --include-ignored --test-threads=1 >"$log" 2>&1
    status=$?
    verdict=$(test_verdict "$log" "$status")
    record "cuda graph test" "${verdict%%|*}" "${verdict#*|}"

    # The replay cases through the CLI on cuda, each checked against `reference` by `forward`
    # itself; a case the cuda backend refuses as unsupported (head size 16) must say so.
    # (The output joins info.log: $OUT brings back at most 8 files.)
    log="$out/info.log"
    local case_file ok=0 refused=0 failed=0
    for case_file in tests/replay-cases/*.case.safetensors; do
        echo "==== $case_file" >>"$log"
        if timeout "$TIMEOUT" "$BIN/pagedattn" forward --backend cuda --check --input "$case_file" >>"$log" 2>&1; then
            ok=$((ok + 1))
        elif tail -1 "$log" | grep 'does not support head size' >/dev/null; then
            refused=$((refused + 1))
        else
            failed=$((failed + 1))
        fi
    done
    if [ "$failed" = 0 ] && [ "$ok" -gt 0 ]; then
        record "replay cases" PASS "$ok pass, $refused refused as unsupported"
    else
        record "replay cases" FAIL "$ok pass, $refused refused as unsupported, $failed failed"
    fi

    engine_tests

    python_tests

    [ "$parts" = tests ] && finish
    sanitizers
    finish
}

# The Python package in a fresh venv (the machine's torch reached through a .pth file, since
# nothing downloads here): the README's Python example on CUDA tensors with no
# LD_LIBRARY_PATH, then the pytest suite, CUDA tests included (they must not skip).
python_tests() {
    local wheel venv log status result
    log="$out/python-tests.log"
    wheel=$(ls "$BIN"/pagedattn-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        record "python tests" FAIL "no wheel in $BIN: run 'tools/gpu-suite.sh build'"
        return
    fi
    venv=$(mktemp -d)
    python3 -m venv "$venv" >"$log" 2>&1
    # The machine's packages (torch; python3 may itself be a venv's) after the venv's own.
    python3 -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
        >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine.pth"
    local wheels=${GPU_SUITE_WHEELS:-.whl} names=""
    [ -d "$wheels" ] && names=$(ls "$wheels" | grep 'whl$' | cut -d- -f1 | sort -u | tr '\n' ' ')
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q --no-index --no-deps "$wheel" \
        ${names:+--find-links "$wheels" $names} >>"$log" 2>&1
    awk '/^```python$/ {on = 1; next} /^```$/ {on = 0} on' README.md >"$venv/readme_example.py"
    echo "-- the README's Python example" >>"$log"
    if ! (cd "$venv" && env -u LD_LIBRARY_PATH timeout "$TIMEOUT" bin/python readme_example.py) \
        >>"$log" 2>&1 || ! tail -1 "$log" | grep '^cuda ' >/dev/null; then
        record "python tests" FAIL "the README's Python example did not run on cuda"
        rm -rf "$venv"
        return
    fi
    (cd crates/pagedattn-python && env -u LD_LIBRARY_PATH timeout "$TIMEOUT" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests) >>"$log" 2>&1
    status=$?
    rm -rf "$venv"
    result=$(grep -E '^[0-9]+ (passed|failed)' "$log" | tail -1)
    if [ "$status" = 0 ] && ! grep -E 'SKIPPED.*(needs a CUDA GPU|cuda)' "$log" >/dev/null; then
        record "python tests" PASS "$result"
    else
        record "python tests" FAIL "exit status $status: ${result:-no pytest summary}"
    fi
}

# The three CUDA test executables under compute-sanitizer.
sanitizers() {
    local sanitizer tool part summary found problems log status verdict part_log
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in ${GPU_SUITE_SANITIZERS-memcheck initcheck racecheck}; do
        log="$out/$tool.log"
        if [ ! -x "$sanitizer" ]; then
            record "$tool" FAIL "compute-sanitizer not found"
            continue
        fi
        : >"$log"
        problems=""
        # Fewer random cases under the sanitizer; without the test whose failing allocations
        # the sanitizer would count as API errors, the host-only NVRTC tests, and the decode of
        # 2^24 keys (minutes under instrumentation; its accesses are the long decodes').
        for part in test-cuda test-cuda_attention test-cuda_graph; do
            part_log=$(mktemp)
            PAGEDATTN_TEST_CASES=${GPU_SUITE_SANITIZER_CASES:-6} timeout "$TIMEOUT" \
                "$sanitizer" --tool "$tool" --error-exitcode 99 \
                "$BIN/$part" --include-ignored --test-threads=1 --skip allocation_failures_are_errors \
                --skip kernels_compile_for_sm80_and_sm90a \
                --skip disk_cache_reuses_images_and_recompiles_corrupt_entries \
                --skip decode_positions_are_exact_past_2_pow_24 >"$part_log" 2>&1
            status=$?
            { echo "==== $part: exit status $status"; cat "$part_log"; } >>"$log"
            summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$part_log" | tail -1)
            found=$(sed -nE 's/.*SUMMARY: ([0-9]+) (errors|hazards).*/\1/p' <<<"$summary")
            verdict=$(test_verdict "$part_log" "$status")
            rm -f "$part_log"
            if [ "$status" = 124 ]; then
                problems+="$part timed out after ${TIMEOUT}s; "
            elif [ -z "$found" ]; then
                problems+="$part: no sanitizer summary, exit status $status; "
            elif [ "$found" != 0 ] || [ "${verdict%%|*}" != PASS ]; then
                problems+="$part: $found errors, tests: ${verdict#*|}; "
            fi
        done
        if [ -z "$problems" ]; then
            record "$tool" PASS "0 errors in test-cuda, test-cuda_attention and test-cuda_graph"
        else
            record "$tool" FAIL "${problems%; }"
        fi
    done
}

finish() {
    if [ "$all" = all ]; then
        # One log for all of them: few files come back from $OUT.
        local name
        log=$(mktemp)
        : >"$out/other-tests.log"
        for exe in "$BIN"/test-*; do
            name=${exe#"$BIN"/}
            case "$name" in test-cuda | test-cuda_attention | test-cuda_graph) continue ;; esac
            timeout "$TIMEOUT" "$exe" --include-ignored >"$log" 2>&1
            status=$?
            verdict=$(test_verdict "$log" "$status")
            record "$name" "${verdict%%|*}" "${verdict#*|}"
            { echo "==== $name: exit status $status"; cat "$log"; } >>"$out/other-tests.log"
        done
        rm -f "$log"
    fi

    echo "logs: $out"
    printf '%s\n' "${SUMMARY[@]}"
    exit "$FAILED"
}

case "${1:-}" in
build) build "${2:-}" ;;
run) run everything "${2:-}" ;;
tests) run tests "${2:-}" ;;
sanitizers) run sanitizers ;;
python) run python ;;
engine) run engine ;;
*)
    echo "usage: tools/gpu-suite.sh build [all] | run [all] | tests [all] | sanitizers | python | engine" >&2
    exit 2
    ;;
esac
