"""A vLLM-shaped attention backend over pagedattn's native module.

The classes here have the shape of vLLM's v0 attention backends (``TorchSDPA``, ``XFormers``,
``IPEX``; ``vllm/attention/backends/abstract.py``), so that a vLLM-style model runner can use
pagedattn where it uses those today:

* :class:`AttentionType`: the attention types, as vLLM spells them.
* :class:`PagedAttnBackend`: the static side (names, classes, the cache shape, block swaps and
  copies).
* :class:`PagedAttnMetadata`: one step's batch, with vLLM's field names.
* :class:`PagedAttnImpl`: one layer's attention; ``forward`` writes the new keys and values into
  the layer's cache and attends.

What is computed is pagedattn's contract (``docs/semantics.md``), not any one vLLM backend's
quirks: causal masks aligned to the end of each sequence, every key read from the cache, the
soft cap and fp8 caches honoured on every device.

The native backend is chosen by the tensors' device (a CUDA tensor: ``cuda`` on its GPU; a CPU
tensor: ``cpu``), unless :func:`set_backend` or the environment variable ``PAGEDATTN_BACKEND``
names one (``reference``, ``cpu``, ``cuda`` or ``auto``). Native :class:`~pagedattn.Backend`
objects are created once per (name, device) and reused.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from .. import _native

__all__ = [
    "AttentionType",
    "PagedAttnBackend",
    "PagedAttnMetadata",
    "PagedAttnMetadataBuilder",
    "PagedAttnImpl",
    "BlocksparseNotSupported",
    "set_backend",
    "get_backend",
    "backend_for",
]

#: Environment variable that overrides the native backend's name (see :func:`set_backend`).
BACKEND_ENV = "PAGEDATTN_BACKEND"

_KNOWN_BACKENDS = ("auto", "reference", "cpu", "cuda")

#: vLLM's slot of a token not to be written (``PAD_SLOT_ID``).
PAD_SLOT_ID = -1

#: The head sizes every native backend serves (the ``cuda`` attention's list, vLLM's; ``cpu``
#: and ``reference`` serve any).
SUPPORTED_HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]


class AttentionType:
    """Attention types, the string constants of vLLM's ``AttentionType``."""

    #: Decoder self-attention: causal, over the paged KV cache.
    DECODER = "decoder"
    #: The encoder of an encoder-decoder model: bidirectional, never touches a cache.
    ENCODER = "encoder"
    #: Encoder-only models (BERT-like): bidirectional, no cache.
    ENCODER_ONLY = "encoder_only"
    #: Cross-attention: decoder queries over the encoder's keys and values (the cross cache).
    ENCODER_DECODER = "encoder_decoder"


_ATTN_TYPES = (
    AttentionType.DECODER,
    AttentionType.ENCODER,
    AttentionType.ENCODER_ONLY,
    AttentionType.ENCODER_DECODER,
)


def _attn_type_name(attn_type: Any, where: str) -> str:
    """``attn_type`` as one of the strings of :class:`AttentionType`: vLLM 0.6.6 on passes
    those strings; 0.6.3's ``AttentionType`` is an ``Enum`` (``AttentionType.DECODER``), read by
    its member's name. ``ValueError`` for anything else."""
    name = getattr(attn_type, "name", attn_type)
    name = name.lower() if isinstance(name, str) else name
    if name not in _ATTN_TYPES:
        raise ValueError(f"{where}: {attn_type!r}; expected one of {', '.join(_ATTN_TYPES)}")
    return name


class BlocksparseNotSupported(NotImplementedError, ValueError):
    """Raised for ``blocksparse_params``: pagedattn has no block-sparse attention. It is a
    ``NotImplementedError`` and, as vLLM's own backends raise ``ValueError`` for it, a
    ``ValueError`` too."""


# --------------------------------------------------------------------------------------------
# Native backend selection
# --------------------------------------------------------------------------------------------

_backend_override: Optional[str] = None
_backends: Dict[Tuple[str, int], Any] = {}
_backends_lock = threading.Lock()


def set_backend(name: Optional[str]) -> None:
    """Forces the native backend used for every later call: ``reference``, ``cpu``, ``cuda``
    or ``auto``; ``None`` goes back to the default (the ``PAGEDATTN_BACKEND`` environment
    variable if set, else the tensors' device: ``cuda`` on a CUDA tensor's GPU, ``cpu`` for a
    CPU tensor). ``ValueError`` for another name. A backend must match the tensors' device
    (``reference`` and ``cpu`` run on CPU tensors, ``cuda`` on CUDA tensors); the native module
    raises ``TypeError`` otherwise."""
    global _backend_override
    if name is not None:
        _check_backend_name(name, "set_backend")
    _backend_override = name


def _check_backend_name(name: str, where: str) -> None:
    if name not in _KNOWN_BACKENDS:
        raise ValueError(
            f"{where}: unknown pagedattn backend {name!r}; expected one of {', '.join(_KNOWN_BACKENDS)}"
        )


def _device_of(tensor: Any) -> Tuple[str, int]:
    """``("cuda", ordinal)`` or ``("cpu", 0)`` for a torch tensor (or anything else: cpu)."""
    dev = getattr(tensor, "device", None)
    dev_type = getattr(dev, "type", None)
    if dev_type == "cuda":
        index = dev.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return "cuda", int(index)
    return "cpu", 0


def get_backend(name: str = "auto", device: int = 0) -> Any:
    """The native ``Backend(name, device)``, created at the first request and cached (``device``
    only matters for ``cuda``)."""
    _check_backend_name(name, "get_backend")
    key = (name, device if name in ("cuda", "auto") else 0)
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            backend = _native.Backend(name, key[1])
            _backends[key] = backend
        return backend


