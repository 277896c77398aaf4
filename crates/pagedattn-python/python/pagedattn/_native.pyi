"""Type stubs of pagedattn's native module (written in Rust with PyO3).

Tensors cross by DLPack, zero copy: torch tensors on the CPU or a CUDA GPU, numpy arrays on
the CPU. Every tensor a call reads or writes must be C-contiguous, on the backend's device
(``cpu`` for the ``reference`` and ``cpu`` backends, ``cuda:N`` for ``cuda``) and of the dtype
the call expects; anything else raises (``TypeError`` for a wrong dtype or device,
``ValueError`` for a wrong shape, a non-contiguous tensor or tensors that overlap), and nothing
is copied behind the caller's back.

On CUDA every call runs on the caller's stream: torch's current stream of the tensors' device,
or the ``stream`` given (a ``torch.cuda.Stream`` or a raw ``cudaStream_t`` as an int). It is
ordered after the work already queued there and before the work queued after it, with no
device-wide synchronization, and it can be captured in a ``torch.cuda.CUDAGraph``.

Index tensors (``seq_lens``, ``slot_mapping``, ``block_tables``, ``src_to_dst``, ...) may be
int32 or int64 tensors or arrays on any device (read once, when the call is made: a CUDA index
tensor costs a copy to the host that waits for the stream), or Python sequences of ints.
"""

from typing import Any, Optional, Sequence, Union

Tensor = Any  # torch.Tensor or numpy.ndarray (anything with __dlpack__)
Indices = Union[Tensor, Sequence[int]]
Stream = Union[int, Any, None]  # raw cudaStream_t, torch.cuda.Stream, or None (current)

__version__: str

def backends() -> list[str]:
    """The backend names this build knows: ``reference``, ``cpu`` and, built with CUDA, ``cuda``."""

class Backend:
    """A backend: ``reference`` (f64, the contract as plainly as possible), ``cpu`` (SIMD on
    every core), ``cuda`` (an NVIDIA GPU; kernels compiled at first use by NVRTC) or ``auto``
    (``cuda`` where a GPU is usable, else ``cpu``)."""

    def __init__(self, name: str = "auto", device: int = 0) -> None:
        """The backend ``name`` (on GPU ``device`` for ``cuda``). ``ValueError`` for an unknown
        name; ``RuntimeError`` if the GPU or NVRTC cannot be used."""
    @property
    def name(self) -> str:
        """``reference``, ``cpu`` or ``cuda``."""
    @property
    def device(self) -> str:
        """Where its tensors live, as torch writes it: ``cpu`` or ``cuda:N``."""
    @property
    def kv_cache_layout(self) -> str:
        """How a block's keys (and values) are ordered inside a cache: ``NHD`` (``[B, Hkv, D]``,
        token-major; ``reference``) or ``HND`` (``[Hkv, B, D]``, head-major; ``cpu``, ``cuda``)."""
    @property
    def stream(self) -> Optional[int]:
        """The backend's own CUDA stream (a ``cudaStream_t``; ``None`` off the GPU). Calls run
        on torch's current stream unless given ``stream=``; ``stream=backend.stream`` runs them
        on this one, which orders them with each other only (the caller orders its own work
        with it, e.g. through ``torch.cuda.ExternalStream(backend.stream)``)."""
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, int, int, int, int]:
        """The shape of one layer's cache in this backend's layout: ``(2, NB, B, Hkv, D)`` for
        ``NHD``, ``(2, NB, Hkv, B, D)`` for ``HND``; index 0 of the first axis holds keys, 1
        values. Allocate it with ``torch.zeros(shape, dtype=..., device=backend.device)``;
        any shape ``(2, NB, ...)`` with the same elements per block is accepted too (vLLM's
        ``(2, NB, B * Hkv * D)``, read in this layout)."""
    def details(self) -> list[tuple[str, str]]:
        """What the backend runs on (ISA, threads, GPU, NVRTC ...), as (key, value) pairs."""
    def synchronize(self) -> None:
        """Waits until the backend's queued work is done (nothing to wait for on the host)."""
    def swap_blocks(self, src: Tensor, dst: Tensor, src_to_dst: Indices) -> None:
        """Copies whole blocks ``src[:, s] -> dst[:, d]`` for each row ``(s, d)`` of
        ``src_to_dst`` (``[N, 2]``), keys and values, between two caches of one geometry: a
        GPU's cache and a CPU tensor (swap space; pinned memory is fastest) either way, or two
        caches on one device. ``ValueError`` for a block out of range."""
    def copy_blocks(self, kv_caches: Sequence[Tensor], src_to_dsts: Indices) -> None:
        """Copies block ``s`` to block ``d`` for each row ``(s, d)`` of ``src_to_dsts``
        (``[N, 2]``) in every layer's cache (copy-on-write of a forked sequence)."""

