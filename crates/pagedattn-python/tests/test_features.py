"""Every feature of the plan/run API on every backend and activation dtype, against the dense
float64 reference of ``dense.py`` (which follows docs/semantics.md).

Each call's ``out`` is filled with NaN first and every cache slot or block that no sequence
covers holds NaN (fp8: the NaN code), so that an output element the backend does not write,
or a read of a slot it must not read, shows as a failure. After each call the cache is checked
too: the new keys and values at their slots (fp8: the contract's codes, byte for byte), every
other slot as it was.
"""

import math

import pytest
import torch

import pagedattn
from dense import (
    FP8_NAN_CODE,
    FP8_TORCH,
    alibi_slopes,
    assert_close,
    decode,
    dense_attention,
    dense_attention_manual,
    f32,
    fp8_quantize,
    layout_view,
    make_batch,
    make_cross_batch,
    make_encoder_batch,
    prompt,
    read_slots,
    slots_of,
    tolerance,
    tolerance_for,
)

NAN = float("nan")


def layer(backend, num_heads, head_size, **kwargs):
    """A ``pagedattn.Attention`` for ``backend`` (kwargs as the constructor's)."""
    return pagedattn.Attention(backend, num_heads, head_size, **kwargs)


def reference_modifiers(attn, slopes=None, window=None, cap=None):
    """The layer's score modifiers as the reference takes them, rounded to f32 as the layer
    stores them."""
    return dict(
        scale=f32(attn.scale),
        alibi_slopes=None if slopes is None else [f32(s) for s in slopes],
        sliding_window=window,
        soft_cap=None if cap is None else f32(cap),
    )


def snapshot(cache):
    """A copy of a cache's bytes (CPU), to compare after a call."""
    return None if cache is None else cache.detach().view(torch.uint8).cpu().clone()


