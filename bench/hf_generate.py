#!/usr/bin/env python3
"""The GPU peer of the engine: Hugging Face transformers' batched `generate` on a GGUF model
(dequantized by transformers, run in bf16 with SDPA attention) on the same fixed shape as
bench/engine_vs_llamacpp.py: B requests of PP random prompt tokens, TG new tokens each (end of
turn ignored), greedy. Prints one row per B: seconds and generated tokens per second (median of
--repeats runs after a warm-up).

    python3 bench/hf_generate.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--batches 1,8,32,64,128,256] [--pp 128] [--tg 128] [--cache dynamic|static]

Needs torch with CUDA, transformers and gguf.
"""
import argparse, os, statistics, time

import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    args = p.parse_args()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(args.model)),
        gguf_file=os.path.basename(args.model),
        dtype=torch.bfloat16,
        attn_implementation="sdpa",
    ).cuda().eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s on {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, cache {args.cache}", flush=True)
    gen = torch.Generator().manual_seed(0)
    print("| B | seconds | generated tokens/s |")
    print("|---|---|---|")
    for b in map(int, args.batches.split(",")):
        ids = torch.randint(17, model.config.vocab_size, (b, args.pp), generator=gen).cuda()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.tg,
                      min_new_tokens=args.tg, do_sample=False, pad_token_id=0,
                      cache_implementation=None if args.cache == "dynamic" else "static")
        with torch.inference_mode():
            model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(ids, **kwargs)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                assert out.shape == (b, args.pp + args.tg), out.shape
        s = statistics.median(times)
        print(f"| {b} | {s:.3f} | {b * args.tg / s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