class Metadata:
    """One step's batch: S sequences, prefills first, then decodes (one query token each);
    the step's T query tokens in that order. Field names and meanings are vLLM's."""

    def __init__(
        self,
        *,
        seq_lens: Indices,
        slot_mapping: Indices,
        block_tables: Optional[Indices] = None,
        num_prefills: Optional[int] = None,
        context_lens: Optional[Indices] = None,
        query_start_loc: Optional[Indices] = None,
        block_size: Optional[int] = None,
        encoder_seq_lens: Optional[Indices] = None,
        cross_block_tables: Optional[Indices] = None,
        cross_slot_mapping: Optional[Indices] = None,
    ) -> None:
        """``seq_lens[S]``: keys of each sequence (cached + new). ``slot_mapping[T]``: the
        cache slot (``block * B + offset``) each new key/value token is written to, -1 = not
        written (still a key of its own call). ``block_tables[S, M]``: each sequence's physical blocks (padding after its
        last block is ignored). ``num_prefills``: how many of the sequences are prefills
        (default: all but the trailing ones whose query is 1 token; all of them without
        ``context_lens``/``query_start_loc``). Query lengths come from ``query_start_loc[S+1]``
        if given, else ``seq_lens - context_lens`` for prefills and 1 for decodes, else
        ``seq_lens`` for prefills. ``block_size`` is checked against the cache's at plan time.
        Cross-attention (encoder-decoder): ``encoder_seq_lens[S]``, ``cross_block_tables[S,
        M]``, and ``cross_slot_mapping`` (the encoder tokens' cross-cache slots when this step
        carries encoder keys/values, else empty or None). ``ValueError`` for inconsistent
        fields (naming the field)."""
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prefills(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_prefill_seq_len(self) -> int: ...
    @property
    def max_decode_seq_len(self) -> int: ...
    @property
    def query_start_loc(self) -> list[int]: ...
    @property
    def seq_lens(self) -> list[int]: ...
    @property
    def context_lens(self) -> list[int]: ...

class Plan:
    """A step's metadata validated and prepared on the backend's device by
    ``Attention.plan``; shared by every layer whose geometry matches (heads, head size,
    cache), whatever their scale, ALiBi slopes, soft cap or fp8 scales."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def workspace_bytes(self) -> int: ...

class Attention:
    """One layer's attention: its geometry and score modifiers."""

    def __init__(
        self,
        backend: Backend,
        num_heads: int,
        head_size: int,
        *,
        scale: Optional[float] = None,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[Sequence[float]] = None,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attn_type: str = "decoder",
    ) -> None:
        """``scale`` defaults to ``head_size ** -0.5``; ``num_kv_heads`` to ``num_heads``.
        ``alibi_slopes``: one per query head. ``sliding_window``: a query at position p sees
        keys at positions ``> p - sliding_window``. ``logits_soft_cap``: scores become
        ``cap * tanh(score / cap)`` (0 or None: no cap, as in vLLM). ``kv_cache_dtype``: ``auto`` (the cache holds the
        activations' dtype), ``fp8`` / ``fp8_e4m3`` or ``fp8_e5m2`` (the cache holds fp8 codes,
        stored ``x / k_scale`` and read ``code * k_scale``; a ``uint8``,
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` tensor). ``attn_type``: ``decoder``
        (causal, cached), ``encoder`` / ``encoder_only`` (bidirectional, no cache),
        ``encoder_decoder`` (cross-attention: decoder queries over the encoder's cached keys
        and values). ``ValueError`` for a value out of range; ``NotImplementedError`` if the
        backend lacks a feature (for a head size the ``cuda`` backend's attention lacks: at
        ``run``, since its cache write takes any head size)."""
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def scale(self) -> float: ...
    def plan(
        self, metadata: Metadata, kv_cache: Optional[Tensor] = None, *, dtype: Any = None
    ) -> Plan:
        """Validates ``metadata`` against the cache's geometry (its block count and the
        metadata's block size; ``kv_cache=None`` for calls without a cache) and prepares it.
        ``dtype``: the activations' dtype (``torch.float32`` / ``float16`` / ``bfloat16`` or
        the strings ``f32`` / ``f16`` / ``bf16``); default: the cache's dtype when it holds
        activations, else required. Uploads the plan on CUDA (on the current stream)."""
    def plan_for_graph(
        self,
        metadata: Metadata,
        kv_cache: Optional[Tensor],
        max_seq_len: int,
        *,
        dtype: Any = None,
    ) -> Plan:
        """A plan whose ``run`` calls can be captured in a ``torch.cuda.CUDAGraph`` and replayed
        for later steps of the same batch shape (sequences and query tokens per sequence)
        whose sequences have at most ``max_seq_len`` keys: ``replan`` refreshes it in place.
        Run each call once before capturing it (kernels are compiled at their first use), and
        make the plan before the capture: a plan made while the stream is being captured
        raises ``NotImplementedError`` (it would allocate memory the graph outlives)."""
    def replan(self, plan: Plan, metadata: Metadata, *, stream: Stream = None) -> None:
        """Refreshes ``plan`` for a new step: in place for a ``plan_for_graph`` plan (a graph
        captured on it then runs the new step; ``ValueError`` naming what no longer fits,
        leaving it unchanged), replaced by a new plan otherwise."""
    def run(
        self,
        plan: Plan,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        kv_cache: Optional[Tensor] = None,
        out: Optional[Tensor] = None,
        *,
        stream: Stream = None,
    ) -> Tensor:
        """Writes ``key``/``value`` (``[T, Hkv, D]`` or ``[T, Hkv * D]``; both or neither) into
        ``kv_cache`` through the plan's slot mapping (fp8 caches quantize them), then attends:
        ``out[T, H, D]`` for ``query[T, H, D]`` (or ``[T, H * D]``; ``out`` has the query's
        shape and dtype). Without a cache it attends over ``key``/``value`` themselves
        (encoder, encoder-only). ``out`` defaults to a new tensor like ``query``. Returns
        ``out``. The plan must come from this layer's geometry."""
    def write_kv(
        self,
        plan: Plan,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        *,
        stream: Stream = None,
    ) -> None:
        """Only the cache write of ``run``."""
