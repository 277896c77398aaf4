"""Tests of pagedattn.vllm, the vLLM-shaped layer over the native module.

Every attention output is compared with a float64 dense reference (the contract of
docs/semantics.md written with torch ops), on each backend this machine has: ``reference`` and
``cpu`` on CPU tensors, ``cuda`` when torch sees a GPU and the build has it.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pagedattn = pytest.importorskip("pagedattn")

from pagedattn import _native  # noqa: E402
from pagedattn import vllm as pv  # noqa: E402
from pagedattn.vllm import (  # noqa: E402
    AttentionType,
    PagedAttnBackend,
    PagedAttnImpl,
    PagedAttnMetadata,
)

sys.path.insert(0, os.path.dirname(__file__))

HAS_CUDA = torch.cuda.is_available() and "cuda" in _native.backends()
BACKENDS = ["reference", "cpu"] + (["cuda"] if HAS_CUDA else [])


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """(name, torch device) with the vLLM layer forced onto that backend."""
    name = request.param
    monkeypatch.delenv(pv.BACKEND_ENV, raising=False)
    pv.set_backend(name)
    yield name, ("cuda" if name == "cuda" else "cpu")
    pv.set_backend(None)


def layout_of(device: str) -> str:
    return pv.backend_for(torch.empty(0, device=device)).kv_cache_layout


def token_view(cache, layout, nb, bs, hkv, d):
    """A view ``[2, NB, B, Hkv, D]`` of a vLLM-shaped cache in the backend's layout."""
    if layout == "NHD":
        return cache.view(2, nb, bs, hkv, d)
    assert layout == "HND"
    return cache.view(2, nb, hkv, bs, d).permute(0, 1, 3, 2, 4)


FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def quantize(x, scale, fmt="fp8"):
    """The fp8 code bytes of ``x / scale`` (computed in f32, round to nearest even; the test
    values stay far from the formats' largest finite values, so no saturation is involved)."""
    return (x.float() / torch.tensor(f32(scale), dtype=torch.float32)).to(FP8[fmt]).view(torch.uint8)


def dequantize(codes, scale, fmt="fp8"):
    """The contract's read of fp8 codes: ``code * scale`` (float64)."""
    return codes.view(FP8[fmt]).to(torch.float64) * f32(scale)


try:  # the shared float64 reference of the binding's tests, when present
    import dense as _dense
except ImportError:  # pragma: no cover
    _dense = None


def f32(x):
    """``x`` rounded to float32 (the native config holds the fp8 scales as f32)."""
    return torch.tensor(float(x), dtype=torch.float32).item()


def dense_attention(q, k, v, *, scale, causal, ctx=0, alibi=None, window=None, soft_cap=None,
                    cross=False):
    """float64 reference: q ``[n, H, D]`` at positions ``ctx..ctx+n-1``, k/v ``[L, Hkv, D]``.
    ``causal``: decoder self-attention (aligned to the end); else bidirectional. ``cross``:
    cross-attention, whose ALiBi measures a query from ``min(i, L - 1)`` (the contract).
    ``dense.py``'s when it exists, else ``local_dense_attention``."""
    n, length = q.shape[0], k.shape[0]
    pos = list(range(ctx, ctx + n))
    alibi_pos = [min(i, max(length - 1, 0)) for i in pos] if cross else None
    if _dense is not None:
        return _dense.dense_attention(
            q, k, v, pos, causal=causal, scale=scale, alibi_slopes=alibi,
            sliding_window=window, soft_cap=soft_cap, alibi_q_pos=alibi_pos,
        )
    return local_dense_attention(q, k, v, scale=scale, causal=causal, ctx=ctx, alibi=alibi,
                                 window=window, soft_cap=soft_cap, alibi_pos=alibi_pos)


def local_dense_attention(q, k, v, *, scale, causal, ctx=0, alibi=None, window=None, soft_cap=None,
                          alibi_pos=None):
    """float64 reference: q ``[n, H, D]`` at positions ``ctx..ctx+n-1``, k/v ``[L, Hkv, D]``.
    ``causal``: decoder self-attention (aligned to the end); else bidirectional. ``alibi_pos``:
    the positions ALiBi measures the queries from (default: theirs)."""
    q, k, v = q.double(), k.double(), v.double()
    n, h, d = q.shape
    length, hkv, _ = k.shape
    g = h // hkv
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    i = torch.arange(n, dtype=torch.float64)[:, None] + ctx
    j = torch.arange(length, dtype=torch.float64)[None, :]
    if alibi is not None:
        slopes = torch.tensor(alibi, dtype=torch.float64)[:, None, None]
        ai = i if alibi_pos is None else torch.tensor(alibi_pos, dtype=torch.float64)[:, None]
        s = s + slopes * ((j - ai) if causal else -(j - ai).abs())
    allowed = torch.ones(n, length, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # a query with no allowed key outputs 0
    return torch.einsum("hij,jhd->ihd", p, vv)


def alibi_slopes(n):
    """Bloom's slopes (vLLM's bloom.py)."""
    c = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(c) - 3)))
    slopes = [base ** i for i in range(1, c + 1)]
    if c != n:
        extra = 2 ** (-(2 ** -(math.log2(2 * c) - 3)))
        slopes += [extra ** i for i in range(1, 1 + 2 * min(c, n - c), 2)]
    return slopes


