"""Bad input raises the documented exception, whose message names the field, and never crashes
the process: ``TypeError`` for a wrong dtype or device, ``ValueError`` for a wrong shape, a
non-contiguous tensor, overlapping tensors, out-of-range blocks or slots, inconsistent metadata,
an unknown name or a plan of another geometry; ``NotImplementedError`` for a feature a backend
lacks. A refused call writes nothing: the cache and ``out`` stay as they were, and a good call
still works afterwards."""

import numpy as np
import pytest
import torch

import pagedattn
from conftest import get_backend
from dense import decode, make_batch, make_encoder_batch, prompt, slots_of

NAN = float("nan")


class Setup:
    """A valid small decoder call on ``backend`` to break one thing at a time."""

    def __init__(self, backend, gen, dtype=torch.float32, **layer):
        self.backend = backend
        self.batch = make_batch(backend, [prompt(0, 5), prompt(3, 4), decode(9)], num_heads=4,
                                num_kv_heads=2, head_size=64, dtype=dtype, gen=gen)
        self.attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2, **layer)
        self.plan = self.attn.plan(self.batch.metadata, self.batch.kv_cache)
        b = self.batch
        self.args = dict(query=b.query, key=b.key, value=b.value, kv_cache=b.kv_cache)

    def run(self, **changes):
        """``run`` with some arguments replaced; checks that a refused call wrote nothing."""
        args = dict(self.args, **changes)
        cache = args["kv_cache"]
        before = None
        if isinstance(cache, torch.Tensor):
            before = cache.detach().cpu().contiguous().view(torch.uint8).clone()
        out = args.get("out")
        out_before = out.detach().clone() if isinstance(out, torch.Tensor) else None
        plan = args.pop("plan", self.plan)
        try:
            return self.attn.run(plan, **args)
        except Exception:
            if before is not None:
                after = cache.detach().cpu().contiguous().view(torch.uint8)
                assert torch.equal(before, after), "a refused call changed the cache"
            if out_before is not None and not _overlaps(out, args):
                assert torch.equal(out.detach().cpu().contiguous().view(torch.uint8),
                                   out_before.cpu().contiguous().view(torch.uint8)), \
                    "a refused call wrote out"
            raise

    def still_works(self):
        """A correct call after the refused ones gives a finite output."""
        out = self.attn.run(self.plan, **self.args)
        assert bool(torch.isfinite(out).all())


def _overlaps(out, args):
    return any(isinstance(x, torch.Tensor) and x is not out and
               x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
               for x in args.values())


def raises(exc, *fields):
    """``pytest.raises(exc)`` whose message must name one of ``fields`` (regexes)."""
    return pytest.raises(exc, match="|".join(fields))


# --------------------------------------------------------------------------------------------
# Tensors.
# --------------------------------------------------------------------------------------------


def test_non_contiguous(backend, gen):
    """A transposed (non-contiguous) query, key, out or cache is a ValueError naming it; no
    hidden copy."""
    s = Setup(backend, gen)
    q = s.batch.query
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, strides permuted
    assert q_t.shape == q.shape and not q_t.is_contiguous()
    with raises(ValueError, "query"):
        s.run(query=q_t)
    k_t = s.batch.key.transpose(0, 1).contiguous().transpose(0, 1)
    with raises(ValueError, "key"):
        s.run(key=k_t)
    with raises(ValueError, "out"):
        s.run(out=torch.empty_like(q_t).transpose(0, 1).contiguous().transpose(0, 1))
    c = s.batch.kv_cache
    c_nc = c.transpose(3, 4).contiguous().transpose(3, 4)
    assert c_nc.shape == c.shape and not c_nc.is_contiguous()
    with raises(ValueError, "kv_cache|cache"):
        s.run(kv_cache=c_nc)
    # A strided slice (every other token).
    wide = torch.zeros(2 * q.shape[0], *q.shape[1:], device=q.device)[::2]
    with raises(ValueError, "query"):
        s.run(query=wide)
    s.still_works()


