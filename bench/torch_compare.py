#!/usr/bin/env python3
"""pagedattn versus PyTorch on the CPU or (--backend cuda) on a GPU, side by side, in one run.

With --backend cuda: SDPA with the flash and with the cuDNN backend (each forced through
`sdpa_kernel`) on K/V gathered from the paged cache (the cache write and the gather timed with
it; SDPA alone too), FlexAttention's paged decode, PyTorch's bf16 matmul and device copy as
ceilings, all timed with CUDA events (bench/README.md, "On a GPU"). What follows is the CPU mode.

Runs `pagedattn bench --json` (building it with cargo unless --pagedattn is given), then runs the
same workloads -- same shapes, same paged cache geometry, same number of rotated layers, same
thread count -- through PyTorch, and prints a markdown ratio table:

* decode: K/V gathered from a paged cache ([NB, Hkv, B, D] tensor + block tables), then
  `scaled_dot_product_attention`, GQA grouped as a user would (`enable_gqa=True`,
  `repeat_interleave`, and the query heads of a kv head folded into the query rows,
  `grouped_rows`; the fastest is "PyTorch's best"). The cache write and the gather are timed with
  it, since a paged engine must do both; SDPA alone is reported too. IPEX's paged attention
  (vLLM's CPU path) where it imports. FlexAttention's
  paged path (`torch.nn.attention.experimental._paged_attention` + compiled `flex_attention`)
  for bf16 decode rows, if it runs here (otherwise the table says why).
* prefill: SDPA with is_causal=True on [S, H, n, D] (equal lengths are batched), plus the write of
  the prompt's K/V into the paged cache.
* mixed: the same batch as one engine step: cache write, prompt chunks over cached context
  (gathered K/V, bottom-right causal mask), the fresh prompt (is_causal), the decodes (batched).

Usage: python bench/torch_compare.py [--quick] [--pagedattn PATH] [--backend NAME]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

# Instruction sets matched on both sides (--isa): pagedattn's PAGEDATTN_ISA, ATen's and IPEX's
# ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA. They must be set before torch loads.
ISA_ENV = {
    "avx2": {"PAGEDATTN_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"PAGEDATTN_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512bf16": {"PAGEDATTN_ISA": "avx512bf16", "ATEN_CPU_CAPABILITY": "avx512_bf16",
                   "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {"PAGEDATTN_ISA": "amx", "ATEN_CPU_CAPABILITY": "amx", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
}


def isa_from_argv(argv):
    for i, a in enumerate(argv):
        if a == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--isa="):
            return a.split("=", 1)[1]
    return None


if isa_from_argv(sys.argv[1:]) in ISA_ENV:
    os.environ.update(ISA_ENV[isa_from_argv(sys.argv[1:])])

# Compile FlexAttention in this process: inductor's pool of compile workers otherwise keeps
# competing for the cores and slows every later measurement (seen: 0.2 ms -> 12 ms).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pagedattn", help="path to the pagedattn binary (default: cargo build --release)")
    p.add_argument("--backend", default="auto", help="pagedattn backend (default: auto)")
    p.add_argument("--quick", action="store_true", help="fewer rows, shorter timings")
    p.add_argument("--suite", default="all", choices=["all", "decode", "prefill", "mixed", "paging"])
    p.add_argument("--iters", type=int, help="measured iterations per row (both sides)")
    p.add_argument("--seconds", type=float, help="seconds of measurement per row (both sides)")
    p.add_argument("--wait-quiet", type=float, default=0,
                   help="wait up to this many seconds for other processes to leave the CPUs (pagedattn, then PyTorch)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--flex", default="headline", choices=["headline", "all", "none"],
                   help="FlexAttention paged decode on the headline decode rows (default), every bf16 decode row, or none "
                        "(each shape costs a torch.compile of ~30 s)")
    p.add_argument("--from-json", help="use this `pagedattn bench --json` output instead of running pagedattn")
    p.add_argument("--json-out", help="also write every number (both sides) to this file")
    p.add_argument("--isa", choices=sorted(ISA_ENV),
                   help="force one instruction set on both sides (PAGEDATTN_ISA; ATEN_CPU_CAPABILITY and "
                        "ONEDNN_MAX_CPU_ISA for PyTorch and IPEX)")
    p.add_argument("--no-ipex", action="store_true", help="leave IPEX out even where it imports")
    return p.parse_args()


def pagedattn_binary(args):
    if args.pagedattn:
        return args.pagedattn
    print("building pagedattn (cargo build --release -p pagedattn-cli) ...", file=sys.stderr, flush=True)
    subprocess.run(["cargo", "build", "--release", "-p", "pagedattn-cli"], cwd=REPO, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    return os.path.join(target, "release", "pagedattn")


def run_pagedattn(args):
    if args.from_json:
        with open(args.from_json) as f:
            return json.load(f)
    cmd = [pagedattn_binary(args), "bench", "--json", "--backend", args.backend, "--suite", args.suite]
    for flag, on in (("--quick", args.quick), ("--tiny", args.tiny)):
        if on:
            cmd.append(flag)
    if args.iters:
        cmd += ["--iters", str(args.iters)]
    if args.seconds:
        cmd += ["--seconds", str(args.seconds)]
    if args.wait_quiet:
        cmd += ["--wait-quiet", str(args.wait_quiet)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    # The table goes to stderr (shown as it runs); the JSON to stdout.
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


# ---------------------------------------------------------------------------------------------
# Timing: warm-up, then N iterations, median and min (as pagedattn bench does).


def measure(fn, timing):
    """Runs fn(i) for warm-up and measured iterations; returns (median s, min s, iters)."""
    warm, start, i = [], time.perf_counter(), 0
    while len(warm) < 2 or time.perf_counter() - start < timing["warmup_seconds"]:
        t = time.perf_counter()
        fn(i)
        i += 1
        warm.append(time.perf_counter() - t)
    per = max(statistics.median(warm), 1e-9)
    iters = timing["iters"] or min(max(round(timing["target_seconds"] / per), timing["min_iters"]), 100_000)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(i)
        i += 1
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), iters


# ---------------------------------------------------------------------------------------------
# The workloads, rebuilt in PyTorch from the parameters pagedattn recorded.

FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


class Workload:
    """One row's batch: paged caches (L layers), block tables, slots, new Q/K/V."""

    def __init__(self, row, max_layers=None, device="cpu"):
        p = row["params"]
        self.device = device
        self.row, self.p = row, p
        self.H, self.Hkv, self.D, self.B = p["num_heads"], p["num_kv_heads"], p["head_size"], p["block_size"]
        self.group = self.H // self.Hkv
        self.dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[p["dtype"]]
        self.fp8 = FP8.get(p["kv_cache_dtype"])
        self.cache_dtype = getattr(torch, self.fp8) if self.fp8 else self.dtype
        self.k_scale, self.v_scale = p["k_scale"], p["v_scale"]
        self.seqs = p["seqs"]
        self.seq_lens = [s["context_len"] + s["query_len"] for s in self.seqs]
        self.layers = row["layers"] if max_layers is None else min(row["layers"], max_layers)
        g = torch.Generator().manual_seed(0)
        # Block tables: shuffled or contiguous runs, as pagedattn built them.
        blocks_per_seq = [-(-n // self.B) for n in self.seq_lens]
        nb = sum(blocks_per_seq)
        order = torch.randperm(nb, generator=g) if p["mapping"] == "shuffled" else torch.arange(nb)
        self.tables, at = [], 0
        for m in blocks_per_seq:
            self.tables.append(order[at:at + m])
            at += m
        self.num_blocks = nb
        # Caches: [NB, Hkv, B, D] per layer, random (drawn on the device itself).
        gc = g if device == "cpu" else torch.Generator(device=device).manual_seed(0)
        self.k_cache, self.v_cache = [], []
        for _ in range(self.layers):
            for caches in (self.k_cache, self.v_cache):
                x = torch.rand(nb, self.Hkv, self.B, self.D, generator=gc, device=device) * 2 - 1
                caches.append((x / self.k_scale).to(self.cache_dtype) if self.fp8 else x.to(self.dtype))
                del x
        # New tokens (prefills first, then decodes) and their slots.
        t = sum(s["query_len"] for s in self.seqs)
        self.q = (torch.rand(t, self.H, self.D, generator=g) * 2 - 1).to(self.dtype)
        self.k = (torch.rand(t, self.Hkv, self.D, generator=g) * 2 - 1).to(self.dtype)
        self.v = (torch.rand(t, self.Hkv, self.D, generator=g) * 2 - 1).to(self.dtype)
        blk, off = [], []
        for s, table in zip(self.seqs, self.tables):
            for pos in range(s["context_len"], s["context_len"] + s["query_len"]):
                blk.append(int(table[pos // self.B]))
                off.append(pos % self.B)
        self.slot_blk, self.slot_off = torch.tensor(blk), torch.tensor(off)
        if device != "cpu":
            self.q, self.k, self.v = (x.to(device) for x in (self.q, self.k, self.v))
            self.slot_blk, self.slot_off = self.slot_blk.to(device), self.slot_off.to(device)
            self.tables = [t.to(device) for t in self.tables]
        self.qsl = [0]
        for s in self.seqs:
            self.qsl.append(self.qsl[-1] + s["query_len"])
        # Batch plan: fresh prompts of equal length batched, chunks over context one by one,
        # decodes batched when their lengths are equal (grouped by length otherwise).
        self.fresh, self.chunks, self.decodes = {}, [], {}
        for i, s in enumerate(self.seqs):
            if s["decode"]:
                self.decodes.setdefault(self.seq_lens[i], []).append(i)
            elif s["context_len"] == 0:
                self.fresh.setdefault(s["query_len"], []).append(i)
            else:
                self.chunks.append(i)

    def write(self, layer):
        """The cache write of every new token (pagedattn's forward does it too)."""
        k, v = self.k, self.v
        if self.fp8:
            k = (k.float() / self.k_scale).to(self.cache_dtype)
            v = (v.float() / self.v_scale).to(self.cache_dtype)
            # No index_put for float8 (CUDA, and the CPU in torch 2.8): write the codes.
            kc, vc = self.k_cache[layer].view(torch.uint8), self.v_cache[layer].view(torch.uint8)
            kc[self.slot_blk, :, self.slot_off, :] = k.view(torch.uint8)
            vc[self.slot_blk, :, self.slot_off, :] = v.view(torch.uint8)
            return
        self.k_cache[layer][self.slot_blk, :, self.slot_off, :] = k
        self.v_cache[layer][self.slot_blk, :, self.slot_off, :] = v

    def gather(self, layer, idx):
        """K/V of sequences `idx` (all of length n) from the paged cache: [len(idx), Hkv, n, D]."""
        n = self.seq_lens[idx[0]]
        tables = torch.stack([self.tables[i] for i in idx])  # [S, M]
        out = []
        for cache, scale in ((self.k_cache[layer], self.k_scale), (self.v_cache[layer], self.v_scale)):
            # [S, M, Hkv, B, D]; float8 gathered as its codes (no float8 indexing in torch 2.8)
            x = cache.view(torch.uint8)[tables].view(cache.dtype) if self.fp8 else cache[tables]
            x = x.permute(0, 2, 1, 3, 4).reshape(len(idx), self.Hkv, -1, self.D)[:, :, :n]
            if self.fp8:
                x = x.to(self.dtype) * scale
            out.append(x)
        return out

    def queries(self, idx):
        """Queries of sequences `idx` (equal query lengths): [S, H, n, D]."""
        return torch.stack([self.q[self.qsl[i]:self.qsl[i + 1]] for i in idx]).transpose(1, 2)

    def new_kv(self, idx):
        return [torch.stack([x[self.qsl[i]:self.qsl[i + 1]] for i in idx]).transpose(1, 2) for x in (self.k, self.v)]

    def sdpa(self, q, k, v, gqa, **kw):
        if gqa == "eager_matmul":
            return self.eager(q, k, v, **kw)
        if gqa == "grouped_rows":
            S, H, n, D = q.shape
            if n == 1 and not kw:
                # A decode's query heads of one kv head as the query rows of one SDPA call: each
                # K/V row is read once for the whole group (no mask: every row sees every key).
                out = F.scaled_dot_product_attention(q.reshape(S, self.Hkv, self.group, D), k, v)
                return out.reshape(S, H, 1, D)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        if self.group == 1:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        if gqa == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1), **kw)

    def eager(self, q, k, v, is_causal=False, attn_mask=None):
        """Attention as matmuls (Hugging Face's "eager" attention), the query heads of a kv head
        grouped so K/V are not repeated; softmax in f32."""
        S, H, n, D = q.shape
        L = k.shape[2]
        qg = q.reshape(S, self.Hkv, self.group, n, D)
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * (D ** -0.5)  # [S, Hkv, g, n, L]
        if is_causal:
            attn_mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v.unsqueeze(2)).reshape(S, H, n, D)

    def inputs(self, layer):
        """Every SDPA call's inputs for one step (cache write and gathers done): a list of
        (q, k, v, kwargs)."""
        calls = []
        for n, idx in self.fresh.items():
            k, v = self.new_kv(idx)
            calls.append((self.queries(idx), k, v, {"is_causal": True}))
        for i in self.chunks:
            s = self.seqs[i]
            k, v = self.gather(layer, [i])
            if self.device == "cpu":
                qi = torch.arange(s["query_len"]).unsqueeze(1) + s["context_len"]
                mask = torch.arange(self.seq_lens[i]).unsqueeze(0) <= qi  # bottom-right causal
            else:  # the flash and cuDNN kernels take no boolean mask, but this bias
                from torch.nn.attention.bias import causal_lower_right
                mask = causal_lower_right(s["query_len"], self.seq_lens[i])
            calls.append((self.queries([i]), k, v, {"attn_mask": mask}))
        for n, idx in self.decodes.items():
            k, v = self.gather(layer, idx)
            calls.append((self.queries(idx), k, v, {}))
        return calls

    def step(self, layer, gqa):
        """One engine step: write, gather, attend."""
        self.write(layer)
        return [self.sdpa(q, k, v, gqa, **kw) for q, k, v, kw in self.inputs(layer)]

    def token_rows(self, outs):
        """`step`'s outputs (one per SDPA call, in `inputs`' order) as one [T, H, D] tensor."""
        rows = torch.empty(self.q.shape, dtype=self.dtype)
        calls = [idx for idx in self.fresh.values()] + [[i] for i in self.chunks] + list(self.decodes.values())
        for idx, out in zip(calls, outs):
            for j, i in enumerate(idx):
                rows[self.qsl[i]:self.qsl[i + 1]] = out[j].transpose(0, 1)
        return rows


def gqa_methods(w):
    sdpa = ["enable_gqa", "repeat_interleave"] if w.group > 1 else ["sdpa"]
    if w.group > 1 and w.decodes:
        sdpa.append("grouped_rows")
    # Matmul attention materializes every query's scores: a choice for decodes, not prompts
    # (a 2048-token prompt takes it a minute at AVX2).
    return sdpa + (["eager_matmul"] if not (w.fresh or w.chunks) else [])


def ipex_paged_attention():
    """IPEX's paged attention ops (`ipex.llm.modules.PagedAttention`, vLLM's CPU path), or why
    they are unavailable. IPEX's import prints pages of operator-override warnings on stderr:
    they are silenced."""
    import contextlib
    import io
    try:
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                import intel_extension_for_pytorch  # noqa: F401
                from intel_extension_for_pytorch.llm.modules import PagedAttention
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
        return PagedAttention
    except Exception as e:  # noqa: BLE001
        return f"import failed: {type(e).__name__}: {e}".splitlines()[0][:160]


def ipex_step(w, pa):
    """One engine step through IPEX as vLLM's CPU backend runs it: `reshape_and_cache` writes
    the new tokens into the paged cache (IPEX's layout is ours, [NB, Hkv, B, D]); prompts and
    chunks go through `flash_attn_varlen_func` over the paged K/V, decodes through
    `single_query_cached_kv_attention`. Returns step(layer) -> [T, H, D]."""
    i32 = torch.int32
    slots = (w.slot_blk * w.B + w.slot_off).to(i32)
    scale = w.D ** -0.5
    kv_dtype = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(w.fp8, "auto")
    scales = {"k_scale": w.k_scale, "v_scale": w.v_scale}

    def table(idx):
        m = max(len(w.tables[i]) for i in idx)
        t = torch.zeros(len(idx), m, dtype=i32)
        for r, i in enumerate(idx):
            t[r, :len(w.tables[i])] = w.tables[i]
        return t

    def tokens(idx):
        return torch.cat([torch.arange(w.qsl[i], w.qsl[i + 1]) for i in idx])

    dec = [i for i, s in enumerate(w.seqs) if s["decode"]]
    pre = [i for i, s in enumerate(w.seqs) if not s["decode"]]
    out = torch.empty(w.q.shape, dtype=w.dtype)
    if dec:
        dec_tok = tokens(dec)
        q_dec, out_dec = w.q[dec_tok].contiguous(), torch.empty(len(dec), w.H, w.D, dtype=w.dtype)
        head_mapping = (torch.arange(w.H) // w.group).to(i32)
        dec_table, dec_lens = table(dec), torch.tensor([w.seq_lens[i] for i in dec], dtype=i32)
        dec_max = max(w.seq_lens[i] for i in dec)
    if pre:
        pre_tok = tokens(pre)
        q_pre, out_pre = w.q[pre_tok].contiguous(), torch.empty(len(pre_tok), w.H, w.D, dtype=w.dtype)
        qlens = [w.qsl[i + 1] - w.qsl[i] for i in pre]
        cu_q = torch.tensor([0] + qlens, dtype=i32).cumsum(0).to(i32)
        cu_kv = torch.tensor([0] + [w.seq_lens[i] for i in pre], dtype=i32).cumsum(0).to(i32)
        pre_table, max_q, max_kv = table(pre), max(qlens), max(w.seq_lens[i] for i in pre)

    def step(layer):
        kc, vc = w.k_cache[layer], w.v_cache[layer]
        pa.reshape_and_cache(w.k, w.v, kc, vc, slots, kv_dtype, **scales)
        if pre:
            pa.flash_attn_varlen_func(out_pre, q_pre, kc, vc, cu_q, cu_kv, max_q, max_kv, scale, True, pre_table,
                                      None, kv_cache_dtype=kv_dtype, **scales)
            out[pre_tok] = out_pre
        if dec:
            pa.single_query_cached_kv_attention(out_dec, q_dec, kc, vc, head_mapping, scale, dec_table, dec_lens,
                                                w.B, dec_max, None, **scales)
            out[dec_tok] = out_dec
        return out

    return step


def run_ipex(row, timing, pa):
    """IPEX's paged attention on one row, checked against SDPA first."""
    try:
        w = Workload(row)
        if w.fp8 and w.fp8 != "float8_e5m2":
            return {"error": f"IPEX caches fp8 only as e5m2, not {row['params']['kv_cache_dtype']}"}
        step = ipex_step(w, pa)
        got = step(0).float()
        note = None
        scales = (w.k_scale, w.v_scale)
        if w.fp8 and scales != (1.0, 1.0):
            # IPEX 2.8's CPU ops take k_scale / v_scale but apply neither (seen: new tokens are
            # stored unscaled, codes read as plain values). The work is the same as with
            # scales of 1, where that is right: timed, and checked against SDPA with scales of
            # 1 (the cache's codes taken as values).
            w.k_scale, w.v_scale = 1.0, 1.0
            note = "scales ignored by IPEX"
        want = w.token_rows(w.step(0, gqa_methods(w)[0])).float()
        w.k_scale, w.v_scale = scales
        diff = float((got - want).abs().max())
        if not diff <= 0.05 * max(1.0, float(want.abs().max())):
            return {"error": f"IPEX's output differs from SDPA's by {diff}"}
        med, mn, it = measure(lambda i: step(i % w.layers), timing)
        res = {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it}
        if note:
            res["note"] = note
        return res
    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}


def run_torch(row, timing):
    """Every PyTorch variant of one row: {name: {median_ms, min_ms, iters} or {error}}."""
    w = Workload(row)
    res = {}
    # The variants must agree (a wrong mask or grouping would be a meaningless comparison).
    outs = {m: w.step(0, m) for m in gqa_methods(w)}
    first = next(iter(outs.values()))
    for m, o in outs.items():
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(o, first))
        if diff > 0.05:
            raise RuntimeError(f"{row['name']}: PyTorch variant {m} differs from the others by {diff}")
    del outs, first
    for m in gqa_methods(w):
        try:
            med, mn, it = measure(lambda i: w.step(i % w.layers, m), timing)
            res[m] = {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it}
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, not fatal
            res[m] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
    # SDPA alone, on inputs gathered beforehand (one set per layer, so the reads stay cold).
    try:
        pre = [w.inputs(l) for l in range(w.layers)]
        best = min((m for m in res if "median_ms" in res[m]), key=lambda m: res[m]["median_ms"], default=gqa_methods(w)[0])
        med, mn, it = measure(lambda i: [w.sdpa(q, k, v, best, **kw) for q, k, v, kw in pre[i % w.layers]], timing)
        res["sdpa_only"] = {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it, "method": best}
        del pre
    except Exception as e:  # noqa: BLE001
        res["sdpa_only"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
    return res


def flex_paged_decode(w, dev):
    """FlexAttention's paged decode of the decode-only workload `w` on `dev`: PagedAttention's
    page table holds pagedattn's block tables, each layer's cache in FlexAttention's paged
    layout [1, Hkv, NB * B, D] (w's caches are released). Returns step(i): the new tokens
    written (PagedAttention.assign), then compiled flex_attention over layer i's cache."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    S, nb, B = len(w.seqs), w.num_blocks, w.B
    M = max(len(t) for t in w.tables)
    pa = PagedAttention(nb, B, S, device=dev)
    for s, table in enumerate(w.tables):
        pa.page_table[s, :len(table)] = table
        pa.physical_to_logical[s, table] = torch.arange(len(table), device=dev)
        pa.capacity[s] = len(table) * B
    seq_lens = torch.tensor(w.seq_lens, device=dev)
    caches = [[c.permute(1, 0, 2, 3).reshape(1, w.Hkv, nb * B, w.D).contiguous() for c in cs]
              for cs in (w.k_cache, w.v_cache)]
    del w.k_cache, w.v_cache
    logical = create_block_mask(lambda b, h, q, kv: kv < seq_lens[b], S, None, 1, M * B, device=dev,
                                BLOCK_SIZE=(128, B))
    mask = pa.convert_logical_block_mask(logical, kv_len=seq_lens)
    score_mod = pa.get_score_mod(None, kv_len=seq_lens)
    q = w.q.view(S, 1, w.H, w.D).transpose(1, 2)
    knew = w.k.view(S, 1, w.Hkv, w.D).transpose(1, 2)
    vnew = w.v.view(S, 1, w.Hkv, w.D).transpose(1, 2)
    batch_idx = torch.arange(S, device=dev)
    input_pos = (seq_lens - 1).view(S, 1)
    # Static shapes: every row compiles its own kernel (a dynamic-shape recompile, which
    # torch.compile makes on the second shape it sees, picks tiles that pages of 16 tokens do
    # not divide). A fresh compile cache per row, so that no row meets the recompile limit
    # (past it torch.compile would fall back to eager flex_attention).
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)

    def step(i):
        k, v = caches[0][i % w.layers], caches[1][i % w.layers]
        pa.assign(batch_idx, input_pos, knew, vnew, k, v)
        return flex(q, k, v, block_mask=mask, score_mod=score_mod, enable_gqa=w.group > 1)

    return step


def run_flex(row, timing):
    """FlexAttention's paged decode on the CPU: page table = pagedattn's block tables."""
    try:
        import torch.nn.attention.experimental._paged_attention  # noqa: F401
        import torch.nn.attention.flex_attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"error": f"import failed: {e}"}
    try:
        w = Workload(row)
        if w.fp8:
            return {"error": "no fp8 KV cache in FlexAttention"}
        if w.chunks or w.fresh:
            return {"error": "decode rows only"}
        step = flex_paged_decode(w, "cpu")
        t = time.perf_counter()
        step(0)  # compiles
        compile_s = time.perf_counter() - t
        med, mn, it = measure(step, timing)
        return {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it, "compile_s": compile_s}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}


# ---------------------------------------------------------------------------------------------
# --backend cuda: the same rows on the GPU, timed with CUDA events.


def measure_cuda(fn, timing):
    """Runs fn(i) for warm-up, then queues the measured iterations back to back with a CUDA event
    between each two (the host runs ahead; the events are read at the end, as pagedattn bench
    does). Returns (median s, min s, iters)."""
    warm, start, i = [], time.perf_counter(), 0
    while len(warm) < 3 or time.perf_counter() - start < timing["warmup_seconds"]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        i += 1
        warm.append(a.elapsed_time(b) / 1e3)
    per = max(statistics.median(warm[1:]), 1e-9)
    iters = timing["iters"] or min(max(round(timing["target_seconds"] / per), timing["min_iters"]), 100_000)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for k in range(iters):
        fn(i)
        i += 1
        events[k + 1].record()
    events[-1].synchronize()
    times = [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(iters)]
    return statistics.median(times), min(times), iters


def cuda_ceilings(timing):
    """PyTorch's own ceilings on this GPU: a bf16 matmul (8192^3) and a device copy (2 GiB)."""
    out = {}
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
        med, mn, it = measure_cuda(lambda i: torch.matmul(a, b, out=c), timing)
        out["matmul_bf16_tflops"] = 2 * 8192 ** 3 / med / 1e12
        out["matmul_bf16_tflops_at_min"] = 2 * 8192 ** 3 / mn / 1e12
        del a, b, c
    except Exception as e:  # noqa: BLE001
        out["matmul_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    try:
        n = 1 << 30
        src = torch.randint(0, 255, (2 * n,), device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        med, mn, it = measure_cuda(lambda i: dst.copy_(src), timing)
        out["copy_gbs"] = 2 * 2 * n / med / 1e9
        del src, dst
    except Exception as e:  # noqa: BLE001
        out["copy_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    torch.cuda.empty_cache()
    return out


CUDA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def cuda_sdpa(w, backend, gqa):
    """An SDPA call of `w` on one backend (no fallback to another: the context allows only it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, **kw):
        with sdpa_kernel(getattr(SDPBackend, CUDA_BACKENDS[backend])):
            if w.group > 1 and gqa == "repeat_interleave":
                k, v = k.repeat_interleave(w.group, dim=1), v.repeat_interleave(w.group, dim=1)
                return F.scaled_dot_product_attention(q, k, v, **kw)
            if w.group > 1:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return call


def err(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:200].replace("|", "/")


def run_torch_cuda(row, timing):
    """SDPA (flash, cuDNN) on K/V gathered from the paged cache, with the cache write and the
    gather, and alone on K/V gathered beforehand; each checked against the math backend in f32."""
    w = Workload(row, device="cuda")
    res = {}
    # A reference for one step: f32 math on the same gathered inputs.
    w.write(0)
    calls = w.inputs(0)
    ref = [F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=w.group > 1, **kw)
           for q, k, v, kw in calls]
    for name in CUDA_BACKENDS:
        chosen, why = None, []
        for gqa in (["enable_gqa", "repeat_interleave"] if w.group > 1 else ["none"]):
            try:
                f = cuda_sdpa(w, name, gqa)
                outs = [f(q, k, v, **kw) for q, k, v, kw in calls]
                torch.cuda.synchronize()
                diff = max(float((o.float() - r).abs().max()) for o, r in zip(outs, ref))
                if not diff < 0.05:
                    raise RuntimeError(f"differs from the f32 math reference by {diff}")
                chosen = (gqa, f)
                break
            except Exception as e:  # noqa: BLE001
                why.append(f"{gqa}: {err(e)}")
        if chosen is None:
            res[name] = {"error": "; ".join(why)}
            res[name + "_only"] = {"error": "; ".join(why)}
            continue
        gqa, f = chosen

        def step(i, f=f):
            layer = i % w.layers
            w.write(layer)
            return [f(q, k, v, **kw) for q, k, v, kw in w.inputs(layer)]
        try:
            med, mn, it = measure_cuda(step, timing)
            res[name] = {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it, "gqa": gqa}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": err(e)}
        try:
            pre = [w.inputs(l) for l in range(w.layers)]
            med, mn, it = measure_cuda(lambda i: [f(q, k, v, **kw) for q, k, v, kw in pre[i % w.layers]], timing)
            res[name + "_only"] = {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it, "gqa": gqa}
            del pre
        except Exception as e:  # noqa: BLE001
            res[name + "_only"] = {"error": err(e)}
    del w, calls, ref
    torch.cuda.empty_cache()
    return res


def run_flex_cuda(row, timing):
    """FlexAttention's paged decode on the GPU (compiled): page table = pagedattn's block tables,
    pages of B tokens in FlexAttention's [1, Hkv, NB * B, D] layout, the cache write included
    (PagedAttention.assign)."""
    try:
        import torch.nn.attention.experimental._paged_attention  # noqa: F401
        import torch.nn.attention.flex_attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"error": f"import failed: {err(e)}"}
    try:
        w = Workload(row, device="cuda")
        if w.fp8:
            return {"error": "no fp8 KV cache in FlexAttention"}
        if w.chunks or w.fresh:
            return {"error": "decode rows only"}
        # The reference: the new tokens written, K/V gathered, f32 SDPA (flex writes the same
        # tokens to the same slots again in its first step).
        w.write(0)
        ref = {n: (idx, F.scaled_dot_product_attention(*(x.float() for x in (w.queries(idx), *w.gather(0, idx))),
                                                       enable_gqa=w.group > 1))
               for n, idx in w.decodes.items()}
        step = flex_paged_decode(w, "cuda")
        t = time.perf_counter()
        out = step(0)  # compiles
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t
        diff = max(float((out[idx].float() - r).abs().max()) for idx, r in ref.values())
        if not diff < 0.05:
            return {"error": f"differs from the f32 SDPA reference by {diff}", "compile_s": compile_s}
        del out, ref
        med, mn, it = measure_cuda(step, timing)
        return {"median_ms": med * 1e3, "min_ms": mn * 1e3, "iters": it, "compile_s": compile_s,
                "page_size": w.B, "max_abs_diff": diff}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        return {"error": err(e)}


def table_cuda(doc, results, torch_ceil):
    g, c = doc["gpu"], doc["ceilings"]
    copy, peak = c["copy_gbs"], c["mma_bf16_gflops"]
    lines = []
    lines.append(f"Device: {g['name']} ({g['sm_count']} SMs, L2 {g['l2_bytes'] >> 20} MiB, "
                 f"{g['total_memory'] / 2**30:.0f} GiB, compute capability {g['compute_capability'][0]}."
                 f"{g['compute_capability'][1]}, kernels for {g['arch']}, driver for CUDA "
                 f"{g['driver_cuda_version'][0]}.{g['driver_cuda_version'][1]}); host {doc['machine']['cpu_model']}. "
                 f"pagedattn backend `{doc['backend']}`, {doc['scale']} sizes; PyTorch {torch.__version__} "
                 f"(cuDNN {torch.backends.cudnn.version()}).")
    lines.append("")
    mm = torch_ceil.get("matmul_bf16_tflops")
    lines.append(f"Ceilings measured in the same run: device copy {copy / 1e3:.2f} TB/s counting read + write bytes "
                 f"({c['copy_bytes'] >> 20} MiB, `cuMemcpyDtoDAsync`, CUDA events; {copy / 2e3:.2f} TB/s of reads); "
                 f"`mma.sync` bf16 peak (m16n8k16, f32 accumulate) {peak / 1e3:.0f} TFLOP/s; PyTorch bf16 matmul "
                 f"8192³ {f'{mm:.0f} TFLOP/s' if mm else 'failed: ' + torch_ceil.get('matmul_error', '?')}; "
                 f"PyTorch device copy {torch_ceil.get('copy_gbs', float('nan')) / 1e3:.2f} TB/s (read + write).")
    lines.append("")
    lines.append("| workload | pagedattn ms (min) | pagedattn rate | % of ceiling (during the row) | SDPA flash ms (alone) "
                 "| SDPA cuDNN ms (alone) | FlexAttention paged ms | pagedattn / best peer | speed-up |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def peer(r):
        if r is None:
            return "not run"
        if "median_ms" in r:
            return f"{r['median_ms']:.3f}"
        return "n/a: " + r["error"]

    for row in doc["rows"]:
        name = row["name"] + (" **(headline)**" if row.get("headline") else "")
        if "error" in row:
            lines.append(f"| {name} | skipped: {row['error']} | | | | | | | | |")
            continue
        if row["bound"] == "memory":
            rate = f"{row['gbs'] / 1e3:.2f} TB/s"
            pct = f"{row['pct_mem_bw']:.0f}% of {row['mem_read_gbs_during'] / 1e3:.2f} TB/s copy"
        elif row["bound"] == "compute":
            rate = f"{row['gflops'] / 1e3:.1f} TFLOP/s"
            pct = f"{row['pct_compute_peak']:.0f}% of {row['compute_peak_gflops_during'] / 1e3:.0f} TFLOP/s mma"
            if mm:
                pct += f", {100 * row['gflops'] / 1e3 / mm:.0f}% of matmul"
        else:
            rate = f"{row['gbs'] / 1e3:.2f} TB/s, {row['gflops'] / 1e3:.1f} TFLOP/s"
            pct = f"{row['pct_mem_bw']:.0f}% copy, {row['pct_compute_peak']:.0f}% mma"
        pa = f"{row['median_ms']:.3f} ({row['min_ms']:.3f})"
        res = results.get(row["name"])
        if res is None:
            lines.append(f"| {name} | {pa} | {rate} | {pct} | (pagedattn only) | | | | |")
            continue
        cells = []
        for k in CUDA_BACKENDS:
            a, o = res.get(k), res.get(k + "_only")
            cell = peer(a)
            if o and "median_ms" in o:
                cell += f" ({o['median_ms']:.3f})"
            cells.append(cell)
        flex = res.get("flex")
        ok = {k: v["median_ms"] for k, v in res.items() if k in list(CUDA_BACKENDS) + ["flex"] and v and "median_ms" in v}
        if ok:
            how = min(ok, key=ok.get)
            ratio = f"{row['median_ms'] / ok[how]:.2f} ({how})"
            speed = f"**{ok[how] / row['median_ms']:.2f}×**"
        else:
            ratio = speed = "—"
        lines.append(f"| {name} | {pa} | {rate} | {pct} | {cells[0]} | {cells[1]} | {peer(flex)} | {ratio} | {speed} |")
    for p in doc.get("paging") or []:
        lines.append("")
        lines.append(f"Paging overhead (pagedattn, {p['workload']}: shuffled vs contiguous block tables, interleaved): "
                     f"{p['ratio_paged_over_contiguous']:.3f} (medians), {p['ratio_paged_over_contiguous_min']:.3f} (minimums).")
    if doc.get("mixed"):
        m = doc["mixed"]
        lines.append("")
        lines.append(f"Mixed batch / (its prefill part + its decode part, interleaved): {m['ratio_whole_over_parts']:.3f} "
                     f"(medians), {m['ratio_whole_over_parts_min']:.3f} (minimums).")
    lines.append("")
    lines.append("Times are medians over CUDA events (pagedattn: events on its stream, iterations queued back to back; "
                 "PyTorch: torch.cuda.Event the same way). Decode rate = KV bytes read / time, against the device copy "
                 "bandwidth counted as (read + write) bytes / time; prefill rate = 4 × causal pairs × D × H / time, "
                 "against the `mma.sync` bf16 peak (and PyTorch's bf16 matmul). SDPA columns: cache write + gather of K/V "
                 "from the pages + SDPA restricted to that backend (`sdpa_kernel`), GQA by `enable_gqa=True` where the "
                 "backend takes it, else `repeat_interleave`; in parentheses SDPA alone on K/V gathered beforehand. "
                 "Chunks over cached context use `causal_lower_right`. FlexAttention: "
                 "`torch.nn.attention.experimental._paged_attention` + compiled `flex_attention`, cache write "
                 "(`assign`) included, headline decode only unless `--flex all`. pagedattn / best peer compares with the "
                 "fastest full step (write + gather + attention) of the peers. "
                 f"Command: `{' '.join(sys.argv)}` -> `{doc['command']}`.")
    return "\n".join(lines)


def main_cuda(args):
    doc = run_pagedattn(args)
    timing = dict(doc["timing"])
    torch_ceil = cuda_ceilings(timing)
    print(f"torch ceilings: {torch_ceil}", file=sys.stderr, flush=True)
    results, flex_rows = {}, []
    for row in doc["rows"]:
        if "error" in row or row["suite"] == "paging":
            continue
        print(f"torch: {row['name']} ...", file=sys.stderr, flush=True)
        try:
            res = run_torch_cuda(row, timing)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            res = {k: {"error": err(e)} for k in CUDA_BACKENDS}
        results[row["name"]] = res
        summary = ", ".join(f"{k} {fmt_ms(v)} ms" if "median_ms" in v else f"{k} failed ({v.get('error', '')[:80]})"
                            for k, v in res.items())
        print(f"torch: {row['name']}: {summary} (pagedattn {row['median_ms']:.3f} ms)", file=sys.stderr, flush=True)
        is_bf16_decode = row["suite"] == "decode" and row["params"]["kv_cache_dtype"] == "auto"
        if is_bf16_decode and (args.flex == "all" or (args.flex == "headline" and row.get("headline"))):
            flex_rows.append(row)
    for row in flex_rows:
        print(f"torch: {row['name']} FlexAttention paged (torch.compile first) ...", file=sys.stderr, flush=True)
        flex = run_flex_cuda(row, timing)
        results[row["name"]]["flex"] = flex
        print(f"torch: {row['name']}: flex {fmt_ms(flex)} ms {flex.get('error', '')}", file=sys.stderr, flush=True)
    text = table_cuda(doc, results, torch_ceil)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"pagedattn": doc, "torch": results, "torch_version": torch.__version__,
                       "torch_ceilings": torch_ceil}, f, indent=1)


# ---------------------------------------------------------------------------------------------
# How busy the machine was with other processes (as `pagedattn bench` reports it).


def cpu_times():
    """(busy ticks of all CPUs, steal ticks, total ticks, this process's ticks) or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    t = os.times()
    ours = round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))
    return user + nice + system + irq + softirq, steal, sum(v), ours


def load_between(a, b):
    if not a or not b or b[2] <= a[2]:
        return None
    total = b[2] - a[2]
    return {"others": max(0, (b[0] - a[0]) - (b[3] - a[3])) / total, "steal": (b[1] - a[1]) / total}


def describe_load(load):
    if not load:
        return "unknown"
    warn = " -- NOT QUIET: figures are unreliable" if load["others"] > 0.05 or load["steal"] > 0.05 else ""
    return f"other processes {100 * load['others']:.0f}% of all CPUs, hypervisor steal {100 * load['steal']:.0f}%{warn}"


def wait_quiet(seconds):
    """Waits up to `seconds` for other processes to use under 5% of the CPUs over one second."""
    start = time.monotonic()
    while True:
        a = cpu_times()
        time.sleep(1.0)
        load = load_between(a, cpu_times())
        if load is None or (load["others"] < 0.05 and load["steal"] < 0.05) or time.monotonic() - start >= seconds:
            return load
        if int(time.monotonic() - start) % 10 == 0:
            print(f"waiting for quiet: {describe_load(load)}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The table.


def fmt_ms(r):
    return f"{r['median_ms']:.3f}" if r and "median_ms" in r else "—"


def noisy(load):
    """A marker for a measurement during which other processes used the CPUs."""
    return " !" if load and (load["others"] > 0.05 or load["steal"] > 0.05) else ""


def table(doc, results, torch_load):
    m, c = doc["machine"], doc["ceilings"]
    lines = []
    bf16 = c.get("bf16_dot_gflops_all_cores")
    amx = c.get("amx_bf16_gflops_all_cores")
    lines.append(f"Machine: {m['cpu_model']} ({m['cpu_id']}), {m['threads']} threads, LLC {m['llc_bytes'] >> 20} MiB, "
                 f"SIMD {' '.join(m['simd'])}. pagedattn backend `{doc['backend']}`, {doc['scale']} sizes; "
                 f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads. Instruction sets: pagedattn "
                 f"{c.get('isa', os.environ.get('PAGEDATTN_ISA', 'best'))}, ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN "
                 f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'best')}.")
    lines.append("")
    lines.append(f"Ceilings (measured by `pagedattn bench` at the start of the run): memory read {c['mem_read_gbs']:.1f} GB/s "
                 f"({c['threads']} threads; 1 thread {c['mem_read_gbs_1thread']:.1f}), paged read (the headline decode's "
                 f"access pattern) {c.get('paged_read_gbs', float('nan')):.1f} GB/s, f32 FMA {c['f32_fma_gflops_per_core']:.0f} "
                 f"GFLOP/s per core / {c['f32_fma_gflops_all_cores']:.0f} all cores ({c['f32_isa']}), bf16 dot "
                 + (f"{c['bf16_dot_gflops_per_core']:.0f} / {bf16:.0f} GFLOP/s" if bf16 else "n/a")
                 + (f", AMX bf16 {c['amx_bf16_gflops_per_core']:.0f} / {amx:.0f} GFLOP/s" if amx else "")
                 + f"; prefill rows are compared with the {c['compute_ceiling']}.")
    lines.append("")
    lines.append("| workload | pagedattn ms | pagedattn rate | % of ceiling (measured during the row) | PyTorch best ms (how) "
                 "| pagedattn / PyTorch | speed-up | PyTorch attention only ms | FlexAttention paged ms | IPEX paged ms |")
    lines.append("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for row in doc["rows"]:
        name = row["name"] + (" **(headline)**" if row.get("headline") else "")
        if "error" in row:
            lines.append(f"| {name} | skipped: {row['error']} | | | | | | | | |")
            continue
        if row["bound"] == "memory":
            rate = f"{row['gbs']:.1f} GB/s"
            pct = f"{row['pct_mem_bw']:.0f}% of {row['mem_read_gbs_during']:.1f} GB/s"
            if row.get("paged_read_gbs_during"):
                pct += f" (paged read: {row['pct_paged_read']:.0f}% of {row['paged_read_gbs_during']:.1f})"
        elif row["bound"] == "compute":
            rate = f"{row['gflops']:.0f} GFLOP/s"
            pct = f"{row['pct_compute_peak']:.0f}% of {row['compute_peak_gflops_during']:.0f} GFLOP/s"
        else:
            rate = f"{row['gbs']:.1f} GB/s, {row['gflops']:.0f} GFLOP/s"
            pct = (f"{row['pct_mem_bw']:.0f}% bw, {row['pct_compute_peak']:.0f}% peak")
        res = results.get(row["name"])
        if res is None:
            lines.append(f"| {name} | {row['median_ms']:.3f} | {rate} | {pct} | (pagedattn only) | | | | | |")
            continue
        ok = {k: v for k, v in res.items() if k not in ("sdpa_only", "flex", "load") and "median_ms" in v}
        if ok:
            how = min(ok, key=lambda k: ok[k]["median_ms"])
            best = ok[how]["median_ms"]
            best_s = f"{best:.3f} ({how}){noisy(res.get('load'))}"
            ratio = f"{row['median_ms'] / best:.2f}"
            speed = f"**{best / row['median_ms']:.2f}×**"
        else:
            best_s = "failed: " + "; ".join(v.get("error", "") for k, v in res.items() if k != "load")
            ratio = speed = "—"
        sdpa = res.get("sdpa_only", {})
        flex = res.get("flex")
        if flex is None:
            flex_s = "not run"
        elif "median_ms" in flex:
            flex_s = f"{flex['median_ms']:.3f}"
        else:
            flex_s = "n/a: " + flex["error"].replace("|", "/")
        ipex = res.get("ipex")
        ipex_s = ("not run" if ipex is None else fmt_ms(ipex) + (f" ({ipex['note']})" if "note" in ipex else "")
                  if "median_ms" in ipex else "n/a: " + ipex["error"].replace("|", "/"))
        lines.append(f"| {name} | {row['median_ms']:.3f}{noisy(row.get('load'))} | {rate} | {pct} | {best_s} | {ratio} | {speed} | "
                     f"{fmt_ms(sdpa)} | {flex_s} | {ipex_s} |")
    for p in doc.get("paging") or []:
        lines.append("")
        lines.append(f"Paging overhead (pagedattn, {p['workload']}: shuffled vs contiguous block tables, interleaved): "
                     f"{p['ratio_paged_over_contiguous']:.3f} (medians), {p['ratio_paged_over_contiguous_min']:.3f} (minimums).")
    lines.append("")
    lines.append(f"Load of other processes: during pagedattn {describe_load(doc.get('load_during'))}; "
                 f"during PyTorch {describe_load(torch_load)}.")
    lines.append("")
    lines.append("Times are medians. PyTorch best = the fastest of SDPA with `enable_gqa=True`, SDPA on K/V repeated with "
                 "`repeat_interleave`, SDPA with a decode's query heads of one kv head folded into the query rows "
                 "(`grouped_rows`: each K/V row read once per group), attention written as matmuls (`eager_matmul`, f32 "
                 "softmax; decode-only rows), each including the cache write and the gather of K/V from the pages (fresh prompts use their "
                 "new K/V directly), and IPEX's paged attention (`ipex`: `reshape_and_cache`, `flash_attn_varlen_func` for "
                 "prompts and chunks, `single_query_cached_kv_attention` for decodes, as vLLM's CPU backend calls them); "
                 "attention only = the fastest of these on inputs gathered beforehand. Speed-up = PyTorch best / pagedattn. "
                 f"Command: `{' '.join(sys.argv)}` -> `{doc['command']}`.")
    return "\n".join(lines)


def main():
    args = parse_args()
    if args.backend == "cuda":
        return main_cuda(args)
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    doc = run_pagedattn(args)
    timing = dict(doc["timing"])
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)
    torch_start = cpu_times()
    results, flex_rows = {}, []
    for row in doc["rows"]:
        if "error" in row or row["suite"] == "paging":
            continue
        print(f"torch: {row['name']} ...", file=sys.stderr, flush=True)
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        before = cpu_times()
        res = run_torch(row, timing)
        res["load"] = load_between(before, cpu_times())
        results[row["name"]] = res
        summary = ", ".join(f"{k} {fmt_ms(v)} ms" if "median_ms" in v else f"{k} failed"
                            for k, v in res.items() if k != "load")
        print(f"torch: {row['name']}: {summary} (pagedattn {row['median_ms']:.3f} ms)", file=sys.stderr, flush=True)
        is_bf16_decode = row["suite"] == "decode" and row["params"]["kv_cache_dtype"] == "auto"
        if is_bf16_decode and (args.flex == "all" or (args.flex == "headline" and row.get("headline"))):
            flex_rows.append(row)
    # FlexAttention last: torch.compile leaves state behind (threads, caches) that must not
    # touch the SDPA measurements.
    for row in flex_rows:
        print(f"torch: {row['name']} FlexAttention paged (torch.compile first) ...", file=sys.stderr, flush=True)
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        flex = run_flex(row, timing)
        results[row["name"]]["flex"] = flex
        print(f"torch: {row['name']}: flex {fmt_ms(flex)} ms {flex.get('error', '')}", file=sys.stderr, flush=True)
    # IPEX after the SDPA rows (its import replaces some of ATen's CPU kernels).
    pa = "left out (--no-ipex)" if args.no_ipex else ipex_paged_attention()
    for row in doc["rows"]:
        if row["name"] not in results:
            continue
        if isinstance(pa, str):
            results[row["name"]]["ipex"] = {"error": pa}
            continue
        print(f"torch: {row['name']} IPEX paged ...", file=sys.stderr, flush=True)
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        results[row["name"]]["ipex"] = r = run_ipex(row, timing, pa)
        print(f"torch: {row['name']}: IPEX {fmt_ms(r)} ms {r.get('error', '')}", file=sys.stderr, flush=True)
    torch_load = load_between(torch_start, cpu_times())
    text = table(doc, results, torch_load)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"pagedattn": doc, "torch": results, "torch_version": torch.__version__,
                       "torch_threads": torch.get_num_threads(), "torch_load": torch_load}, f, indent=1)


if __name__ == "__main__":
    main()