class Batch:
    """A step: sequences ``(context, new)`` (prefills first, decodes with new == 1), each given
    distinct random physical blocks."""

    def __init__(self, seqs, block_size, num_blocks, gen, device="cpu"):
        self.seqs = seqs
        self.bs = block_size
        self.nb = num_blocks
        self.device = device
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, self.slots = [], []
        for ctx, new in seqs:
            nblk = -(-(ctx + new) // block_size)
            table, perm = perm[:nblk], perm[nblk:]
            self.tables.append(table)
            self.slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        self.num_prefills = sum(1 for ctx, new in seqs if not (new == 1 and ctx > 0))
        assert all(new == 1 and ctx > 0 for ctx, new in seqs[self.num_prefills:])
        self.qsl = [0]
        for _, new in seqs:
            self.qsl.append(self.qsl[-1] + new)
        self.num_tokens = self.qsl[-1]

    def metadata(self, **extra):
        dev = self.device
        np_ = self.num_prefills
        seq_lens = [c + n for c, n in self.seqs]
        width = max(len(t) for t in self.tables)
        tables = [t + [0] * (width - len(t)) for t in self.tables]
        fields = dict(
            num_prefills=np_,
            num_prefill_tokens=self.qsl[np_],
            num_decode_tokens=len(self.seqs) - np_,
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=dev),
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_prefill_seq_len=max(seq_lens[:np_], default=0),
            max_decode_seq_len=max(seq_lens[np_:], default=0),
            context_lens_tensor=torch.tensor([c for c, _ in self.seqs], dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(self.qsl, dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in self.seqs),
        )
        fields.update(extra)
        return PagedAttnBackend.make_metadata(**fields)


def make_layer_data(batch, h, hkv, d, dtype, gen):
    """Per sequence full keys/values ``[L, Hkv, D]`` and new queries ``[n, H, D]``."""
    ks, vs, qs = [], [], []
    for ctx, new in batch.seqs:
        ks.append(torch.randn(ctx + new, hkv, d, generator=gen).to(dtype))
        vs.append(torch.randn(ctx + new, hkv, d, generator=gen).to(dtype))
        qs.append(torch.randn(new, h, d, generator=gen).to(dtype))
    return qs, ks, vs


def fill_context(cache, layout, batch, ks, vs, hkv, d, fp8_scales=None, fmt="fp8"):
    """Writes each sequence's cached context into the cache (as fp8 codes for an fp8 cache)."""
    tv = token_view(cache, layout, batch.nb, batch.bs, hkv, d)
    for (ctx, _), table, k, v in zip(batch.seqs, batch.tables, ks, vs):
        for p in range(ctx):
            blk, off = table[p // batch.bs], p % batch.bs
            kp, vp = k[p], v[p]
            if fp8_scales is not None:
                kp, vp = quantize(kp, fp8_scales[0], fmt), quantize(vp, fp8_scales[1], fmt)
            tv[0, blk, off] = kp.to(cache.device)
            tv[1, blk, off] = vp.to(cache.device)


# ---------------------------------------------------------------------------------------------
# Decoder: a mixed batch through two layers sharing one metadata
# ---------------------------------------------------------------------------------------------

H, HKV, D, BS, NB = 4, 2, 32, 4, 40
MIXED = [(0, 5), (6, 4), (7, 1), (16, 1), (3, 1)]  # 2 prefills (one with context), 3 decodes

FEATURES = {
    "gqa": dict(),
    "alibi": dict(alibi=True),
    "window": dict(window=3),
    "soft_cap": dict(soft_cap=0.9),
    "fp8": dict(fp8="fp8"),
    "fp8_e5m2": dict(fp8="fp8_e5m2", dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
    "f16": dict(dtype=torch.float16),
    "all": dict(alibi=True, window=5, soft_cap=2.0),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_decoder_mixed_batch_two_layers(backend, feature):
    name, dev = backend
    f = FEATURES[feature]
    dtype = f.get("dtype", torch.float32)
    fp8 = f.get("fp8")
    gen = torch.Generator().manual_seed(list(FEATURES).index(feature))
    batch = Batch(MIXED, BS, NB, gen, device=dev)
    md = batch.metadata()
    layout = layout_of(dev)
    # Two layers of one shape: different scale, slopes, soft cap and fp8 scales.
    layer_cfgs = [
        dict(scale=D ** -0.5, slopes=alibi_slopes(H), cap=f.get("soft_cap"), kv=(0.07, 0.03)),
        dict(scale=0.11, slopes=[s * 2 for s in alibi_slopes(H)], cap=f.get("soft_cap") and f["soft_cap"] * 1.5,
             kv=(0.05, 0.09)),
    ]
    for li, cfg in enumerate(layer_cfgs):
        impl = PagedAttnImpl(
            H, D, cfg["scale"], num_kv_heads=HKV,
            alibi_slopes=cfg["slopes"] if f.get("alibi") else None,
            sliding_window=f.get("window"),
            kv_cache_dtype=fp8 or "auto",
            logits_soft_cap=cfg["cap"],
        )
        k_scale, v_scale = cfg["kv"] if fp8 else (1.0, 1.0)
        shape = PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D)
        cache = torch.zeros(shape, dtype=torch.uint8 if fp8 else dtype, device=dev)
        qs, ks, vs = make_layer_data(batch, H, HKV, D, dtype, gen)
        fill_context(cache, layout, batch, ks, vs, HKV, D, (k_scale, v_scale) if fp8 else None, fp8)
        query = torch.cat(qs).reshape(batch.num_tokens, H * D).to(dev)
        key = torch.cat([k[c:] for k, (c, _) in zip(ks, batch.seqs)]).reshape(-1, HKV * D).to(dev)
        value = torch.cat([v[c:] for v, (c, _) in zip(vs, batch.seqs)]).reshape(-1, HKV * D).to(dev)
        out = impl.forward(query, key, value, cache, md, k_scale=k_scale, v_scale=v_scale)
        assert out.shape == (batch.num_tokens, H * D) and out.dtype == dtype
        # The new tokens are in the cache, at their slots (fp8: as their codes).
        tv = token_view(cache, layout, NB, BS, HKV, D).cpu()
        for t, slot in enumerate(batch.slots):
            kt, vt = key[t].cpu().view(HKV, D), value[t].cpu().view(HKV, D)
            if fp8:
                kt, vt = quantize(kt, k_scale, fp8), quantize(vt, v_scale, fp8)
            assert torch.equal(tv[0, slot // BS, slot % BS], kt), f"key of token {t}"
            assert torch.equal(tv[1, slot // BS, slot % BS], vt), f"value of token {t}"
        # Dense reference over every key, as read back from the cache.
        for s, (ctx, new) in enumerate(batch.seqs):
            k, v = ks[s].double(), vs[s].double()
            if fp8:
                k = dequantize(quantize(ks[s], k_scale, fp8), k_scale, fp8)
                v = dequantize(quantize(vs[s], v_scale, fp8), v_scale, fp8)
            want = dense_attention(
                qs[s], k, v, scale=cfg["scale"], causal=True, ctx=ctx,
                alibi=cfg["slopes"] if f.get("alibi") else None,
                window=f.get("window"), soft_cap=cfg["cap"],
            )
            got = out[batch.qsl[s]:batch.qsl[s + 1]].view(new, H, D).cpu().double()
            tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}.get(dtype, 1e-4)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"layer {li} seq {s}: {m}")
    # One plan for both layers (same shape), made at the first one.
    assert len(md._plans) == 1


def test_forward_shapes_and_output_argument(backend):
    """[T, H, D] queries, [T, Hkv, D] keys, an ``output`` tensor, non-contiguous slices of a
    fused qkv: the same numbers as the plain call."""
    name, dev = backend
    gen = torch.Generator().manual_seed(7)
    batch = Batch(MIXED, BS, NB, gen, device=dev)
    md = batch.metadata()
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    shape = PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D)
    cache = torch.randn(shape, generator=gen).to(dev)  # garbage in unused slots is never read
    t = batch.num_tokens
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=gen).to(dev)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    assert not q.is_contiguous()
    plain = impl.forward(q.contiguous(), k.contiguous(), v.contiguous(), cache.clone(), md)
    fused = impl.forward(q, k, v, cache.clone(), md)
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    output = torch.full((t, H * D), float("nan"), device=dev)
    got = impl.forward(q.reshape(t, H, D), k.reshape(t, HKV, D), v.reshape(t, HKV, D), cache.clone(), md,
                       output=output)
    assert got.shape == (t, H * D) and got.data_ptr() == output.data_ptr()
    torch.testing.assert_close(output, plain, atol=0, rtol=0)
    # A non-contiguous output is filled too.
    wide = torch.full((t, 2 * H * D), float("nan"), device=dev)
    impl.forward(q, k, v, cache.clone(), md, output=wide[:, : H * D])
    torch.testing.assert_close(wide[:, : H * D], plain, atol=0, rtol=0)
    assert len(md._plans) == 1


def test_profile_run_without_cache(backend):
    """An empty kv_cache (numel() == 0): no cache, attend over the new tokens (all prefills)."""
    name, dev = backend
    gen = torch.Generator().manual_seed(3)
    batch = Batch([(0, 5), (0, 3)], BS, NB, gen, device=dev)
    md = batch.metadata(slot_mapping=torch.full((8,), -1, dtype=torch.int64, device=dev),
                        block_tables=torch.empty(0, dtype=torch.int32, device=dev))
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV, sliding_window=2)
    qs, ks, vs = make_layer_data(batch, H, HKV, D, torch.float32, gen)
    out = impl.forward(torch.cat(qs).to(dev), torch.cat(ks).to(dev), torch.cat(vs).to(dev),
                       torch.empty(0, device=dev), md)
    for s in range(2):
        want = dense_attention(qs[s], ks[s], vs[s], scale=D ** -0.5, causal=True, window=2)
        got = out[batch.qsl[s]:batch.qsl[s + 1]].view(-1, H, D).cpu().double()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("style", ["torch_sdpa", "xformers_empty_prefill_rows", "all_prefill_no_tables"])
def test_vllm_runner_metadata_conventions(backend, style):
    """Metadata as vLLM's runners build it gives the same output as the full metadata.
    ``torch_sdpa``: seq_lens of the prefills only, the decodes' lengths in seq_lens_tensor,
    block tables of the decodes only, no context_lens_tensor, query_start_loc of the prefills.
    ``xformers_empty_prefill_rows``: a fresh prompt's table row is empty, padded with 0.
    ``all_prefill_no_tables``: a batch of fresh prompts with a ``[S, 0]`` block table."""
    name, dev = backend
    gen = torch.Generator().manual_seed(11)
    seqs = [(0, 5), (0, 6)] + ([] if style == "all_prefill_no_tables" else [(7, 1), (9, 1)])
    batch = Batch(seqs, BS, NB, gen, device=dev)
    full = batch.metadata()
    seq_lens = [c + n for c, n in seqs]
    i32 = dict(dtype=torch.int32, device=dev)
    if style == "torch_sdpa":
        width = max(len(t) for t in batch.tables[2:])
        vllm_md = batch.metadata(
            seq_lens=seq_lens[:2],
            seq_lens_tensor=torch.tensor(seq_lens[2:], **i32),
            context_lens_tensor=None,
            query_start_loc=torch.tensor(batch.qsl[:3], **i32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in batch.tables[2:]], **i32),
        )
    elif style == "xformers_empty_prefill_rows":
        rows = [[], []] + batch.tables[2:]
        width = max(map(len, rows))
        vllm_md = batch.metadata(block_tables=torch.tensor([r + [0] * (width - len(r)) for r in rows], **i32))
    else:
        vllm_md = batch.metadata(block_tables=torch.empty(2, 0, **i32), query_start_loc=None,
                                 context_lens_tensor=None)
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    shape = PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D)
    cache = torch.randn(shape, generator=gen).to(dev)
    t = batch.num_tokens
    q = torch.randn(t, H * D, generator=gen).to(dev)
    k = torch.randn(t, HKV * D, generator=gen).to(dev)
    v = torch.randn(t, HKV * D, generator=gen).to(dev)
    want = impl.forward(q, k, v, cache.clone(), full)
    got = impl.forward(q, k, v, cache.clone(), vllm_md)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Encoder, encoder-only, encoder-decoder
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_encoder_decoder_cross_attention(backend, alibi):
    """Prefill writes the encoder's K/V into the cross cache through cross_slot_mapping; a decode
    step then reads them with key=value=None. With ALiBi, a query past the encoder's last key
    measures from that key (the contract)."""
    name, dev = backend
    gen = torch.Generator().manual_seed(5)
    layout = layout_of(dev)
    enc_lens, dec_lens = [5, 7], [7, 2]  # sequence 0: decoder positions past the last encoder key
    scale = 0.2
    cross_tables, cross_slots, perm = [], [], torch.randperm(NB, generator=gen).tolist()
    for n in enc_lens:
        nblk = -(-n // BS)
        table, perm = perm[:nblk], perm[nblk:]
        cross_tables.append(table)
        cross_slots += [table[p // BS] * BS + p % BS for p in range(n)]
    width = max(map(len, cross_tables))
    cross_bt = torch.tensor([t + [0] * (width - len(t)) for t in cross_tables], dtype=torch.int32, device=dev)
    enc = dict(
        encoder_seq_lens=enc_lens,
        encoder_seq_lens_tensor=torch.tensor(enc_lens, dtype=torch.int32, device=dev),
        max_encoder_seq_len=max(enc_lens),
        num_encoder_tokens=sum(enc_lens),
        cross_block_tables=cross_bt,
    )
    # Decoder self-attention blocks (unused by the cross layer, but a real step has them).
    dec_batch = Batch([(0, n) for n in dec_lens], BS, NB, gen, device=dev)
    md = dec_batch.metadata(cross_slot_mapping=torch.tensor(cross_slots, dtype=torch.int64, device=dev), **enc)
    slopes = alibi_slopes(H) if alibi else None
    impl = PagedAttnImpl(H, D, scale, num_kv_heads=HKV, alibi_slopes=slopes,
                         attn_type=AttentionType.ENCODER_DECODER)
    cache = torch.zeros(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D), device=dev)
    k_enc = torch.randn(sum(enc_lens), HKV, D, generator=gen)
    v_enc = torch.randn(sum(enc_lens), HKV, D, generator=gen)
    q = torch.randn(sum(dec_lens), H, D, generator=gen)
    out = impl.forward(q.reshape(-1, H * D).to(dev), k_enc.reshape(-1, HKV * D).to(dev),
                       v_enc.reshape(-1, HKV * D).to(dev), cache, md)
    tv = token_view(cache, layout, NB, BS, HKV, D).cpu()
    for t, slot in enumerate(cross_slots):
        assert torch.equal(tv[0, slot // BS, slot % BS], k_enc[t])
        assert torch.equal(tv[1, slot // BS, slot % BS], v_enc[t])
    es = [0, enc_lens[0], sum(enc_lens)]
    ds = [0, dec_lens[0], sum(dec_lens)]
    for s in range(2):
        want = dense_attention(q[ds[s]:ds[s + 1]], k_enc[es[s]:es[s + 1]], v_enc[es[s]:es[s + 1]],
                               scale=scale, causal=False, alibi=slopes, cross=True)
        torch.testing.assert_close(out[ds[s]:ds[s + 1]].view(-1, H, D).cpu().double(), want, atol=1e-4, rtol=1e-4)

    # Decode step: one new decoder token per sequence, no encoder K/V, the cross cache read.
    slots = [dec_batch.tables[s][dec_lens[s] // BS] * BS + dec_lens[s] % BS for s in range(2)]
    width = max(map(len, dec_batch.tables))
    md2 = PagedAttnMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        seq_lens=[n + 1 for n in dec_lens],
        seq_lens_tensor=torch.tensor([n + 1 for n in dec_lens], dtype=torch.int32, device=dev),
        max_decode_seq_len=max(dec_lens) + 1,
        context_lens_tensor=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in dec_batch.tables], dtype=torch.int32,
                                  device=dev),
        max_query_len=1,
        cross_slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),
        **enc,
    )
    q2 = torch.randn(2, H, D, generator=gen)
    before = cache.clone()
    out2 = impl.forward(q2.reshape(2, H * D).to(dev), None, None, cache, md2)
    assert torch.equal(cache, before)
    for s in range(2):
        want = dense_attention(q2[s:s + 1], k_enc[es[s]:es[s + 1]], v_enc[es[s]:es[s + 1]], scale=scale,
                               causal=False, ctx=dec_lens[s], alibi=slopes, cross=True)
        torch.testing.assert_close(out2[s:s + 1].view(1, H, D).cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
def test_encoder_types_bidirectional_no_cache(backend, attn_type):
    """Encoder and encoder-only layers attend bidirectionally over their own tokens and never
    touch the cache, even when given one."""
    name, dev = backend
    gen = torch.Generator().manual_seed(9)
    lens = [4, 6]
    slopes = alibi_slopes(H)
    if attn_type == AttentionType.ENCODER:
        md = PagedAttnMetadata(
            num_prefills=2, num_prefill_tokens=5, num_decode_tokens=0,
            slot_mapping=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64, device=dev),  # the decoder's
            seq_lens=[3, 2], encoder_seq_lens=lens,
            encoder_seq_lens_tensor=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_encoder_seq_len=6, num_encoder_tokens=10,
        )
    else:
        md = Batch([(0, n) for n in lens], BS, NB, gen, device=dev).metadata()
    impl = PagedAttnImpl(H, D, 0.15, num_kv_heads=HKV, alibi_slopes=slopes, attn_type=attn_type)
    q = torch.randn(10, H, D, generator=gen)
    k = torch.randn(10, HKV, D, generator=gen)
    v = torch.randn(10, HKV, D, generator=gen)
    cache = torch.zeros(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D), device=dev)
    out = impl.forward(q.view(10, -1).to(dev), k.view(10, -1).to(dev), v.view(10, -1).to(dev), cache, md)
    assert not cache.any()
    starts = [0, 4, 10]
    for s in range(2):
        a, b = starts[s], starts[s + 1]
        want = dense_attention(q[a:b], k[a:b], v[a:b], scale=0.15, causal=False, alibi=slopes)
        torch.testing.assert_close(out[a:b].view(-1, H, D).cpu().double(), want, atol=1e-4, rtol=1e-4)


def test_cross_attention_requires_cross_fields():
    md = PagedAttnMetadata(num_prefills=1, num_prefill_tokens=2, num_decode_tokens=0,
                           slot_mapping=torch.tensor([0, 1]), seq_lens=[2])
    impl = PagedAttnImpl(H, D, 0.1, num_kv_heads=HKV, attn_type=AttentionType.ENCODER_DECODER)
    cache = torch.zeros(PagedAttnBackend.get_kv_cache_shape(4, BS, HKV, D))
    with pytest.raises(AttributeError, match="cross-attention metadata"):
        impl.forward(torch.randn(2, H * D), None, None, cache, md)
    enc = PagedAttnImpl(H, D, 0.1, num_kv_heads=HKV, attn_type=AttentionType.ENCODER)
    with pytest.raises(AttributeError, match="encoder metadata"):
        enc.forward(torch.randn(2, H * D), torch.randn(2, HKV * D), torch.randn(2, HKV * D), cache, md)


# ---------------------------------------------------------------------------------------------
# Backend: names, shapes, swaps, copies, rejections
# ---------------------------------------------------------------------------------------------


def test_backend_static_side():
    assert PagedAttnBackend.get_name() == "PAGEDATTN"
    assert PagedAttnBackend.get_impl_cls() is PagedAttnImpl
    assert PagedAttnBackend.get_metadata_cls() is PagedAttnMetadata
    md = PagedAttnBackend.make_metadata(num_prefills=0, num_prefill_tokens=0, num_decode_tokens=1,
                                        slot_mapping=torch.tensor([3]), seq_lens=[4])
    assert isinstance(md, PagedAttnMetadata)
    assert AttentionType.DECODER == "decoder" and AttentionType.ENCODER == "encoder"
    assert AttentionType.ENCODER_ONLY == "encoder_only" and AttentionType.ENCODER_DECODER == "encoder_decoder"


@pytest.mark.parametrize("nb,bs,hkv,d", [(10, 16, 8, 128), (3, 8, 1, 64), (1, 32, 4, 80)])
def test_kv_cache_shape_is_vllms(nb, bs, hkv, d):
    # vLLM's PagedAttention.get_kv_cache_shape.
    assert PagedAttnBackend.get_kv_cache_shape(nb, bs, hkv, d) == (2, nb, bs * hkv * d)


@pytest.mark.parametrize("name", BACKENDS)
def test_kv_cache_shape_matches_native_layout(name):
    """vLLM's flat shape holds exactly the native cache's elements, block for block."""
    be = pv.get_backend(name)
    native = be.kv_cache_shape(NB, BS, HKV, D)
    flat = PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D)
    native = tuple(native)
    assert native[:2] == flat[:2] and math.prod(native[2:]) == flat[2]


def test_native_kv_cache_shape_is_a_tuple():
    assert isinstance(pv.get_backend("cpu").kv_cache_shape(NB, BS, HKV, D), tuple)


def test_backend_selection(monkeypatch):
    monkeypatch.delenv(pv.BACKEND_ENV, raising=False)
    pv.set_backend(None)
    x = torch.zeros(1)
    assert pv.backend_for(x).name == "cpu"
    assert pv.backend_for(x) is pv.backend_for(x)  # cached
    monkeypatch.setenv(pv.BACKEND_ENV, "reference")
    assert pv.backend_for(x).name == "reference"
    pv.set_backend("cpu")
    try:
        assert pv.backend_for(x).name == "cpu"
        with pytest.raises(ValueError):
            pv.set_backend("tpu")
    finally:
        pv.set_backend(None)
    monkeypatch.setenv(pv.BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match="PAGEDATTN_BACKEND"):
        pv.backend_for(x)


def random_cache(nb, dtype, device, gen):
    shape = PagedAttnBackend.get_kv_cache_shape(nb, BS, HKV, D)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def check_swapped(src, dst, before_dst, pairs):
    want = before_dst.clone()
    for s, d in pairs:
        want[:, d] = src[:, s].to(want.device)
    assert torch.equal(dst.cpu().view(torch.uint8), want.cpu().view(torch.uint8))


@pytest.mark.parametrize("name", ["cpu", "reference"])
def test_swap_blocks_cpu_round_trip(name):
    pv.set_backend(name)
    try:
        gen = torch.Generator().manual_seed(1)
        src = random_cache(12, torch.float16, "cpu", gen)
        swap = random_cache(6, torch.float16, "cpu", gen)
        before = swap.clone()
        out_pairs = [[3, 0], [7, 4], [11, 5]]
        try:
            PagedAttnBackend.swap_blocks(src, swap, torch.tensor(out_pairs, dtype=torch.int64))
        except (NotImplementedError, TypeError) as e:  # pragma: no cover - depends on the build
            pytest.skip(f"cpu -> cpu swap not supported: {e}")
        check_swapped(src, swap, before, out_pairs)
        back = torch.zeros_like(src)
        in_pairs = [[0, 1], [4, 2], [5, 9]]
        PagedAttnBackend.swap_blocks(swap, back, in_pairs)
        for (s_out, s_swap), (s_in, d_back) in zip(out_pairs, in_pairs):
            assert s_swap == s_in
            assert torch.equal(back[:, d_back], src[:, s_out])
        with pytest.raises(ValueError):
            PagedAttnBackend.swap_blocks(src, swap, [[12, 0]])
        # vLLM before 0.5 passed a dict of a source block to its destination.
        again = torch.zeros_like(src)
        PagedAttnBackend.swap_blocks(swap, again, {0: 1, 4: 2, 5: 9})
        assert torch.equal(again, back)
    finally:
        pv.set_backend(None)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
def test_swap_blocks_cuda_cpu_round_trip():
    gen = torch.Generator().manual_seed(2)
    gpu = random_cache(12, torch.bfloat16, "cuda", gen)
    host = random_cache(6, torch.bfloat16, "cpu", gen).pin_memory()
    before = host.clone()
    pairs = [[3, 0], [7, 4], [11, 5]]
    PagedAttnBackend.swap_blocks(gpu, host, torch.tensor(pairs))
    torch.cuda.synchronize()
    check_swapped(gpu, host, before, pairs)
    gpu2 = torch.zeros_like(gpu)
    back = [[0, 1], [4, 2], [5, 9]]
    PagedAttnBackend.swap_blocks(host, gpu2, back)
    torch.cuda.synchronize()
    check_swapped(host, gpu2, torch.zeros_like(gpu2), back)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_blocks_every_layer_byte_for_byte(backend, dtype):
    name, dev = backend
    gen = torch.Generator().manual_seed(4)
    caches = [random_cache(10, dtype, dev, gen) for _ in range(3)]
    befores = [c.clone() for c in caches]
    pairs = [[0, 5], [2, 6], [2, 7], [9, 1]]  # one source to several destinations, as vLLM's forks
    PagedAttnBackend.copy_blocks(caches, torch.tensor(pairs, dtype=torch.int64, device=dev))
    for c, b in zip(caches, befores):
        want = b.clone()
        for s, d in pairs:
            want[:, d] = b[:, s]
        assert torch.equal(c.view(torch.uint8), want.view(torch.uint8))
    PagedAttnBackend.copy_blocks([], pairs)  # no layer: nothing to do
    # vLLM before 0.5 passed a dict of a source to its destinations: the same copies.
    dict_caches = [b.clone() for b in befores]
    PagedAttnBackend.copy_blocks(dict_caches, {0: [5], 2: [6, 7], 9: [1]})
    for c, d in zip(caches, dict_caches):
        assert torch.equal(c.view(torch.uint8), d.view(torch.uint8))


def test_blocksparse_rejected():
    with pytest.raises(NotImplementedError):
        PagedAttnImpl(H, D, 0.1, num_kv_heads=HKV, blocksparse_params={"block_size": 64})


def test_bad_heads_rejected():
    with pytest.raises(ValueError):
        PagedAttnImpl(6, D, 0.1, num_kv_heads=4)


# ---------------------------------------------------------------------------------------------
# Metadata views
# ---------------------------------------------------------------------------------------------


def test_prefill_and_decode_metadata_views():
    gen = torch.Generator().manual_seed(0)
    batch = Batch(MIXED, BS, NB, gen)
    md = batch.metadata()
    pre, dec = md.prefill_metadata, md.decode_metadata
    assert pre is md.prefill_metadata and dec is md.decode_metadata  # cached
    assert (pre.num_prefills, pre.num_prefill_tokens, pre.num_decode_tokens) == (2, 9, 0)
    assert pre.seq_lens == [5, 10] and pre.max_decode_seq_len == 0
    assert torch.equal(pre.slot_mapping, md.slot_mapping[:9])
    assert torch.equal(pre.block_tables, md.block_tables[:2])
    assert pre.query_start_loc.tolist() == [0, 5, 9]
    assert (dec.num_prefills, dec.num_prefill_tokens, dec.num_decode_tokens) == (0, 0, 3)
    assert dec.seq_lens_tensor.tolist() == [8, 17, 4] and dec.max_prefill_seq_len == 0
    assert torch.equal(dec.slot_mapping, md.slot_mapping[9:])
    assert torch.equal(dec.block_tables, md.block_tables[2:])
    only_decodes = Batch([(4, 1)], BS, NB, gen).metadata()
    assert only_decodes.prefill_metadata is None and only_decodes.decode_metadata is not None
    only_prefills = Batch([(0, 3)], BS, NB, gen).metadata()
    assert only_prefills.decode_metadata is None and only_prefills.prefill_metadata is not None


def test_native_metadata_conversion():
    gen = torch.Generator().manual_seed(0)
    batch = Batch(MIXED, BS, NB, gen)
    md = batch.metadata()
    n = md.native(AttentionType.DECODER, block_size=BS)
    assert n is md.native(AttentionType.DECODER, block_size=BS)  # cached
    assert n.num_seqs == 5 and n.num_tokens == 12
    assert (n.num_prefills, n.num_prefill_tokens, n.num_decode_tokens) == (2, 9, 3)
    assert n.seq_lens == [5, 10, 8, 17, 4] and n.context_lens == [0, 6, 7, 16, 3]
    assert n.query_start_loc == batch.qsl
    assert n.max_prefill_seq_len == 10 and n.max_decode_seq_len == 17


# ---------------------------------------------------------------------------------------------
# vLLM 0.6's fields and call forms; metadata that contradicts itself
# ---------------------------------------------------------------------------------------------


def vllm_06_fields(batch):
    """The fields vLLM 0.6's builders add beside the base ones, consistent with ``batch``
    (docs/design/vllm-interface.md)."""
    np_ = batch.num_prefills
    seq_lens = [c + n for c, n in batch.seqs]
    cum = lambda lens: [sum(lens[:i]) for i in range(len(lens) + 1)]
    i32 = dict(dtype=torch.int32)
    prefill_queries = [n for _, n in batch.seqs[:np_]]
    return dict(
        seq_start_loc=torch.tensor(cum(seq_lens), **i32),
        max_decode_query_len=1,
        is_prompt=len(batch.seqs) == np_,
        seqlen_q=torch.tensor(cum(prefill_queries), **i32),
        max_seqlen=max(prefill_queries),
        chunked_prefill=True,
        max_kv_len=max(seq_lens[:np_]),
        kv_start_loc=torch.tensor(cum(seq_lens[:np_]), **i32),
        prefill_query_start_loc=torch.tensor(cum(prefill_queries), **i32),
        enable_kv_scales_calculation=False,
    )


def test_vllm_06_fields_are_accepted_and_change_nothing(backend):
    """Metadata with every field vLLM 0.6's TorchSDPA / xFormers / IPEX builders pass gives the
    output of the base fields alone; the attention type given per call (0.6's form, a string
    or 0.6.3's enum member) overrides the construction's."""
    import enum

    name, dev = backend
    gen = torch.Generator().manual_seed(5)
    batch = Batch(MIXED, BS, NB, gen, device=dev)
    base = batch.metadata()
    full = batch.metadata(**{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in vllm_06_fields(batch).items()})
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    cache = torch.randn(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D), generator=gen).to(dev)
    t = batch.num_tokens
    q = torch.randn(t, H * D, generator=gen).to(dev)
    k = torch.randn(t, HKV * D, generator=gen).to(dev)
    v = torch.randn(t, HKV * D, generator=gen).to(dev)
    want = impl.forward(q, k, v, cache.clone(), base)
    got = impl.forward(q, k, v, cache.clone(), full)
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    class VllmAttentionType(enum.Enum):  # vLLM 0.6.3's
        DECODER = enum.auto()
        ENCODER = enum.auto()
        ENCODER_DECODER = enum.auto()

    by_enum = impl.forward(q, k, v, cache.clone(), base, 1.0, 1.0, attn_type=VllmAttentionType.DECODER)
    torch.testing.assert_close(by_enum, want, atol=0, rtol=0)
    # An encoder-only call of a decoder-built layer: bidirectional, no cache, per call.
    enc = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV, attn_type=AttentionType.ENCODER_ONLY)
    prompts = Batch([(0, 5), (0, 4)], BS, NB, gen, device=dev).metadata()
    qe, ke, ve = (x[:9] for x in (q, k, v))
    torch.testing.assert_close(
        impl.forward(qe, ke, ve, cache.clone(), prompts, attn_type="encoder_only"),
        enc.forward(qe, ke, ve, cache.clone(), prompts),
        atol=0, rtol=0,
    )
    with pytest.raises(ValueError, match="attn_type: 'sideways'"):
        impl.forward(q, k, v, cache.clone(), base, attn_type="sideways")


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("query_start_loc", [0, 5, 8, 9, 10, 11], "metadata.query_start_loc and metadata.context_lens_tensor disagree: sequence 1"),
        ("seq_start_loc", [0, 5, 15, 23, 40, 40], "metadata.seq_start_loc and metadata.seq_lens disagree"),
        ("is_prompt", True, "metadata.is_prompt and metadata.num_decode_tokens disagree"),
        ("seqlen_q", [0, 5, 10], "metadata.seqlen_q and metadata.query_start_loc disagree"),
        ("max_seqlen", 3, "metadata.max_seqlen and metadata.query_start_loc disagree"),
        ("max_kv_len", 9, "metadata.max_kv_len and metadata.seq_lens disagree"),
        ("kv_start_loc", [0, 5, 16], "metadata.kv_start_loc and metadata.seq_lens disagree"),
        ("prefill_query_start_loc", [0, 4, 9], "metadata.prefill_query_start_loc and metadata.query_start_loc disagree"),
        ("max_prefill_seq_len", 9, "metadata.max_prefill_seq_len and metadata.seq_lens disagree"),
        ("max_decode_seq_len", 16, "metadata.max_decode_seq_len and metadata.seq_lens disagree"),
        ("max_query_len", 4, "metadata.max_query_len and metadata.query_start_loc disagree"),
        ("num_prefill_tokens", 8, "metadata.num_prefill_tokens and metadata.query_start_loc disagree"),
        ("slot_mapping", list(range(11)), "metadata.slot_mapping and metadata.query_start_loc disagree: 11 slots for 12"),
    ],
)
def test_metadata_that_contradicts_itself_is_refused_naming_both_fields(field, value, says):
    """Two fields that describe the same thing and disagree: a ``ValueError`` naming both at
    the first forward, never one silently winning. (A maximum is a bound: only one below the
    longest disagrees.)"""
    gen = torch.Generator().manual_seed(6)
    batch = Batch(MIXED, BS, NB, gen)
    if isinstance(value, list):
        value = torch.tensor(value, dtype=torch.int64 if field == "slot_mapping" else torch.int32)
    md = batch.metadata(**{field: value})
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    cache = torch.zeros(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D))
    t = batch.num_tokens
    q = torch.randn(t, H * D, generator=gen)
    k = torch.randn(t, HKV * D, generator=gen)
    with pytest.raises(ValueError, match=__import__("re").escape(says)):
        impl.forward(q, k, k.clone(), cache, md)


