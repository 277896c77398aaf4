"""vLLM's v1 attention-backend interface over pagedattn (the shape of vLLM 0.11's
``vllm/v1/attention/backends``; docs/design/vllm-interface.md, section 2).

* :class:`PagedAttnBackend`: ``get_name``, ``get_impl_cls``, ``get_metadata_cls``,
  ``get_builder_cls``, ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
  cache_dtype_str)`` (``(2, NB, B * Hkv * D)``, as v0's and vLLM's CPU backend), the supported
  head sizes and dtypes; ``accept_output_buffer``.
* :class:`PagedAttnMetadataBuilder`: ``(kv_cache_spec, layer_names, vllm_config, device)``;
  ``build(common_prefix_len, common_attn_metadata, fast_build=False)`` reads vLLM's
  ``CommonAttentionMetadata`` (``query_start_loc``, ``seq_lens``, ``num_reqs``,
  ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``, ``block_table_tensor``,
  ``slot_mapping``, ``causal``).
* :class:`PagedAttnImpl`: constructed as the v1 layer constructs it (positionally:
  ``num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
  kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name``);
  ``forward(layer, query, key, value, kv_cache, attn_metadata, output=None, ...)`` writes the
  new keys and values through ``slot_mapping`` and attends, into ``output``.

A v1 batch comes in any order, and a request's query may be of any length (a decode, a
speculative decode of several tokens, a prompt chunk): every request is given to the native
layer as a prefill over its cached context (``seq_len - query_len`` tokens), which covers
them all. Tokens past ``num_actual_tokens`` are padding: not computed, their output rows left
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Type

from . import SUPPORTED_HEAD_SIZES, AttentionType, PagedAttnMetadata
from . import PagedAttnBackend as _V0Backend
from . import PagedAttnImpl as _V0Impl

__all__ = ["PagedAttnBackend", "PagedAttnMetadataV1", "PagedAttnMetadataBuilder", "PagedAttnImpl"]


class PagedAttnBackend:
    """vLLM v1's ``AttentionBackend`` for pagedattn (static side)."""

    #: ``forward`` writes into the ``output`` the layer passes (``[T, H, D]``).
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        """``"PAGEDATTN"`` (vLLM 0.33 needs ``register_backend`` for a name of its own)."""
        return "PAGEDATTN"

    @staticmethod
    def get_impl_cls() -> Type["PagedAttnImpl"]:
        """:class:`PagedAttnImpl`."""
        return PagedAttnImpl

    @staticmethod
    def get_metadata_cls() -> Type["PagedAttnMetadataV1"]:
        """:class:`PagedAttnMetadataV1`."""
        return PagedAttnMetadataV1

    @staticmethod
    def get_builder_cls() -> Type["PagedAttnMetadataBuilder"]:
        """:class:`PagedAttnMetadataBuilder`."""
        return PagedAttnMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> Tuple[int, ...]:
        """v0's shape, ``(2, num_blocks, block_size * num_kv_heads * head_size)``: see
        :meth:`pagedattn.vllm.PagedAttnBackend.get_kv_cache_shape`."""
        return _V0Backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_head_sizes() -> List[int]:
        """The head sizes every native backend serves."""
        return _V0Backend.get_supported_head_sizes()

    @staticmethod
    def get_supported_dtypes() -> List[Any]:
        """float16, bfloat16 and float32 activations."""
        import torch

        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        """``ValueError`` for a head size :meth:`get_supported_head_sizes` lacks."""
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"head_size: {head_size}; pagedattn serves {SUPPORTED_HEAD_SIZES}"
            )


