"""`EngineConfig`: the engine's sizes and switches, and the checks made on them before
anything is allocated (`check_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jaxkv.block_pool import check_tenant_block_quotas
from jaxkv.engine.stats import DEFAULT_WINDOW_STEPS
from jaxkv.kv_events_publisher import KVEventsConfig, check_endpoint
from jaxkv.sampling_params import LOGPROBS_MODES

__all__ = ["WEIGHT_UPDATE_POLICIES", "EngineConfig", "check_config"]


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine. `encoder_cache_size` / `encoder_compute_budget` count image
    embeddings (None: room for `max_num_batched_tokens`, at least one image).
    The KV cache is sized by `jaxkv.engine.sizing`: `num_blocks` as given, else as many as
    `kv_cache_memory` bytes per device hold (or `memory_utilization` of the device's
    memory, vLLM's `gpu_memory_utilization`, where the device reports its size);
    `max_model_len=None` takes the longest request that pool holds, capped by the
    model's `max_position_embeddings`. `LLMEngine.config` holds the resolved values.
    `kv_cache_dtype` "int8" / "fp8" stores the KV cache quantised, a float32 scale per
    token and head (`jaxkv.device.storage`); "auto" stores it in `dtype`.
    `kv_events_endpoint` (None: off) publishes each step's KV events as vLLM does
    (`jaxkv.kv_events_publisher`), data rank `k` on the endpoint's port + `k`;
    `kv_events_replay_endpoint` adds the replay socket; `kv_events_topic` is the topic
    frame; `kv_events_int_block_hashes=False` sends digest bytes instead of 64-bit ints.
    What KV events may hold in memory, per data rank (vLLM's `KVEventsConfig` names):
    `kv_events_hwm` messages queued for each subscriber that does not read (the PUB
    socket's high-water mark; past it that subscriber misses messages),
    `kv_events_buffer_steps` messages kept for replay, `kv_events_max_queue_size`
    batches waiting for the publishing thread (past it the oldest is dropped), and
    `kv_events_replay_hwm` replayed messages queued for each replay client (one that
    does not read is dropped; `jaxkv.kv_events_replay`).
    `stats_window_steps`: the recent steps `LLMEngine.stats.steps` keeps; the totals
    (`stats.summary()`) cover the whole run whatever it is.
    `kv_offloading_size` (vLLM's name; bytes, None: off) keeps blocks in a host-memory
    tier behind the device pool (`jaxkv.engine.offload`), evicting by
    `kv_offloading_policy` ("lru" or "arc"), with optional per-`cache_salt` byte caps
    `kv_offloading_tenant_quotas` (each at least one block, at most the budget); full
    attention and sliding-window KV-cache groups; each data rank has its own tier of
    that budget, as each has its own device pool. `kv_offloading_store` is when a
    cached block is copied there: "finished" (the default) when a request holding it
    finishes or is preempted, so the tier also holds blocks still in the device pool;
    "evicted" only when the device pool evicts it for reuse (host bytes and copies
    spent only on blocks the device drops). "finished" stays the default: on the
    multi-turn test workload (a device pool of a third of the working set) "evicted"
    served fewer prefix tokens (336 vs 432 of 558 on the one-group model, equal on the
    hybrid one): a block evicted for another request admitted earlier in the same
    `schedule()` is only queued for the tier, in neither tier yet, so a request
    admitted after it in that step recomputes it.
    `device_tenant_block_quotas` (None: off) caps the blocks each listed `cache_salt`
    may hold in the device prefix cache, per data rank (each an int >= 0): a salt at
    its cap gives up its own least recently freed cached block, or leaves the new block
    uncached when all of its cached blocks are in use; it never evicts another salt's
    blocks (`jaxkv.block_pool.BlockPool`). Given (even `{}`), every salt's cached blocks
    are counted for `stats.tenants()`. Quota keys (here and in
    `kv_offloading_tenant_quotas`) are non-empty salts, or `"*"` for every salt not
    listed; unsalted requests are never capped. A quota is a cap, not a reservation:
    other tenants may still fill the free blocks a capped tenant does not hold.
    `enable_kv_cache_events` (vLLM's `KVEventsConfig` name) keeps each step's KV events,
    the device pool's and the host tier's (`medium="CPU"`), for `take_kv_events()`,
    with or without an endpoint.
    `weight_update_policy`: what `LLMEngine.update_weights` does with the requests
    holding KV: "recompute" (the default) preempts them, to recompute their KV under
    the new weights; "keep" lets them go on with their KV (partial-rollout RL), keyed
    under their admission version (see `Scheduler.update_weights`); "abort" aborts them.
    Waiting requests are always keyed under the new version.
    `logprobs_mode` (vLLM's `ModelConfig.logprobs_mode`, one of `LOGPROBS_MODES`): what
    a request's `logprobs` hold, the log-softmax ("*_logprobs") or the logits
    ("*_logits") of the model's raw output ("raw_*", the default "raw_logprobs") or of
    what the token was sampled from after the stop-token ban, penalties, temperature and
    filters ("processed_*"; `jaxkv.engine.sampling`); `prompt_logprobs` are of the raw
    output in either case, as in vLLM."""

    block_size: int | None = None  # None: 128 on a TPU, else 16 (`default_block_size`)
    num_blocks: int | None = None  # None: from the memory budget, else 128
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int | None = 256  # None: the longest that fits, at most the model's
    kv_cache_memory: int | None = None  # bytes per device for the KV cache
    memory_utilization: float | None = None  # of the device's memory (memory_stats)
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    zero_freed_blocks: bool = False
    async_scheduling: bool = True
    encoder_cache_size: int | None = None
    encoder_compute_budget: int | None = None
    hash_fn: str = "sha256"
    seed: int = 0
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # vLLM's name: "auto" (= dtype), "int8" or "fp8" (e4m3)
    compilation_cache_dir: str | None = "auto"  # jaxkv.device.compilation_cache
    kv_events_endpoint: str | None = None  # e.g. "tcp://*:5557"
    kv_events_replay_endpoint: str | None = None  # e.g. "tcp://*:5558"
    kv_events_topic: str = ""
    kv_events_int_block_hashes: bool = True
    kv_events_redact_prompts: bool = False  # publish no token ids or salts (README: tenants)
    kv_events_hwm: int = KVEventsConfig.hwm
    kv_events_buffer_steps: int = KVEventsConfig.buffer_steps
    kv_events_max_queue_size: int = KVEventsConfig.max_queue_size
    kv_events_replay_hwm: int = KVEventsConfig.replay_hwm
    kv_offloading_size: int | None = None  # bytes of host memory, e.g. 8 * 2**30
    kv_offloading_policy: str = "lru"
    kv_offloading_store: str = "finished"  # or "evicted": when blocks go to the host tier
    kv_offloading_tenant_quotas: Mapping[str, int] | None = None
    device_tenant_block_quotas: Mapping[str, int] | None = None
    enable_kv_cache_events: bool = False
    stats_window_steps: int = DEFAULT_WINDOW_STEPS
    weight_update_policy: str = "recompute"  # or "keep", "abort"
    logprobs_mode: str = "raw_logprobs"  # vLLM's name and values (LOGPROBS_MODES)


