#!/usr/bin/env python3
"""Where a Python call's host time goes on CUDA: the median host µs per call (300 bursts of 32
calls queued after a synchronization, three rounds) of `Attention.run` on torch's current
stream, with `stream=` the raw handle, on the backend's own stream (`stream=backend.stream`, no
caller-stream bookkeeping), with Python's garbage collector off, on a side stream, of
`write_kv` alone, and of one small torch launch for comparison; for a decode of one sequence
(1024 keys) and a prefill of 8192 tokens, 32/8 heads, D 128, bf16, 4 caches rotated.

Usage: python bench/python_host_time.py   (on a machine with a GPU)
"""
import gc, statistics, subprocess, sys, time, json
import torch, pagedattn

def bursts(fn, n=300, calls=32):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for j in range(calls):
            fn(j)
        out.append((time.perf_counter_ns() - t0) / 1e3 / calls)
    torch.cuda.synchronize()
    return statistics.median(out)

be = pagedattn.Backend("cuda")
dev = be.device
def setup(tokens, ctx, h=32, hkv=8, d=128, b=16, layers=4):
    attn = pagedattn.Attention(be, h, d, num_kv_heads=hkv)
    nb = (ctx + tokens) // b + 8
    caches = [torch.zeros(be.kv_cache_shape(nb, b, hkv, d), dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    n = ctx + tokens
    table = list(range(-(-n // b)))
    md = pagedattn.Metadata(seq_lens=[n], slot_mapping=[table[i // b] * b + i % b for i in range(ctx, n)],
                            block_tables=[table], context_lens=[ctx], num_prefills=0 if tokens == 1 else 1)
    plan = attn.plan(md, caches[0], dtype=torch.bfloat16)
    q = torch.randn(tokens, h, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    return attn, plan, caches, q, k, v, out

for name, tokens, ctx in [("decode 1x1024", 1, 1024), ("prefill 1x8192", 8192, 0)]:
    attn, plan, caches, q, k, v, out = setup(tokens, ctx)
    L = len(caches)
    s = torch.cuda.current_stream()
    handle = s.cuda_stream
    side = torch.cuda.Stream()
    a, b_, c = (torch.randn(16, device=dev) for _ in range(3))
    variants = {
        "run": lambda j: attn.run(plan, q, k, v, caches[j % L], out),
        "run stream=int": lambda j: attn.run(plan, q, k, v, caches[j % L], out, stream=handle),
        "run own stream": lambda j: attn.run(plan, q, k, v, caches[j % L], out, stream=be.stream),
        "write_kv": lambda j: attn.write_kv(plan, k, v, caches[j % L]),
        "torch.add out=": lambda j: torch.add(a, b_, out=c),
    }
    for f in variants.values():
        for j in range(200): f(j)
    res = {k2: [] for k2 in variants}
    res["run gc off"] = []
    res["run side stream"] = []
    for r in range(3):
        for k2, f in variants.items():
            res[k2].append(bursts(f))
        gc.disable(); res["run gc off"].append(bursts(variants["run"])); gc.enable()
        with torch.cuda.stream(side):
            res["run side stream"].append(bursts(variants["run"]))
    print(name, {k2: [round(x, 2) for x in v2] for k2, v2 in res.items()}, flush=True)
    del attn, plan, caches, q, k, v, out
    torch.cuda.empty_cache()
