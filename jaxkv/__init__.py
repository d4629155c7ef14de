"""jaxkv: vLLM v1-style KV-cache management for JAX serving.

The top-level package is host-side only (Python + numpy) and never imports
JAX; the jitted device code lives in `jaxkv.device`, the serving engine in
`jaxkv.engine`, the models in `jaxkv.models`.

Exported here is what a user of the cache managers needs (`__all__` lists them
in these groups):

- requests and their block hashes: a `Request` hashed by
  `get_request_block_hasher(block_size, get_hash_fn_by_name(name))`;
- what the cache holds: one spec per attention type, grouped in a `KVCacheConfig`;
- sizing a cache for a model and a memory budget;
- the `KVCacheManager` and what it hands out (blocks per group, prefix-cache
  stats, page copies), the `BlockPool` under it, `BlockTable` for the device;
- KV events (drained per step by `KVCacheManager.take_events()`);
- the multimodal encoder cache.

Everything else (the coordinators and per-type managers, hash-key helpers, the
free-block queue, block-size and DCP resolution helpers, the capacity
arithmetic) stays importable from its own module, e.g.
`jaxkv.kv_cache_coordinator.HybridKVCacheCoordinator` or
`jaxkv.single_type_kv_cache_manager.SlidingWindowManager`. What exists only for
vLLM's own tests and call shapes is in `jaxkv.compat.vllm`, which the core never
imports.
"""

from jaxkv.block_pool import BlockPool
from jaxkv.block_table import BlockTable
from jaxkv.blocks import KVCacheBlock
from jaxkv.encoder_cache_manager import (
    EncoderBudget,
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    compute_encoder_budget,
)
from jaxkv.hashing import (
    BlockHash,
    get_hash_fn_by_name,
    get_none_hash,
    hash_block_tokens,
    init_none_hash,
)
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from jaxkv.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from jaxkv.kv_cache_planning import (
    KVCacheCapacity,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
    get_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
)
from jaxkv.kv_cache_utils import KVCacheBlockCopy, resolve_kv_cache_block_sizes
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.mm_hashing import hash_mm_item
from jaxkv.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)
from jaxkv.request_hashing import RequestBlockHasher, get_request_block_hasher
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    # requests and block hashes
    "BlockHash",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "Request",
    "RequestBlockHasher",
    "RequestOutputKind",
    "RequestStatus",
    "SamplingParams",
    "get_hash_fn_by_name",
    "get_none_hash",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_mm_item",
    "init_none_hash",
    # specs and configs
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVCacheTensor",
    "KVQuantMode",
    "MLAAttentionSpec",
    "MambaSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    # sizing
    "KVCacheCapacity",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_capacity",
    "get_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "resolve_kv_cache_block_sizes",
    # the manager
    "BlockPool",
    "BlockTable",
    "KVCacheBlock",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    # events
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    # encoder cache
    "EncoderBudget",
    "EncoderCacheManager",
    "EncoderDecoderCacheManager",
    "compute_encoder_budget",
]