def test_cuda_graph_capture_metadata_is_accepted(backend):
    """The metadata vLLM 0.6's ``CommonAttentionState`` makes to capture a decode graph of B
    sequences: every slot -1, lengths of 1, ``max_decode_seq_len`` the longest it captures for
    (a bound, not the batch's), ``max_decode_query_len`` 1, no query_start_loc."""
    name, dev = backend
    b = 4
    md = PagedAttnBackend.make_metadata(
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
        slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=dev), seq_lens=None,
        seq_lens_tensor=torch.ones(b, dtype=torch.int32, device=dev), max_query_len=1,
        max_decode_query_len=1, max_prefill_seq_len=0, max_decode_seq_len=8192,
        query_start_loc=None, seq_start_loc=None, context_lens_tensor=None,
        block_tables=torch.zeros(b, 4, dtype=torch.int32, device=dev), use_cuda_graph=True,
    )
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    cache = torch.zeros(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D)).to(dev)
    q = torch.randn(b, H * D).to(dev)
    k = torch.randn(b, HKV * D).to(dev)
    out = impl.forward(q, k, k.clone(), cache, md)
    assert out.shape == (b, H * D) and torch.isfinite(out).all()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked_prefill", "plain_prompts"])
def test_metadata_builder_as_vllm_runners_use_it(backend, chunked):
    """``PagedAttnBackend.make_metadata_builder(input_builder).build(...)``, as vLLM 0.6's model
    runner calls it (its ``inter_data_list`` of sequence groups, made here as the runner makes
    them), gives the step's metadata: the same output as the metadata written by hand. With
    chunked prefill a prefill may have context (its table is given); without, prompts are fresh
    (an empty table row: their keys are their new tokens) and a prefill with context is a
    prefix-cache hit (its computed blocks)."""
    from types import SimpleNamespace as NS

    name, dev = backend
    gen = torch.Generator().manual_seed(12)
    batch = Batch(MIXED, BS, NB, gen, device=dev)
    groups = []
    for i, (ctx, new) in enumerate(batch.seqs):
        prompt = i < batch.num_prefills
        hit = prompt and ctx > 0 and not chunked
        groups.append(NS(
            seq_ids=[i], input_tokens=[[0] * new], orig_seq_lens=[ctx + new], seq_lens=[ctx + new],
            query_lens=[new], context_lens=[ctx], curr_sliding_window_blocks=[0], is_prompt=prompt,
            block_tables={i: batch.tables[i]}, prefix_cache_hit=hit,
            computed_block_nums=batch.tables[i] if hit else [],
        ))
    runner = NS(device=torch.device(dev), graph_block_tables=None)
    input_builder = NS(runner=runner, sliding_window=None, block_size=BS,
                       chunked_prefill_enabled=chunked, inter_data_list=groups)
    builder = PagedAttnBackend.make_metadata_builder(input_builder)
    assert isinstance(builder, PagedAttnBackend.get_builder_cls())
    seq_lens = [c + n for c, n in batch.seqs]
    md = builder.build(seq_lens, [n for _, n in batch.seqs], -1, len(seq_lens))
    assert md.slot_mapping.tolist() == batch.slots
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 9, 3)
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    cache = torch.randn(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D), generator=gen).to(dev)
    t = batch.num_tokens
    q = torch.randn(t, H * D, generator=gen).to(dev)
    k = torch.randn(t, HKV * D, generator=gen).to(dev)
    v = torch.randn(t, HKV * D, generator=gen).to(dev)
    want = impl.forward(q, k, v, cache.clone(), batch.metadata())
    got = impl.forward(q, k, v, cache.clone(), md)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert 64 in PagedAttnBackend.get_supported_head_sizes()