def backend_for(tensor: Any) -> Any:
    """The native backend for tensors on ``tensor``'s device: the one :func:`set_backend` or
    ``PAGEDATTN_BACKEND`` names, else ``cuda`` on a CUDA tensor's GPU and ``cpu`` for a CPU
    tensor. ``auto`` (forced) means the device's default too. Cached."""
    kind, ordinal = _device_of(tensor)
    name = _backend_override
    if name is None:
        env = os.environ.get(BACKEND_ENV, "").strip()
        if env:
            _check_backend_name(env, BACKEND_ENV)
            name = env
    if name is None or name == "auto":
        name = kind
    return get_backend(name, ordinal)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _cumulative(lens: Sequence[int]) -> List[int]:
    """``[0, l0, l0 + l1, ...]``: vLLM's ``*_start_loc`` form of lengths."""
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


def _to_list(x: Any) -> Optional[list]:
    """A tensor, array or sequence as a (nested) Python list; None stays None."""
    if x is None:
        return None
    if hasattr(x, "tolist"):
        return x.tolist()
    return [(_to_list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else v) for v in x]


def _numel(x: Any) -> int:
    if x is None:
        return 0
    if hasattr(x, "numel"):
        n = x.numel
        return int(n() if callable(n) else n)
    if hasattr(x, "size") and not callable(x.size):
        return int(x.size)  # numpy
    return len(x)


def _len(x: Any) -> Optional[int]:
    """Length of the first axis, None for None."""
    if x is None:
        return None
    shape = getattr(x, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) > 0 else 0
    return len(x)


def _blocks_of_slots(slots: List[int], block_size: int) -> Optional[List[int]]:
    """The block-table row of a fresh prompt whose token ``p`` has slot ``slots[p]``: each
    block the one its tokens' slots name, 0 for a block whose tokens all have slot -1 (never
    read: such tokens are keys from the call's inputs). ``None`` where the slots name no
    consistent table (an offset other than the position's, two blocks for one)."""
    row = []
    for first in range(0, len(slots), block_size):
        blocks = set()
        for p in range(first, min(first + block_size, len(slots))):
            v = slots[p]
            if v < 0:
                continue
            if v % block_size != p % block_size:
                return None
            blocks.add(v // block_size)
        if len(blocks) > 1:
            return None
        row.append(blocks.pop() if blocks else 0)
    return row


def _block_pairs(pairs: Any) -> Any:
    """Block pairs as the native module takes them: a ``[N, 2]`` tensor or array as it is; a
    dict (vLLM before 0.5: ``{src: dst}`` to swap, ``{src: [dst, ...]}`` to copy) as an
    int64 ``[N, 2]`` tensor, its pairs in the dict's order."""
    if not isinstance(pairs, dict):
        return pairs
    import torch

    rows = [
        (int(src), int(dst))
        for src, dsts in pairs.items()
        for dst in (dsts if isinstance(dsts, (list, tuple)) else [dsts])
    ]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2)


def _index_table(x: Any) -> Any:
    """A 2-D index table for the native module: tensors and arrays as they are, nested Python
    lists as an int32 tensor (``[S, M]``, rows padded with 0)."""
    if x is None or hasattr(x, "__dlpack__"):
        return x
    import torch

    rows = [list(map(int, r)) for r in x]
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(
        len(rows), width
    )


def _scale_value(x: Any) -> float:
    """A k/v scale as a float (vLLM passes floats, later versions 0-d tensors)."""
    return float(x.item()) if hasattr(x, "item") else float(x)


def _block_size_of(kv_cache: Any, num_kv_heads: int, head_size: int) -> int:
    """Block size of a cache of shape ``(2, NB, ...)`` holding ``B * Hkv * D`` elements per
    block (vLLM's flat shape or the native 5-D one)."""
    per_block = 1
    for n in kv_cache.shape[2:]:
        per_block *= int(n)
    row = num_kv_heads * head_size
    if len(kv_cache.shape) < 3 or per_block % row != 0:
        raise ValueError(
            f"kv_cache.shape: {tuple(kv_cache.shape)} is not (2, num_blocks, block_size * "
            f"{num_kv_heads} * {head_size}) for {num_kv_heads} kv heads of size {head_size}"
        )
    return per_block // row


# --------------------------------------------------------------------------------------------
# Backend (static side)
# --------------------------------------------------------------------------------------------


