"""pagedattn: attention over a paged KV cache, for torch tensors on the CPU and CUDA GPUs.

Plan once per step, run every layer::

    import torch, pagedattn

    backend = pagedattn.Backend("auto")               # cuda where a GPU is usable, else cpu
    attn = pagedattn.Attention(backend, num_heads=8, head_size=64, num_kv_heads=2)
    cache = torch.zeros(backend.kv_cache_shape(16, 16, 2, 64), device=backend.device)
    md = pagedattn.Metadata(seq_lens=[5], slot_mapping=range(5), block_tables=[[3]])
    plan = attn.plan(md, cache)
    q = torch.randn(5, 8, 64, device=backend.device)
    k, v = torch.randn(2, 5, 2, 64, device=backend.device)
    out = attn.run(plan, q, k, v, cache)              # [5, 8, 64]

``pagedattn.vllm`` has classes shaped like vLLM's attention backends; ``pagedattn.hf`` runs a
Hugging Face transformers model's attention on pagedattn. The native API is described in
``_native.pyi``.
"""

from ._native import Attention, Backend, Metadata, Plan, __version__, backends

__all__ = ["Attention", "Backend", "Metadata", "Plan", "__version__", "backends"]
