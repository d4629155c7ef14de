"""KV-cache specs: what one layer's (or one group's) cache looks like, in pages.

A spec is pure description; it never owns memory. The device allocator sizes
arrays from it, the block pool counts pages of it, capacity planning adds it up
(SPEC §6). Every spec validates itself on construction: a bad value is a
`ValueError` naming the field, the value and what is allowed.

Size: over 800 lines because it is one class hierarchy and the config built from it:
the base `KVCacheSpec`, every attention kind, `MambaSpec` and `UniformTypeKVCacheSpecs`
refer to each other (merging, page sizes, the kind helpers), and `KVCacheConfig`
validates its groups against them. A split would either import back into this module
(an import cycle) or move the base class away from the kinds it dispatches on.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import numpy as np

from jaxkv._checks import AssertedValueError, check_bool, check_int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def numpy_dtype(dtype: str | np.dtype | type) -> np.dtype:
    """`dtype` ("bfloat16", "float16", np.float32, ...) as a numpy dtype.

    bfloat16 comes from `ml_dtypes` (installed with JAX); importing it does not
    import JAX.
    """
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def dtype_num_bytes(dtype: str | np.dtype | type) -> int:
    """Bytes per element of `dtype` ("bfloat16", "float32", np.float16, ...)."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return 2
    return int(np.dtype(dtype).itemsize)


class KVQuantMode(enum.IntEnum):
    """How an attention layer's KV cache is quantized (vLLM's values).

    The spec carries it for the attention kernels; it does not change the page
    size (a backend that stores scales inline publishes the larger page through
    `page_size_padded`).
    """

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5