class PagedAttnBackend:
    """vLLM's ``AttentionBackend`` for pagedattn: static and class methods only, never
    instantiated."""

    @staticmethod
    def get_name() -> str:
        """``"PAGEDATTN"``."""
        return "PAGEDATTN"

    @staticmethod
    def get_impl_cls() -> Type["PagedAttnImpl"]:
        """:class:`PagedAttnImpl`."""
        return PagedAttnImpl

    @staticmethod
    def get_metadata_cls() -> Type["PagedAttnMetadata"]:
        """:class:`PagedAttnMetadata`."""
        return PagedAttnMetadata

    @classmethod
    def make_metadata(cls, *args: Any, **kwargs: Any) -> "PagedAttnMetadata":
        """``get_metadata_cls()(*args, **kwargs)``."""
        return cls.get_metadata_cls()(*args, **kwargs)

    @staticmethod
    def get_builder_cls() -> Type["PagedAttnMetadataBuilder"]:
        """:class:`PagedAttnMetadataBuilder` (vLLM 0.6's model runners build each step's
        metadata with it)."""
        return PagedAttnMetadataBuilder

    @classmethod
    def make_metadata_builder(cls, *args: Any, **kwargs: Any) -> "PagedAttnMetadataBuilder":
        """``get_builder_cls()(*args, **kwargs)``."""
        return cls.get_builder_cls()(*args, **kwargs)

    @staticmethod
    def get_state_cls() -> Type["PagedAttnState"]:
        """:class:`PagedAttnState` (every vLLM 0.6 model runner makes one, ``(runner)``)."""
        return PagedAttnState

    @staticmethod
    def get_supported_head_sizes() -> List[int]:
        """The head sizes every native backend serves (:data:`SUPPORTED_HEAD_SIZES`)."""
        return list(SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> Tuple[int, ...]:
        """One layer's cache shape, exactly vLLM's: ``(2, num_blocks, block_size * num_kv_heads
        * head_size)``; index 0 of the first axis holds keys, 1 values. Allocate it on the
        device the layer runs on, of the activations' dtype (``kv_cache_dtype="auto"``) or
        ``torch.uint8`` for an fp8 cache. Each block's ``B * Hkv * D`` elements are read in the
        native backend's layout, ``Backend.kv_cache_layout``: ``HND`` (``[Hkv, B, D]``,
        head-major) for ``cpu`` and ``cuda``, ``NHD`` (``[B, Hkv, D]``) for ``reference`` — not
        vLLM's x-split key layout."""
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @staticmethod
    def swap_blocks(src_kv_cache: Any, dst_kv_cache: Any, src_to_dst: Any) -> None:
        """Copies whole blocks ``src_kv_cache[:, s] -> dst_kv_cache[:, d]`` (keys and values)
        for each row ``(s, d)`` of ``src_to_dst`` (``[N, 2]``, int32/int64, any device; or a
        dict ``{s: d}``, as vLLM before 0.5 passed it): a GPU cache and a CPU tensor either way,
        or two caches on one device. Runs on the backend of the GPU involved (the cpu backend
        for two CPU tensors), on its current stream."""
        involved = dst_kv_cache if _device_of(dst_kv_cache)[0] == "cuda" else src_kv_cache
        backend_for(involved).swap_blocks(src_kv_cache, dst_kv_cache, _block_pairs(src_to_dst))

    @staticmethod
    def copy_blocks(kv_caches: Sequence[Any], src_to_dists: Any) -> None:
        """Copies block ``s`` to block ``d`` for each row ``(s, d)`` of ``src_to_dists``
        (``[N, 2]``; or a dict ``{s: [d, ...]}``, as vLLM before 0.5 passed it) in every layer's
        cache of ``kv_caches`` (copy-on-write of a forked sequence). Nothing to do for no
        layer."""
        kv_caches = list(kv_caches)
        if not kv_caches:
            return
        backend_for(kv_caches[0]).copy_blocks(kv_caches, _block_pairs(src_to_dists))


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class PagedAttnMetadata:
    """One step's batch, with vLLM's field names (``XFormersMetadata`` / ``TorchSDPAMetadata``).

    Sequences are ordered prefills first, then decodes (one query token each); the step's query
    tokens in that order. Tensors may live on any device; they are read once per step, when the
    first layer runs, and converted to a native :class:`pagedattn.Metadata` that is cached on
    this object together with the plans every layer shares.

    Accepted conventions (vLLM's backends differ here):

    * ``seq_lens`` holds every sequence's length (XFormers), or only the prefills' with the
      decodes' in ``seq_lens_tensor`` (TorchSDPA); without ``seq_lens``, ``seq_lens_tensor``
      holds every sequence's.
    * Query lengths come from ``query_start_loc`` (``[S+1]``, or ``[num_prefills+1]`` for the
      prefills only), else from ``context_lens_tensor`` (``seq_len - context_len`` for
      prefills), else a prefill's query is its whole sequence; decodes have 1 token.
    * ``block_tables`` has one row per sequence, or one per decode (TorchSDPA; the prefills'
      rows then come from ``prefill_block_tables`` when set). A prefill without cached context
      reads its keys from the blocks its ``slot_mapping`` names (vLLM gives such prefills an
      empty, zero-padded table row); its tokens with slot -1 (``PAD_SLOT_ID``: a
      sliding-window prompt's tokens older than the window) are keys from the call's inputs.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: Any
    seq_lens: Optional[List[int]] = None
    seq_lens_tensor: Any = None
    max_prefill_seq_len: int = 0
    max_decode_seq_len: int = 0
    context_lens_tensor: Any = None
    block_tables: Any = None
    query_start_loc: Any = None
    max_query_len: Optional[int] = None
    # Encoder and cross-attention fields (encoder-decoder models).
    encoder_seq_lens: Optional[List[int]] = None
    encoder_seq_lens_tensor: Any = None
    max_encoder_seq_len: Optional[int] = None
    num_encoder_tokens: Optional[int] = None
    cross_slot_mapping: Any = None
    cross_block_tables: Any = None
    # vLLM's too, by its builders and runners (docs/design/vllm-interface.md): accepted; where
    # a field repeats what others say, the two must agree (checked at the first forward).
    use_cuda_graph: bool = False
    prefill_block_tables: Any = None
    multi_modal_placeholder_index_maps: Any = None
    #: ``[S+1]`` cumulative sequence lengths (CommonMetadataBuilder): must match ``seq_lens``.
    seq_start_loc: Any = None
    #: The decodes' longest query (CUDA-graph capture): at least the decodes' (1).
    max_decode_query_len: Optional[int] = None
    #: Whether the batch is prompts only (TorchSDPA and IPEX in 0.6.3): must match
    #: ``num_decode_tokens == 0``.
    is_prompt: Optional[bool] = None
    #: IPEX's cumulative prefill query lengths (``[num_prefills+1]``): must match the queries.
    seqlen_q: Any = None
    #: IPEX's longest prefill query: at least the prefills'.
    max_seqlen: Optional[int] = None
    #: TorchSDPA's (0.6.6) switch for chunked prefill: accepted.
    chunked_prefill: Optional[bool] = None
    #: TorchSDPA's (0.6.6) longest prefill sequence: at least the prefills'.
    max_kv_len: Optional[int] = None
    #: TorchSDPA's (0.6.6) cumulative prefill sequence lengths: must match them.
    kv_start_loc: Any = None
    #: The prefills' ``query_start_loc`` (0.11's TorchSDPA): must match the queries.
    prefill_query_start_loc: Any = None
    #: ``[S+1]`` cumulative encoder lengths (0.6.6): must match ``encoder_seq_lens``.
    encoder_seq_start_loc: Any = None
    #: vLLM's fp8 scale calculation switch: accepted (pagedattn's scales are the layer's).
    enable_kv_scales_calculation: bool = False
    #: The block size the slots and tables were computed for; checked against the cache's.
    block_size: Optional[int] = None

    def __post_init__(self) -> None:
        self._native_cache: Dict[Any, Any] = {}
        self._plans: Dict[Any, Any] = {}
        self._cached_prefill_metadata: Optional["PagedAttnMetadata"] = None
        self._cached_decode_metadata: Optional["PagedAttnMetadata"] = None

    # ---- vLLM's views ------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        """Number of sequences: prefills plus decodes."""
        return self.num_prefills + self.num_decode_tokens

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        """Whether the encoder fields are all set (as vLLM's property)."""
        return (
            self.encoder_seq_lens is not None
            and self.encoder_seq_lens_tensor is not None
            and self.max_encoder_seq_len is not None
        )

    @property
    def is_all_cross_attn_metadata_set(self) -> bool:
        """Whether the encoder and cross-attention fields are all set (as vLLM's property)."""
        return (
            self.is_all_encoder_attn_metadata_set
            and self.cross_slot_mapping is not None
            and self.cross_block_tables is not None
        )

    def _encoder_fields(self) -> Dict[str, Any]:
        return dict(
            encoder_seq_lens=self.encoder_seq_lens,
            encoder_seq_lens_tensor=self.encoder_seq_lens_tensor,
            max_encoder_seq_len=self.max_encoder_seq_len,
            cross_slot_mapping=self.cross_slot_mapping,
            cross_block_tables=self.cross_block_tables,
            block_size=self.block_size,
        )

    @property
    def prefill_metadata(self) -> Optional["PagedAttnMetadata"]:
        """The prefills alone (as XFormers' property): None without prefills, else a new
        metadata (cached) with the first ``num_prefills`` sequences and their tokens."""
        if self.num_prefills == 0:
            return None
        if self._cached_prefill_metadata is not None:
            return self._cached_prefill_metadata
        np_, npt = self.num_prefills, self.num_prefill_tokens
        sl = self.seq_lens
        sel = lambda x: None if x is None or _len(x) is None else x[:np_]
        qsl = self.query_start_loc
        if qsl is not None:
            qsl = qsl[: np_ + 1]
        block_tables = self.block_tables
        if block_tables is not None and _len(block_tables) == self.num_seqs:
            block_tables = block_tables[:np_]
        elif self.prefill_block_tables is not None:
            block_tables = self.prefill_block_tables
        seq_lens_tensor = self.seq_lens_tensor
        if seq_lens_tensor is not None and _len(seq_lens_tensor) == self.num_seqs:
            seq_lens_tensor = seq_lens_tensor[:np_]
        self._cached_prefill_metadata = PagedAttnMetadata(
            num_prefills=np_,
            num_prefill_tokens=npt,
            num_decode_tokens=0,
            slot_mapping=self.slot_mapping[:npt],
            seq_lens=None if sl is None else list(sl[:np_]),
            seq_lens_tensor=seq_lens_tensor,
            max_prefill_seq_len=self.max_prefill_seq_len,
            max_decode_seq_len=0,
            context_lens_tensor=sel(self.context_lens_tensor),
            block_tables=block_tables,
            query_start_loc=qsl,
            max_query_len=self.max_query_len,
            use_cuda_graph=False,
            **self._encoder_fields(),
        )
        return self._cached_prefill_metadata

    @property
    def decode_metadata(self) -> Optional["PagedAttnMetadata"]:
        """The decodes alone (as XFormers' property): None without decode tokens, else a new
        metadata (cached) with the last ``num_decode_tokens`` sequences and their tokens."""
        if self.num_decode_tokens == 0:
            return None
        if self._cached_decode_metadata is not None:
            return self._cached_decode_metadata
        np_, npt, nd = self.num_prefills, self.num_prefill_tokens, self.num_decode_tokens
        s = self.num_seqs
        tail = lambda x: None if x is None else (x[np_:] if _len(x) == s else x)
        sl = self.seq_lens
        if sl is not None:
            sl = list(sl[np_:]) if len(sl) == s else None
        seq_lens_tensor = tail(self.seq_lens_tensor)
        if sl is None and seq_lens_tensor is not None:
            sl = [int(v) for v in _to_list(seq_lens_tensor)]
        qsl = None
        if self.query_start_loc is not None and _len(self.query_start_loc) == s + 1:
            q = self.query_start_loc[np_:]
            qsl = [v - q[0] for v in q] if isinstance(q, (list, tuple)) else q - q[0]
        self._cached_decode_metadata = PagedAttnMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=nd,
            slot_mapping=self.slot_mapping[npt:],
            seq_lens=sl,
            seq_lens_tensor=seq_lens_tensor,
            max_prefill_seq_len=0,
            max_decode_seq_len=self.max_decode_seq_len,
            context_lens_tensor=tail(self.context_lens_tensor),
            block_tables=tail(self.block_tables),
            query_start_loc=qsl,
            max_query_len=1,
            use_cuda_graph=self.use_cuda_graph,
            **self._encoder_fields(),
        )
        return self._cached_decode_metadata

    def asdict_zerocopy(self, skip_fields: Optional[set] = None) -> Dict[str, Any]:
        """The dataclass fields as a dict, without copying tensors (vLLM's method)."""
        skip = skip_fields or set()
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }

    # ---- native conversion -------------------------------------------------------------------

    def _decoder_lengths(self) -> Tuple[List[int], Optional[list], Optional[list], List[int]]:
        """``(seq_lens, query_start_loc, context_lens, query_lens)`` of every sequence, on the
        host, from whichever of vLLM's conventions this object follows."""
        np_, s = self.num_prefills, self.num_seqs
        nd = s - np_
        sl = None if self.seq_lens is None else [int(v) for v in self.seq_lens]
        slt = None if self.seq_lens_tensor is None else [int(v) for v in _to_list(self.seq_lens_tensor)]
        if sl is not None and len(sl) == s:
            seq_lens = sl
        elif sl is not None and len(sl) == np_ and slt is not None and len(slt) in (nd, s):
            seq_lens = sl + slt[len(slt) - nd :]
        elif slt is not None and len(slt) == s:
            seq_lens = slt
        else:
            raise ValueError(
                f"metadata.seq_lens: {sl!r} (seq_lens_tensor {slt!r}) gives no length for each of "
                f"the {s} sequences ({np_} prefills + {nd} decodes)"
            )
        qsl = None if self.query_start_loc is None else [int(v) for v in _to_list(self.query_start_loc)]
        if qsl is not None:
            if len(qsl) == np_ + 1 and nd > 0:
                qsl = qsl + [qsl[-1] + i for i in range(1, nd + 1)]
            elif len(qsl) != s + 1:
                raise ValueError(
                    f"metadata.query_start_loc: {len(qsl)} entries; expected {s + 1} (S + 1) or "
                    f"{np_ + 1} (num_prefills + 1)"
                )
        ctx = None
        if self.context_lens_tensor is not None and _numel(self.context_lens_tensor) > 0:
            ctx = [int(v) for v in _to_list(self.context_lens_tensor)]
            if len(ctx) != s:
                raise ValueError(
                    f"metadata.context_lens_tensor: {len(ctx)} entries; expected {s}, one per sequence"
                )
        if qsl is not None:
            query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        elif ctx is not None:
            query_lens = [seq_lens[i] - ctx[i] for i in range(np_)] + [1] * nd
        else:
            query_lens = seq_lens[:np_] + [1] * nd
        self._check_agreement(seq_lens, qsl, ctx, query_lens)
        return seq_lens, qsl, ctx, query_lens

    def _check_agreement(self, seq_lens: List[int], qsl: Optional[list], ctx: Optional[list],
                         query_lens: List[int]) -> None:
        """``ValueError`` naming both fields where two fields say the same thing differently
        (one must not silently win)."""
        np_, s = self.num_prefills, self.num_seqs
        prefill_seq_lens, prefill_queries = seq_lens[:np_], query_lens[:np_]

        def disagree(a: str, b: str, detail: str) -> ValueError:
            return ValueError(f"metadata.{a} and metadata.{b} disagree: {detail}")

        if qsl is not None and ctx is not None:
            for i in range(s):
                if seq_lens[i] - ctx[i] != query_lens[i]:
                    raise disagree(
                        "query_start_loc", "context_lens_tensor",
                        f"sequence {i} has {query_lens[i]} query tokens by query_start_loc, but "
                        f"seq_len {seq_lens[i]} - context {ctx[i]} = {seq_lens[i] - ctx[i]}",
                    )
        if sum(query_lens) != _numel(self.slot_mapping):
            raise disagree(
                "slot_mapping", "query_start_loc" if qsl is not None else "seq_lens",
                f"{_numel(self.slot_mapping)} slots for {sum(query_lens)} query tokens",
            )
        if sum(prefill_queries) != self.num_prefill_tokens:
            raise disagree(
                "num_prefill_tokens", "query_start_loc" if qsl is not None else "seq_lens",
                f"{self.num_prefill_tokens} against the prefills' {sum(prefill_queries)} query tokens",
            )
        checks = [
            ("seq_start_loc", "seq_lens", self.seq_start_loc, _cumulative(seq_lens)),
            ("kv_start_loc", "seq_lens", self.kv_start_loc, _cumulative(prefill_seq_lens)),
            ("seqlen_q", "query_start_loc", self.seqlen_q, _cumulative(prefill_queries)),
            ("prefill_query_start_loc", "query_start_loc", self.prefill_query_start_loc,
             _cumulative(prefill_queries)),
        ]
        for name, other, given, want in checks:
            if given is not None and _numel(given) > 0:
                got = [int(v) for v in _to_list(given)]
                if got != want:
                    raise disagree(name, other, f"{got} against {want}")
        maxima = [
            ("max_prefill_seq_len", "seq_lens", self.max_prefill_seq_len, prefill_seq_lens),
            ("max_decode_seq_len", "seq_lens", self.max_decode_seq_len, seq_lens[np_:]),
            ("max_kv_len", "seq_lens", self.max_kv_len, prefill_seq_lens),
            ("max_seqlen", "query_start_loc", self.max_seqlen, prefill_queries),
            ("max_decode_query_len", "num_decode_tokens", self.max_decode_query_len,
             query_lens[np_:]),
        ]
        for name, other, given, lens in maxima:
            # A maximum is a bound (CUDA-graph capture gives max_decode_seq_len the longest
            # sequence it captures for): refused only below the longest. 0 or None: not set.
            if given and lens and int(given) < max(lens):
                raise disagree(name, other, f"{int(given)} below the longest, {max(lens)}")
        if self.max_query_len is not None and int(self.max_query_len) < max(query_lens, default=0):
            raise disagree(
                "max_query_len", "query_start_loc" if qsl is not None else "seq_lens",
                f"{self.max_query_len} below the longest query, {max(query_lens)}",
            )
        if self.is_prompt is not None and bool(self.is_prompt) != (self.num_decode_tokens == 0):
            raise disagree(
                "is_prompt", "num_decode_tokens",
                f"is_prompt {self.is_prompt} with {self.num_decode_tokens} decode tokens",
            )

    def _decoder_block_tables(
        self, seq_lens: List[int], query_lens: List[int], block_size: int
    ) -> List[List[int]]:
        """One block-table row per sequence (see the class docstring), padded with 0."""
        np_, s = self.num_prefills, self.num_seqs
        nd = s - np_
        given = _to_list(self.block_tables) if _numel(self.block_tables) > 0 else []
        given = [list(map(int, r)) for r in given]
        if len(given) == s:
            rows = given
        elif len(given) == nd:
            pre = _to_list(self.prefill_block_tables) if _numel(self.prefill_block_tables) > 0 else []
            pre = [list(map(int, r)) for r in pre]
            rows = (pre if len(pre) == np_ else [[] for _ in range(np_)]) + given
        elif not given:
            rows = [[] for _ in range(s)]
        else:
            raise ValueError(
                f"metadata.block_tables: {len(given)} rows; expected {s} (one per sequence) or "
                f"{nd} (one per decode)"
            )
        slots = [int(v) for v in _to_list(self.slot_mapping)]
        start = 0
        for i in range(s):
            n = query_lens[i]
            ctx = seq_lens[i] - n
            if i < np_ and ctx == 0 and n > 0:
                row = _blocks_of_slots(slots[start : start + n], block_size)
                if row is not None:
                    rows[i] = row
            start += n
        width = max((len(r) for r in rows), default=0)
        return [r + [0] * (width - len(r)) for r in rows]

    def native(self, attn_type: str = AttentionType.DECODER, *, with_kv: bool = True,
               block_size: Optional[int] = None) -> Any:
        """This step as a native :class:`pagedattn.Metadata` for a layer of ``attn_type``
        (cached on this object): ``decoder`` reads the decoder fields; ``encoder`` the encoder
        tokens (``encoder_seq_lens``, no cache); ``encoder_only`` the decoder fields with no
        cache; ``encoder_decoder`` the decoder queries and the cross fields
        (``encoder_seq_lens``, ``cross_block_tables``, and ``cross_slot_mapping`` when
        ``with_kv``: the call carries the encoder's keys and values). ``block_size``: the
        cache's, for the block tables of prefills (see the class docstring); None without a
        cache."""
        try:
            attn_type = _attn_type_name(attn_type, "attn_type")
        except ValueError:
            raise AttributeError(f"Invalid attention type {attn_type}") from None
        if attn_type != AttentionType.ENCODER_DECODER:
            with_kv = True
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            block_size = None
        key = (attn_type, with_kv, block_size)
        cached = self._native_cache.get(key)
        if cached is not None:
            return cached
        md = self._build_native(attn_type, with_kv, block_size)
        self._native_cache[key] = md
        return md

    def _encoder_seq_lens(self) -> List[int]:
        if self.encoder_seq_lens is not None:
            lens = [int(v) for v in self.encoder_seq_lens]
        else:
            lens = [int(v) for v in _to_list(self.encoder_seq_lens_tensor)]
        if self.encoder_seq_start_loc is not None and _numel(self.encoder_seq_start_loc) > 0:
            got = [int(v) for v in _to_list(self.encoder_seq_start_loc)]
            want = _cumulative(lens)
            if got != want:
                raise ValueError(
                    f"metadata.encoder_seq_start_loc and metadata.encoder_seq_lens disagree: "
                    f"{got} against {want}"
                )
        return lens

    def _build_native(self, attn_type: str, with_kv: bool, block_size: Optional[int]) -> Any:
        if attn_type == AttentionType.ENCODER:
            if self.encoder_seq_lens is None and self.encoder_seq_lens_tensor is None:
                raise AttributeError("Encoder attention requires setting encoder metadata attributes.")
            lens = self._encoder_seq_lens()
            return _native.Metadata(
                seq_lens=lens, slot_mapping=[-1] * sum(lens), num_prefills=len(lens)
            )
        seq_lens, qsl, ctx, query_lens = self._decoder_lengths()
        if attn_type == AttentionType.ENCODER_ONLY:
            return _native.Metadata(
                seq_lens=seq_lens,
                slot_mapping=[-1] * sum(query_lens),
                num_prefills=len(seq_lens),
                query_start_loc=qsl,
            )
        common = dict(
            seq_lens=seq_lens,
            slot_mapping=self.slot_mapping,
            num_prefills=self.num_prefills,
            context_lens=ctx,
            query_start_loc=qsl,
            block_size=self.block_size,
        )
        if attn_type == AttentionType.DECODER:
            tables = None
            if block_size is not None:
                tables = self._decoder_block_tables(seq_lens, query_lens, block_size)
            return _native.Metadata(block_tables=_index_table(tables), **common)
        # encoder_decoder
        if (
            (self.encoder_seq_lens is None and self.encoder_seq_lens_tensor is None)
            or (block_size is not None and self.cross_block_tables is None)
        ):
            raise AttributeError(
                "Encoder/decoder cross-attention requires setting cross-attention metadata attributes."
            )
        cross_slots = None
        if with_kv and block_size is not None:
            if self.cross_slot_mapping is None:
                raise AttributeError(
                    "Encoder/decoder cross-attention requires setting cross-attention metadata attributes."
                )
            cross_slots = self.cross_slot_mapping
        return _native.Metadata(
            encoder_seq_lens=self._encoder_seq_lens(),
            cross_block_tables=_index_table(self.cross_block_tables) if block_size is not None else None,
            cross_slot_mapping=cross_slots,
            **common,
        )


