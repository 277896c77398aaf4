"""Hugging Face transformers causal LMs generating on pagedattn's paged KV cache.

    import pagedattn.hf
    gen = pagedattn.hf.PagedGenerator(model, backend="auto")
    new_tokens = gen.generate([ids_a, ids_b, ids_c], max_new_tokens=32)   # greedy

or in one call: ``pagedattn.hf.generate(model, input_ids_list, max_new_tokens, backend=...)``.

How it hooks in: importing this module registers an attention function named ``pagedattn``
in transformers' attention registry (``transformers.AttentionInterface.register``). While a
:class:`PagedGenerator` runs a step it sets the model's ``config._attn_implementation`` to
``pagedattn`` (and back afterwards, so the same model object still runs on ``sdpa`` or
``eager`` outside it), so every attention layer of the model calls
:func:`paged_attention_forward` with its query, key and value (RoPE already applied, layout
``[batch, heads, tokens, head_size]``) instead of SDPA. No attention mask is built for
``pagedattn`` (it has no mask function registered, which transformers reads as "the attention
masks itself"): pagedattn's causal mask comes from the step's metadata.

A step packs all of its sequences' new tokens into one row (batch 1, no padding): a prefill step
holds every prompt, a decode step one token per running sequence. The model runs with
``use_cache=False`` and ``position_ids`` per token (each token's position in its own sequence,
so RoPE matches an unpacked run); pagedattn owns the cache: one ``(2, NB, ...)`` tensor per
layer in the backend's layout, blocks handed out by a free-list allocator as sequences grow and
returned when they finish. The step's ``pagedattn.Metadata`` is planned once per step (per
distinct layer geometry) and every layer runs on that plan: ``Attention.run`` writes the step's
keys and values into the layer's cache and attends over everything cached.

Greedy decoding is done here (argmax of the last token's logits of each sequence), not by
``model.generate``. Works for decoder-only models whose attention modules call transformers'
attention interface (tested: Llama and SmolLM2, Mistral with a sliding window, Gemma2 with soft
cap and alternating sliding / full layers). Per layer: the ``scaling`` the module passes, its
head counts and head size from the tensors, and the ``sliding_window`` / ``softcap`` the model
passes to the attention function; attention sinks, dropout and ALiBi models are not handled.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections import deque
from typing import Iterable, Optional, Sequence, Union

import torch

try:  # the native names, re-exported by the package (or straight from the extension)
    from . import Attention, Backend, Metadata  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    from ._native import Attention, Backend, Metadata  # type: ignore[no-redef]

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockAllocator",
    "PagedKVCache",
    "PagedGenerator",
    "generate",
    "generate_reference",
    "paged_attention_forward",
    "register",
]

ATTN_IMPLEMENTATION = "pagedattn"

# The step being run; set by PagedGenerator around the model's forward call.
_CURRENT_STEP: contextvars.ContextVar[Optional["_Step"]] = contextvars.ContextVar(
    "pagedattn_hf_step", default=None
)
_REGISTERED = False


def register() -> None:
    """Registers :func:`paged_attention_forward` as ``attn_implementation="pagedattn"`` in
    transformers' attention registry (done on import; calling it again does nothing)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _REGISTERED = True


# --------------------------------------------------------------------------------------------
# The cache


