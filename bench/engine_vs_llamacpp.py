#!/usr/bin/env python3
"""SmolLM2 (or any Llama GGUF) served by `pagedattn run` and by llama.cpp's
`llama-batched-bench` on the same file, cores and shape: B requests of PP random prompt tokens
each generating TG tokens (past end-of-turn), all arriving at once. Prints one table row per B:
each engine's wall time and its generated tokens per second, and the ratio.

    python3 bench/engine_vs_llamacpp.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-bin DIR_WITH_llama-batched-bench [--threads 2] [--batches 1,8,32,64]

llama.cpp builds from the source the PyPI sdist `llama-cpp-python` vendors (BENCHMARKS.md says
how); its threads are `--threads`, ours rayon's (`RAYON_NUM_THREADS`, set to the same).
"""
import argparse, json, os, subprocess, sys

from traces import fixed_shape_trace

def ours(args, b):
    trace = fixed_shape_trace(b, args.pp, args.tg)
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    out = subprocess.run([args.pagedattn, "run", "--model", args.model, "--trace", trace,
                          "--precision", "fast", "--no-verify", "--backend", "cpu",
                          "--max-batched-tokens", "512", "--max-seqs", str(max(b, 1)), "--json"],
                         env=env, check=True, capture_output=True, text=True).stdout
    os.unlink(trace)
    report = json.loads(out)
    return report["seconds"], report["summary"]["generated_tokens"]

def llamacpp(args, b):
    out = subprocess.run([os.path.join(args.llama_bin, "llama-batched-bench"), "-m", args.model,
                          "-t", str(args.threads), "-c", str(b * (args.pp + args.tg) + 256),
                          "-b", "2048", "-ub", "512", "-npp", str(args.pp), "-ntg", str(args.tg),
                          "-npl", str(b)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(args.pp) and cells[2] == str(b):
            return float(cells[8]), b * args.tg
    sys.exit(f"no result row for B={b} in llama-batched-bench's output:\n{out}")

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--pagedattn", default="target/release/pagedattn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--batches", default="1,8,32,64")
    args = p.parse_args()
    print(f"| B | pagedattn s | pagedattn gen tok/s | llama.cpp s | llama.cpp gen tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        (ts, tn), (ls, ln) = ours(args, b), llamacpp(args, b)
        print(f"| {b} | {ts:.2f} | {tn / ts:.1f} | {ls:.2f} | {ln / ls:.1f} | {(tn / ts) / (ln / ls):.2f} |", flush=True)

if __name__ == "__main__":
    main()
