"""Dense float64 references and paged-cache builders for the tests of pagedattn's Python binding.

Everything here follows ``docs/semantics.md`` (the contract):

* ``dense_attention`` is attention over dense keys and values in float64. Without a soft cap
  it is ``torch.nn.functional.scaled_dot_product_attention`` with a float ``attn_mask`` that
  carries the causal / sliding-window mask (``-inf``) and the ALiBi bias; the soft cap
  (``cap * tanh(score / cap)``, applied to the scaled score *before* ALiBi is added) cannot be
  expressed through SDPA's mask, so with a soft cap the scores are computed by hand
  (``dense_attention_manual``; the SDPA path is checked against it in the tests).
* ``make_batch`` builds one step's paged batch for a backend: a cache tensor in the backend's
  layout whose unused slots and blocks hold NaN, shuffled block tables, slot mappings, the
  ``pagedattn.Metadata`` of a mixed batch (prefills with and without cached context, then
  decodes), and the per-sequence dense keys and values that the cache holds after the call's
  write (fp8 codes dequantized as the contract says), from which ``Batch.reference`` computes
  the expected output.
* ``make_cross_batch`` does the same for encoder-decoder cross-attention, ``make_encoder_batch``
  for the encoder types (no cache).
* ``fp8_quantize`` / ``fp8_dequantize``: the contract's fp8 storage (round to nearest even of
  ``x / scale`` computed in f32, saturated to the largest finite value; read ``code * scale``).
* ``tolerance`` / ``assert_close``: the allowed error of an output, derived from its dtype and
  the backend as ``crates/pagedattn/tests/cpu_vs_reference.rs`` derives it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import pagedattn

F64 = torch.float64

# --------------------------------------------------------------------------------------------
# Dense attention.
# --------------------------------------------------------------------------------------------


def _positions(x, n: int) -> torch.Tensor:
    """``x`` (a sequence of ints, a tensor or None = ``0..n-1``) as an int64 CPU tensor."""
    if x is None:
        return torch.arange(n, dtype=torch.int64)
    return torch.as_tensor(x, dtype=torch.int64).reshape(-1).cpu()


def score_bias(
    q_pos,
    num_keys: int,
    num_heads: int,
    *,
    causal: bool,
    alibi_slopes: Optional[Sequence[float]] = None,
    sliding_window: Optional[int] = None,
    alibi_q_pos=None,
):
    """The additive score term ``[H, Tq, Tk]`` (float64: ALiBi bias, ``-inf`` where masked) and
    the allowed-key mask ``[Tq, Tk]`` (bool) for queries at positions ``q_pos`` over keys at
    positions ``0..num_keys-1``.

    Mask: causal (decoder) allows ``j <= i`` and, with a window W, ``i - W < j``; non-causal
    allows every key.
    ALiBi: ``slope_h * (j - i)`` when causal, ``-slope_h * |j - i|`` otherwise, measured from
    ``alibi_q_pos`` when given (cross-attention: ``min(i, n - 1)``, see ``cross_alibi_positions``),
    else from ``q_pos``.
    """
    i = _positions(q_pos, 0)[:, None]
    j = torch.arange(num_keys, dtype=torch.int64)[None, :]
    allowed = torch.ones(i.shape[0], num_keys, dtype=torch.bool)
    if causal:
        allowed &= j <= i
        if sliding_window is not None:
            allowed &= j > i - sliding_window
    elif sliding_window is not None:
        raise ValueError("the contract has no sliding window for non-causal attention")
    bias = torch.zeros(num_heads, i.shape[0], num_keys, dtype=F64)
    if alibi_slopes is not None:
        ai = i if alibi_q_pos is None else _positions(alibi_q_pos, 0)[:, None]
        slopes = torch.tensor([float(s) for s in alibi_slopes], dtype=F64)
        # Distances are exact integers, converted to f64 once (the contract's rule).
        dist = (j - ai).to(F64)
        dist = dist if causal else -dist.abs()
        bias = bias + slopes[:, None, None] * dist[None]
    bias = bias.masked_fill(~allowed[None], float("-inf"))
    return bias, allowed


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos=None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    alibi_slopes: Optional[Sequence[float]] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    alibi_q_pos=None,
    use_sdpa: bool = True,
) -> torch.Tensor:
    """Dense attention in float64: ``q[Tq, H, D]`` over ``k, v[Tk, Hkv, D]`` -> ``out[Tq, H, D]``.

    ``q_pos[Tq]``: each query's position among the keys (keys sit at ``0..Tk-1``; default
    ``0..Tq-1``). ``scale`` defaults to ``D ** -0.5``. Query head h reads kv head
    ``h // (H // Hkv)`` (GQA / MQA). Masks and ALiBi: ``score_bias``. A query with no allowed
    key outputs zeros (contract, item 5). The inputs are converted to float64 exactly (give the
    values the backend reads: activations as stored in their dtype, fp8 codes dequantized).

    Without a soft cap this is SDPA with ``enable_gqa=True`` and a float mask; with one (or
    ``use_sdpa=False``) it is ``dense_attention_manual``, since SDPA cannot cap the scores
    before the bias is added.
    """
    tq, h, d = q.shape
    tk, hkv, _ = k.shape
    assert h % hkv == 0 and v.shape == k.shape
    scale = d**-0.5 if scale is None else float(scale)
    if soft_cap is not None or not use_sdpa:
        return dense_attention_manual(
            q, k, v, q_pos, causal=causal, scale=scale, alibi_slopes=alibi_slopes,
            sliding_window=sliding_window, soft_cap=soft_cap, alibi_q_pos=alibi_q_pos,
        )
    q_pos = _positions(q_pos, tq)
    bias, allowed = score_bias(
        q_pos, tk, h, causal=causal, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        alibi_q_pos=alibi_q_pos,
    )
    q64, k64, v64 = (x.detach().to("cpu", F64) for x in (q, k, v))
    if tk == 0 or tq == 0:
        return torch.zeros(tq, h, d, dtype=F64)
    out = F.scaled_dot_product_attention(
        q64.permute(1, 0, 2)[None],  # [1, H, Tq, D]
        k64.permute(1, 0, 2)[None],  # [1, Hkv, Tk, D]
        v64.permute(1, 0, 2)[None],
        attn_mask=bias[None],  # [1, H, Tq, Tk]
        scale=scale,
        enable_gqa=True,
    )[0].permute(1, 0, 2)
    # Rows without an allowed key: SDPA gives NaN (softmax of all -inf); the contract gives 0.
    empty = ~allowed.any(dim=1)
    return out.masked_fill(empty[:, None, None], 0.0).contiguous()


def dense_attention_manual(
    q, k, v, q_pos=None, *, causal=True, scale=None, alibi_slopes=None, sliding_window=None,
    soft_cap=None, alibi_q_pos=None,
) -> torch.Tensor:
    """``dense_attention`` with the scores computed by hand (float64): ``s = scale * q.k``, then
    ``s = cap * tanh(s / cap)`` (soft cap), then ``+ ALiBi``, masked keys at ``-inf``,
    softmax, weighted sum of the values. Used for the soft cap, which SDPA cannot express."""
    tq, h, d = q.shape
    tk, hkv, _ = k.shape
    scale = d**-0.5 if scale is None else float(scale)
    q_pos = _positions(q_pos, tq)
    bias, allowed = score_bias(
        q_pos, tk, h, causal=causal, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        alibi_q_pos=alibi_q_pos,
    )
    q64, k64, v64 = (x.detach().to("cpu", F64) for x in (q, k, v))
    group = h // hkv
    kr = k64.repeat_interleave(group, dim=1)  # [Tk, H, D]
    vr = v64.repeat_interleave(group, dim=1)
    s = scale * torch.einsum("thd,jhd->htj", q64, kr)
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s + bias
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # all-masked rows
    out = torch.einsum("htj,jhd->thd", p, vr)
    empty = ~allowed.any(dim=1)
    return out.masked_fill(empty[:, None, None], 0.0).contiguous()


def cross_alibi_positions(q_pos, num_encoder_keys: int) -> list[int]:
    """The positions ALiBi measures a cross-attention query from: ``min(i, n - 1)``."""
    return [min(int(i), max(num_encoder_keys - 1, 0)) for i in _positions(q_pos, 0)]


def alibi_slopes(num_heads: int) -> list[float]:
    """Bloom's ALiBi slopes ``2^(-8 (h + 1) / H)`` (for a power-of-two H; any H here)."""
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]