def check_cache(backend, batch, before, attn, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """After a call: the written slots hold the new keys/values (fp8: their codes, exactly),
    and every other byte of the cache is as it was (unused blocks and padding slots: NaN)."""
    if batch.kv_cache is None:
        return
    layout = backend.kv_cache_layout
    hkv, d = attn.num_kv_heads, attn.head_size
    after = batch.kv_cache.detach().view(torch.uint8).cpu()
    written = [s for s in batch.slot_mapping if s >= 0]
    key_rows = [i for i, s in enumerate(batch.slot_mapping) if s >= 0]
    fp8 = kv_cache_dtype != "auto"
    c5 = layout_view(batch.kv_cache.detach().cpu() if not fp8
                     else batch.kv_cache.detach().view(torch.uint8).cpu(),
                     layout, batch.block_size, hkv, d)
    if written and batch.key is not None:
        k_new = batch.key.detach().cpu().reshape(-1, hkv, d)[key_rows]
        v_new = batch.value.detach().cpu().reshape(-1, hkv, d)[key_rows]
        got_k, got_v = read_slots(c5, layout, 0, written), read_slots(c5, layout, 1, written)
        if fp8:
            k_new = fp8_quantize(k_new, kv_cache_dtype, k_scale)
            v_new = fp8_quantize(v_new, kv_cache_dtype, v_scale)
            diff = (got_k != k_new).nonzero()
            assert diff.numel() == 0, (
                f"fp8 key codes differ from the contract's at {diff[:4].tolist()}: "
                f"got {got_k[tuple(diff[0])].item():#x}, want {k_new[tuple(diff[0])].item():#x}")
            assert torch.equal(got_v, v_new), "fp8 value codes differ from the contract's"
        else:
            assert torch.equal(got_k.view(torch.uint8), k_new.view(torch.uint8)), \
                "keys not written bit-exactly at their slots"
            assert torch.equal(got_v.view(torch.uint8), v_new.view(torch.uint8)), \
                "values not written bit-exactly at their slots"
    # Everything else untouched: compare the bytes outside the written slots.
    b5_after = layout_view(after.view(batch.kv_cache.dtype) if not fp8 else after, layout,
                           batch.block_size, hkv, d)
    b5_before = layout_view(before.view(batch.kv_cache.dtype) if not fp8 else before, layout,
                            batch.block_size, hkv, d)
    mask = torch.ones(batch.num_blocks * batch.block_size, dtype=torch.bool)
    if written:
        mask[torch.tensor(written)] = False
    others = mask.nonzero().reshape(-1).tolist()
    for kv in (0, 1):
        a = read_slots(b5_after, layout, kv, others).view(torch.uint8)
        b = read_slots(b5_before, layout, kv, others).view(torch.uint8)
        assert torch.equal(a, b), "the call changed cache slots outside its slot mapping"
    # The unused blocks still hold NaN (nothing wrote there).
    for blk in batch.unused_blocks or []:
        blk_bytes = (b5_after[:, blk])
        if fp8:
            assert bool((blk_bytes == FP8_NAN_CODE).all())
        else:
            assert bool(torch.isnan(blk_bytes.float()).all())


def run_case(backend, dtype, batch, attn, *, slopes=None, window=None, cap=None,
             kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, plan_dtype=None):
    """Plans and runs ``attn`` on ``batch`` (out poisoned with NaN), checks the output against
    the dense reference within the derived tolerance, and the cache; returns the output."""
    if plan_dtype is None and (batch.kv_cache is None or kv_cache_dtype != "auto"):
        plan_dtype = dtype  # required where no cache of activations tells it
    plan = attn.plan(batch.metadata, batch.kv_cache, dtype=plan_dtype)
    assert plan.num_tokens == batch.query.shape[0]
    before = snapshot(batch.kv_cache)
    out = torch.full_like(batch.query, NAN)
    got = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache, out=out)
    assert got is out
    backend.synchronize()
    mods = reference_modifiers(attn, slopes, window, cap)
    want = batch.reference(**mods)
    rel, atol = tolerance(backend.name, dtype, batch, scale=mods["scale"],
                          alibi_slopes=mods["alibi_slopes"], soft_cap=mods["soft_cap"])
    assert_close(out, want, rel, atol)
    check_cache(backend, batch, before, attn, kv_cache_dtype, k_scale, v_scale)
    return out, want


# Batches.
MIXED = [prompt(0, 9), prompt(11, 5), prompt(16, 1), decode(7), decode(16), decode(1)]
DECODES = [decode(0), decode(7), decode(8), decode(15), decode(23)]


def decoder_case(backend, dtype, gen, seqs, *, num_heads=4, num_kv_heads=None, head_size=64,
                 block_size=8, slopes=None, window=None, cap=None, scale=None, amplitude=1.0,
                 **batch_kwargs):
    """Builds a decoder batch and a layer, runs and checks them."""
    hkv = num_heads if num_kv_heads is None else num_kv_heads
    batch = make_batch(backend, seqs, num_heads=num_heads, num_kv_heads=hkv,
                       head_size=head_size, dtype=dtype, gen=gen, block_size=block_size,
                       amplitude=amplitude, **batch_kwargs)
    attn = layer(backend, num_heads, head_size, num_kv_heads=hkv, alibi_slopes=slopes,
                 sliding_window=window, logits_soft_cap=cap, scale=scale)
    return run_case(backend, dtype, batch, attn, slopes=slopes, window=window, cap=cap)


# --------------------------------------------------------------------------------------------
# The reference itself.
# --------------------------------------------------------------------------------------------


