#!/usr/bin/env python3
"""pagedattn from Python against pagedattn from Rust, on the same workloads, in one run.

For each row -- a decode of 1 sequence (the per-call overhead), the headline decode and the
headline prefill of `pagedattn bench` -- this runs the Rust bench on that row
(`pagedattn bench --json --rows NAME`), then the same workload through the Python package: the
same shapes, cache geometry, shuffled block tables and number of caches rotated over, a plan
made once, one `Attention.run` (cache write, then attention) per call on cache `i % layers`,
timed per call after a warm-up, median. Rust and Python alternate for `--rounds` rounds; the
table gives the medians of the rounds' medians and their ratio.

On the CPU both sides are timed on the host wall clock (per call). On a GPU both are timed with
CUDA events (device time: pagedattn's events on its stream in Rust; events on torch's current
stream around each Python call, which the call's work is ordered on), and the host time a call
costs its caller's thread is measured too: the median of 100 bursts of 32 calls queued back to
back after a synchronization (the Rust bench's `host_us_per_call`).

torch allocates the Python side's caches; THP_MEM_ALLOC_ENABLE=1 (set here before torch loads)
gives them transparent huge pages as pagedattn's own cache allocation asks for.

Usage: python bench/python_overhead.py [--backend cpu|cuda] [--pagedattn PATH] [--rounds 3]
                                       [--seconds 1.5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

import pagedattn  # noqa: E402

ROWS = {
    # (suite, row name): the 1-sequence decode, the headline decode, the headline prefill.
    "cpu": [("decode", "decode b1 ctx512"), ("decode", "decode b32 ctx4096"),
            ("prefill", "prefill 4x2048 H32/32")],
    "cuda": [("decode", "decode b1 ctx1024"), ("decode", "decode b64 ctx4096"),
             ("prefill", "prefill 1x8192 H32/32")],
}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def rust_row(exe, backend, suite, name, seconds):
    """The Rust bench's JSON row `name`."""
    cmd = [exe, "bench", "--backend", backend, "--suite", suite, "--rows", name, "--json",
           "--seconds", str(seconds)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [r for r in json.loads(out)["rows"] if r["name"] == name]
    if not rows:
        sys.exit(f"pagedattn bench has no row named {name!r}")
    return rows[0]


class PythonRow:
    """The workload of a Rust row's `params`, through the Python package."""

    def __init__(self, backend, params, layers):
        p = params
        self.backend = backend
        dev = backend.device
        dtype = DTYPES[p["dtype"]]
        h, hkv, d, b, nb = (p["num_heads"], p["num_kv_heads"], p["head_size"], p["block_size"],
                            p["num_blocks"])
        self.attn = pagedattn.Attention(backend, h, d, num_kv_heads=hkv,
                                        kv_cache_dtype=p["kv_cache_dtype"],
                                        k_scale=p["k_scale"], v_scale=p["v_scale"])
        shape = backend.kv_cache_shape(nb, b, hkv, d)
        fp8 = p["kv_cache_dtype"] != "auto"
        self.caches = []
        for _ in range(layers):
            if fp8:
                c = torch.randint(0, 0x78, shape, dtype=torch.uint8, device=dev)
            else:
                c = torch.empty(shape, dtype=dtype, device=dev).uniform_(-1, 1)
            self.caches.append(c)
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(nb, generator=g).tolist()
        tables, slots, seq_lens, context_lens = [], [], [], []
        for s in p["seqs"]:
            n = s["context_len"] + s["query_len"]
            table, order = order[: -(-n // b)], order[-(-n // b):]
            tables.append(table)
            seq_lens.append(n)
            context_lens.append(s["context_len"])
            slots += [table[i // b] * b + i % b for i in range(s["context_len"], n)]
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        md = pagedattn.Metadata(seq_lens=seq_lens, slot_mapping=slots, block_tables=tables,
                                context_lens=context_lens,
                                num_prefills=sum(not s["decode"] for s in p["seqs"]))
        self.plan = self.attn.plan(md, self.caches[0], dtype=dtype)
        t = p["num_tokens"]
        self.q = torch.empty(t, h, d, dtype=dtype, device=dev).uniform_(-1, 1)
        self.k = torch.empty(t, hkv, d, dtype=dtype, device=dev).uniform_(-1, 1)
        self.v = torch.empty(t, hkv, d, dtype=dtype, device=dev).uniform_(-1, 1)
        self.out = torch.empty_like(self.q)

    def call(self, i):
        self.attn.run(self.plan, self.q, self.k, self.v, self.caches[i % len(self.caches)],
                      self.out)

    def time(self, seconds, warmup=0.3):
        """Median seconds per call (device time on a GPU), and host µs per call on a GPU."""
        cuda = self.backend.device.startswith("cuda")
        i, end = 0, time.perf_counter() + warmup
        while time.perf_counter() < end:
            self.call(i)
            i += 1
        laps = []
        if cuda:
            torch.cuda.synchronize()
            end = time.perf_counter() + seconds
            while time.perf_counter() < end or len(laps) < 5:
                # One lap per call, as the Rust bench's event clock; read in batches of 64.
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(65)]
                marks[0].record()
                for j in range(64):
                    self.call(i)
                    i += 1
                    marks[j + 1].record()
                marks[-1].synchronize()
                laps += [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end or len(laps) < 5:
                t0 = time.perf_counter_ns()
                self.call(i)
                laps.append((time.perf_counter_ns() - t0) / 1e9)
                i += 1
        host = None
        if cuda:
            bursts = []
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                for j in range(32):
                    self.call(j)
                bursts.append((time.perf_counter_ns() - t0) / 1e3 / 32)
            torch.cuda.synchronize()
            host = statistics.median(bursts)
        return statistics.median(laps), host


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pagedattn", default="target/release/pagedattn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    backend = pagedattn.Backend(args.backend)
    print(f"backend {backend.name} on {backend.device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    lines = ["| row | Rust median | Python median | Python / Rust | Python − Rust | host µs/call Rust | host µs/call Python |",
             "|---|---|---|---|---|---|---|"]
    for suite, name in ROWS[backend.name]:
        rust, python, rust_host, python_host = [], [], [], []
        prepared = None
        for _ in range(args.rounds):
            r = rust_row(args.pagedattn, backend.name, suite, name, args.seconds)
            rust.append(r["median_ms"] / 1e3)
            if r.get("host_us_per_call") is not None:
                rust_host.append(r["host_us_per_call"])
            if prepared is None:
                prepared = PythonRow(backend, r["params"], r["layers"])
            t, host = prepared.time(args.seconds)
            python.append(t)
            if host is not None:
                python_host.append(host)
            print(f"  {name}: rust {rust[-1] * 1e3:.4f} ms, python {t * 1e3:.4f} ms"
                  + (f", host {rust_host[-1]:.2f} / {host:.2f} µs" if host is not None else ""),
                  flush=True)
        del prepared
        rm, pm = statistics.median(rust), statistics.median(python)
        host = (f"{statistics.median(rust_host):.2f} | {statistics.median(python_host):.2f}"
                if python_host else "- | -")
        lines.append(f"| {name} | {rm * 1e3:.4f} ms | {pm * 1e3:.4f} ms | {pm / rm:.3f} | "
                     f"{(pm - rm) * 1e6:+.1f} µs | {host} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