# --------------------------------------------------------------------------------------------
# fp8.
# --------------------------------------------------------------------------------------------

FP8_TORCH = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_MAX = {"fp8": 448.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def f32(x: float) -> float:
    """``x`` rounded to float32 (the binding stores scales as f32)."""
    return torch.tensor(float(x), dtype=torch.float32).item()


def fp8_quantize(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """The contract's fp8 storage of ``x``: round to nearest even of ``x / scale`` computed in
    f32, saturated to the format's largest finite value; returns the codes as uint8 (CPU)."""
    fmt = FP8_TORCH[kv_cache_dtype]
    m = FP8_MAX[kv_cache_dtype]
    y = x.detach().to("cpu", torch.float32) / torch.tensor(f32(scale), dtype=torch.float32)
    return y.clamp(-m, m).to(fmt).view(torch.uint8)


def fp8_dequantize(codes: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """The contract's read of fp8 codes (uint8 or float8 tensor): ``code * scale``, float64."""
    fmt = FP8_TORCH[kv_cache_dtype]
    return codes.detach().cpu().view(torch.uint8).view(fmt).to(F64) * f32(scale)


FP8_NAN_CODE = 0x7F  # NaN in both e4m3fn and e5m2


# --------------------------------------------------------------------------------------------
# Paged caches.
# --------------------------------------------------------------------------------------------


def layout_view(cache: torch.Tensor, layout: str, block_size: int, num_kv_heads: int,
                head_size: int) -> torch.Tensor:
    """``cache`` (any ``(2, NB, ...)`` shape of this geometry) as ``[2, NB, B, Hkv, D]`` for
    ``NHD`` or ``[2, NB, Hkv, B, D]`` for ``HND`` (a view: writes reach the cache)."""
    nb = cache.shape[1]
    if layout == "NHD":
        return cache.view(2, nb, block_size, num_kv_heads, head_size)
    assert layout == "HND", layout
    return cache.view(2, nb, num_kv_heads, block_size, head_size)


def write_slots(cache5: torch.Tensor, layout: str, kv: int, slots, x: torch.Tensor) -> None:
    """Writes rows ``x[n, Hkv, D]`` at cache ``slots[n]`` (``block * B + offset``) of the keys
    (``kv=0``) or values (``kv=1``) of a 5-D layout view (``layout_view``)."""
    slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
    if slots.numel() == 0:
        return
    b = cache5.shape[2] if layout == "NHD" else cache5.shape[3]
    blocks, offs = (slots // b).to(cache5.device), (slots % b).to(cache5.device)
    c = cache5[kv]
    if layout == "NHD":
        c[blocks, offs] = x.to(cache5.device)
    else:
        c[blocks, :, offs, :] = x.to(cache5.device)


def read_slots(cache5: torch.Tensor, layout: str, kv: int, slots) -> torch.Tensor:
    """The rows ``[n, Hkv, D]`` at cache ``slots`` of a 5-D layout view (``layout_view``)."""
    slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
    b = cache5.shape[2] if layout == "NHD" else cache5.shape[3]
    blocks, offs = (slots // b).to(cache5.device), (slots % b).to(cache5.device)
    c = cache5[kv]
    if layout == "NHD":
        return c[blocks, offs]
    return c[blocks, :, offs, :]


def random_values(gen: torch.Generator, shape, dtype, amplitude: float = 1.0) -> torch.Tensor:
    """Uniform values in ``[-amplitude, amplitude)`` of ``dtype`` on the CPU, from ``gen``."""
    x = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * amplitude
    return x.to(dtype)


def new_cache(backend, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
              cache_dtype) -> torch.Tensor:
    """A cache of ``backend.kv_cache_shape(...)`` on ``backend.device``, every element NaN
    (fp8 caches: the NaN code 0x7F), so that any read of an unused slot shows."""
    shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    assert tuple(shape) == (
        (2, num_blocks, block_size, num_kv_heads, head_size)
        if backend.kv_cache_layout == "NHD"
        else (2, num_blocks, num_kv_heads, block_size, head_size)
    ), (shape, backend.kv_cache_layout)
    if cache_dtype.is_floating_point and cache_dtype.itemsize > 1:
        return torch.full(shape, float("nan"), dtype=cache_dtype, device=backend.device)
    c = torch.full(shape, FP8_NAN_CODE, dtype=torch.uint8, device=backend.device)
    return c if cache_dtype == torch.uint8 else c.view(cache_dtype)


@dataclasses.dataclass
class Seq:
    """One sequence of a step: ``context`` tokens already in the cache, ``new`` tokens computed
    now; ``decode`` marks a decode (exactly one new token). For cross-attention, ``encoder``
    is the sequence's number of encoder tokens."""

    context: int
    new: int
    decode: bool = False
    encoder: int = 0

    @property
    def length(self) -> int:
        """Keys of the sequence after the step (cached + new)."""
        return self.context + self.new


def prompt(context: int, new: int, encoder: int = 0) -> Seq:
    """A prefill: ``new`` tokens after ``context`` cached ones (0: a fresh prompt)."""
    return Seq(context, new, False, encoder)


def decode(context: int, encoder: int = 0) -> Seq:
    """A decode: one new token after ``context`` cached ones."""
    return Seq(context, 1, True, encoder)


def allocate_tables(gen: torch.Generator, lengths: Sequence[int], block_size: int,
                    spare_blocks: int):
    """Shuffled block tables covering ``lengths`` tokens each, drawn from a random permutation
    of ``sum(blocks) + spare_blocks`` blocks. Returns ``(tables, num_blocks, unused)``:
    ragged tables (lists of ints), the cache's block count, and the blocks no table holds."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at:at + n])
        at += n
    return tables, num_blocks, perm[at:]


def pad_tables(tables, pad: int):
    """Ragged tables as an int32 ``[S, M]`` tensor, rows padded with ``pad`` (padding past a
    sequence's last block is never read; the tests pad with an unused, NaN-filled block)."""
    width = max([len(t) for t in tables] + [1])
    return torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int32)


def slots_of(table, block_size: int, positions) -> list[int]:
    """The cache slots of ``positions`` through a sequence's block ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


@dataclasses.dataclass
class Batch:
    """One step's paged batch (built by ``make_batch`` / ``make_cross_batch`` /
    ``make_encoder_batch``) and everything the dense reference needs."""

    metadata: "pagedattn.Metadata"
    query: torch.Tensor  # [T, H, D] activation dtype, on the backend's device
    key: Optional[torch.Tensor]  # [Tk, Hkv, D] new keys (None at a cross decode)
    value: Optional[torch.Tensor]
    kv_cache: Optional[torch.Tensor]
    seqs: list
    query_ranges: list  # per sequence, its range of query tokens
    q_pos: list  # per sequence, its queries' positions
    keys: list  # per sequence, float64 [n, Hkv, D]: the keys as the backend reads them
    values: list
    causal: bool
    cross: bool = False
    block_tables: Optional[list] = None
    slot_mapping: Optional[list] = None  # the slots this call writes (cross: cross slots)
    unused_blocks: Optional[list] = None
    num_blocks: int = 0
    block_size: int = 0
    decoder_blocks: int = 0  # cross batches: blocks the decoder's own block tables use

    def reference(self, **modifiers) -> torch.Tensor:
        """The expected output ``[T, H, D]`` (float64): ``dense_attention`` per sequence with
        the layer's ``modifiers`` (``scale``, ``alibi_slopes``, ``sliding_window``,
        ``soft_cap``). Cross-attention measures ALiBi from ``min(i, n - 1)``."""
        t, h, d = self.query.shape[0], self.query.shape[-2], self.query.shape[-1]
        out = torch.zeros(t, h, d, dtype=F64)
        q = self.query.detach().cpu().reshape(t, h, d)
        for s, r in enumerate(self.query_ranges):
            if len(r) == 0:
                continue
            extra = {}
            if self.cross and modifiers.get("alibi_slopes") is not None:
                extra["alibi_q_pos"] = cross_alibi_positions(self.q_pos[s], self.keys[s].shape[0])
            out[r.start:r.stop] = dense_attention(
                q[r.start:r.stop], self.keys[s], self.values[s], self.q_pos[s],
                causal=self.causal, **modifiers, **extra,
            )
        return out

    @property
    def max_pos(self) -> int:
        """The largest query or key position of the batch (for ALiBi's share of the error);
        cross-attention: the largest encoder position, from which ALiBi measures a query past
        every encoder key."""
        m = 0
        for s in range(len(self.seqs)):
            n = self.keys[s].shape[0]
            pos = cross_alibi_positions(self.q_pos[s], n) if self.cross else self.q_pos[s]
            m = max([m, n - 1] + [int(p) for p in pos])
        return m

    def read_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value the batch's queries may read, concatenated (float64)."""
        ks = [k for k in self.keys if k.numel()] or [torch.zeros(0, dtype=F64)]
        vs = [v for v in self.values if v.numel()] or [torch.zeros(0, dtype=F64)]
        return torch.cat([k.reshape(-1) for k in ks]), torch.cat([v.reshape(-1) for v in vs])


def _stored(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """What a cache holds for activations ``x``, as float64: ``x`` itself, or its fp8 codes
    dequantized."""
    if kv_cache_dtype == "auto":
        return x.detach().cpu().to(F64)
    return fp8_dequantize(fp8_quantize(x, kv_cache_dtype, scale), kv_cache_dtype, scale)


def _cache_elements(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """The elements a cache stores for ``x``: ``x`` or its fp8 codes (uint8)."""
    if kv_cache_dtype == "auto":
        return x
    return fp8_quantize(x, kv_cache_dtype, scale)


def _cache_dtype(dtype, kv_cache_dtype: str, cache_dtype):
    if kv_cache_dtype == "auto":
        return dtype
    return torch.uint8 if cache_dtype is None else cache_dtype


def make_batch(
    backend,
    seqs: Sequence[Seq],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype,
    gen: torch.Generator,
    block_size: int = 8,
    kv_cache_dtype: str = "auto",
    cache_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    spare_blocks: int = 2,
    amplitude: float = 1.0,
    padding: Sequence[int] = (),
    index_kind: str = "torch",
    metadata_form: str = "query_start_loc",
) -> Batch:
    """A decoder step over a paged cache for ``backend``: sequences ``seqs`` (prefills first,
    then decodes). The context tokens' keys and values are written straight into the cache
    tensor (fp8: quantized) at their shuffled blocks; the new ones are returned as
    ``key``/``value`` for ``run`` to write. Every other cache element is NaN. ``padding``:
    indices of new tokens (in the step's token order) whose slot is -1 (not written, still a
    key of this call, as the cache would hold it). ``index_kind``: index tensors as ``torch`` tensors (int32 tables / int64 slots),
    ``numpy`` arrays or Python ``list``s. ``metadata_form``: lengths given as
    ``query_start_loc`` or ``context_lens`` (plus ``num_prefills`` either way).
    """
    dev = backend.device
    layout = backend.kv_cache_layout
    cdt = _cache_dtype(dtype, kv_cache_dtype, cache_dtype)
    tables, num_blocks, unused = allocate_tables(gen, [s.length for s in seqs], block_size,
                                                 spare_blocks)
    pad_block = unused[0] if unused else 0
    cache = new_cache(backend, num_blocks, block_size, num_kv_heads, head_size, cdt)
    c5 = layout_view(cache.view(torch.uint8) if kv_cache_dtype != "auto" else cache,
                     layout, block_size, num_kv_heads, head_size)
    t = sum(s.new for s in seqs)
    query = random_values(gen, (t, num_heads, head_size), dtype, amplitude)
    key = random_values(gen, (t, num_kv_heads, head_size), dtype, amplitude)
    value = random_values(gen, (t, num_kv_heads, head_size), dtype, amplitude)
    slot_mapping, qranges, q_pos, keys, values = [], [], [], [], []
    at = 0
    for s, seq in enumerate(seqs):
        # Context: written into the cache directly, as an earlier step would have.
        ck = random_values(gen, (seq.context, num_kv_heads, head_size), dtype, amplitude)
        cv = random_values(gen, (seq.context, num_kv_heads, head_size), dtype, amplitude)
        ctx_slots = slots_of(tables[s], block_size, range(seq.context))
        write_slots(c5, layout, 0, ctx_slots, _cache_elements(ck, kv_cache_dtype, k_scale))
        write_slots(c5, layout, 1, ctx_slots, _cache_elements(cv, kv_cache_dtype, v_scale))
        new_slots = slots_of(tables[s], block_size, range(seq.context, seq.length))
        r = range(at, at + seq.new)
        for m, tok in enumerate(r):
            if tok in padding:
                new_slots[m] = -1
        slot_mapping += new_slots
        qranges.append(r)
        q_pos.append(list(range(seq.context, seq.length)))
        nk, nv = key[r.start:r.stop], value[r.start:r.stop]
        keys.append(torch.cat([_stored(ck, kv_cache_dtype, k_scale),
                               _stored(nk, kv_cache_dtype, k_scale)]))
        values.append(torch.cat([_stored(cv, kv_cache_dtype, v_scale),
                                 _stored(nv, kv_cache_dtype, v_scale)]))
        at += seq.new
    num_prefills = sum(1 for s in seqs if not s.decode)
    assert all(not s.decode for s in seqs[:num_prefills]), "prefills first"
    qsl = [0]
    for s in seqs:
        qsl.append(qsl[-1] + s.new)
    fields = dict(
        seq_lens=[s.length for s in seqs],
        slot_mapping=slot_mapping,
        block_tables=pad_tables(tables, pad_block),
        num_prefills=num_prefills,
        block_size=block_size,
    )
    if metadata_form == "query_start_loc":
        fields["query_start_loc"] = qsl
    else:
        assert metadata_form == "context_lens"
        fields["context_lens"] = [s.context for s in seqs]
    md = pagedattn.Metadata(**convert_indices(fields, index_kind))
    return Batch(
        metadata=md,
        query=query.to(dev),
        key=key.to(dev),
        value=value.to(dev),
        kv_cache=cache,
        seqs=list(seqs),
        query_ranges=qranges,
        q_pos=q_pos,
        keys=keys,
        values=values,
        causal=True,
        block_tables=tables,
        slot_mapping=slot_mapping,
        unused_blocks=unused,
        num_blocks=num_blocks,
        block_size=block_size,
    )


def convert_indices(fields: dict, index_kind: str) -> dict:
    """Metadata index fields as torch tensors (int64 slots, int32 others), numpy arrays
    (``numpy``: int64 slots, int32 others; ``numpy64``: all int64) or Python lists."""
    import numpy as np

    out = {}
    for name, x in fields.items():
        if name in ("num_prefills", "block_size") or x is None:
            out[name] = x
            continue
        t = torch.as_tensor(x)
        wide = "slot_mapping" in name
        if index_kind == "torch":
            out[name] = t.to(torch.int64 if wide else torch.int32)
        elif index_kind == "numpy":
            out[name] = t.numpy().astype(np.int64 if wide else np.int32)
        elif index_kind == "numpy64":
            out[name] = t.numpy().astype(np.int64)
        elif index_kind == "list":
            out[name] = t.tolist()
        else:
            raise ValueError(index_kind)
    return out


def make_encoder_batch(backend, lengths: Sequence[int], *, num_heads: int, num_kv_heads: int,
                       head_size: int, dtype, gen: torch.Generator,
                       amplitude: float = 1.0) -> Batch:
    """An encoder / encoder-only step: sequences of ``lengths`` tokens attending
    bidirectionally over their own keys and values (the inputs; no cache). The metadata gives
    only ``seq_lens`` and ``slot_mapping`` (all -1): every sequence is a prefill."""
    dev = backend.device
    t = sum(lengths)
    query = random_values(gen, (t, num_heads, head_size), dtype, amplitude)
    key = random_values(gen, (t, num_kv_heads, head_size), dtype, amplitude)
    value = random_values(gen, (t, num_kv_heads, head_size), dtype, amplitude)
    md = pagedattn.Metadata(seq_lens=list(lengths), slot_mapping=[-1] * t)
    qranges, q_pos, keys, values, at = [], [], [], [], 0
    for n in lengths:
        r = range(at, at + n)
        qranges.append(r)
        q_pos.append(list(range(n)))
        keys.append(key[r.start:r.stop].to(F64))
        values.append(value[r.start:r.stop].to(F64))
        at += n
    return Batch(md, query.to(dev), key.to(dev), value.to(dev), None, [prompt(0, n) for n in lengths],
                 qranges, q_pos, keys, values, causal=False)


def make_cross_batch(
    backend,
    seqs: Sequence[Seq],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype,
    gen: torch.Generator,
    write_encoder: bool,
    use_cache: bool = True,
    block_size: int = 8,
    kv_cache_dtype: str = "auto",
    cache_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    spare_blocks: int = 2,
    amplitude: float = 1.0,
    decoder_tables: bool = True,
) -> Batch:
    """An encoder-decoder cross-attention step: decoder sequences ``seqs`` (``Seq.encoder``
    encoder tokens each) whose queries attend, non-causally, over their encoder's keys and
    values. ``write_encoder``: the step carries the encoder keys/values (``key``/``value``
    ``[sum(encoder), Hkv, D]``), written into the cross cache through ``cross_slot_mapping``
    (the encoder-decoder prefill); else the cross cache already holds them (decode, later
    chunks) and ``key``/``value`` are None. ``use_cache=False``: no cross cache at all, the
    keys and values are the inputs (requires ``write_encoder``). The decoder's own fields
    (``seq_lens``, ``slot_mapping``, ``block_tables``) describe a decoder self-attention cache
    of the same block size (the metadata is the one a model's both layers share); only the
    encoder fields matter to the cross layer. ``decoder_tables=False`` leaves the decoder's
    block tables out and its slots -1 (for decoder positions too far for a real cache)."""
    dev = backend.device
    layout = backend.kv_cache_layout
    cdt = _cache_dtype(dtype, kv_cache_dtype, cache_dtype)
    if decoder_tables:
        dec_tables, dec_blocks, _ = allocate_tables(gen, [s.length for s in seqs], block_size, 0)
    else:
        dec_tables, dec_blocks = None, 0
    enc_lens = [s.encoder for s in seqs]
    tables, num_blocks, unused = allocate_tables(gen, enc_lens, block_size, spare_blocks)
    pad_block = unused[0] if unused else 0
    cache = c5 = None
    if use_cache:
        cache = new_cache(backend, num_blocks, block_size, num_kv_heads, head_size, cdt)
        c5 = layout_view(cache.view(torch.uint8) if kv_cache_dtype != "auto" else cache,
                         layout, block_size, num_kv_heads, head_size)
    t = sum(s.new for s in seqs)
    te = sum(enc_lens)
    query = random_values(gen, (t, num_heads, head_size), dtype, amplitude)
    ek = random_values(gen, (te, num_kv_heads, head_size), dtype, amplitude)
    ev = random_values(gen, (te, num_kv_heads, head_size), dtype, amplitude)
    cross_slots, qranges, q_pos, keys, values = [], [], [], [], []
    at = eat = 0
    kd = kv_cache_dtype if use_cache else "auto"
    for s, seq in enumerate(seqs):
        slots = slots_of(tables[s], block_size, range(seq.encoder))
        k_s, v_s = ek[eat:eat + seq.encoder], ev[eat:eat + seq.encoder]
        if use_cache and not write_encoder:
            write_slots(c5, layout, 0, slots, _cache_elements(k_s, kv_cache_dtype, k_scale))
            write_slots(c5, layout, 1, slots, _cache_elements(v_s, kv_cache_dtype, v_scale))
        cross_slots += slots
        r = range(at, at + seq.new)
        qranges.append(r)
        q_pos.append(list(range(seq.context, seq.length)))
        keys.append(_stored(k_s, kd, k_scale))
        values.append(_stored(v_s, kd, v_scale))
        at += seq.new
        eat += seq.encoder
    num_prefills = sum(1 for s in seqs if not s.decode)
    qsl = [0]
    for s in seqs:
        qsl.append(qsl[-1] + s.new)
    dec_slots = []
    for s, seq in enumerate(seqs):
        dec_slots += (slots_of(dec_tables[s], block_size, range(seq.context, seq.length))
                      if decoder_tables else [-1] * seq.new)
    fields = convert_indices(dict(
        seq_lens=[s.length for s in seqs],
        slot_mapping=dec_slots,
        block_tables=pad_tables(dec_tables, 0) if decoder_tables else None,
        query_start_loc=qsl,
        encoder_seq_lens=enc_lens,
        cross_block_tables=pad_tables(tables, pad_block),
        cross_slot_mapping=cross_slots if write_encoder else None,
    ), "torch")
    md = pagedattn.Metadata(num_prefills=num_prefills, block_size=block_size, **fields)
    return Batch(
        metadata=md,
        query=query.to(dev),
        key=ek.to(dev) if write_encoder else None,
        value=ev.to(dev) if write_encoder else None,
        kv_cache=cache,
        seqs=list(seqs),
        query_ranges=qranges,
        q_pos=q_pos,
        keys=keys,
        values=values,
        causal=False,
        cross=True,
        block_tables=tables,
        slot_mapping=cross_slots if write_encoder else [],
        unused_blocks=unused,
        num_blocks=num_blocks,
        block_size=block_size,
        decoder_blocks=dec_blocks,
    )


# --------------------------------------------------------------------------------------------
# Tolerances.
# --------------------------------------------------------------------------------------------

U = 2.0**-24  # f32 unit roundoff
# The constants the Rust suites (cpu_vs_reference.rs, cuda_attention.rs) calibrated for an
# f32-accumulating kernel against the f64 reference.
C0 = 16.0
C1 = 3.0

ULP = {torch.float32: (2.0**-23, 0.0), torch.float16: (2.0**-10, 2.0**-24),
       torch.bfloat16: (2.0**-7, 0.0)}


def tolerance(backend_name: str, dtype, batch: Batch, *, scale: float,
              alibi_slopes=None, soft_cap=None) -> tuple[float, float]:
    """``tolerance_for`` over what ``batch``'s queries read (its queries, and the keys and
    values its sequences hold after the call, fp8 dequantized)."""
    ks, vs = batch.read_keys_values()
    return tolerance_for(backend_name, dtype, q=batch.query, k=ks, v=vs, scale=scale,
                         alibi_slopes=alibi_slopes, soft_cap=soft_cap, max_pos=batch.max_pos)


def tolerance_for(backend_name: str, dtype, *, q, k, v, scale: float, alibi_slopes=None,
                  soft_cap=None, max_pos: int = 0) -> tuple[float, float]:
    """``(rel, abs)``: an output element passes when ``|got - want| <= rel * max(|got|,
    |want|) + abs``, as the Rust suites (``crates/pagedattn/tests/cpu_vs_reference.rs``,
    ``cuda_attention.rs``) derive it, for queries ``q`` over keys ``k`` and values ``v`` (the
    values the backend reads; any shapes) with the largest position ``max_pos``:

    * ``rel``: one unit in the last place of the output dtype (2^-23, 2^-10, 2^-7: both sides
      round once); ``abs`` starts at f16's smallest subnormal step (2^-24) for f16.
    * The kernel's f32 error (``cpu``, ``cuda``): ``vmax * U * (C0 + C1 * smag)``, where
      ``vmax`` is the largest value magnitude read, and ``smag`` bounds the score terms:
      ``|scale| * D * qmax * kmax + max|slope| * max_pos + cap``.
    * bf16 on ``cpu``/``cuda`` (and f16 on ``cuda``): the probabilities rounded to the
      activation type for P.V: ``2^-8 vmax`` (bf16) and ``(2^-10 + keys 2^-25) vmax`` (f16).
    * ``reference`` computes in f64 as this module does: only the final rounding, plus
      ``vmax * 1e-12`` for the different order of its f64 sums.
    """
    rel, tiny = ULP[dtype]
    d = torch.as_tensor(q).shape[-1]
    q, k, v = (torch.as_tensor(x).detach().cpu().to(F64).reshape(-1) for x in (q, k, v))
    q, k, v = q[torch.isfinite(q)], k[torch.isfinite(k)], v[torch.isfinite(v)]
    vmax = float(v.abs().max()) if v.numel() else 0.0
    kmax = float(k.abs().max()) if k.numel() else 0.0
    qmax = float(q.abs().max()) if q.numel() else 0.0
    slope = max((abs(float(s)) for s in alibi_slopes), default=0.0) if alibi_slopes else 0.0
    smag = abs(scale) * d * qmax * kmax + slope * max_pos + (soft_cap or 0.0)
    if backend_name == "reference":
        return rel, tiny + vmax * 1e-12
    atol = tiny + vmax * U * (C0 + C1 * smag)
    if dtype == torch.bfloat16:
        atol += 2.0**-8 * vmax
    elif dtype == torch.float16 and backend_name == "cuda":
        atol += (2.0**-10 + (max_pos + 1) * 2.0**-25) * vmax
    return rel, atol


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, atol: float,
                 what: str = "output") -> None:
    """Elementwise ``|got - want| <= rel * max(|got|, |want|) + atol`` with ``got`` finite;
    on failure names the worst element, its values and the allowance."""
    g = torch.as_tensor(got).detach().cpu().to(F64).reshape(want.shape)
    w = want.to(F64)
    bound = rel * torch.maximum(g.abs(), w.abs()) + atol
    err = (g - w).abs()
    bad = ~(torch.isfinite(g) & (err <= bound))
    if bad.any():
        ratio = torch.where(torch.isfinite(err), err / bound, torch.full_like(err, math.inf))
        ratio = torch.where(bad, ratio, torch.zeros_like(ratio))
        idx = int(ratio.reshape(-1).argmax())
        pos = tuple(int(x) for x in torch.unravel_index(torch.tensor(idx), w.shape))
        raise AssertionError(
            f"{what}{list(pos)} = {g[pos].item()!r}, reference = {w[pos].item()!r} "
            f"(difference {err[pos].item():.3e}, allowed {bound[pos].item():.3e}); "
            f"{int(bad.sum())} of {w.numel()} elements out of tolerance "
            f"(rel {rel:.2e}, abs {atol:.2e})"
        )