def test_dense_reference_sdpa_matches_manual(gen):
    """The SDPA path (float mask) and the hand-computed scores agree, with every modifier SDPA
    can express (GQA, causal with window and context, ALiBi, non-causal ALiBi)."""
    q = torch.randn(7, 6, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(12, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(12, 2, 16, generator=gen, dtype=torch.float64)
    pos = list(range(5, 12))
    for kw in [dict(causal=True), dict(causal=True, sliding_window=3),
               dict(causal=True, alibi_slopes=alibi_slopes(6), scale=-0.3),
               dict(causal=False, alibi_slopes=alibi_slopes(6), alibi_q_pos=[3] * 7)]:
        a = dense_attention(q, k, v, pos, **kw)
        b = dense_attention_manual(q, k, v, pos, **kw)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), kw


def test_dense_reference_by_hand():
    """A case worked out by hand: one head, D = 1, query at position 2 over keys 0..2 with a
    window of 2 (keys 1 and 2), ALiBi slope 0.5 (bias -0.5 on key 1), scale 1, soft cap 10;
    and a query with no key at all (an empty encoder sequence) outputs 0."""
    q = torch.tensor([[[1.0]]], dtype=torch.float64)
    k = torch.tensor([[[5.0]], [[1.0]], [[2.0]]], dtype=torch.float64)
    v = torch.tensor([[[100.0]], [[3.0]], [[7.0]]], dtype=torch.float64)
    s1, s2 = 10 * math.tanh(0.1) - 0.5, 10 * math.tanh(0.2)
    p1 = math.exp(s1) / (math.exp(s1) + math.exp(s2))
    want = p1 * 3.0 + (1 - p1) * 7.0
    got = dense_attention(q, k, v, [2], scale=1.0, alibi_slopes=[0.5], sliding_window=2,
                          soft_cap=10.0)
    assert abs(got.item() - want) < 1e-12
    none = dense_attention(q, k[:0], v[:0], [2], causal=False)
    assert none.item() == 0.0


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_quantize_is_the_contracts(fmt, gen):
    """``dense.fp8_quantize`` (torch's float8 conversion after clamping) against the contract
    written out from scratch: the nearest fp8 value of ``x / scale`` (f32), ties to the even
    code, saturated to the largest finite value; on random values, exact midpoints between
    neighbouring codes, subnormals and values past the largest finite one."""
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_TORCH[fmt])
    table = table.to(torch.float64)
    codes = [c for c in range(128) if math.isfinite(table[c].item())]
    vals = [table[c].item() for c in codes]  # ascending with the code for positive codes

    def contract(x):
        a = min(abs(x), vals[-1])
        best = min(range(len(vals)), key=lambda i: (abs(vals[i] - a), codes[i] % 2))
        return codes[best] | (0x80 if x < 0 or (x == 0 and math.copysign(1, x) < 0) else 0)

    mids = [(vals[i] + vals[i + 1]) / 2 for i in range(len(vals) - 1)]
    xs = (mids + [-m for m in mids] + vals + [1e9, -1e9, vals[-1] * 1.01, 2.0**-20, 0.0]
          + (torch.randn(300, generator=gen, dtype=torch.float64) * 50).tolist())
    x = torch.tensor(xs, dtype=torch.float32)  # midpoints of fp8 values are exact in f32
    got = fp8_quantize(x, fmt, 1.0).tolist()
    want = [contract(float(v)) for v in x.tolist()]
    bad = [(xs[i], got[i], want[i]) for i in range(len(xs)) if got[i] != want[i]]
    assert not bad, bad[:5]
    # The scale divides in f32.
    y = fp8_quantize(torch.tensor([1.0, -3.0]), fmt, 0.3)
    ref = [contract(float(torch.tensor(v, dtype=torch.float32) / torch.tensor(f32(0.3))))
           for v in (1.0, -3.0)]
    assert y.tolist() == ref


# --------------------------------------------------------------------------------------------
# Decoder.
# --------------------------------------------------------------------------------------------


def test_prefill_causal(backend, dtype, gen):
    """Fresh prompts (no context), causal, block size 8, lengths across block boundaries."""
    decoder_case(backend, dtype, gen, [prompt(0, 13), prompt(0, 8), prompt(0, 1), prompt(0, 20)])


