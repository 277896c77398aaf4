#!/usr/bin/env python3
"""NCCL all-reduce latency at the sizes tensor parallelism sends a decode step (the f32
residual stream of B tokens of `--hidden` values, twice a layer), through PyTorch's NCCL, one
process a GPU: what `--tensor-parallel` pays per all-reduce, measured beside the engine in the
same device call. Prints, per B, the mean of a CUDA graph replaying 64 all-reduces (as a
decode step of the 8B shape has), eager all-reduces, and the bytes each rank holds.

    python3 -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py \
        [--hidden 4096] [--batches 1,64] [--iters 200]

Keep NCCL_NVLS_ENABLE=0 (the machine's setting): multicast is off.
"""
import argparse, os

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--per-step", type=int, default=64, help="all-reduces in a step's graph")
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    if rank == 0:
        print(f"| B | bytes a rank | eager us per all-reduce | in a graph us per all-reduce | ranks {dist.get_world_size()} |")
        print("|---|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        x = torch.ones(b, args.hidden, device="cuda", dtype=torch.float32)
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        eager = 1e3 * start.elapsed_time(end) / args.iters
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.per_step):
                    dist.all_reduce(x)
        torch.cuda.synchronize()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        replays = max(1, args.iters // args.per_step * 4)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        graphed = 1e3 * start.elapsed_time(end) / (replays * args.per_step)
        if rank == 0:
            print(f"| {b} | {4 * b * args.hidden:,} | {eager:.1f} | {graphed:.1f} | |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
