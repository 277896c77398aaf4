#!/usr/bin/env python3
"""The engine on the GPU: SmolLM2 (or any Llama GGUF, or a synthetic model's shape such as
`--synthetic llama3-8b`) served by `pagedattn run --backend cuda`
(the bf16 GPU model) on bench/hf_generate.py's fixed shape: B requests of PP random prompt
tokens, TG new tokens each (end of turn ignored), greedy, all arriving at once. Prints one row
per B: wall seconds (process start excluded: the report's serving time), generated tokens
per second, a decode step's time and its forward pass's (the rest is the engine's host work),
how many steps replayed CUDA graphs, and the attention's share of the other steps' time.

    python3 bench/engine_gpu.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--batches 1,8,32,64,128,256] [--pp 128] [--tg 128] [--repeats 3]
    python3 bench/engine_gpu.py --synthetic llama3-8b --batches 1,64 --repeats 1
    python3 bench/engine_gpu.py --synthetic llama3-8b --batches 1,64 --tensor-parallel 1,2,4

With `--tensor-parallel N,...` each B runs on each GPU count (`pagedattn run --tensor-parallel
N`), and a column gives the tokens/s against the first count's.

Run bench/hf_generate.py in the same device call for the peer's rows.
"""
import argparse, json, os, statistics, subprocess

from traces import fixed_shape_trace


def serve(args, b, gpus):
    extra = ["--no-cuda-graphs"] if args.no_cuda_graphs else []
    extra += ["--tensor-parallel", str(gpus)]
    trace = fixed_shape_trace(b, args.pp, args.tg)
    model = ["--model", args.model] if args.model else ["--synthetic", args.synthetic]
    out = subprocess.run([args.pagedattn, "run", *model, "--trace", trace,
                          "--backend", "cuda", "--no-verify", "--json",
                          "--max-batched-tokens", str(args.max_batched_tokens),
                          "--max-seqs", str(max(b, 1))] + extra,
                         check=True, capture_output=True, text=True).stdout
    os.unlink(trace)
    return json.loads(out)


def main():
    p = argparse.ArgumentParser()
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a GGUF file or Hugging Face folder")
    which.add_argument("--synthetic", help="a synthetic model's shape (pagedattn run --synthetic)")
    p.add_argument("--pagedattn", default="target/release/pagedattn")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--tensor-parallel", default="1", help="GPU counts to run, e.g. 1,2,4")
    args = p.parse_args()
    counts = list(map(int, args.tensor_parallel.split(",")))
    print("| B | GPUs | seconds (median) | generated tokens/s | vs first count | decode step ms (median) | of which forward ms | decode tokens/s vs first count | graph steps | attention share (untimed graph steps aside) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        first = None
        for gpus in counts:
            runs = [serve(args, b, gpus) for _ in range(args.repeats)]
            secs = statistics.median(r["seconds"] for r in runs)
            r = runs[0]
            gen = r["summary"]["generated_tokens"]
            share = r["summary"].get("attention_share")
            share = "—" if share is None else f"{100 * share:.1f}%"
            decodes = [s for s in r["steps"] if s["prefill_tokens"] == 0]
            step_ms = 1e3 * statistics.median(s["seconds"] for s in decodes)
            fwd_ms = 1e3 * statistics.median(s["forward_seconds"] for s in decodes)
            graphs = sum(s["graph"] for s in r["steps"])
            first = first or (gen / secs, step_ms)
            print(f"| {b} | {gpus} | {secs:.3f} | {gen / secs:,.0f} | {gen / secs / first[0]:.2f}x | {step_ms:.3f} | {fwd_ms:.3f} | {first[1] / step_ms:.2f}x | {graphs} of {len(r['steps'])} | {share} |", flush=True)


if __name__ == "__main__":
    main()