def test_decode(backend, dtype, gen):
    """Decodes only, contexts 0..23 (a first token, exactly full blocks, partial blocks)."""
    decoder_case(backend, dtype, gen, DECODES)


def test_mixed_chunked_prefill(backend, dtype, gen):
    """A mixed batch: a fresh prompt, prompt chunks after cached context (chunked prefill /
    prefix caching, one of one token), then decodes."""
    decoder_case(backend, dtype, gen, MIXED)


@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_head_sizes(backend, dtype, gen, head_size):
    """Head sizes 64, 80 (not a power of two), 128, 256 on a small mixed batch."""
    decoder_case(backend, dtype, gen, [prompt(0, 6), prompt(5, 4), decode(9), decode(3)],
                 num_heads=2, head_size=head_size, block_size=4)


@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa-8-2", "mqa-6-1"])
def test_gqa_mqa(backend, dtype, gen, heads):
    """Grouped-query (8 heads over 2 kv heads) and multi-query (6 over 1) attention."""
    h, hkv = heads
    decoder_case(backend, dtype, gen, MIXED, num_heads=h, num_kv_heads=hkv, head_size=64)


def test_alibi(backend, dtype, gen):
    """ALiBi (Bloom's slopes, plus a negative one) on a mixed batch with GQA."""
    slopes = alibi_slopes(4)
    slopes[1] = -0.25
    decoder_case(backend, dtype, gen, MIXED, num_kv_heads=2, slopes=slopes)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(backend, dtype, gen, window):
    """Sliding windows of 1 (the query's own key), 5 and 16 keys over chunked prefills and
    decodes longer than the window."""
    decoder_case(backend, dtype, gen, MIXED + [decode(30)], window=window)


def test_soft_cap(backend, dtype, gen):
    """The logits soft cap, with scores well past the cap (amplitude 3, D 64: |scores| up to
    ~70 against a cap of 5)."""
    decoder_case(backend, dtype, gen, MIXED, cap=5.0, amplitude=3.0)


def test_all_modifiers(backend, dtype, gen):
    """GQA, ALiBi, a window, a soft cap and a negative scale together, with a token of slot -1
    (not written, still a key of this call) in a chunked prefill."""
    decoder_case(backend, dtype, gen, MIXED, num_heads=4, num_kv_heads=2,
                 slopes=alibi_slopes(4), window=6, cap=8.0, scale=-0.2, padding=[11])


def test_unwritten_slots(backend, dtype, gen):
    """Tokens with slot -1 are queries and keys of their own call but are not written: their
    cache slots keep their NaN (docs/semantics.md, "Slot -1 means do not write")."""
    decoder_case(backend, dtype, gen, [prompt(0, 10), prompt(4, 6), decode(5)],
                 padding=[0, 3, 12, 16])


def test_a_query_whose_only_key_is_unwritten(backend, gen):
    """A one-token prompt with slot -1 attends its own key, and nothing is written (vLLM's
    CUDA-graph padding is such a token): ``run_case`` checks the output against the dense
    reference, where that key is the query's only one, and the cache byte for byte."""
    decoder_case(backend, torch.float32, gen, [prompt(0, 1), decode(4)], padding=[0])


# --------------------------------------------------------------------------------------------
# fp8 caches.
# --------------------------------------------------------------------------------------------

FP8_CASES = [
    ("fp8_e4m3", torch.uint8),
    ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8", torch.float8_e4m3fn),
    ("fp8_e5m2", torch.uint8),
    ("fp8_e5m2", torch.float8_e5m2),
]


@pytest.mark.parametrize("kv_cache_dtype,cache_dtype", FP8_CASES,
                         ids=[f"{a}-{str(b).split('.')[-1]}" for a, b in FP8_CASES])