# --------------------------------------------------------------------------------------------
# Metadata builder (vLLM 0.6's runners)
# --------------------------------------------------------------------------------------------


class PagedAttnState:
    """vLLM 0.6's attention state (``CommonAttentionState``): what a model runner asks of the
    backend around its steps. Eager steps need nothing (``begin_forward``). vLLM's CUDA-graph
    capture is refused: the layer converts each step's metadata on the host, which a capture
    cannot hold, and the capture's padded decodes (slot -1) need the private cache's launches,
    which a graph plan refuses; run vLLM with ``enforce_eager=True``."""

    _NO_GRAPHS = (
        "pagedattn.vllm does not support vLLM's CUDA-graph capture (the layer converts each "
        "step's metadata on the host): run vLLM with enforce_eager=True"
    )

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def begin_forward(self, model_input: Any) -> None:
        """Nothing to prepare: the first layer's forward plans the step."""
        return None

    def graph_capture(self, max_batch_size: int) -> Any:
        """Refused: raises ``NotImplementedError`` (see the class)."""
        raise NotImplementedError(self._NO_GRAPHS)

    def graph_clone(self, batch_size: int) -> "PagedAttnState":
        """Refused, as :meth:`graph_capture`."""
        raise NotImplementedError(self._NO_GRAPHS)

    def graph_capture_get_metadata_for_batch(
        self, batch_size: int, is_encoder_decoder_model: bool = False
    ) -> Any:
        """Refused, as :meth:`graph_capture`."""
        raise NotImplementedError(self._NO_GRAPHS)

    def get_graph_input_buffers(
        self, attn_metadata: Any, is_encoder_decoder_model: bool = False
    ) -> Dict[str, Any]:
        """Refused, as :meth:`graph_capture`."""
        raise NotImplementedError(self._NO_GRAPHS)

    def prepare_graph_input_buffers(
        self, input_buffers: Any, attn_metadata: Any, is_encoder_decoder_model: bool = False
    ) -> None:
        """Refused, as :meth:`graph_capture`."""
        raise NotImplementedError(self._NO_GRAPHS)