class BlockAllocator:
    """A free list of the cache's block ids (``0 .. num_blocks - 1``)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"pagedattn.hf: out of KV-cache blocks: {n} needed, {len(self._free)} free "
                f"of {self.num_blocks} (give PagedGenerator a larger num_blocks)"
            )
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)


class PagedKVCache:
    """Every layer's paged cache: ``layers[i]`` is layer i's ``(2, NB, ...)`` tensor in the
    backend's layout (``Backend.kv_cache_shape``), on the backend's device; slot
    ``block * block_size + offset``."""

    def __init__(
        self,
        backend: Backend,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        shape = tuple(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=backend.device) for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(num_blocks)

    def fits(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> bool:
        return (len(self.layers), self.num_kv_heads, self.head_size, self.dtype) == (
            num_layers,
            num_kv_heads,
            head_size,
            dtype,
        )


class _Sequence:
    """One request: its tokens, how many of them the cache holds, its blocks."""

    def __init__(self, index: int, prompt: list[int]) -> None:
        self.index = index
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.num_cached = 0
        self.blocks: list[int] = []
        self.done = False

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class _Step:
    """What the attention function needs during one forward call."""

    def __init__(self, generator: "PagedGenerator", metadata: Metadata, num_tokens: int) -> None:
        self.generator = generator
        self.metadata = metadata
        self.num_tokens = num_tokens
        self.plans: dict = {}
        self.layers_run = 0


# --------------------------------------------------------------------------------------------
# The attention function transformers calls


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' attention-function signature (as ``sdpa_attention_forward``): query
    ``[1, H, T, D]``, key and value ``[1, Hkv, T, D]`` (the step's tokens packed in one row);
    returns ``(out [1, T, H, D], None)``. The mask is pagedattn's (from the step's metadata);
    ``attention_mask`` is ignored."""
    step = _CURRENT_STEP.get()
    if step is None:
        raise RuntimeError(
            "pagedattn.hf: attn_implementation='pagedattn' runs only inside a PagedGenerator "
            "step (pagedattn owns the KV cache and the step's metadata)"
        )
    if dropout and module.training:
        raise NotImplementedError("pagedattn.hf: attention dropout (training) is not supported")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("pagedattn.hf: attention sinks are not supported")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"pagedattn.hf: expected the step's tokens packed in one row, query [1, H, T, D]; "
            f"got {tuple(query.shape)}"
        )
    _, num_heads, num_tokens, head_size = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens != step.num_tokens:
        raise ValueError(
            f"pagedattn.hf: the attention got {num_tokens} tokens, the step has {step.num_tokens}"
        )
    gen = step.generator
    layer = _layer_index(gen, module)
    attn = gen._attention(
        layer,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=scaling if scaling is not None else getattr(module, "scaling", None),
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    cache = gen.cache.layers[layer]
    # [1, H, T, D] -> [T, H, D], contiguous (a copy: transformers hands a transposed view).
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous().to(cache.dtype)
    v = value[0].transpose(0, 1).contiguous().to(cache.dtype)
    geometry = (num_heads, num_kv_heads, head_size, gen._windows.get(layer), q.dtype)
    plan = step.plans.get(geometry)
    if plan is None:  # once per step (per distinct geometry), shared by the layers
        plan = attn.plan(step.metadata, cache, dtype=q.dtype)
        step.plans[geometry] = plan
    out = attn.run(plan, q, k, v, cache)
    step.layers_run += 1
    return out.unsqueeze(0), None


def _layer_index(gen: "PagedGenerator", module: torch.nn.Module) -> int:
    idx = getattr(module, "layer_idx", None)
    if idx is None:  # number the attention modules in their first step's call order
        idx = gen._module_index.setdefault(id(module), len(gen._module_index))
    return int(idx)


# --------------------------------------------------------------------------------------------
# The generator


@contextlib.contextmanager
def _attn_implementation(model: torch.nn.Module, name: str):
    """Sets ``config._attn_implementation`` of the model (and its text sub-config) for the
    duration, restoring the previous values."""
    configs = []
    for cfg in (model.config, _text_config(model.config)):
        if cfg not in configs:
            configs.append(cfg)
    for mod in model.modules():  # sub-modules may hold their own config object
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and cfg not in configs:
            configs.append(cfg)
    old = [cfg._attn_implementation for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = name
        yield
    finally:
        for cfg, o in zip(configs, old):
            cfg._attn_implementation = o


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _backend_for(model: torch.nn.Module, backend: Union[str, Backend]) -> Backend:
    if isinstance(backend, Backend):
        b = backend
    elif backend == "auto":  # follow the model: cuda where it is, else cpu
        dev = _model_device(model)
        b = Backend("cuda", dev.index or 0) if dev.type == "cuda" else Backend("cpu")
    elif backend == "cuda":
        dev = _normalize(_model_device(model))
        b = Backend("cuda", dev.index if dev.type == "cuda" else 0)
    else:
        b = Backend(backend)
    if torch.device(b.device) != _normalize(_model_device(model)):
        raise ValueError(
            f"pagedattn.hf: the model is on {_model_device(model)} but backend {b.name!r} runs "
            f"on {b.device}; move the model there (model.to({b.device!r})) or pick another backend"
        )
    return b


def _normalize(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


class PagedGenerator:
    """Greedy generation of a transformers causal LM with its attention on pagedattn.

    ``backend``: ``auto`` (``cuda`` if the model is on a GPU, else ``cpu``), ``cpu``,
    ``reference``, ``cuda`` or a ``pagedattn.Backend``; it must run where the model is.
    ``block_size``: tokens per cache block. ``num_blocks``: the cache's size in blocks, shared
    by all sequences of a ``generate`` call; ``None`` sizes it for each call (every prompt plus
    ``max_new_tokens``). The cache holds the model's dtype."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Union[str, Backend] = "auto",
        *,
        block_size: int = 16,
        num_blocks: Optional[int] = None,
    ) -> None:
        register()
        self.model = model
        self.backend = _backend_for(model, backend)
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = _text_config(model.config)
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_size = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.dtype = _model_dtype(model)
        self.device = _model_device(model)
        self.cache: Optional[PagedKVCache] = None
        self._attns: dict[int, Attention] = {}
        self._windows: dict[int, Optional[int]] = {}
        self._module_index: dict[int, int] = {}
        self.steps = 0
        if num_blocks is not None:
            self._ensure_cache(num_blocks)

    # -- pieces ------------------------------------------------------------------------------

    def _ensure_cache(self, num_blocks: int) -> PagedKVCache:
        c = self.cache
        if c is None or c.num_blocks < num_blocks or c.block_size != self.block_size:
            self.cache = PagedKVCache(
                self.backend,
                self.num_layers,
                self.num_kv_heads,
                self.head_size,
                num_blocks,
                self.block_size,
                self.dtype,
            )
        return self.cache

    def _attention(
        self,
        layer: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: Optional[float],
        sliding_window: Optional[int],
        softcap: Optional[float],
    ) -> Attention:
        """Layer ``layer``'s native Attention, made at its first call."""
        a = self._attns.get(layer)
        if a is None:
            if (num_kv_heads, head_size) != (self.num_kv_heads, self.head_size):
                raise ValueError(
                    f"pagedattn.hf: layer {layer} has {num_kv_heads} kv heads of size "
                    f"{head_size}, the cache was made for {self.num_kv_heads} of "
                    f"{self.head_size}"
                )
            window = int(sliding_window) if sliding_window else None
            a = Attention(
                self.backend,
                num_heads,
                head_size,
                scale=float(scale) if scale is not None else None,
                num_kv_heads=num_kv_heads,
                sliding_window=window,
                logits_soft_cap=float(softcap) if softcap else None,
            )
            self._attns[layer] = a
            self._windows[layer] = window
        return a

    def _metadata(self, seqs: list[_Sequence], num_new: list[int]):
        """Grows the sequences' block tables for their new tokens and describes the step:
        returns the metadata, each token's position and id, and ``query_start_loc``."""
        B = self.block_size
        alloc = self.cache.allocator
        seq_lens, context_lens, qsl, slots, positions, ids = [], [], [0], [], [], []
        num_prefills = 0
        for s, n in zip(seqs, num_new):
            total = s.num_cached + n
            need = -(-total // B) - len(s.blocks)
            if need > 0:
                s.blocks.extend(alloc.allocate(need))
            for p in range(s.num_cached, total):
                slots.append(s.blocks[p // B] * B + p % B)
                positions.append(p)
                ids.append(s.tokens[p])
            if s.num_cached == 0 or n > 1:
                num_prefills += 1
            seq_lens.append(total)
            context_lens.append(s.num_cached)
            qsl.append(qsl[-1] + n)
        # Prefills first, then decodes (the contract's order); callers keep it.
        width = max(len(s.blocks) for s in seqs)
        tables = torch.zeros((len(seqs), width), dtype=torch.int32)  # padding is ignored
        for i, s in enumerate(seqs):
            tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
        md = Metadata(
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            num_prefills=num_prefills,
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            block_size=B,
        )
        return md, positions, ids, qsl

    @torch.inference_mode()
    def step(self, seqs: list[_Sequence], num_new: list[int]) -> torch.Tensor:
        """Runs the model on each sequence's next ``num_new[i]`` uncached tokens (prefills
        first, then single-token decodes) and returns the logits of each sequence's last token,
        ``[S, vocab]``."""
        md, positions, ids, qsl = self._metadata(seqs, num_new)
        dev = self.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.tensor([positions], dtype=torch.long, device=dev)
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.long, device=dev)
        st = _Step(self, md, len(ids))
        token = _CURRENT_STEP.set(st)
        try:
            with _attn_implementation(self.model, ATTN_IMPLEMENTATION):
                logits = self._forward(input_ids, position_ids, last)
        finally:
            _CURRENT_STEP.reset(token)
        if st.layers_run != self.num_layers:
            raise RuntimeError(
                f"pagedattn.hf: {st.layers_run} attention calls in a step of a "
                f"{self.num_layers}-layer model: the model does not route its attention "
                f"through transformers' attention interface"
            )
        for s, n in zip(seqs, num_new):
            s.num_cached += n
        self.steps += 1
        return logits

    def _forward(self, input_ids, position_ids, last):
        kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        if getattr(self, "_logits_to_keep", True):
            try:  # only the rows we need through the LM head
                out = self.model(**kw, logits_to_keep=last)
                if out.logits.shape[1] == last.numel():
                    return out.logits[0]
            except TypeError:
                pass
            self._logits_to_keep = False
        return self.model(**kw).logits[0, last]

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        input_ids_list: Sequence[Union[Sequence[int], torch.Tensor]],
        max_new_tokens: int,
        *,
        eos_token_id: Union[None, int, Sequence[int]] = None,
    ) -> list[list[int]]:
        """Greedy continuations of every prompt (a list of token ids or a 1-D tensor each):
        one prefill step of all prompts, then decode steps of the unfinished sequences. A
        sequence stops after ``max_new_tokens`` new tokens or at one of ``eos_token_id``
        (included). Returns each prompt's new tokens."""
        prompts = [_as_ids(p) for p in input_ids_list]
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("pagedattn.hf: an empty prompt has nothing to continue")
        eos = set() if eos_token_id is None else (
            {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}
        )
        B = self.block_size
        need = sum(-(-(len(p) + max_new_tokens) // B) for p in prompts)
        self._ensure_cache(self.num_blocks or need)
        seqs = [_Sequence(i, p) for i, p in enumerate(prompts)]
        if max_new_tokens <= 0:
            return [[] for _ in seqs]
        try:
            running = seqs
            num_new = [len(s.tokens) for s in running]
            while running:
                logits = self.step(running, num_new)
                nxt = logits.argmax(dim=-1).tolist()
                for s, t in zip(running, nxt):
                    s.tokens.append(int(t))
                    if len(s.new_tokens) >= max_new_tokens or t in eos:
                        s.done = True
                        self.cache.allocator.free(s.blocks)
                        s.blocks = []
                running = [s for s in running if not s.done]
                num_new = [1] * len(running)
        finally:
            for s in seqs:
                if s.blocks:
                    self.cache.allocator.free(s.blocks)
                    s.blocks = []
        return [s.new_tokens for s in seqs]


def _as_ids(p) -> list[int]:
    if isinstance(p, torch.Tensor):
        if p.dim() == 2 and p.shape[0] == 1:
            p = p[0]
        return [int(x) for x in p.tolist()]
    return [int(x) for x in p]


def generate(
    model: torch.nn.Module,
    input_ids_list: Sequence[Union[Sequence[int], torch.Tensor]],
    max_new_tokens: int,
    *,
    backend: Union[str, Backend] = "auto",
    block_size: int = 16,
    num_blocks: Optional[int] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
) -> list[list[int]]:
    """Greedy continuations of a batch of prompts with the model's attention on pagedattn
    (:class:`PagedGenerator` for one call)."""
    gen = PagedGenerator(model, backend, block_size=block_size, num_blocks=num_blocks)
    return gen.generate(input_ids_list, max_new_tokens, eos_token_id=eos_token_id)


@torch.inference_mode()
def generate_reference(
    model: torch.nn.Module,
    input_ids_list: Sequence[Union[Sequence[int], torch.Tensor]],
    max_new_tokens: int,
    *,
    attn_implementation: str = "sdpa",
    eos_token_id: Union[None, int, Sequence[int]] = None,
) -> list[list[int]]:
    """The same greedy loop on transformers' own attention (``sdpa`` by default) and its own
    KV cache, one prompt at a time (no padding): what :func:`generate` must reproduce."""
    eos = set() if eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}
    )
    dev = _model_device(model)
    # transformers 5.x calls the cache argument `cache` (`past_key_values` before).
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    results = []
    with _attn_implementation(model, attn_implementation):
        for p in input_ids_list:
            ids = _as_ids(p)
            new: list[int] = []
            cur = torch.tensor([ids], dtype=torch.long, device=dev)
            past = None
            pos = 0
            while len(new) < max_new_tokens:
                n = cur.shape[1]
                out = model(
                    input_ids=cur,
                    position_ids=torch.arange(pos, pos + n, device=dev)[None],
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_arg: past},
                )
                past = getattr(out, cache_arg, None)
                if past is None:
                    past = out.past_key_values
                pos += n
                t = int(out.logits[0, -1].argmax())
                new.append(t)
                if t in eos:
                    break
                cur = torch.tensor([[t]], dtype=torch.long, device=dev)
            results.append(new)
    return results


try:  # register on import when transformers is there
    register()
except ImportError:  # pragma: no cover
    pass