def test_fp8_cache(backend, dtype, gen, kv_cache_dtype, cache_dtype):
    """fp8 caches with k_scale, v_scale != 1 (not powers of two), as uint8 and float8 tensors:
    the new tokens' codes are the contract's (round to nearest even of x / scale in f32,
    saturated), and attention reads ``code * scale`` for context and new tokens alike. The
    key scale is small enough that some keys saturate at the largest finite code."""
    k_scale, v_scale = 0.0023, 0.0371
    amplitude = 1.2  # keys up to 1.2 / 0.0023 = 522 > 448: e4m3 saturates
    seqs = [prompt(0, 7), prompt(9, 4), decode(8), decode(13)]
    batch = make_batch(backend, seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                       gen=gen, kv_cache_dtype=kv_cache_dtype, cache_dtype=cache_dtype,
                       k_scale=k_scale, v_scale=v_scale, amplitude=amplitude)
    assert batch.kv_cache.dtype == cache_dtype
    attn = layer(backend, 4, 64, num_kv_heads=2, kv_cache_dtype=kv_cache_dtype,
                 k_scale=k_scale, v_scale=v_scale)
    run_case(backend, dtype, batch, attn, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
             v_scale=v_scale, plan_dtype=dtype)
    if kv_cache_dtype != "fp8_e5m2":
        codes = fp8_quantize(batch.key.cpu(), kv_cache_dtype, k_scale)
        assert bool(((codes & 0x7F) == 0x7E).any()), "the case should saturate some keys"


def test_fp8_plan_dtype_as_string(backend, gen):
    """``plan(dtype="bf16")``: the activation dtype given as a string for an fp8 cache."""
    batch = make_batch(backend, [prompt(3, 4), decode(5)], num_heads=2, num_kv_heads=2,
                       head_size=64, dtype=torch.bfloat16, gen=gen, kv_cache_dtype="fp8_e4m3",
                       k_scale=0.05, v_scale=0.02)
    attn = layer(backend, 2, 64, kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.02)
    run_case(backend, torch.bfloat16, batch, attn, kv_cache_dtype="fp8_e4m3", k_scale=0.05,
             v_scale=0.02, plan_dtype="bf16")


# --------------------------------------------------------------------------------------------
# Encoder types.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_type", ["encoder", "encoder_only"])
@pytest.mark.parametrize("use_alibi", [False, True], ids=["plain", "alibi"])
def test_encoder(backend, dtype, gen, attn_type, use_alibi):
    """Encoder and encoder-only attention: bidirectional over each sequence's own inputs, no
    cache (ALiBi ``-slope * |j - i|``), GQA, sequences of 1..12 tokens."""
    batch = make_encoder_batch(backend, [12, 1, 7], num_heads=4, num_kv_heads=2, head_size=64,
                               dtype=dtype, gen=gen)
    slopes = alibi_slopes(4) if use_alibi else None
    attn = layer(backend, 4, 64, num_kv_heads=2, attn_type=attn_type, alibi_slopes=slopes)
    run_case(backend, dtype, batch, attn, slopes=slopes)


def test_cross_prefill(backend, dtype, gen):
    """Encoder-decoder prefill: the step carries the encoder keys/values, written into the cross
    cache through ``cross_slot_mapping``; decoder queries attend non-causally over them, with
    ALiBi measured from ``min(i, n - 1)``; a sequence with 0 encoder tokens outputs 0."""
    seqs = [prompt(0, 6, encoder=11), prompt(0, 3, encoder=2), prompt(0, 2, encoder=0)]
    batch = make_cross_batch(backend, seqs, num_heads=4, num_kv_heads=2, head_size=64,
                             dtype=dtype, gen=gen, write_encoder=True)
    slopes = alibi_slopes(4)
    attn = layer(backend, 4, 64, num_kv_heads=2, attn_type="encoder_decoder",
                 alibi_slopes=slopes)
    out, _ = run_case(backend, dtype, batch, attn, slopes=slopes)
    assert bool((out[9:11].cpu() == 0).all()), "no encoder key: zero output"