class PagedAttnMetadataBuilder:
    """vLLM 0.6's ``AttentionMetadataBuilder`` for pagedattn: built by the model runner's input
    builder (``ModelInputForGPUBuilder`` / the CPU runner's), it reads that builder's
    ``inter_data_list`` (one entry per sequence group: ``seq_ids``, ``input_tokens``,
    ``orig_seq_lens``, ``seq_lens``, ``query_lens``, ``context_lens``,
    ``curr_sliding_window_blocks``, ``is_prompt``, ``block_tables`` (seq id to block ids, None
    in a profiling run), ``computed_block_nums``, ``prefix_cache_hit``) and makes a
    :class:`PagedAttnMetadata` as vLLM's ``CommonMetadataBuilder`` makes its backends'.

    Slots: a prompt's tokens before ``query_len - sliding_window`` get :data:`PAD_SLOT_ID`
    (not cached: outside every later query's window), a profiling run's tokens all do, the
    others ``block * block_size + offset`` of their position. Table rows: the computed blocks
    on a prefix-cache hit, the last ``curr_sliding_window_block`` blocks of a decode or of a
    chunked prefill, none for a plain prompt (its keys are its own new tokens).
    """

    def __init__(self, input_builder: Any) -> None:
        """Reads ``input_builder.runner`` (``device``, ``graph_block_tables`` with CUDA
        graphs), ``sliding_window`` and ``block_size``."""
        self.input_builder = input_builder
        self.runner = input_builder.runner
        self.sliding_window = input_builder.sliding_window
        self.block_size = int(input_builder.block_size)

    def build(self, seq_lens: List[int], query_lens: List[int], cuda_graph_pad_size: int,
              batch_size: int) -> PagedAttnMetadata:
        """The step's metadata. ``seq_lens`` and ``query_lens``: every sequence's (padded
        for a CUDA graph); ``cuda_graph_pad_size``: padding decodes to add (-1: no graph);
        ``batch_size``: the (padded) batch."""
        import torch

        slots: List[int] = []
        context_lens: List[int] = []
        tables: List[List[int]] = []
        prefill_seq_lens: List[int] = []
        decode_seq_lens: List[int] = []
        num_prefills = num_prefill_tokens = num_decode_tokens = 0
        chunked = bool(getattr(self.input_builder, "chunked_prefill_enabled", False))
        for group in self.input_builder.inter_data_list:
            given = group.block_tables
            profiling = given is None or (
                isinstance(given, dict) and all(t is None for t in given.values())
            )
            per_seq = zip(
                group.seq_ids, group.input_tokens, group.orig_seq_lens, group.seq_lens,
                group.query_lens, group.context_lens, group.curr_sliding_window_blocks,
            )
            for seq_id, tokens, seq_len, curr_len, query_len, context_len, window_blocks in per_seq:
                context_lens.append(context_len)
                if group.is_prompt:
                    num_prefills += 1
                    num_prefill_tokens += len(tokens)
                    prefill_seq_lens.append(seq_len)
                else:
                    if query_len != 1:
                        raise ValueError(
                            f"sequence {seq_id}: a decode of {query_len} query tokens; expected 1"
                        )
                    num_decode_tokens += 1
                    decode_seq_lens.append(curr_len)
                row: List[int] = []
                if group.prefix_cache_hit:
                    row = list(group.computed_block_nums)
                elif (chunked or not group.is_prompt) and given is not None:
                    row = list(given[seq_id][-window_blocks:])
                tables.append(row)
                if profiling:
                    slots.extend([PAD_SLOT_ID] * seq_len)
                    continue
                # A prompt's tokens that no later query's window reaches are not cached.
                start = 0
                if group.is_prompt and self.sliding_window is not None:
                    start = max(0, query_len - self.sliding_window)
                slots.extend([PAD_SLOT_ID] * max(0, start - context_len))
                table = given[seq_id]
                b = self.block_size
                slots.extend(
                    table[p // b] * b + p % b for p in range(max(start, context_len), seq_len)
                )
        device = getattr(self.runner, "device", None)
        with_graph = cuda_graph_pad_size != -1
        if with_graph:
            slots.extend([PAD_SLOT_ID] * cuda_graph_pad_size)
            num_decode_tokens = batch_size
            rows = self.runner.graph_block_tables[:batch_size].copy()
            for i, row in enumerate(tables):
                rows[i, : len(row)] = row
            block_tables = torch.from_numpy(rows).to(device)
        else:
            width = max((len(r) for r in tables), default=0)
            block_tables = torch.tensor(
                [r + [0] * (width - len(r)) for r in tables], dtype=torch.int32, device=device
            ).reshape(len(tables), width)
        if max(query_lens, default=0) <= 0:
            raise ValueError(f"query_lens: {query_lens}; expected a query of at least one token")

        def cumulative(lens: List[int]) -> Any:
            return torch.tensor(_cumulative(lens), dtype=torch.int32, device=device)

        return PagedAttnMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            seq_lens=list(seq_lens),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_prefill_seq_len=max(prefill_seq_lens, default=0),
            max_decode_seq_len=max(decode_seq_lens, default=0),
            query_start_loc=cumulative(query_lens),
            seq_start_loc=cumulative(seq_lens),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=block_tables,
            use_cuda_graph=with_graph,
            block_size=self.block_size,
        )


