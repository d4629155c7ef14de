"""Device side of jaxkv: sharded paged KV caches, paged attention, step metadata.

Never imports the host scheduler (`jaxkv.kv_cache_manager`, `jaxkv.block_pool`, ...):
the host hands over plain int32 numpy data, the device makes no allocation decisions.
"""

from jaxkv.device.attention import (
    AttentionOptions,
    paged_decode_attention,
    ragged_paged_attention,
)
from jaxkv.device.compile_guard import (
    CompilationCounter,
    CompilationError,
    compilation_cache_hits,
    compilation_count,
    no_compilation,
)
from jaxkv.device.encoder_store import EncoderCacheStore
from jaxkv.device.kv_cache import PagedKVCache
from jaxkv.device.mesh import DATA_AXIS, MODEL_AXIS, KVLayout, make_mesh
from jaxkv.device.step_metadata import (
    StepField,
    StepInputs,
    StepLayout,
    StepMetadata,
    StepMetadataPacker,
    StepRows,
    StepShape,
    default_min_num_tokens,
    padding_buckets,
    pick_bucket,
    token_buckets,
    unpack_step,
)

__all__ = [
    "DATA_AXIS",
    "MODEL_AXIS",
    "AttentionOptions",
    "CompilationCounter",
    "CompilationError",
    "EncoderCacheStore",
    "KVLayout",
    "PagedKVCache",
    "StepField",
    "StepInputs",
    "StepLayout",
    "StepMetadata",
    "StepMetadataPacker",
    "StepRows",
    "StepShape",
    "compilation_cache_hits",
    "compilation_count",
    "make_mesh",
    "no_compilation",
    "default_min_num_tokens",
    "padding_buckets",
    "token_buckets",
    "paged_decode_attention",
    "pick_bucket",
    "ragged_paged_attention",
    "unpack_step",
]
