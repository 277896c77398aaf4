"""How much an autotuned cuBLASLt algorithm could save on the GPU model's small products:
PyTorch's matmul of the given shapes (bf16, y = x W^T with W [n, k], x [t, k]) timed inside a
CUDA graph of REPS replays, with cuBLAS's default choice and with TunableOp searching
cuBLASLt's algorithms (PYTORCH_TUNABLEOP_ENABLED=1). SmolLM2-135M's four products by default.

    python3 bench/gemm_tune_probe.py [--tokens 1,64] [--shapes 960x576,576x576,3072x576,576x1536]

Run it twice in one call, once with PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1
(and PYTORCH_TUNABLEOP_FILENAME under $OUT), and compare the columns.
"""
import argparse
import os

import torch


def per_call_us(fn, reps=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--shapes", default="960x576,576x576,3072x576,576x1536")
    args = p.parse_args()
    tuned = os.environ.get("PYTORCH_TUNABLEOP_ENABLED") == "1"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"TunableOp {'on' if tuned else 'off'}")
    print("| t | n x k | us per product |")
    print("|---|---|---|")
    torch.manual_seed(0)
    for t in map(int, args.tokens.split(",")):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            us = per_call_us(lambda: torch.matmul(x, w.t(), out=y))
            print(f"| {t} | {n} x {k} | {us:.2f} |", flush=True)


if __name__ == "__main__":
    main()
