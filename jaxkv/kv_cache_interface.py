"""KV-cache specs: what one layer's (or one group's) cache looks like, in pages.

A spec is pure description; it never owns memory. The device allocator sizes
arrays from it, the block pool counts pages of it, capacity planning adds it up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jaxkv._checks import check_int


def dtype_num_bytes(dtype: str | np.dtype) -> int:
    """Bytes per element of `dtype` ("bfloat16", "float32", np.float16, ...)."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return 2
    return int(np.dtype(dtype).itemsize)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs: one page holds `block_size` tokens of one layer."""

    block_size: int

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, min_value=1)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Peak bytes one request can hold at `max_model_len` (SPEC §6)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 128
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("num_kv_heads", self.num_kv_heads)
        check_int("head_size", self.head_size)
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(
                f"num_kv_heads and head_size must be positive, got "
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}"
            )

    @property
    def page_size_bytes(self) -> int:
        return (
            2 * self.block_size * self.num_kv_heads * self.head_size * dtype_num_bytes(self.dtype)
        )


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: one page per `block_size` tokens."""

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return math.ceil(max_model_len / self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last `sliding_window` tokens only."""

    sliding_window: int = field(default=4096)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (math.ceil(tokens / self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of `attention_chunk_size` tokens."""

    attention_chunk_size: int = field(default=8192)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return math.ceil(tokens / self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table because they share one spec."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One device buffer of `size` bytes shared by `shared_by` layers."""

    size: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the pool has and how layers are grouped onto them."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    @classmethod
    def single_group(
        cls, spec: KVCacheSpec, num_blocks: int, layer_names: tuple[str, ...] = ("layer.0",)
    ) -> KVCacheConfig:
        """The common case: every layer has `spec`, each layer its own tensor."""
        tensors = tuple(
            KVCacheTensor(spec.page_size_bytes * num_blocks, (name,)) for name in layer_names
        )
        return cls(num_blocks, tensors, (KVCacheGroupSpec(tuple(layer_names), spec),))