@pytest.mark.parametrize("use_alibi", [False, True], ids=["plain", "alibi"])
def test_cross_decode(backend, dtype, gen, use_alibi):
    """Encoder-decoder after the prefill: no key/value in the call; the cross cache (filled
    earlier) is read through ``cross_block_tables`` and ``encoder_seq_lens``, for a decoder
    prompt chunk and decodes whose positions run past the encoder's length (ALiBi measured
    from the last encoder key)."""
    seqs = [prompt(4, 5, encoder=9), decode(20, encoder=5), decode(3, encoder=17),
            decode(0, encoder=1)]
    batch = make_cross_batch(backend, seqs, num_heads=4, num_kv_heads=4, head_size=64,
                             dtype=dtype, gen=gen, write_encoder=False)
    slopes = alibi_slopes(4) if use_alibi else None
    attn = layer(backend, 4, 64, attn_type="encoder_decoder", alibi_slopes=slopes)
    run_case(backend, dtype, batch, attn, slopes=slopes)


def test_cross_alibi_far_decoder(backend, dtype, gen):
    """Cross-attention ALiBi for decoder queries at positions past 2^26 over 9 and 3 encoder
    keys: measured from the last encoder key (``min(i, n - 1)``), so the f32 backends keep
    every score exact; measuring from ``i`` itself (a constant of ``slope * i`` ~ 1.7e7 per
    score) would round the scores away in f32. The tolerance takes the encoder positions
    only."""
    far = 2**26 + 5
    seqs = [prompt(far, 3, encoder=9), decode(far + 1000, encoder=3)]
    batch = make_cross_batch(backend, seqs, num_heads=4, num_kv_heads=2, head_size=64,
                             dtype=dtype, gen=gen, write_encoder=True, decoder_tables=False)
    assert batch.max_pos == 8
    slopes = alibi_slopes(4)
    attn = layer(backend, 4, 64, num_kv_heads=2, attn_type="encoder_decoder",
                 alibi_slopes=slopes)
    run_case(backend, dtype, batch, attn, slopes=slopes)


def test_cross_fp8(backend, gen):
    """Cross-attention over an fp8 cross cache: prefill writes codes, decode reads them."""
    for write in (True, False):
        seqs = ([prompt(0, 3, encoder=10), prompt(0, 2, encoder=4)] if write
                else [decode(6, encoder=10), decode(2, encoder=4)])
        batch = make_cross_batch(backend, seqs, num_heads=2, num_kv_heads=2, head_size=64,
                                 dtype=torch.float16, gen=gen, write_encoder=write,
                                 kv_cache_dtype="fp8_e5m2", k_scale=0.125, v_scale=0.07)
        attn = layer(backend, 2, 64, attn_type="encoder_decoder", kv_cache_dtype="fp8_e5m2",
                     k_scale=0.125, v_scale=0.07)
        run_case(backend, torch.float16, batch, attn, kv_cache_dtype="fp8_e5m2",
                 k_scale=0.125, v_scale=0.07, plan_dtype=torch.float16)


def test_cross_without_cache(backend, gen):
    """Cross-attention without a cache (``kv_cache=None``): the encoder keys and values are
    the call's inputs."""
    seqs = [prompt(0, 4, encoder=6), prompt(2, 3, encoder=3)]
    batch = make_cross_batch(backend, seqs, num_heads=4, num_kv_heads=1, head_size=64,
                             dtype=torch.float32, gen=gen, write_encoder=True, use_cache=False)
    attn = layer(backend, 4, 64, num_kv_heads=1, attn_type="encoder_decoder")
    run_case(backend, torch.float32, batch, attn)


