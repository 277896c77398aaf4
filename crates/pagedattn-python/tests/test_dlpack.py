"""Zero copy through DLPack: ``run(..., out=t)`` returns ``t`` itself and writes its memory, the
cache is written in place at its layout position, numpy arrays work on the CPU, and 2-D
``[T, H * D]`` queries (and keys/values) work."""

import numpy as np
import pytest
import torch

import pagedattn
from dense import (
    assert_close,
    decode,
    dense_attention,
    f32,
    layout_view,
    make_batch,
    prompt,
    slots_of,
    tolerance,
    tolerance_for,
)

NAN = float("nan")


def small_batch(backend, gen, dtype=torch.float32, **kw):
    seqs = [prompt(0, 5), prompt(3, 4), decode(9)]
    return make_batch(backend, seqs, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                      gen=gen, **kw)


def check(backend, batch, out, attn, dtype=torch.float32):
    want = batch.reference(scale=f32(attn.scale))
    rel, atol = tolerance(backend.name, dtype, batch, scale=f32(attn.scale))
    assert_close(torch.as_tensor(out).reshape(want.shape), want, rel, atol)


def test_out_is_returned_and_written_in_place(backend, gen):
    """``run(out=t)`` returns ``t`` itself (same object, same memory), having written every
    element (t was NaN)."""
    batch = small_batch(backend, gen)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    out = torch.full_like(batch.query, NAN)
    ptr = out.data_ptr()
    got = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache, out=out)
    assert got is out
    assert out.data_ptr() == ptr
    assert not torch.isnan(out).any()
    check(backend, batch, out, attn)


def test_out_is_a_view_into_a_larger_buffer(backend, gen):
    """``out`` may be a contiguous slice of a larger buffer: exactly that memory is written,
    the rest of the buffer stays as it was."""
    batch = small_batch(backend, gen)
    t, h, d = batch.query.shape
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    buf = torch.full((t + 4, h, d), 7.0, device=backend.device)
    out = buf[2:2 + t]
    assert out.is_contiguous() and out.data_ptr() != buf.data_ptr()
    out.fill_(NAN)
    got = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache, out=out)
    assert got is out
    assert bool((buf[:2] == 7).all()) and bool((buf[2 + t:] == 7).all())
    check(backend, batch, buf[2:2 + t], attn)


def test_default_out_is_a_new_tensor_like_query(backend, gen):
    """Without ``out``, ``run`` returns a new tensor of the query's shape, dtype and device."""
    batch = small_batch(backend, gen, dtype=torch.bfloat16)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    out = attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache)
    assert isinstance(out, torch.Tensor)
    assert out.shape == batch.query.shape and out.dtype == torch.bfloat16
    assert str(out.device) == str(batch.query.device)
    assert out.data_ptr() != batch.query.data_ptr()
    check(backend, batch, out, attn, torch.bfloat16)