@dataclass(eq=False)
class PagedAttnMetadataV1:
    """One step of a v1 batch: vLLM's common fields, and the v0 metadata the native layer is
    given (every request a prefill over its cached context; see the module docstring)."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: Any
    max_seq_len: int
    seq_lens: Any
    block_table: Any
    slot_mapping: Any
    causal: bool
    #: What the native layer is given (made by the builder).
    v0: PagedAttnMetadata


class PagedAttnMetadataBuilder:
    """vLLM v1's ``AttentionMetadataBuilder``: a step's metadata from ``CommonAttentionMetadata``."""

    def __init__(self, kv_cache_spec: Any, layer_names: List[str], vllm_config: Any,
                 device: Any) -> None:
        """Keeps the KV cache spec's ``block_size`` (the slots' and tables')."""
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        self.block_size = getattr(kv_cache_spec, "block_size", None)

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        """Nothing to reorder (any order is served): ``False``."""
        return False

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> PagedAttnMetadataV1:
        """The step's metadata. ``ValueError`` for a cascade prefix (``common_prefix_len > 0``:
        this backend asks for none) or a non-causal decoder batch."""
        cam = common_attn_metadata
        if common_prefix_len:
            raise ValueError(
                f"common_prefix_len: {common_prefix_len}; pagedattn has no cascade attention (0)"
            )
        n = int(cam.num_actual_tokens)
        reqs = int(cam.num_reqs)
        qsl = cam.query_start_loc[: reqs + 1]
        seq_lens = cam.seq_lens[:reqs]
        qsl_host = [int(v) for v in qsl.tolist()]
        if qsl_host[-1] != n:
            raise ValueError(
                f"common_attn_metadata.query_start_loc and .num_actual_tokens disagree: "
                f"{qsl_host[-1]} query tokens against {n}"
            )
        seq_host = [int(v) for v in seq_lens.tolist()]
        queries = [b - a for a, b in zip(qsl_host, qsl_host[1:])]
        context = [s - q for s, q in zip(seq_host, queries)]
        if any(c < 0 for c in context):
            i = next(i for i, c in enumerate(context) if c < 0)
            raise ValueError(
                f"common_attn_metadata.seq_lens and .query_start_loc disagree: request {i} has "
                f"{queries[i]} query tokens in a sequence of {seq_host[i]}"
            )
        import torch

        v0 = PagedAttnMetadata(
            num_prefills=reqs,
            num_prefill_tokens=n,
            num_decode_tokens=0,
            slot_mapping=cam.slot_mapping[:n],
            seq_lens=seq_host,
            seq_lens_tensor=seq_lens,
            max_prefill_seq_len=max(seq_host, default=0),
            context_lens_tensor=torch.tensor(context, dtype=torch.int32),
            block_tables=cam.block_table_tensor[:reqs],
            query_start_loc=qsl,
            max_query_len=int(cam.max_query_len),
            block_size=self.block_size,
        )
        return PagedAttnMetadataV1(
            num_actual_tokens=n,
            max_query_len=int(cam.max_query_len),
            query_start_loc=qsl,
            max_seq_len=int(cam.max_seq_len),
            seq_lens=seq_lens,
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
            causal=bool(getattr(cam, "causal", True)),
            v0=v0,
        )


class PagedAttnImpl:
    """vLLM v1's ``AttentionImpl`` over pagedattn (the v0 impl's computation)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None, alibi_slopes: Optional[List[float]] = None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: Any = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, **extra_impl_args: Any) -> None:
        """In the order the v1 layer passes them. ``kv_sharing_target_layer_name`` (a layer
        reading another's cache) and extra arguments (``sinks``) are refused: not computed
        here."""
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError(
                "kv_sharing_target_layer_name: pagedattn does not share KV caches between layers"
            )
        if extra_impl_args:
            raise NotImplementedError(
                f"{', '.join(sorted(extra_impl_args))}: not supported by pagedattn"
            )
        self._impl = _V0Impl(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                             sliding_window, kv_cache_dtype, None, logits_soft_cap, attn_type)
        self.num_heads, self.head_size = self._impl.num_heads, self._impl.head_size
        self.num_kv_heads, self.attn_type = self._impl.num_kv_heads, self._impl.attn_type

    def forward(self, layer: Any, query: Any, key: Optional[Any], value: Optional[Any],
                kv_cache: Any, attn_metadata: Optional[PagedAttnMetadataV1],
                output: Optional[Any] = None, output_scale: Any = None,
                output_block_scale: Any = None) -> Any:
        """Writes the first ``num_actual_tokens`` new keys and values through ``slot_mapping``
        and attends, into ``output`` (``[T, H, D]`` or ``[T, H * D]``; the rows past
        ``num_actual_tokens`` untouched) or a new tensor. ``attn_metadata`` None (vLLM's
        warm-up): ``output`` as it is. The fp8 scales are the layer's (``_k_scale_float``,
        ``_v_scale_float``). ``output_scale`` (quantized output) is refused."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("output_scale: pagedattn writes unquantized outputs")
        if attn_metadata is None:
            return output if output is not None else query
        n = attn_metadata.num_actual_tokens
        k_scale = float(getattr(layer, "_k_scale_float", 1.0))
        v_scale = float(getattr(layer, "_v_scale_float", 1.0))
        k = None if key is None else key[:n]
        v = None if value is None else value[:n]
        out = None if output is None else output[:n]
        result = self._impl.forward(query[:n], k, v, kv_cache, attn_metadata.v0, k_scale,
                                    v_scale, out)
        return output if output is not None else result