# --------------------------------------------------------------------------------------------
# Metadata and plans.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_kind", ["torch", "numpy", "numpy64", "list"])
@pytest.mark.parametrize("form", ["query_start_loc", "context_lens"])
def test_metadata_forms(backend, gen, index_kind, form):
    """Index fields as torch int32/int64 tensors, numpy int32/int64 arrays or lists, with the
    query lengths given by ``query_start_loc`` or by ``context_lens``: the derived fields are
    vLLM's and the output is right."""
    seqs = [prompt(0, 5), prompt(6, 3), decode(9), decode(2)]
    out, _ = decoder_case(backend, torch.float32, gen, seqs, index_kind=index_kind,
                          metadata_form=form)
    batch = make_batch(backend, seqs, num_heads=1, num_kv_heads=1, head_size=64,
                       dtype=torch.float32, gen=gen, index_kind=index_kind, metadata_form=form)
    md = batch.metadata
    assert md.num_seqs == 4
    assert md.num_tokens == 10
    assert md.num_prefills == 2
    assert md.num_prefill_tokens == 8
    assert md.num_decode_tokens == 2
    assert md.max_query_len == 5
    assert md.max_seq_len == 10
    assert md.max_prefill_seq_len == 9
    assert md.max_decode_seq_len == 10
    assert list(md.query_start_loc) == [0, 5, 8, 9, 10]
    assert list(md.seq_lens) == [5, 9, 10, 3]
    assert list(md.context_lens) == [0, 6, 9, 2]


@pytest.mark.parametrize("pad", [-1, 10**6], ids=["minus-one", "past-the-cache"])
def test_block_table_padding_ignored(backend, gen, pad):
    """Block-table entries past a sequence's last block are padding, never read nor checked
    (``_native.pyi``): -1 or a block id past the cache there changes nothing."""
    seqs = [prompt(0, 17), prompt(2, 3), decode(4)]
    batch = make_batch(backend, seqs, num_heads=2, num_kv_heads=2, head_size=64,
                       dtype=torch.float32, gen=gen)
    attn = layer(backend, 2, 64)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    cache = batch.kv_cache.clone()
    want = attn.run(plan, batch.query, batch.key, batch.value, cache)
    width = max(len(t) for t in batch.block_tables) + 2
    tables = [t + [pad] * (width - len(t)) for t in batch.block_tables]
    md = pagedattn.Metadata(seq_lens=batch.metadata.seq_lens, slot_mapping=batch.slot_mapping,
                            block_tables=torch.tensor(tables, dtype=torch.int32),
                            query_start_loc=batch.metadata.query_start_loc,
                            num_prefills=2, block_size=batch.block_size)
    plan = attn.plan(md, batch.kv_cache)
    got = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_metadata_default_num_prefills():
    """Without ``num_prefills``: sequences whose query is longer than one token are the
    prefills (with ``context_lens``); without context_lens/query_start_loc all are prefills."""
    md = pagedattn.Metadata(seq_lens=[5, 9, 4], context_lens=[0, 6, 3],
                            slot_mapping=[-1] * 9, block_tables=[[0, 1], [2, 3], [4, 5]],
                            block_size=8)
    assert md.num_prefills == 2 and md.num_tokens == 9 and md.num_decode_tokens == 1
    md = pagedattn.Metadata(seq_lens=[5, 1, 4], slot_mapping=[-1] * 10)
    assert md.num_prefills == 3 and md.num_tokens == 10 and list(md.context_lens) == [0, 0, 0]


