"""jaxkv: vLLM v1-style KV-cache management for JAX serving.

The top-level package is host-side only (Python + numpy) and never imports
JAX; the jitted device code lives in `jaxkv.device`.
"""

from jaxkv.block_pool import BlockPool
from jaxkv.block_table import BlockTable
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.encoder_cache_manager import (
    EncoderBudget,
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    compute_encoder_budget,
)
from jaxkv.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_none_hash,
    get_none_hash_seed,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
)
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from jaxkv.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.mm_hashing import hash_mm_item, processor_kwargs_digest
from jaxkv.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
    SamplingParams,
)
from jaxkv.request_hashing import (
    BlockHashMemo,
    RequestBlockHasher,
    generate_block_hash_extra_keys,
    get_request_block_hasher,
)

__all__ = [
    "BlockHashMemo",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "ChunkedLocalAttentionSpec",
    "EncoderBudget",
    "EncoderCacheManager",
    "EncoderDecoderCacheManager",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "PrefixCacheStats",
    "Request",
    "RequestBlockHasher",
    "RequestStatus",
    "SamplingParams",
    "SlidingWindowSpec",
    "compute_encoder_budget",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_none_hash",
    "get_none_hash_seed",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_mm_item",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "processor_kwargs_digest",
]