def test_cache_written_in_place_at_layout_position(backend, gen):
    """A key and value written through ``slot_mapping`` appear in the torch cache tensor
    itself (no copy) at the backend's layout position: ``cache[0, block, offset, h]`` for
    ``NHD``, ``cache[0, block, h, offset]`` for ``HND`` (1 for values)."""
    h, d, b = 2, 64, 4
    attn = pagedattn.Attention(backend, h, d)
    cache = torch.zeros(backend.kv_cache_shape(5, b, h, d), device=backend.device)
    ptr = cache.data_ptr()
    table = [3, 1]
    md = pagedattn.Metadata(seq_lens=[6], slot_mapping=slots_of(table, b, range(6)),
                            block_tables=[table], block_size=b)
    plan = attn.plan(md, cache)
    q = torch.randn(6, h, d, generator=gen).to(backend.device)
    k = torch.randn(6, h, d, generator=gen).to(backend.device)
    v = torch.randn(6, h, d, generator=gen).to(backend.device)
    attn.run(plan, q, k, v, cache)
    backend.synchronize()
    assert cache.data_ptr() == ptr
    for pos in range(6):
        blk, off = table[pos // b], pos % b
        for hh in range(h):
            if backend.kv_cache_layout == "NHD":
                kc, vc = cache[0, blk, off, hh], cache[1, blk, off, hh]
            else:
                assert backend.kv_cache_layout == "HND"
                kc, vc = cache[0, blk, hh, off], cache[1, blk, hh, off]
            assert torch.equal(kc, k[pos, hh]) and torch.equal(vc, v[pos, hh]), (pos, hh)
    # Blocks the table does not hold are untouched.
    for blk in (0, 2, 4):
        assert bool((cache[:, blk] == 0).all())


def test_flat_vllm_cache_shape(backend, gen):
    """A cache of vLLM's flat shape ``(2, NB, B * Hkv * D)`` is accepted, read in the backend's
    layout, and written in place."""
    batch = small_batch(backend, gen)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    nb = batch.kv_cache.shape[1]
    flat = batch.kv_cache.reshape(2, nb, -1)
    assert flat.data_ptr() == batch.kv_cache.data_ptr()
    plan = attn.plan(batch.metadata, flat)
    out = attn.run(plan, batch.query, batch.key, batch.value, flat)
    check(backend, batch, out, attn)
    c5 = layout_view(flat, backend.kv_cache_layout, batch.block_size, 2, 64)
    assert c5.data_ptr() == batch.kv_cache.data_ptr()


def test_two_dimensional_query_key_value(backend, gen):
    """``query``/``out`` as ``[T, H * D]`` and ``key``/``value`` as ``[T, Hkv * D]``: the same
    result as the 3-D call, ``out`` of the query's (2-D) shape."""
    batch = small_batch(backend, gen)
    t, h, d = batch.query.shape
    attn = pagedattn.Attention(backend, h, d, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    q2 = batch.query.reshape(t, h * d)
    k2, v2 = batch.key.reshape(t, -1), batch.value.reshape(t, -1)
    out = torch.full_like(q2, NAN)
    got = attn.run(plan, q2, k2, v2, batch.kv_cache, out=out)
    assert got is out and out.shape == (t, h * d)
    check(backend, batch, out.reshape(t, h, d), attn)
    default = attn.run(plan, q2, k2, v2, batch.kv_cache)
    assert default.shape == (t, h * d)
    # A 2-D query with a 3-D out (or the reverse) is not the query's shape.
    with pytest.raises(ValueError):
        attn.run(plan, q2, k2, v2, batch.kv_cache, out=torch.empty_like(batch.query))


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_numpy_arrays(np_dtype, gen):
    """numpy arrays on the CPU (float32, float16; numpy has no bf16) as query, key, value,
    cache and out, with numpy index arrays: ``out`` is the array itself, written in place, the
    cache array written in place, the output equal to the torch tensors' call bit for bit."""
    for name in ("reference", "cpu"):
        backend = pagedattn.Backend(name)
        tdt = torch.float32 if np_dtype == np.float32 else torch.float16
        batch = small_batch(backend, gen, dtype=tdt, index_kind="numpy")
        attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
        torch_cache = batch.kv_cache.clone()
        np_cache = batch.kv_cache.numpy().copy()
        plan = attn.plan(batch.metadata, np_cache)
        q, k, v = batch.query.numpy(), batch.key.numpy(), batch.value.numpy()
        out = np.full(q.shape, np.nan, dtype=np_dtype)
        got = attn.run(plan, q, k, v, np_cache, out=out)
        assert got is out
        assert not np.isnan(out).any()
        want = attn.run(plan, batch.query, batch.key, batch.value, torch_cache)
        assert np.array_equal(out.view(np.uint8), want.numpy().view(np.uint8)), name
        assert np.array_equal(np_cache.view(np.uint8), torch_cache.numpy().view(np.uint8))
        check(backend, batch, torch.from_numpy(out), attn, tdt)
        default = attn.run(plan, q, k, v, np_cache.copy())
        assert isinstance(default, np.ndarray) and default.dtype == np_dtype
        assert default.shape == q.shape
        assert np.array_equal(default.view(np.uint8), out.view(np.uint8))


def test_numpy_and_torch_mixed(gen):
    """A numpy query with a torch cache and out: DLPack on both sides, one call."""
    backend = pagedattn.Backend("cpu")
    batch = small_batch(backend, gen)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    out = torch.full_like(batch.query, NAN)
    got = attn.run(plan, batch.query.numpy(), batch.key.numpy(), batch.value, batch.kv_cache,
                   out=out)
    assert got is out
    check(backend, batch, out, attn)


def test_encoder_without_cache_two_dimensional(backend, gen):
    """An encoder call (no cache) with 2-D inputs."""
    t, h, d = 9, 2, 64
    attn = pagedattn.Attention(backend, h, d, attn_type="encoder_only")
    md = pagedattn.Metadata(seq_lens=[4, 5], slot_mapping=[-1] * t)
    plan = attn.plan(md, None, dtype=torch.float32)
    q = torch.randn(t, h * d, generator=gen).to(backend.device)
    k = torch.randn(t, h * d, generator=gen).to(backend.device)
    v = torch.randn(t, h * d, generator=gen).to(backend.device)
    out = attn.run(plan, q, k, v)
    assert out.shape == (t, h * d)
    q3, k3, v3 = (x.cpu().reshape(t, h, d) for x in (q, k, v))
    want = torch.cat([dense_attention(q3[:4], k3[:4], v3[:4], causal=False),
                      dense_attention(q3[4:], k3[4:], v3[4:], causal=False)])
    rel, atol = tolerance_for(backend.name, torch.float32, q=q3, k=k3, v=v3,
                              scale=f32(attn.scale), max_pos=4)
    assert_close(out.reshape(t, h, d), want, rel, atol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stream_ordering(gen):
    """On CUDA, ``run`` is ordered on the given stream after the work queued there: a query
    filled on a side stream just before the call is the one attended."""
    backend = pagedattn.Backend("cuda")
    batch = small_batch(backend, gen)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2)
    plan = attn.plan(batch.metadata, batch.kv_cache)
    s = torch.cuda.Stream()
    q = torch.zeros_like(batch.query)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)
        q.copy_(batch.query)
        out = attn.run(plan, q, batch.key, batch.value, batch.kv_cache, stream=s)
    s.synchronize()
    check(backend, batch, out, attn)