def test_wrong_dtype(backend, gen):
    """A query of f64 or int, a key of another dtype than the query, a cache of another dtype,
    an out of another dtype: TypeError naming the tensor."""
    s = Setup(backend, gen)
    b = s.batch
    with raises(TypeError, "query"):
        s.run(query=b.query.double())
    with raises(TypeError, "query"):
        s.run(query=b.query.to(torch.int32))
    with raises(TypeError, "key"):
        s.run(key=b.key.half())
    with raises(TypeError, "value"):
        s.run(value=b.value.to(torch.bfloat16))
    with raises(TypeError, "kv_cache|cache"):
        s.run(kv_cache=b.kv_cache.half())
    # A query of f16 over the f32 cache the plan was made for.
    with raises(TypeError, "query|kv_cache|cache"):
        s.run(query=b.query.half(), key=b.key.half(), value=b.value.half())
    s.still_works()


def test_out_wrong_dtype(backend, gen):
    """``out`` of another dtype than the query: TypeError (a wrong dtype) naming out."""
    s = Setup(backend, gen)
    with raises(TypeError, "out"):
        s.run(out=torch.empty_like(s.batch.query, dtype=torch.float16))


def test_wrong_dtype_fp8_cache(backend, gen):
    """An fp8 layer: a float16 cache is not fp8 storage, a float8_e5m2 cache is not e4m3
    (TypeError); planning without the activation dtype, where the cache cannot tell it, is
    refused."""
    batch = make_batch(backend, [prompt(0, 4), decode(5)], num_heads=2, num_kv_heads=2,
                       head_size=64, dtype=torch.float16, gen=gen, kv_cache_dtype="fp8_e4m3",
                       k_scale=0.5, v_scale=0.5)
    attn = pagedattn.Attention(backend, 2, 64, kv_cache_dtype="fp8_e4m3", k_scale=0.5,
                               v_scale=0.5)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        attn.plan(batch.metadata, batch.kv_cache)
    plan = attn.plan(batch.metadata, batch.kv_cache, dtype=torch.float16)
    with raises(TypeError, "kv_cache|cache"):
        attn.run(plan, batch.query, batch.key, batch.value, batch.kv_cache.half())
    with raises(TypeError, "kv_cache|cache"):
        attn.run(plan, batch.query, batch.key, batch.value,
                 batch.kv_cache.view(torch.float8_e5m2))
    with raises(TypeError, "kv_cache|cache|dtype"):
        attn.plan(batch.metadata, batch.kv_cache.view(torch.float8_e5m2), dtype=torch.float16)
    out = attn.run(plan, batch.query, batch.key, batch.value,
                   batch.kv_cache.view(torch.float8_e4m3fn))
    assert bool(torch.isfinite(out).all())


