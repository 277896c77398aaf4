"""CUDA only: calls ordered on torch's current stream (a non-default one too), and decode
steps captured in a ``torch.cuda.CUDAGraph`` and replayed for later steps after ``replan``."""

import pytest
import torch

import pagedattn
from dense import dense_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, HKV, D, B = 8, 2, 64, 16
DEV = "cuda"


def decode_step(tables, lengths):
    """Metadata of one decode step: sequence s holds ``lengths[s]`` keys in its blocks
    ``tables[s]``; its new token goes to position ``lengths[s] - 1``."""
    slots = [t[(n - 1) // B] * B + (n - 1) % B for t, n in zip(tables, lengths)]
    return pagedattn.Metadata(
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        num_prefills=0,
    )


def dense_decode(q, keys, values, lengths):
    """The dense answer of a decode step: sequence s attends over its first ``lengths[s]``
    keys (``keys[s]``: ``[>= n, HKV, D]``)."""
    rows = [
        dense_attention(q[s : s + 1], keys[s][:n], values[s][:n], [n - 1], causal=True)
        for s, n in enumerate(lengths)
    ]
    return torch.cat(rows)


def test_graph_capture_then_replay_with_new_metadata():
    torch.manual_seed(0)
    backend = pagedattn.Backend("cuda")
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    num_blocks, seqs, max_len = 64, 3, 96
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, B, HKV, D), device=DEV,
                        dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[s * 6 : s * 6 + 6] for s in range(seqs)]  # 6 blocks = 96 tokens each
    # Every sequence's keys and values, written one decode step at a time below.
    keys = torch.randn(seqs, max_len, HKV, D, device=DEV).bfloat16()
    values = torch.randn(seqs, max_len, HKV, D, device=DEV).bfloat16()
    queries = torch.randn(max_len, seqs, H, D, device=DEV).bfloat16()

    # The static buffers the graph reads and writes.
    q = torch.empty(seqs, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.empty(seqs, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    out = torch.empty_like(q)

    def fill(step):
        q.copy_(queries[step])
        k.copy_(keys[:, step])
        v.copy_(values[:, step])

    lengths = [1, 1, 1]
    plan = attn.plan_for_graph(decode_step(tables, lengths), cache, max_len)
    # Steps 0..9 run eagerly (the first compiles the kernels), each checked.
    for step in range(10):
        lengths = [step + 1] * seqs
        attn.replan(plan, decode_step(tables, lengths))
        fill(step)
        attn.run(plan, q, k, v, cache, out)
        want = dense_decode(q, keys, values, lengths)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(plan, q, k, v, cache, out)
    # Later steps: new metadata and inputs, then a replay.
    for step in range(10, 40):
        lengths = [step + 1] * seqs
        attn.replan(plan, decode_step(tables, lengths))
        fill(step)
        out.fill_(float("nan"))
        graph.replay()
        want = dense_decode(q, keys, values, lengths)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
    # The cache holds every step's keys, written by the eager calls and the replays.
    layout = cache.view(2, num_blocks, HKV, B, D)
    for s in range(seqs):
        got = torch.stack([layout[0, tables[s][p // B], :, p % B] for p in range(40)])
        torch.testing.assert_close(got, keys[s, :40], rtol=0, atol=0)


def test_replan_refuses_a_step_that_does_not_fit_the_graph_plan():
    backend = pagedattn.Backend("cuda")
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    cache = torch.zeros(backend.kv_cache_shape(8, B, HKV, D), device=DEV)
    plan = attn.plan_for_graph(decode_step([[0], [1]], [3, 5]), cache, 16)
    with pytest.raises(ValueError, match="metadata"):
        attn.replan(plan, decode_step([[0, 2], [1, 3], [4, 5]], [3, 5, 7]))


def test_a_plan_made_during_a_capture_is_refused():
    """A plan allocates memory that a graph would outlive: refused during a capture, which
    stays valid (a plan made before it is captured as usual)."""
    backend = pagedattn.Backend("cuda")
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    cache = torch.zeros(backend.kv_cache_shape(8, B, HKV, D), device=DEV)
    md = decode_step([[0], [1]], [3, 5])
    plan = attn.plan_for_graph(md, cache, 16)
    q = torch.randn(2, H, D, device=DEV)
    k = torch.randn(2, HKV, D, device=DEV)
    v = torch.randn(2, HKV, D, device=DEV)
    out = torch.empty_like(q)
    attn.run(plan, q, k, v, cache, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with pytest.raises(NotImplementedError, match="captured into a graph"):
            attn.plan(md, cache)
        attn.run(plan, q, k, v, cache, out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def test_work_is_ordered_on_a_non_default_stream():
    """Producer, attention and consumer all on a side stream, with a long kernel first: the
    attention must wait for the producer and the consumer for the attention."""
    torch.manual_seed(1)
    backend = pagedattn.Backend("cuda")
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    cache = torch.zeros(backend.kv_cache_shape(8, B, HKV, D), device=DEV)
    md = decode_step([[3, 5]], [20])
    plan = attn.plan(md, cache)
    keys = torch.randn(20, HKV, D, device=DEV)
    values = torch.randn(20, HKV, D, device=DEV)
    # The cache holds the first 19 keys; the 20th comes with the call.
    layout = cache.view(2, 8, HKV, B, D)
    for p in range(19):
        layout[0, [3, 5][p // B], :, p % B] = keys[p]
        layout[1, [3, 5][p // B], :, p % B] = values[p]
    source = torch.randn(1, H, D, device=DEV)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = torch.zeros(1, H, D, device=DEV)
        torch.cuda._sleep(50_000_000)  # long enough that a missing wait reads zeros
        q.copy_(source)
        out = attn.run(plan, q, keys[19:], values[19:], cache)
        result = out * 1.0  # consumed on the same stream, before any host wait
    side.synchronize()
    want = dense_attention(source, keys, values, [19], causal=True)
    torch.testing.assert_close(result.double().cpu(), want, rtol=1e-4, atol=1e-4)


def test_plans_made_and_dropped_between_calls_on_a_busy_stream():
    """Steps on a side stream kept far behind the host: each step's plan is made, run and
    dropped at once, and the next step's plan allocated and uploaded, while the earlier
    steps' kernels have yet to run. A plan freed or overwritten before the side stream is
    done with it would give a wrong answer."""
    torch.manual_seed(3)
    backend = pagedattn.Backend("cuda")
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    num_blocks = 16
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, B, HKV, D), device=DEV)
    keys = torch.randn(60, HKV, D, device=DEV)
    values = torch.randn(60, HKV, D, device=DEV)
    queries = torch.randn(60, 1, H, D, device=DEV)
    tables = [[7, 2, 11, 4]]
    outs = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for n in range(1, 61):
            torch.cuda._sleep(200_000)
            plan = attn.plan(decode_step(tables, [n]), cache)
            outs.append(attn.run(plan, queries[n - 1], keys[n - 1 : n], values[n - 1 : n], cache))
            del plan
    side.synchronize()
    for n, out in enumerate(outs, start=1):
        want = dense_attention(queries[n - 1], keys[:n], values[:n], [n - 1], causal=True)
        torch.testing.assert_close(out.double().cpu(), want, rtol=1e-4, atol=1e-4)


def test_calls_on_the_backends_own_stream():
    """``stream=backend.stream`` runs the call there; the caller orders its work with it."""
    torch.manual_seed(4)
    backend = pagedattn.Backend("cuda")
    assert isinstance(backend.stream, int)
    attn = pagedattn.Attention(backend, H, D, num_kv_heads=HKV)
    cache = torch.zeros(backend.kv_cache_shape(4, B, HKV, D), device=DEV)
    q = torch.randn(1, H, D, device=DEV)
    k = torch.randn(1, HKV, D, device=DEV)
    v = torch.randn(1, HKV, D, device=DEV)
    plan = attn.plan(decode_step([[2]], [1]), cache, stream=backend.stream)
    torch.cuda.synchronize()
    out = attn.run(plan, q, k, v, cache, stream=backend.stream)
    backend.synchronize()
    want = dense_attention(q, k, v, [0], causal=True)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-4, atol=1e-4)


def test_swap_to_host_and_back():
    torch.manual_seed(2)
    backend = pagedattn.Backend("cuda")
    shape = backend.kv_cache_shape(6, B, HKV, D)
    cache = torch.randn(shape, device=DEV, dtype=torch.float16)
    before = cache.clone()
    host = torch.zeros(backend.kv_cache_shape(4, B, HKV, D), dtype=torch.float16).pin_memory()
    backend.swap_blocks(cache, host, torch.tensor([[5, 0], [2, 3]]))
    torch.cuda.synchronize()
    assert torch.equal(host[:, 0], before[:, 5].cpu()) and torch.equal(host[:, 3], before[:, 2].cpu())
    cache.zero_()
    backend.swap_blocks(host, cache, [[0, 1], [3, 4]])
    torch.cuda.synchronize()
    assert torch.equal(cache[:, 1], before[:, 5]) and torch.equal(cache[:, 4], before[:, 2])
    assert not cache[:, [0, 2, 3, 5]].any()