class KVCacheSpecKind(enum.StrEnum):
    """What kind of layer a KV-cache group serves; routers read it off `BlockStored`."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class TensorParallelBytes:
    """One spec's page under a tensor-parallel degree (SPEC §6).

    `page_size_bytes` is what one device holds per page; `num_replicas` is how
    many devices hold each distinct shard (1: no replication) and
    `replicated_bytes` the bytes per page across all devices beyond one copy of
    the whole page: the memory replication costs, reported, never hidden.
    """

    tensor_parallel_size: int
    page_size_bytes: int
    num_replicas: int
    replicated_bytes: int


def _check_positive(name: str, value: object, what: str) -> None:
    """TypeError unless an integer (as `check_int`), ValueError unless positive."""
    if check_int(name, value) <= 0:
        raise ValueError(f"{what}: {name} must be a positive integer, got {value!r}")


def _check_tensor_parallel_size(tensor_parallel_size: int) -> None:
    _check_positive("tensor_parallel_size", tensor_parallel_size, "tensor parallelism")


def _check_page_size_padded(spec: AttentionSpec | MambaSpec, unpadded: int) -> None:
    """`page_size_padded`, when set, is an int of at least the unpadded page."""
    padded = spec.page_size_padded
    if padded is None:
        return
    if check_int("page_size_padded", padded) < unpadded:
        raise ValueError(
            f"{type(spec).__name__}: page_size_padded={padded} is smaller than the "
            f"{unpadded}-byte page it pads; it must be >= {unpadded} (or None)"
        )


class SpecMergeError(AssertedValueError):
    """Layers that cannot share one KV-cache group spec (`KVCacheSpec.merge`)."""


def _merge_equal_specs(cls: type, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    """The one spec of `specs` (`SpecMergeError` unless there is one and all are equal)."""
    if not specs or any(spec != specs[0] for spec in specs[1:]):
        raise SpecMergeError(
            f"{cls.__name__}.merge: all layers of one KV cache group must have the same "
            f"spec, got {sorted({repr(s) for s in specs})}"
        )
    return specs[0]


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs: one page holds `block_size` tokens of one layer.

    `dcp_sharded`: decode context parallelism shards this cache's token
    positions across ranks (one block then spans `block_size * dcp` tokens).
    """

    block_size: int
    dcp_sharded: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size, type(self).__name__)

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.UNKNOWN

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this spec's group takes part in prefix caching."""
        return True

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Peak bytes one request can hold at `max_model_len` (SPEC §6)."""
        raise NotImplementedError

    def max_num_blocks_per_req(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Pages one request holds at most: its peak bytes over the page size."""
        return cdiv(
            self.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            self.page_size_bytes,
        )

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        """Per-device page bytes under `tensor_parallel_size` (default: replicated)."""
        _check_tensor_parallel_size(tensor_parallel_size)
        page = self.page_size_bytes
        return TensorParallelBytes(
            tensor_parallel_size, page, tensor_parallel_size, page * (tensor_parallel_size - 1)
        )

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """One spec for a group of layers: they must all be equal (`SpecMergeError`)."""
        return _merge_equal_specs(cls, specs)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention KV: a page holds K and V of `block_size` tokens for every KV head.

    `head_size_v` defaults to `head_size` (0 for MLA: one latent vector per token).
    `dcp_sharded` defaults to True (vLLM's default for attention): with decode
    context parallelism a block spans `block_size * dcp` tokens.
    `page_size_padded`: the page's bytes when a backend pads it beyond the K/V
    content (`unpadded_page_size_bytes`); None: no padding. Planning and
    capacity count the padded page. `kv_quant_mode`: see `KVQuantMode`.
    """

    num_kv_heads: int = 1
    head_size: int = 128
    dtype: str = "bfloat16"
    dcp_sharded: bool = field(default=True, kw_only=True)
    head_size_v: int | None = field(default=None, kw_only=True)
    kv_quant_mode: KVQuantMode = field(default=KVQuantMode.NONE, kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        what = type(self).__name__
        _check_positive("num_kv_heads", self.num_kv_heads, what)
        _check_positive("head_size", self.head_size, what)
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        elif not isinstance(self.head_size_v, int) or self.head_size_v < 0:
            raise ValueError(f"{what}: head_size_v must be >= 0, got {self.head_size_v!r}")
        try:
            dtype_num_bytes(self.dtype)
        except TypeError as e:
            raise ValueError(f"{what}: dtype {self.dtype!r} is not a known dtype") from e
        try:
            object.__setattr__(self, "kv_quant_mode", KVQuantMode(self.kv_quant_mode))
        except ValueError:
            raise ValueError(
                f"{what}: kv_quant_mode {self.kv_quant_mode!r} is not one of "
                f"{[m.name for m in KVQuantMode]}"
            ) from None
        _check_page_size_padded(self, self.unpadded_page_size_bytes)

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def unpadded_page_size_bytes(self) -> int:
        """K and V of `block_size` tokens for every KV head."""
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + self.head_size_v)  # type: ignore[operator]
            * dtype_num_bytes(self.dtype)
        )

    @property
    def real_page_size_bytes(self) -> int:
        """vLLM's other name for `unpadded_page_size_bytes`."""
        return self.unpadded_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        """KV heads split evenly; with fewer heads than devices each head is replicated.

        With `num_kv_heads >= tp`, `tp` must divide the heads (`ValueError`
        otherwise); with fewer, `tp` must be a multiple of the heads and each
        device holds one head, every head on `tp // num_kv_heads` devices.
        """
        _check_tensor_parallel_size(tensor_parallel_size)
        tp, heads = tensor_parallel_size, self.num_kv_heads
        if self.page_size_bytes % heads:
            raise ValueError(
                f"{type(self).__name__}: a padded page of {self.page_size_bytes} bytes cannot "
                f"be split over num_kv_heads={heads}; page_size_padded must be a multiple of "
                "the KV heads"
            )
        per_head = self.page_size_bytes // heads
        if heads >= tp:
            if heads % tp:
                raise ValueError(
                    f"{type(self).__name__}: num_kv_heads={heads} cannot be split evenly "
                    f"over tensor_parallel_size={tp}; tp must divide the KV heads"
                )
            return TensorParallelBytes(tp, per_head * (heads // tp), 1, 0)
        if tp % heads:
            raise ValueError(
                f"{type(self).__name__}: num_kv_heads={heads} is smaller than "
                f"tensor_parallel_size={tp}, which must then be a multiple of the KV heads"
            )
        replicas = tp // heads
        return TensorParallelBytes(tp, per_head, replicas, per_head * heads * (replicas - 1))


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: one page per `block_size` tokens.

    `sliding_window` / `attention_chunk_size` (at most one; None: neither): the
    layer computes windowed or chunked attention but its cache is allocated
    and cached as full attention (vLLM's layout when the hybrid allocator is
    off, or after `unify_hybrid_kv_cache_specs`). They do not change paging.
    """

    sliding_window: int | None = field(default=None, kw_only=True)
    attention_chunk_size: int | None = field(default=None, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.FULL_ATTENTION

    def __post_init__(self) -> None:
        super().__post_init__()
        what = type(self).__name__
        for name in ("sliding_window", "attention_chunk_size"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), what)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError(
                f"{what}: sliding_window={self.sliding_window} and attention_chunk_size="
                f"{self.attention_chunk_size} are both set; a layer has at most one"
            )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> FullAttentionSpec:
        """vLLM's rule: full-attention layers (not MLA) that differ at most in their
        windows merge into one spec carrying the one window (`ValueError` when
        windows differ, `SpecMergeError` for any other difference)."""
        if not specs or not all(
            isinstance(s, FullAttentionSpec) and not isinstance(s, MLAAttentionSpec) for s in specs
        ):
            raise SpecMergeError(
                f"{cls.__name__}.merge: every layer must be a FullAttentionSpec (not MLA), "
                f"got {[type(s).__name__ for s in specs]}"
            )
        types = {type(s) for s in specs}
        if len(types) > 1 and types & {RSWASpec, SinkFullAttentionSpec}:
            raise SpecMergeError(
                f"{cls.__name__}.merge: R-SWA and sink layers keep other blocks or keys than "
                f"full attention and merge only with their own kind, got "
                f"{sorted(t.__name__ for t in types)}"
            )
        windows: dict[str, int | None] = {}
        for name in ("sliding_window", "attention_chunk_size"):
            values = {getattr(s, name) for s in specs} - {None}
            if len(values) > 1:
                raise ValueError(
                    f"{cls.__name__}.merge: layers of one KV cache group must share "
                    f"{name}, got {sorted(values)}"
                )
            windows[name] = values.pop() if values else None
        first: FullAttentionSpec = specs[0]  # type: ignore[assignment]
        merged = replace(first, **windows)
        _check_same_attention_fields(cls, merged, specs)
        return merged


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """DeepSeek-style multi-head latent attention: one latent KV head per token.

    The latent vector (`head_size` elements: compressed KV plus rope part) is
    not split by tensor parallelism: every device holds the whole page.
    `cache_dtype_str`: the cache's storage format name (e.g. "fp8_ds_mla"),
    which layers of one group must share; None: `dtype`.
    """

    head_size_v: int | None = field(default=0, kw_only=True)
    cache_dtype_str: str | None = field(default=None, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.MLA_ATTENTION

    def __post_init__(self) -> None:
        _check_latent_layout(self)
        super().__post_init__()

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        return KVCacheSpec.tensor_parallel_bytes(self, tensor_parallel_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> MLAAttentionSpec:
        """MLA layers merge when every field (`cache_dtype_str` included) is equal."""
        if not specs or not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise SpecMergeError(
                f"{cls.__name__}.merge: every layer must be an MLAAttentionSpec, "
                f"got {[type(s).__name__ for s in specs]}"
            )
        return _merge_equal_specs(cls, specs)  # type: ignore[return-value]


@dataclass(frozen=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention (R-SWA): the prompt stays visible to every
    later token, generated tokens only within the last `rswa_window`.

    Paged and prefix-cached as full attention (its kind is FULL_ATTENTION, as
    vLLM reports it), and sized as full attention: a request can hold its
    whole prompt plus the window. The manager (`RSWAManager`) releases the gap
    blocks between the prompt's last block and the decode window.
    """

    rswa_window: int = field(kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("rswa_window", self.rswa_window, "RSWASpec")

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> RSWASpec:
        """R-SWA layers sharing one `rswa_window` merge as full attention does
        (`SpecMergeError` for a layer of another type or another window)."""
        if not specs or not all(isinstance(s, RSWASpec) for s in specs):
            raise SpecMergeError(
                f"{cls.__name__}.merge: every layer must be an RSWASpec, "
                f"got {[type(s).__name__ for s in specs]}"
            )
        windows = sorted({s.rswa_window for s in specs})  # type: ignore[attr-defined]
        if len(windows) > 1:
            raise SpecMergeError(
                f"{cls.__name__}.merge: layers of one KV cache group must share rswa_window, "
                f"got {windows}"
            )
        return super().merge(specs)  # type: ignore[return-value]


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with `sink_len` static sink tokens whose K/V the model supplies
    (vLLM's `StaticSinkAttention`): every query also attends to the sinks.

    Paged, cached and sized as full attention; the sinks' K/V live outside the
    request's block table. `sink_len` None (vLLM's default) describes the
    layer but cannot be served: its manager needs a whole number of blocks.
    """

    sink_len: int | None = field(default=None, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SINK_FULL_ATTENTION

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink_len is not None:
            _check_positive("sink_len", self.sink_len, "SinkFullAttentionSpec")

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> SinkFullAttentionSpec:
        """Sink layers sharing one `sink_len` merge as full attention does
        (`SpecMergeError` for a layer of another type or another `sink_len`)."""
        if not specs or not all(isinstance(s, SinkFullAttentionSpec) for s in specs):
            raise SpecMergeError(
                f"{cls.__name__}.merge: every layer must be a SinkFullAttentionSpec, "
                f"got {[type(s).__name__ for s in specs]}"
            )
        sink_lens = {s.sink_len for s in specs}  # type: ignore[attr-defined]
        if len(sink_lens) > 1:
            raise SpecMergeError(
                f"{cls.__name__}.merge: layers of one KV cache group must share sink_len, "
                f"got {sorted(sink_lens, key=str)}"
            )
        return super().merge(specs)  # type: ignore[return-value]


def _check_latent_layout(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    """MLA pages hold one latent vector per token: one KV head, no separate V."""
    what = type(spec).__name__
    if spec.num_kv_heads != 1:
        raise ValueError(f"{what} stores one latent KV head, got num_kv_heads={spec.num_kv_heads}")
    if spec.head_size_v not in (0, None):
        raise ValueError(f"{what} has no separate V, head_size_v must be 0, got {spec.head_size_v}")
    object.__setattr__(spec, "head_size_v", 0)


def _check_same_attention_fields(
    cls: type, merged: AttentionSpec, specs: Sequence[KVCacheSpec]
) -> None:
    """`SpecMergeError` unless every spec matches `merged` in every `AttentionSpec` field."""
    names = [f.name for f in fields(AttentionSpec) if f.compare]
    for spec in specs:
        differing = [n for n in names if getattr(spec, n) != getattr(merged, n)]
        if differing:
            raise SpecMergeError(
                f"{cls.__name__}.merge: all layers of one KV cache group must have the same "
                f"attention spec; {spec!r} differs in {differing}"
            )


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last `sliding_window` tokens only."""

    sliding_window: int = field(default=4096)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SLIDING_WINDOW

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("sliding_window", self.sliding_window, "SlidingWindowSpec")

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks a request holds at most at once: the window behind the computed tokens
        plus those in flight (released blocks are reused); one more because the window
        can start mid-block."""
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention stored in MLA's latent format (one KV head, no V).

    Managed exactly as `SlidingWindowSpec`; its pages, like MLA's, are not
    split by tensor parallelism. `cache_dtype_str`: as `MLAAttentionSpec`'s.
    """

    head_size_v: int | None = field(default=0, kw_only=True)
    cache_dtype_str: str | None = field(default=None, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SLIDING_WINDOW_MLA

    def __post_init__(self) -> None:
        _check_latent_layout(self)
        super().__post_init__()

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        return KVCacheSpec.tensor_parallel_bytes(self, tensor_parallel_size)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of `attention_chunk_size` tokens."""

    attention_chunk_size: int = field(default=8192)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(
            "attention_chunk_size", self.attention_chunk_size, "ChunkedLocalAttentionSpec"
        )

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks a request holds at most at once: the current chunk plus the tokens in
        flight (blocks of finished chunks are released and reused)."""
        tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder layers attending to encoder output: a fixed allocation per request.

    `max_num_encoder_input_tokens` sizes the peak (e.g. 1500 for Whisper); the
    blocks are never prefix-cached (encoder states are unique per request).
    """

    max_num_encoder_input_tokens: int = field(default=1500, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.CROSS_ATTENTION

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(
            "max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, "CrossAttentionSpec"
        )

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """One ring block per request, for the whole request: the raw keys of the token
    group a layer is still compressing (vLLM's circular buffer).

    `block_size` is the ring's capacity in tokens. Never prefix-cached (per-request
    scratch), never zeroed on allocation, and a request holds exactly one page
    however long it grows. Its kind is UNKNOWN, as vLLM reports it.
    """

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        """The ring is written by position modulo its size, not through a slot mapping."""
        return False

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.page_size_bytes


MAMBA_CACHE_MODES = ("none", "all", "align")


def _state_shapes(shapes: object) -> tuple[tuple[int, ...], ...]:
    """`MambaSpec.shapes` as a tuple of int tuples; a flat tuple of ints is one shape."""
    try:
        entries = tuple(shapes)  # type: ignore[arg-type]
        if entries and all(isinstance(d, (int, np.integer)) for d in entries):
            entries = (entries,)
        return tuple(tuple(operator.index(d) for d in shape) for shape in entries)
    except TypeError:
        raise TypeError(
            f"MambaSpec: shapes must be a tuple of int tuples (one per state tensor), "
            f"got {shapes!r}"
        ) from None


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """State-space layers: one page holds a layer's whole recurrent state.

    `shapes`/`dtypes`: one entry per state tensor (e.g. conv and SSM state).
    `mamba_cache_mode`: "none" (not prefix-cached; only the running state is
    held), "all" (the state at every block boundary is kept and cached),
    "align" (only the latest state is kept; states landing on block boundaries
    are cached). `num_prefill_checkpoint_blocks` (> 0: on) and
    `prefill_checkpoint_alignment` ("align", vLLM): a prefill chunk whose
    backend can export the state at the chunk's last hit boundary (the rule of
    `is_mamba_prefill_checkpoint_valid`) gets a spare state block for it, keyed
    there. `tp_replicated`: every tensor-parallel rank holds the whole
    state (otherwise the state is split evenly). `page_size_padded`: the page's
    bytes when padded beyond the states (to share a page size with attention
    layers); None: no padding.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    tp_replicated: bool = False
    page_size_padded: int | None = field(default=None, kw_only=True)
    num_prefill_checkpoint_blocks: int = field(default=0, kw_only=True)
    prefill_checkpoint_alignment: int | None = field(default=None, kw_only=True)
    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.MAMBA

    def __post_init__(self) -> None:
        super().__post_init__()
        shapes = _state_shapes(self.shapes)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not shapes:
            raise ValueError("MambaSpec: shapes must name at least one state tensor, got ()")
        if len(self.dtypes) != len(shapes):
            raise ValueError(
                f"MambaSpec: one dtype per state shape, got {len(shapes)} shapes and "
                f"{len(self.dtypes)} dtypes"
            )
        for shape in shapes:
            if math.prod(shape) <= 0:
                raise ValueError(
                    f"MambaSpec: every state shape must have positive size, got {shape}"
                )
        for dtype in self.dtypes:
            try:
                dtype_num_bytes(dtype)
            except TypeError as e:
                raise ValueError(f"MambaSpec: dtype {dtype!r} is not a known dtype") from e
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"MambaSpec: mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.num_speculative_blocks < 0:
            raise ValueError(
                f"MambaSpec: num_speculative_blocks must be >= 0, got {self.num_speculative_blocks}"
            )
        if self.num_prefill_checkpoint_blocks < 0:
            raise ValueError(
                "MambaSpec: num_prefill_checkpoint_blocks must be >= 0 (one is used per prefill "
                f"chunk), got {self.num_prefill_checkpoint_blocks!r}"
            )
        alignment = self.prefill_checkpoint_alignment
        if alignment is not None and (
            isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
        ):
            raise ValueError(
                f"MambaSpec: prefill_checkpoint_alignment must be a positive int or None, got "
                f"{alignment!r}"
            )
        _check_page_size_padded(self, self.real_page_size_bytes)

    @property
    def numpy_dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(numpy_dtype(d) for d in self.dtypes)

    @property
    def prefix_cacheable(self) -> bool:
        return self.mamba_cache_mode != "none"

    @property
    def real_page_size_bytes(self) -> int:
        """The state tensors' bytes, without padding."""
        return sum(
            math.prod(shape) * dtype_num_bytes(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        if self.mamba_cache_mode == "all":
            pages = cdiv(max_model_len, self.block_size)
        elif self.mamba_cache_mode == "align":
            # The running state, the one it continues from, and a prefill checkpoint.
            pages = 2 + self.num_prefill_checkpoint_blocks
        else:
            pages = 1
        return (pages + self.num_speculative_blocks) * self.page_size_bytes

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        if self.tp_replicated:
            return KVCacheSpec.tensor_parallel_bytes(self, tensor_parallel_size)
        _check_tensor_parallel_size(tensor_parallel_size)
        page = self.page_size_bytes
        if page % tensor_parallel_size:
            raise ValueError(
                f"MambaSpec: a state page of {page} bytes cannot be split evenly over "
                f"tensor_parallel_size={tensor_parallel_size}"
            )
        return TensorParallelBytes(tensor_parallel_size, page // tensor_parallel_size, 1, 0)


def get_mamba_prefill_checkpoint_position(
    num_tokens: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    num_hash_lookahead_tokens: int = 0,
) -> int:
    """The last position of a `num_tokens`-token prefill whose Mamba state a later request
    can reuse (as vLLM does): a hash boundary that leaves at least one token (or the hash
    lookahead) to recompute for the logits; with EAGLE one hash unit lower, as its
    attention hit drops one."""
    proof_limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = proof_limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a step computing `[query_start, query_end)` can export the state at
    `checkpoint_position` into a spare state block (vLLM's rule): the step starts
    on a hash boundary, the checkpoint lies strictly inside it, at least one hash unit
    past its start and a multiple of `checkpoint_alignment` tokens from it, and its
    column (the block before the step's last) lies past the step's initial state.
    `checkpoint_alignment` None: the backend exports no checkpoints."""
    if checkpoint_alignment is None:
        return False
    if checkpoint_alignment <= 0:
        raise ValueError(f"checkpoint_alignment must be positive, got {checkpoint_alignment}")
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type with different shapes sharing one group.

    "One type" means every layer needs the same number of token slots: the
    same spec class, block size and window (or chunk, or Mamba page). A page
    of the group is the sum of its layers' pages.

    Like vLLM's, construction accepts any layers (a mixed group reports
    `KVCacheSpecKind.UNKNOWN`); serving one with a block table
    (`layer_type_spec`) is a `ValueError` unless they are of one type.
    """

    kv_cache_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_cache_specs:
            object.__setattr__(self, "dcp_sharded", self.first_spec.dcp_sharded)

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def kind(self) -> KVCacheSpecKind:  # type: ignore[override]
        return get_kv_cache_spec_kind(self)

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def layer_type_spec(self) -> KVCacheSpec:
        """The first layer's spec, which sets how the group's one block table is
        managed; `ValueError` unless every layer is of its type and block size."""
        if not self.is_uniform_type(self.kv_cache_specs) or (
            self.first_spec.block_size != self.block_size
        ):
            raise ValueError(
                f"UniformTypeKVCacheSpecs(block_size={self.block_size}): layers sharing one "
                "block table must share spec type, block size and window; got "
                f"{sorted({repr(s) for s in self.kv_cache_specs.values()})}"
            )
        return self.first_spec

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        pages = max(
            spec.max_num_blocks_per_req(max_model_len, max_num_batched_tokens)
            for spec in self.kv_cache_specs.values()
        )
        return pages * self.page_size_bytes

    def tensor_parallel_bytes(self, tensor_parallel_size: int) -> TensorParallelBytes:
        parts = [
            s.tensor_parallel_bytes(tensor_parallel_size) for s in self.kv_cache_specs.values()
        ]
        return TensorParallelBytes(
            tensor_parallel_size,
            sum(p.page_size_bytes for p in parts),
            max(p.num_replicas for p in parts),
            sum(p.replicated_bytes for p in parts),
        )

    @staticmethod
    def is_uniform_type(kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether every layer needs the same number of token slots."""
        specs = list(kv_cache_specs.values())
        if not specs:
            return False
        first = specs[0]

        def type_key(spec: KVCacheSpec) -> tuple:
            key: tuple = (type(spec), spec.block_size, spec.dcp_sharded)
            if isinstance(spec, SlidingWindowSpec):
                key += (spec.sliding_window,)
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                key += (spec.attention_chunk_size,)
            elif isinstance(spec, CrossAttentionSpec):
                key += (spec.max_num_encoder_input_tokens,)
            elif isinstance(spec, RSWASpec):
                key += (spec.rswa_window,)
            elif isinstance(spec, SinkFullAttentionSpec):
                key += (spec.sink_len,)
            elif isinstance(spec, MambaSpec):
                key += (
                    spec.mamba_cache_mode,
                    spec.num_speculative_blocks,
                    spec.page_size_bytes,
                    spec.tp_replicated,
                )
            return key

        return all(type_key(s) == type_key(first) for s in specs[1:])

    @classmethod
    def from_specs(
        cls, kv_cache_specs: Mapping[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """The group spec when every layer is of one type, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        first = next(iter(kv_cache_specs.values()))
        return cls(block_size=first.block_size, kv_cache_specs=dict(kv_cache_specs))


def iter_layer_specs(kv_cache_spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The per-layer specs a group spec covers (itself unless it is a uniform-type group)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        return tuple(kv_cache_spec.kv_cache_specs.values())
    return (kv_cache_spec,)


def is_full_attention_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """Whether a group spec is, or wraps only, full attention (MLA included; a
    sliding-window layer anywhere in it makes it not)."""
    layer_specs = iter_layer_specs(kv_cache_spec)
    return bool(layer_specs) and all(isinstance(s, FullAttentionSpec) for s in layer_specs)


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind of a group spec: its layers' one kind; FULL_ATTENTION for a mix of
    full-attention kinds (full and MLA); otherwise UNKNOWN."""
    kinds = {spec.kind for spec in iter_layer_specs(kv_cache_spec)}
    if len(kinds) == 1:
        return kinds.pop()
    if kinds and is_full_attention_spec(kv_cache_spec):
        return KVCacheSpecKind.FULL_ATTENTION
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """The sliding window a group's events report: its layers' one window (None when
    a layer is not sliding-window or the layers' windows differ)."""
    windows = {
        spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        for spec in iter_layer_specs(kv_cache_spec)
    }
    return windows.pop() if len(windows) == 1 else None


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table because they share one spec.

    `is_eagle_group`: the group belongs to an EAGLE/MTP drafter and gets the
    last-block drop. `host_resident`: the group's pages come from a separate
    host pool (`KVCacheConfig.host_num_blocks`). `enable_kv_transfer`: the group
    is part of the KV state a connector moves (vLLM's field; jaxkv has no
    connector, the config's `transfer_*` views read it).
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    host_resident: bool = False
    enable_kv_transfer: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        for name in ("is_eagle_group", "host_resident", "enable_kv_transfer"):
            object.__setattr__(
                self, name, check_bool(f"KVCacheGroupSpec.{name}", getattr(self, name))
            )


@dataclass(frozen=True)
class KVCacheTensor:
    """One device buffer of `size` bytes, described in one of two forms.

    jaxkv's: `shared_by`, the layers (one per group) whose pages alias this
    buffer; a block id addresses the same bytes in each. vLLM's placement
    form (keywords): `layers` laid out in one allocation, layer l's page of
    block b starting `offset + l * layer_stride + b * block_stride` bytes in.
    A description only: jaxkv's device caches are sized from the specs.
    """

    size: int
    shared_by: tuple[str, ...] = ()
    layers: tuple[str, ...] = field(default=(), kw_only=True)
    layer_stride: int = field(default=0, kw_only=True)
    block_stride: int = field(default=0, kw_only=True)
    offset: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared_by", tuple(self.shared_by))
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.layers:
            if check_int("offset", self.offset) < 0:
                raise ValueError(f"KVCacheTensor: offset must be >= 0, got {self.offset}")
            if self.shared_by:
                raise ValueError(
                    f"KVCacheTensor: give shared_by={self.shared_by} or layers={self.layers}, "
                    "not both"
                )
            for name in ("layer_stride", "block_stride"):
                _check_positive(name, getattr(self, name), "KVCacheTensor with layers")


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the pool has and how layers are grouped onto them.

    `prefix_cache_retention_interval`: sparse prefix-cache retention for
    sliding-window and Mamba groups (None: cache densely; 0: only the replay
    boundary; k > 0: one reachable tail per k tokens).
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    prefix_cache_retention_interval: int | None = None
    host_num_blocks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        seen: dict[str, int] = {}
        for i, group in enumerate(self.kv_cache_groups):
            for name in group.layer_names:
                if name in seen:
                    raise ValueError(
                        f"layer {name!r} is in KV cache groups {seen[name]} and {i}; "
                        "a layer has exactly one spec"
                    )
                seen[name] = i

    @property
    def has_mamba_layers(self) -> bool:
        return any(
            isinstance(s, MambaSpec)
            for g in self.kv_cache_groups
            for s in iter_layer_specs(g.kv_cache_spec)
        )

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """Whether the device's attention caches use more than one dtype."""
        dtypes = {
            numpy_dtype(s.dtype)
            for g in self.kv_cache_groups
            if not g.host_resident
            for s in iter_layer_specs(g.kv_cache_spec)
            if isinstance(s, AttentionSpec)
        }
        return len(dtypes) > 1

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        """Ids of the groups a KV connector transfers (`enable_kv_transfer`)."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.enable_kv_transfer)

    @property
    def transfer_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.transfer_group_ids)

    @property
    def transfer_group_index_by_layer(self) -> dict[str, int]:
        """Layer name -> index of its group in `transfer_groups`."""
        return {
            name: index
            for index, group in enumerate(self.transfer_groups)
            for name in group.layer_names
        }

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        """Transferred groups whose blocks a hash-addressed store may keep (no scratch
        state such as cross-attention or a circular buffer)."""
        return tuple(
            i
            for i in self.transfer_group_ids
            if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable
        )

    @property
    def prefix_cacheable_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return tuple(self.kv_cache_groups[i] for i in self.prefix_cacheable_group_ids)

    def select_transfer_block_ids(
        self, block_ids: Sequence[Sequence[int]]
    ) -> tuple[Sequence[int], ...]:
        """The entries of per-group `block_ids` that belong to transferred groups."""
        if len(block_ids) != len(self.kv_cache_groups):
            raise ValueError(
                f"select_transfer_block_ids: expected block ids for {len(self.kv_cache_groups)} "
                f"KV cache groups, got {len(block_ids)}"
            )
        return tuple(block_ids[i] for i in self.transfer_group_ids)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether new blocks must be zeroed before use (vLLM's rule): a Mamba state is
        read before it is fully written, and a page reused under another precision
        would decode stale bytes as NaN/Inf. (Pass it to the coordinator's
        `needs_kv_cache_zeroing` to record new block ids; the caller drains them.)"""
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache

    @classmethod
    def single_group(
        cls, spec: KVCacheSpec, num_blocks: int, layer_names: tuple[str, ...] = ("layer.0",)
    ) -> KVCacheConfig:
        """The common case: every layer has `spec`, each layer its own tensor."""
        tensors = tuple(
            KVCacheTensor(spec.page_size_bytes * num_blocks, (name,)) for name in layer_names
        )
        return cls(num_blocks, tensors, (KVCacheGroupSpec(tuple(layer_names), spec),))

    @classmethod
    def from_groups(
        cls,
        groups: Mapping[KVCacheSpec, tuple[str, ...]] | list[tuple[KVCacheSpec, tuple[str, ...]]],
        num_blocks: int,
        prefix_cache_retention_interval: int | None = None,
    ) -> KVCacheConfig:
        """Hand-built groups (spec, layer names), one tensor per layer: for tests and benchmarks."""
        items = list(groups.items()) if isinstance(groups, Mapping) else list(groups)
        group_specs = tuple(KVCacheGroupSpec(tuple(names), spec) for spec, names in items)
        tensors = tuple(
            KVCacheTensor(spec.page_size_bytes * num_blocks, (name,))
            for spec, names in items
            for name in names
        )
        return cls(num_blocks, tensors, group_specs, prefix_cache_retention_interval)