def test_state_class_serves_eager_runners_and_refuses_graph_capture():
    """``get_state_cls()(runner)``, which every vLLM 0.6 model runner makes: ``begin_forward``
    each step does nothing; a CUDA-graph capture is refused naming ``enforce_eager``."""
    from types import SimpleNamespace as NS

    state = PagedAttnBackend.get_state_cls()(NS(device=torch.device("cpu")))
    assert state.begin_forward(NS()) is None
    for call in (lambda: state.graph_capture(8), lambda: state.graph_clone(8),
                 lambda: state.graph_capture_get_metadata_for_batch(8),
                 lambda: state.get_graph_input_buffers(None),
                 lambda: state.prepare_graph_input_buffers({}, None)):
        with pytest.raises(NotImplementedError, match="enforce_eager=True"):
            call()


def test_metadata_builder_profiling_run(backend):
    """vLLM's profiling run (block tables ``{seq_id: None}``, an empty cache): every slot is
    PAD_SLOT_ID and the layer attends over the new tokens, as the no-cache path does."""
    from types import SimpleNamespace as NS

    name, dev = backend
    gen = torch.Generator().manual_seed(13)
    group = NS(seq_ids=[0], input_tokens=[[0] * 6], orig_seq_lens=[6], seq_lens=[6], query_lens=[6],
               context_lens=[0], curr_sliding_window_blocks=[0], is_prompt=True,
               block_tables={0: None}, prefix_cache_hit=False, computed_block_nums=[])
    input_builder = NS(runner=NS(device=torch.device(dev)), sliding_window=None, block_size=BS,
                       chunked_prefill_enabled=False, inter_data_list=[group])
    md = PagedAttnBackend.make_metadata_builder(input_builder).build([6], [6], -1, 1)
    assert md.slot_mapping.tolist() == [pv.PAD_SLOT_ID] * 6
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV)
    q = torch.randn(6, H * D, generator=gen).to(dev)
    k = torch.randn(6, HKV * D, generator=gen).to(dev)
    v = torch.randn(6, HKV * D, generator=gen).to(dev)
    out = impl.forward(q, k, v, torch.empty(0, device=dev), md)
    want = dense_attention(q.cpu().view(6, H, D).double(), k.cpu().view(6, HKV, D).double(),
                           v.cpu().view(6, HKV, D).double(), scale=D ** -0.5, causal=True)
    torch.testing.assert_close(out.cpu().view(6, H, D).double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_sliding_window_prompt_as_vllms_runner_gives_it(backend, kv_cache_dtype):
    """vLLM 0.6's runner on a Mistral-style layer (window 32), a fresh prompt of 100 tokens,
    blocks of 16 reused in a ring of two (its block manager's table ``[A, B, A, B, A, B, A]``):
    the builder gives the 68 tokens older than the window ``PAD_SLOT_ID``
    (``compute_slot_mapping_start_idx``) and an empty table row; vLLM's prefill attends over the
    key and value tensors it is given, so every token is a key of the prompt's queries. The
    output is that dense windowed attention over the call's keys (fp8: as the cache holds
    them), and only the last 32 tokens are written, at their ring slots."""
    from types import SimpleNamespace as NS

    name, dev = backend
    gen = torch.Generator().manual_seed(21)
    n, window, bs, nb, a, b = 100, 32, 16, 4, 1, 3
    ring = [[a, b][i % 2] for i in range(math.ceil(n / bs))]
    group = NS(seq_ids=[0], input_tokens=[[0] * n], orig_seq_lens=[n], seq_lens=[n],
               query_lens=[n], context_lens=[0], curr_sliding_window_blocks=[0], is_prompt=True,
               block_tables={0: ring}, prefix_cache_hit=False, computed_block_nums=[])
    input_builder = NS(runner=NS(device=torch.device(dev), graph_block_tables=None),
                       sliding_window=window, block_size=bs, chunked_prefill_enabled=False,
                       inter_data_list=[group])
    md = PagedAttnBackend.make_metadata_builder(input_builder).build([n], [n], -1, 1)
    slots = md.slot_mapping.tolist()
    assert slots[: n - window] == [pv.PAD_SLOT_ID] * (n - window)
    assert slots[n - window:] == [ring[p // bs] * bs + p % bs for p in range(n - window, n)]
    scales = dict(k_scale=0.05, v_scale=0.04) if kv_cache_dtype == "fp8" else {}
    impl = PagedAttnImpl(H, D, D ** -0.5, num_kv_heads=HKV, sliding_window=window,
                         kv_cache_dtype=kv_cache_dtype)
    shape = PagedAttnBackend.get_kv_cache_shape(nb, bs, HKV, D)
    if kv_cache_dtype == "fp8":
        cache = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(dev)
    else:
        cache = torch.randn(shape, generator=gen).to(dev)
    before = cache.clone()
    q = torch.randn(n, H * D, generator=gen).to(dev)
    k = torch.randn(n, HKV * D, generator=gen).to(dev)
    v = torch.randn(n, HKV * D, generator=gen).to(dev)
    out = impl.forward(q, k, v, cache, md, **scales)
    kk, vv = k.cpu().view(n, HKV, D).double(), v.cpu().view(n, HKV, D).double()
    if scales:
        kk = dequantize(quantize(kk.float(), scales["k_scale"]), scales["k_scale"]).double()
        vv = dequantize(quantize(vv.float(), scales["v_scale"]), scales["v_scale"]).double()
    want = dense_attention(q.cpu().view(n, H, D).double(), kk, vv, scale=D ** -0.5, causal=True,
                           window=window)
    torch.testing.assert_close(out.cpu().view(n, H, D).double(), want, atol=5e-5, rtol=0)
    # Written: the last 32 tokens at their ring slots; every other byte as before.
    layout = layout_of(dev)
    got, was = (token_view(c.cpu().view(torch.uint8) if scales else c.cpu(), layout, nb, bs, HKV, D)
                for c in (cache, before))
    expect = was.clone()
    for p in range(n - window, n):
        blk, off = ring[p // bs], p % bs
        rows = [k.cpu().view(n, HKV, D)[p], v.cpu().view(n, HKV, D)[p]]
        for side, row in enumerate(rows):
            expect[side, blk, off] = quantize(row, scales["kv"[side] + "_scale"]) if scales else row
    assert torch.equal(got, expect)


def test_v1_backend_serves_a_batch_in_any_order_with_padding(backend):
    """``pagedattn.vllm.v1`` as vLLM 0.11's v1 runner drives it: the impl constructed
    positionally in the v1 layer's order, the builder's ``build(0, common_attn_metadata)``,
    ``forward(layer, q, k, v, kv_cache, md, output=output)`` with ``[T, H, D]`` views and
    padding tokens past ``num_actual_tokens`` (slot -1). Requests in any order, a decode
    first and a speculative decode of 3 tokens last: each request's rows equal the v0 layer's
    for the same sequence; the padding rows are untouched; ``md=None`` returns ``output``."""
    from types import SimpleNamespace as NS

    from pagedattn.vllm import v1

    name, dev = backend
    gen = torch.Generator().manual_seed(14)
    v0_order = [(6, 4), (0, 5), (16, 3), (7, 1)]
    batch = Batch(v0_order, BS, NB, gen, device=dev)
    order = [3, 0, 1, 2]  # the v1 batch: the decode first
    seqs = [v0_order[i] for i in order]
    cache = torch.randn(PagedAttnBackend.get_kv_cache_shape(NB, BS, HKV, D), generator=gen).to(dev)
    t = batch.num_tokens
    q = torch.randn(t, H, D, generator=gen).to(dev)
    k = torch.randn(t, HKV, D, generator=gen).to(dev)
    v = torch.randn(t, HKV, D, generator=gen).to(dev)
    want = PagedAttnImpl(H, D, D ** -0.5, HKV).forward(
        q.view(t, H * D), k.view(t, HKV * D), v.view(t, HKV * D), cache.clone(), batch.metadata()
    ).view(t, H, D)
    rows = [list(range(batch.qsl[i], batch.qsl[i + 1])) for i in order]
    perm = [r for rs in rows for r in rs]
    pad = 3
    slots = [batch.slots[r] for r in perm] + [-1] * pad
    width = max(len(tb) for tb in batch.tables)
    i32 = dict(dtype=torch.int32, device=dev)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    cam = NS(
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor([c + n for c, n in seqs], **i32),
        num_reqs=len(seqs), num_actual_tokens=t, max_query_len=5,
        max_seq_len=max(c + n for c, n in seqs),
        block_table_tensor=torch.tensor([batch.tables[i] + [0] * (width - len(batch.tables[i])) for i in order], **i32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), causal=True,
    )
    assert v1.PagedAttnBackend.get_builder_cls() is v1.PagedAttnMetadataBuilder
    builder = v1.PagedAttnBackend.get_builder_cls()(NS(block_size=BS), ["layer.0"], None, dev)
    md = builder.build(0, cam)
    impl = v1.PagedAttnBackend.get_impl_cls()(H, D, D ** -0.5, HKV, None, None, "auto", None,
                                             "decoder", None)
    layer = NS(_k_scale_float=1.0, _v_scale_float=1.0)
    qp = torch.cat([q[perm], torch.zeros(pad, H, D, device=dev)])
    kp = torch.cat([k[perm], torch.zeros(pad, HKV, D, device=dev)])
    vp = torch.cat([v[perm], torch.zeros(pad, HKV, D, device=dev)])
    output = torch.full((t + pad, H, D), 7.0, device=dev)
    got = impl.forward(layer, qp, kp, vp, cache.clone(), md, output=output)
    assert got is output
    torch.testing.assert_close(output[:t], want[perm], atol=0, rtol=0)
    assert (output[t:] == 7.0).all()
    assert impl.forward(layer, qp, kp, vp, cache, None, output=output) is output
    with pytest.raises(ValueError, match="cascade"):
        builder.build(4, cam)
    with pytest.raises(NotImplementedError, match="sinks"):
        v1.PagedAttnImpl(H, D, D ** -0.5, HKV, sinks=torch.zeros(H))