# --------------------------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------------------------


class PagedAttnImpl:
    """One layer's attention, vLLM's ``AttentionImpl`` over pagedattn.

    ``num_kv_heads`` defaults to ``num_heads`` (it must divide it: query head ``h`` reads kv
    head ``h // (num_heads // num_kv_heads)``); ``alibi_slopes``: one per query head;
    ``sliding_window``: a query at position p sees keys at positions ``> p - W``;
    ``logits_soft_cap``: scores become ``cap * tanh(score / cap)`` (None or 0: off);
    ``kv_cache_dtype``: ``auto`` or ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` (a ``uint8`` cache);
    ``blocksparse_params``: not supported (:class:`BlocksparseNotSupported`, a
    ``NotImplementedError``). Every feature works on every backend and attention type the
    contract allows (a sliding window only with ``decoder``).

    The native layer objects are created at the first ``forward``, on the backend of the
    query's device (:func:`backend_for`), one per ``(k_scale, v_scale)`` pair.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[List[float]] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        blocksparse_params: Optional[Dict[str, Any]] = None,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        """See the class docstring. ``ValueError`` for inconsistent head counts or an unknown
        ``attn_type``; the native module checks the rest at the first ``forward``."""
        if blocksparse_params is not None:
            raise BlocksparseNotSupported("pagedattn does not support block-sparse attention.")
        attn_type = _attn_type_name(attn_type, "attn_type")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        if alibi_slopes is not None:
            alibi_slopes = [float(v) for v in _to_list(alibi_slopes)]
        self.alibi_slopes = alibi_slopes
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.attn_type = attn_type
        self._layers: Dict[Any, Any] = {}

    def _layer(self, backend: Any, k_scale: float, v_scale: float, attn_type: str) -> Any:
        """The native ``Attention`` for ``backend``, these scales and ``attn_type`` (cached)."""
        key = (id(backend), k_scale, v_scale, attn_type)
        layer = self._layers.get(key)
        if layer is None:
            layer = _native.Attention(
                backend,
                self.num_heads,
                self.head_size,
                scale=self.scale,
                num_kv_heads=self.num_kv_heads,
                alibi_slopes=self.alibi_slopes,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                kv_cache_dtype=self.kv_cache_dtype,
                k_scale=k_scale,
                v_scale=v_scale,
                attn_type=attn_type,
            )
            self._layers[key] = layer
        return layer

    def _plan(self, layer: Any, backend: Any, md: PagedAttnMetadata, cache: Any,
              block_size: Optional[int], with_kv: bool, num_kv_tokens: Optional[int],
              dtype: Any, attn_type: str) -> Any:
        """The step's plan for this layer's shape, made once per metadata object and shared
        by every layer of the same shape (heads, head size, window, attention type, cache
        geometry and dtype, activation dtype)."""
        cache_key = None
        if cache is not None:
            cache_key = (int(cache.shape[1]), block_size, str(cache.dtype))
        key = (
            id(backend),
            attn_type,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.sliding_window,
            self.kv_cache_dtype,
            cache_key,
            str(dtype),
            with_kv,
            num_kv_tokens,
        )
        plan = md._plans.get(key)
        if plan is None:
            native_md = md.native(attn_type, with_kv=with_kv, block_size=block_size)
            plan = layer.plan(native_md, cache, dtype=dtype)
            md._plans[key] = plan
        return plan

    def forward(
        self,
        query: Any,
        key: Optional[Any],
        value: Optional[Any],
        kv_cache: Any,
        attn_metadata: PagedAttnMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        output: Optional[Any] = None,
        *,
        attn_type: Optional[Any] = None,
    ) -> Any:
        """vLLM's ``forward``: writes the new ``key``/``value`` into ``kv_cache`` through
        ``slot_mapping`` (``cross_slot_mapping`` for ``encoder_decoder``), then attends.

        ``attn_type``: this call's attention type, as vLLM 0.6 passes it per call (a string of
        :class:`AttentionType` or 0.6.3's enum member); default the one given at construction.

        ``query``: ``[T, H * D]`` or ``[T, H, D]``; ``key``/``value``: ``[Tk, Hkv * D]`` or
        ``[Tk, Hkv, D]``, both or neither (None: a cross-attention decode step reading the
        cached encoder keys); ``kv_cache``: ``(2, NB, B * Hkv * D)`` (see
        :meth:`PagedAttnBackend.get_kv_cache_shape`), or an empty tensor (``numel() == 0``,
        e.g. a profiling run): no cache, attend over the new tokens. ``encoder`` and
        ``encoder_only`` layers never use a cache. Non-contiguous inputs (vLLM's slices of a
        fused qkv) are made contiguous first (a copy). Returns ``[T, H * D]``, written into
        ``output`` when given (``[T, H * D]`` or ``[T, H, D]``)."""
        if (key is None) != (value is None):
            raise ValueError("key and value: both or neither")
        md = attn_metadata
        t = int(query.shape[0])
        hd = self.num_heads * self.head_size
        kind = self.attn_type if attn_type is None else _attn_type_name(attn_type, "attn_type")
        backend = backend_for(query)
        layer = self._layer(backend, _scale_value(k_scale), _scale_value(v_scale), kind)

        cache = kv_cache
        if (
            cache is None
            or _numel(cache) == 0
            or kind in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        ):
            cache = None
        block_size = None
        if cache is not None:
            block_size = _block_size_of(cache, self.num_kv_heads, self.head_size)

        q = query if query.is_contiguous() else query.contiguous()
        k = v = None
        if key is not None:
            k = key if key.is_contiguous() else key.contiguous()
            v = value if value.is_contiguous() else value.contiguous()
        with_kv = k is not None
        plan = self._plan(
            layer, backend, md, cache, block_size, with_kv,
            None if k is None else int(k.shape[0]), q.dtype, kind,
        )

        out = None
        if output is not None and output.is_contiguous() and output.numel() == q.numel():
            out = output.view(q.shape)
        result = layer.run(plan, q, k, v, cache, out)
        if output is None:
            return result.view(t, hd)
        if out is None:  # a non-contiguous output: computed aside, then copied in
            output.copy_(result.reshape(output.shape))
        return output.view(t, hd) if output.is_contiguous() else output