# What `update_weights` does with requests holding KV (`EngineConfig.weight_update_policy`).
WEIGHT_UPDATE_POLICIES = ("recompute", "keep", "abort")

# The fields that hold a positive int or None.
_POSITIVE_OR_NONE = (
    "block_size", "kv_cache_memory", "num_blocks", "max_model_len", "encoder_cache_size",
    "encoder_compute_budget",
)  # fmt: skip
# The fields that hold a positive int.
_POSITIVE = (
    "kv_events_hwm", "kv_events_buffer_steps", "kv_events_max_queue_size",
    "kv_events_replay_hwm", "stats_window_steps",
)  # fmt: skip


def check_config(c: EngineConfig) -> Mapping[str, int] | None:
    """Raise ValueError/TypeError naming the first bad field of `c`; called before the
    device memory is allocated, so a bad config changes nothing. Returns the checked
    `device_tenant_block_quotas` (None: off)."""
    for name in (*_POSITIVE_OR_NONE, *_POSITIVE):
        value = getattr(c, name)
        if value is None and name in _POSITIVE_OR_NONE:
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            allowed = "a positive int or None" if name in _POSITIVE_OR_NONE else "a positive int"
            raise ValueError(f"EngineConfig.{name} must be {allowed}, got {value!r}")
    if c.memory_utilization is not None and not 0 < c.memory_utilization <= 1:
        raise ValueError(
            f"EngineConfig.memory_utilization must be in (0, 1], got {c.memory_utilization!r}"
        )
    for name in ("enable_kv_cache_events", "kv_events_redact_prompts"):
        if not isinstance(getattr(c, name), bool):
            raise TypeError(f"EngineConfig.{name} must be a bool, got {getattr(c, name)!r}")
    device_quotas = check_tenant_block_quotas(
        c.device_tenant_block_quotas, "EngineConfig.device_tenant_block_quotas"
    )
    if c.weight_update_policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(
            f"EngineConfig.weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got "
            f"{c.weight_update_policy!r}"
        )
    if c.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(
            f"EngineConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {c.logprobs_mode!r}"
        )
    if c.kv_cache_dtype not in ("auto", "int8", "fp8"):
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {c.kv_cache_dtype!r}"
        )
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        if getattr(c, name) is not None:
            check_endpoint(getattr(c, name), f"EngineConfig.{name}")
    return device_quotas