def test_plan_shared_by_layers(backend, dtype, gen):
    """One plan serves layers that differ only in scale, ALiBi slopes and soft cap, each with
    its own cache; outputs are each layer's."""
    seqs = [prompt(0, 6), prompt(4, 3), decode(10)]
    b1 = make_batch(backend, seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                    gen=gen)
    layers = [
        (layer(backend, 4, 64, num_kv_heads=2), None, None),
        (layer(backend, 4, 64, num_kv_heads=2, scale=0.05, alibi_slopes=alibi_slopes(4)),
         alibi_slopes(4), None),
        (layer(backend, 4, 64, num_kv_heads=2, logits_soft_cap=3.0), None, 3.0),
    ]
    plan = layers[0][0].plan(b1.metadata, b1.kv_cache)
    for attn, slopes, cap in layers:
        # The same block tables and slots, a fresh cache of this layer's own context.
        cache = b1.kv_cache.clone()
        out = torch.full_like(b1.query, NAN)
        assert attn.run(plan, b1.query, b1.key, b1.value, cache, out=out) is out
        mods = reference_modifiers(attn, slopes, None, cap)
        want = b1.reference(**mods)
        rel, atol = tolerance(backend.name, dtype, b1, scale=mods["scale"],
                              alibi_slopes=mods["alibi_slopes"], soft_cap=mods["soft_cap"])
        assert_close(out, want, rel, atol)


def test_write_kv(backend, dtype, gen):
    """``write_kv`` alone writes exactly the cache bytes that ``run`` writes (and nothing
    else), fp8 included; a ``run`` after it gives the same output as on the fresh cache."""
    for kvd in ("auto", "fp8_e4m3"):
        scales = dict(k_scale=0.04, v_scale=0.03) if kvd != "auto" else {}
        batch = make_batch(backend, [prompt(3, 5), prompt(0, 2), decode(6)], num_heads=2,
                           num_kv_heads=2, head_size=64, dtype=dtype, gen=gen,
                           kv_cache_dtype=kvd, padding=[4], **scales)
        attn = layer(backend, 2, 64, kv_cache_dtype=kvd, **scales)
        plan = attn.plan(batch.metadata, batch.kv_cache, dtype=dtype)
        fresh = batch.kv_cache.clone()
        before = snapshot(batch.kv_cache)
        assert attn.write_kv(plan, batch.key, batch.value, batch.kv_cache) is None
        backend.synchronize()
        check_cache(backend, batch, before, attn, kvd, **scales)
        by_run = attn.run(plan, batch.query, batch.key, batch.value, fresh)
        backend.synchronize()
        assert torch.equal(fresh.view(torch.uint8), batch.kv_cache.view(torch.uint8))
        again = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache)
        assert torch.equal(again.view(torch.uint8), by_run.view(torch.uint8))


def test_chunking_invariance(backend, gen):
    """A prompt computed in one step equals the same prompt in two chunks (the second over the
    first's cached context) to within the dtype's rounding: keys are read from the cache."""
    d, h = 64, 2
    q = torch.randn(12, h, d, generator=gen).to(backend.device)
    k = torch.randn(12, h, d, generator=gen).to(backend.device)
    v = torch.randn(12, h, d, generator=gen).to(backend.device)
    table = [2, 0]
    attn = layer(backend, h, d)

    def step(ctx, n, cache):
        md = pagedattn.Metadata(seq_lens=[ctx + n], query_start_loc=[0, n], num_prefills=1,
                                slot_mapping=slots_of(table, 8, range(ctx, ctx + n)),
                                block_tables=[table], block_size=8)
        plan = attn.plan(md, cache)
        return attn.run(plan, q[ctx:ctx + n], k[ctx:ctx + n], v[ctx:ctx + n], cache)

    c1 = torch.full(backend.kv_cache_shape(3, 8, h, d), NAN, device=backend.device)
    whole = step(0, 12, c1)
    c2 = torch.full(backend.kv_cache_shape(3, 8, h, d), NAN, device=backend.device)
    first = step(0, 7, c2)
    second = step(7, 5, c2)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    got = torch.cat([first, second])
    want = dense_attention(q.cpu(), k.cpu(), v.cpu())
    rel, atol = tolerance_for(backend.name, torch.float32, q=q, k=k, v=v, scale=f32(attn.scale),
                              max_pos=11)
    assert_close(got, want, rel, atol)
    assert_close(got, whole.cpu().double(), 2 * rel, 2 * atol, "chunked vs whole")