def test_index_dtype(backend, gen):
    """Index tensors must be integers: a float slot mapping or block table is a TypeError."""
    with raises(TypeError, "slot_mapping"):
        pagedattn.Metadata(seq_lens=[3], slot_mapping=torch.tensor([0.0, 1.0, 2.0]),
                           block_tables=[[0]], block_size=8)
    with raises(TypeError, "block_tables"):
        pagedattn.Metadata(seq_lens=[3], slot_mapping=[0, 1, 2],
                           block_tables=np.zeros((1, 1), dtype=np.float32), block_size=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wrong_device(gen):
    """A CPU tensor (query, out, cache) given to the cuda backend, or a GPU tensor to a CPU
    backend: TypeError naming it."""
    cuda = get_backend("cuda")
    s = Setup(cuda, gen)
    with raises(TypeError, "query"):
        s.run(query=s.batch.query.cpu())
    with raises(TypeError, "out"):
        s.run(out=torch.empty_like(s.batch.query, device="cpu"))
    with raises(TypeError, "kv_cache|cache"):
        s.run(kv_cache=s.batch.kv_cache.cpu())
    with raises(TypeError, "kv_cache|cache"):
        s.attn.plan(s.batch.metadata, s.batch.kv_cache.cpu())
    cpu = Setup(get_backend("cpu"), gen)
    with raises(TypeError, "query"):
        cpu.run(query=cpu.batch.query.cuda())
    s.still_works()


def test_wrong_shapes(backend, gen):
    """Wrong head count, head size or token count of query, key, value, out, or a cache of
    another geometry: ValueError naming the tensor."""
    s = Setup(backend, gen)
    b = s.batch
    t = b.query.shape[0]
    dev = backend.device
    with raises(ValueError, "query"):
        s.run(query=torch.zeros(t, 5, 64, device=dev))
    with raises(ValueError, "query"):
        s.run(query=torch.zeros(t + 1, 4, 64, device=dev))
    with raises(ValueError, "query"):
        s.run(query=torch.zeros(t, 4, 64, 1, device=dev))
    with raises(ValueError, "key"):
        s.run(key=torch.zeros(t, 4, 64, device=dev))
    with raises(ValueError, "value"):
        s.run(value=torch.zeros(t - 1, 2, 64, device=dev))
    with raises(ValueError, "out"):
        s.run(out=torch.zeros(t, 4, 32, device=dev))
    with raises(ValueError, "kv_cache|cache"):
        s.run(kv_cache=torch.zeros(backend.kv_cache_shape(b.num_blocks, b.block_size, 2, 32),
                                   device=dev))
    with raises(ValueError, "kv_cache|cache"):  # one block fewer than the plan's
        s.run(kv_cache=b.kv_cache[:, 1:].contiguous())
    with raises(ValueError, "kv_cache|cache"):  # not (2, NB, ...)
        s.run(kv_cache=b.kv_cache.reshape(-1))
    with raises(ValueError, "kv_cache|cache|block_size"):  # another block size, same elements
        shape = backend.kv_cache_shape(b.num_blocks * 2, b.block_size // 2, 2, 64)
        s.attn.plan(b.metadata, torch.zeros(shape, device=dev))
    with raises(ValueError, "key|value"):  # key without value
        s.run(value=None)
    s.still_works()


def test_read_only_numpy_out():
    """A read-only numpy array as ``out`` (or cache) is refused (ValueError), not written."""
    backend = get_backend("cpu")
    md = pagedattn.Metadata(seq_lens=[3], slot_mapping=[-1] * 3)
    attn = pagedattn.Attention(backend, 2, 64, attn_type="encoder")
    plan = attn.plan(md, None, dtype="f32")
    q = np.ones((3, 2, 64), dtype=np.float32)
    out = np.zeros_like(q)
    out.setflags(write=False)
    with raises(ValueError, "out"):
        attn.run(plan, q, q.copy(), q.copy(), out=out)
    assert not out.any()


def test_overlap(backend, gen):
    """``out`` that is the query, overlaps the query, the key, or the cache: ValueError."""
    s = Setup(backend, gen)
    b = s.batch
    with raises(ValueError, "overlap|out"):
        s.run(out=b.query)
    buf = torch.zeros(b.query.shape[0] + 1, 4, 64, device=backend.device)
    buf[:-1].copy_(b.query)
    with raises(ValueError, "overlap|out"):
        s.run(query=buf[:-1], out=buf[1:])
    kbuf = torch.zeros(b.query.numel(), device=backend.device)
    kbuf[: b.key.numel()].copy_(b.key.reshape(-1))
    with raises(ValueError, "overlap|out"):
        s.run(key=kbuf[: b.key.numel()].view_as(b.key), out=kbuf.view_as(b.query))
    n = b.query.numel()
    cache_view = b.kv_cache.view(-1)[:n].view_as(b.query)
    with raises(ValueError, "overlap|out"):
        s.run(out=cache_view)
    s.still_works()


# --------------------------------------------------------------------------------------------
# Metadata.
# --------------------------------------------------------------------------------------------


def plan_with(backend, attn, cache, **fields):
    """Builds the metadata and plans it (either step may refuse)."""
    return attn.plan(pagedattn.Metadata(**fields), cache)


def test_block_out_of_range(backend, gen):
    """A block id past the cache (or negative) in block_tables, or a slot past the cache in
    slot_mapping: ValueError naming the field."""
    b = get_backend(backend.name)
    attn = pagedattn.Attention(b, 2, 64)
    cache = torch.zeros(b.kv_cache_shape(4, 8, 2, 64), device=b.device)
    ok = dict(seq_lens=[10], slot_mapping=slots_of([1, 3], 8, range(10)),
              block_tables=[[1, 3]], block_size=8)
    plan_with(b, attn, cache, **ok)
    with raises(ValueError, "block_tables"):
        plan_with(b, attn, cache, **dict(ok, block_tables=[[1, 4]],
                                         slot_mapping=slots_of([1, 4], 8, range(10))))
    with raises(ValueError, "block_tables"):
        plan_with(b, attn, cache, **dict(ok, block_tables=[[-2, 3]],
                                         slot_mapping=[-1] * 10))
    with raises(ValueError, "slot_mapping"):
        plan_with(b, attn, cache, **dict(ok, slot_mapping=slots_of([1, 3], 8, range(9)) + [32]))
    with raises(ValueError, "slot_mapping"):
        plan_with(b, attn, cache, **dict(ok, slot_mapping=slots_of([1, 3], 8, range(9)) + [-5]))
    with raises(ValueError, "block_tables"):  # a table too short for seq_len
        plan_with(b, attn, cache, **dict(ok, block_tables=[[1]], slot_mapping=[-1] * 10))


def test_cross_block_out_of_range(backend, gen):
    """A cross block table entry past the cross cache: ValueError naming cross_block_tables."""
    attn = pagedattn.Attention(backend, 2, 64, attn_type="encoder_decoder")
    cache = torch.zeros(backend.kv_cache_shape(3, 8, 2, 64), device=backend.device)
    with raises(ValueError, "cross_block_tables"):
        plan_with(backend, attn, cache, seq_lens=[2], slot_mapping=[-1, -1],
                  encoder_seq_lens=[12], cross_block_tables=[[0, 3]], block_size=8)


def test_seq_lens_and_slot_mapping_disagree(backend, gen):
    """slot_mapping with more or fewer entries than the step's tokens, or a slot that is not
    the one its position maps to through the block table: ValueError naming slot_mapping."""
    attn = pagedattn.Attention(backend, 2, 64)
    cache = torch.zeros(backend.kv_cache_shape(4, 8, 2, 64), device=backend.device)
    slots = slots_of([2, 0], 8, range(10))
    with raises(ValueError, "slot_mapping"):
        plan_with(backend, attn, cache, seq_lens=[10], slot_mapping=slots + [5],
                  block_tables=[[2, 0]], block_size=8)
    with raises(ValueError, "slot_mapping"):
        plan_with(backend, attn, cache, seq_lens=[10], slot_mapping=slots[:-1],
                  block_tables=[[2, 0]], block_size=8)
    with raises(ValueError, "slot_mapping"):
        plan_with(backend, attn, cache, seq_lens=[10], slot_mapping=[s ^ 1 for s in slots],
                  block_tables=[[2, 0]], block_size=8)
    with raises(ValueError, "slot_mapping"):  # one slot twice
        plan_with(backend, attn, cache, seq_lens=[3, 1], slot_mapping=[16, 17, 18, 16],
                  block_tables=[[2], [2]], block_size=8, num_prefills=1,
                  query_start_loc=[0, 3, 4])


def test_inconsistent_metadata_fields(backend):
    """Lengths that contradict each other: ValueError naming the field."""
    with raises(ValueError, "query_start_loc"):
        pagedattn.Metadata(seq_lens=[4, 4], query_start_loc=[0, 5, 3], slot_mapping=[-1] * 3)
    with raises(ValueError, "query_start_loc|seq_lens"):
        pagedattn.Metadata(seq_lens=[4, 4, 4], query_start_loc=[0, 4, 8], slot_mapping=[-1] * 8)
    # (The binding derives query_start_loc from seq_lens - context_lens and names it.)
    with raises(ValueError, "seq_lens|context_lens|query_start_loc"):
        pagedattn.Metadata(seq_lens=[4, 2], context_lens=[5, 1], num_prefills=1,
                           slot_mapping=[-1] * 2)
    with raises(ValueError, "num_prefills"):
        pagedattn.Metadata(seq_lens=[4], num_prefills=2, slot_mapping=[-1] * 4)
    with raises(ValueError, "encoder_seq_lens|cross"):
        attn = pagedattn.Attention(backend, 2, 64, attn_type="encoder_decoder")
        cache = torch.zeros(backend.kv_cache_shape(3, 8, 2, 64), device=backend.device)
        plan_with(backend, attn, cache, seq_lens=[2, 3], slot_mapping=[-1] * 5,
                  encoder_seq_lens=[4], cross_block_tables=[[0]], block_size=8)
    with raises(ValueError, "query length|decode|num_prefills|query_start_loc"):
        attn = pagedattn.Attention(backend, 2, 64)
        cache = torch.zeros(backend.kv_cache_shape(3, 8, 2, 64), device=backend.device)
        plan_with(backend, attn, cache, seq_lens=[3, 3], query_start_loc=[0, 2, 4],
                  num_prefills=1, slot_mapping=[-1] * 4, block_tables=[[0], [1]],
                  block_size=8)


def test_block_size_mismatch(backend):
    """Metadata built for block size 16 planned against a cache of block size 8."""
    attn = pagedattn.Attention(backend, 2, 64)
    cache = torch.zeros(backend.kv_cache_shape(4, 8, 2, 64), device=backend.device)
    with raises(ValueError, "block_size"):
        plan_with(backend, attn, cache, seq_lens=[3], slot_mapping=[0, 1, 2],
                  block_tables=[[0]], block_size=16)


# --------------------------------------------------------------------------------------------
# Names, layers and plans.
# --------------------------------------------------------------------------------------------


def test_unknown_backend():
    """An unknown backend name is a ValueError naming it."""
    with raises(ValueError, "nope"):
        pagedattn.Backend("nope")
    assert set(pagedattn.backends()) >= {"reference", "cpu"}


def test_bad_layer_settings(backend):
    """Settings the contract refuses: ValueError naming the field; a sliding window on a
    non-causal layer: NotImplementedError (the contract's Unsupported)."""
    A = pagedattn.Attention
    with raises(ValueError, "scale"):
        A(backend, 2, 64, scale=0.0)
    with raises(ValueError, "scale"):
        A(backend, 2, 64, scale=float("inf"))
    with raises(ValueError, "num_kv_heads"):
        A(backend, 4, 64, num_kv_heads=3)
    with raises(ValueError, "alibi_slopes"):
        A(backend, 4, 64, alibi_slopes=[0.5, 0.25])
    with raises(ValueError, "alibi_slopes"):
        A(backend, 2, 64, alibi_slopes=[0.5, float("nan")])
    A(backend, 2, 64, logits_soft_cap=0.0)  # 0 means no cap, as in vLLM
    with raises(ValueError, "logits_soft_cap"):
        A(backend, 2, 64, logits_soft_cap=-1.0)
    with raises(ValueError, "attn_type"):
        A(backend, 2, 64, attn_type="sideways")
    with raises(ValueError, "k_scale"):
        A(backend, 2, 64, k_scale=0.5)  # scales other than 1 without an fp8 cache
    with raises(ValueError, "v_scale"):
        A(backend, 2, 64, kv_cache_dtype="fp8", v_scale=-1.0)
    with raises(ValueError, "sliding_window"):
        A(backend, 2, 64, sliding_window=0)
    with raises(ValueError, "head_size"):
        A(backend, 2, 0)
    with raises(NotImplementedError, "sliding window|window"):
        attn = A(backend, 2, 64, attn_type="encoder", sliding_window=4)
        attn.plan(pagedattn.Metadata(seq_lens=[3], slot_mapping=[-1] * 3), None,
                  dtype=torch.float32)


def test_unknown_kv_cache_dtype(backend):
    """An unknown ``kv_cache_dtype`` name is a value out of range: ValueError naming it."""
    with raises(ValueError, "kv_cache_dtype"):
        pagedattn.Attention(backend, 2, 64, kv_cache_dtype="int4")


def test_plan_of_another_geometry(backend, gen):
    """A plan made by a layer of other heads, head size, attention type or window, or by
    another backend, is refused by ``run`` (ValueError naming the plan)."""
    s = Setup(backend, gen)
    b = s.batch
    other_heads = pagedattn.Attention(backend, 2, 64, num_kv_heads=2)
    plan = other_heads.plan(b.metadata, b.kv_cache)
    with raises(ValueError, "plan"):
        s.run(plan=plan)
    windowed = pagedattn.Attention(backend, 4, 64, num_kv_heads=2, sliding_window=3)
    with raises(ValueError, "plan"):
        s.run(plan=windowed.plan(b.metadata, b.kv_cache))
    other = get_backend("cpu" if backend.name == "reference" else "reference")
    if other.device == backend.device:
        foreign = pagedattn.Attention(other, 4, 64, num_kv_heads=2)
        fb = make_batch(other, [prompt(0, 5), prompt(3, 4), decode(9)], num_heads=4,
                        num_kv_heads=2, head_size=64, dtype=torch.float32, gen=gen)
        with raises(ValueError, "plan"):
            s.run(plan=foreign.plan(fb.metadata, fb.kv_cache))
    # A plan of the same geometry with another scale, ALiBi and soft cap is shared.
    same = pagedattn.Attention(backend, 4, 64, num_kv_heads=2, scale=0.3, logits_soft_cap=2.0,
                               alibi_slopes=[0.1, 0.2, 0.3, 0.4])
    out = same.run(s.plan, **s.args)
    assert bool(torch.isfinite(out).all())
    s.still_works()


def test_encoder_fields_for_a_decoder_layer(backend, gen):
    """Metadata with cross-attention fields planned for a decoder layer: ValueError naming
    metadata.encoder (the library refuses fields a layer would silently ignore)."""
    attn = pagedattn.Attention(backend, 2, 64)
    cache = torch.zeros(backend.kv_cache_shape(3, 8, 2, 64), device=backend.device)
    with raises(ValueError, "encoder"):
        plan_with(backend, attn, cache, seq_lens=[3], slot_mapping=[0, 1, 2],
                  block_tables=[[0]], block_size=8, encoder_seq_lens=[4],
                  cross_block_tables=[[1]])


def test_cache_and_plan_disagree(backend, gen):
    """A plan made with a cache, run without one (and the reverse): ValueError naming
    kv_cache; an encoder layer given a cache: ValueError."""
    s = Setup(backend, gen)
    with raises(ValueError, "kv_cache|cache"):
        s.run(kv_cache=None)
    enc = make_encoder_batch(backend, [3, 2], num_heads=4, num_kv_heads=2, head_size=64,
                             dtype=torch.float32, gen=gen)
    attn = pagedattn.Attention(backend, 4, 64, num_kv_heads=2, attn_type="encoder")
    with raises(ValueError, "kv_cache|cache"):
        attn.plan(enc.metadata, s.batch.kv_cache)
    plan = attn.plan(enc.metadata, None, dtype=torch.float32)
    with raises(ValueError, "key|value"):
        attn.run(plan, enc.query)
    with raises(ValueError, "kv_cache|cache"):
        attn.run(plan, enc.query, enc.key, enc.value, s.batch.kv_cache)
    out = attn.run(plan, enc.query, enc.key, enc.value)
    assert bool(torch.isfinite(out).all())


def test_host_backends_have_no_stream():
    for name in ("reference", "cpu"):
        assert pagedattn.Backend(name).stream is None
