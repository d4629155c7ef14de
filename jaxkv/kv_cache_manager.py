"""The KV cache manager: the scheduler's one entry point to KV-cache blocks (SPEC §5).

Size: over 800 lines because `KVCacheManager` is vLLM's one manager class (its whole
API, in vLLM's shape, is methods of one object) and its `allocate_slots` step path
(`_Step`, `SlotState` and the stages that read them) is one hot path kept in one
place; the prefix-cache statistics are `jaxkv.prefix_cache_stats`, the per-group work
`jaxkv.kv_cache_coordinator` and the managers under it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxkv._checks import as_int, check_bool, check_int, check_num_blocks, check_str
from jaxkv.blocks import KVCacheBlock
from jaxkv.kv_cache_coordinator import get_kv_cache_coordinator
from jaxkv.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    cdiv,
    get_kv_cache_spec_sliding_window,
)
from jaxkv.kv_cache_utils import KVCacheBlockCopy, resolve_kv_cache_block_sizes
from jaxkv.kv_events import BlockStored, DeferredKVCacheEvent, KVCacheEvent
from jaxkv.prefix_cache_stats import CachingMetrics, PrefixCacheStats
from jaxkv.request import Request
from jaxkv.single_type_base import NEVER

logger = logging.getLogger("jaxkv")

__all__ = [
    "CachingMetrics",  # jaxkv.prefix_cache_stats's, re-exported
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",  # jaxkv.prefix_cache_stats's, re-exported
    "SlotState",
]


@dataclass
class KVCacheBlocks:
    """Blocks handed to or by the scheduler: one list per KV-cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self, group_ids: Sequence[int] | None = None) -> tuple[list[int], ...]:
        """Block ids per group; `group_ids` selects (and orders) the groups."""
        groups = self.blocks if group_ids is None else [self.blocks[i] for i in group_ids]
        return tuple([block.block_id for block in group] for group in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids is defined for a single KV cache group")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.blocks))


@dataclass(slots=True)
class SlotState:
    """What a request holding blocks can do before `allocate_slots` must change anything.

    `capacity`: the tokens (lookahead included) its blocks hold, at most
    `max_model_len`; `caches_at`: the cacheable-token count at which its next block
    fills and would be cached (`NEVER` when caching is off); `releases_at`: the
    local computed-token count at which some group would release a block that left
    its attention window (`NEVER` without sliding-window, chunked-local or Mamba
    groups); `quiet_until`: `min(capacity, caches_at - 1, releases_at)`.

    Never changed once made (a new one replaces it). Invariant: a step of `n >= 1` new
    tokens, no hits, from `c` computed tokens with `c + n + lookahead <= quiet_until`
    allocates, caches and releases nothing.
    """

    capacity: int
    caches_at: int
    releases_at: int
    quiet_until: int


# What a request's slot state says when it says nothing (every step takes every stage).
_NO_SLOT_STATE = SlotState(0, 0, 0, 0)


@dataclass(slots=True)
class _Step:
    """One `allocate_slots` call: its arguments, then (after validation) Python ints,
    and the token counts of its block layout (see `allocate_slots`)."""

    request: Request
    state: SlotState | None  # None at the request's first allocation
    # Python ints in range, no encoder, KV-connector or reserved-block arguments: a
    # running request's missing blocks can be bounded without counting per group.
    plain: bool
    num_new_tokens: int
    num_new_computed_tokens: int
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    num_encoder_tokens: int
    reserved_blocks: int
    skip_zeroing_group_ids: Sequence[int]  # a tuple of ints with KV-connector tokens
    # Set by `_lay_out` (unset before it):
    hits: tuple[Sequence[KVCacheBlock], ...] = field(init=False)  # per group, [] if none
    has_hits: bool = field(init=False)
    num_local_computed_tokens: int = field(init=False)  # computed, plus the local hits
    num_computed_tokens: int = field(init=False)  # plus the tokens a KV connector computed
    num_tokens: int = field(init=False)  # plus the new tokens: where the step ends
    num_slot_tokens: int = field(init=False)  # plus lookahead tokens, <= max_model_len
    num_cacheable_tokens: int = field(init=False)  # <= request.num_tokens (no unverified)
    # `num_tokens` for the groups that give lookahead tokens no slot, when there are
    # lookahead tokens and such groups; else None.
    num_tokens_main_model: int | None = field(init=False)
    cache: bool = field(init=False)  # caching on and not delayed


class KVCacheManager:
    """Prefix-caching block manager for one pool and one or more KV-cache groups.

    Invariants (kept by the layers below): every block is free xor held; a
    request's held blocks are exactly `get_block_ids(request_id)`; a failed
    `allocate_slots` (it returns None) changes no state but releasing blocks that
    left an attention window; `_slot_states[r]` is `_slot_state_for(r)` for every
    request `r` holding blocks, and `_running` maps their ids to them.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: object = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        track_freed_block_ids: bool = False,
        tenant_block_quotas: Mapping[str, int] | None = None,
    ) -> None:
        """vLLM's arguments, in its order (docs/vllm-differences.md lists what differs).

        `scheduler_block_size` defaults to the LCM of the group block sizes and,
        when given, must equal it; `hash_block_size` defaults to vLLM's choice
        (`resolve_kv_cache_block_sizes`: the group block size, or the GCD of a
        hybrid's). `use_eagle` drops the last matched block of EAGLE groups;
        `num_prefill_lookahead` (multi-token MTP) keeps its re-prefilled tokens
        out of the cache. `enable_mamba_shared_prefix_checkpoint` takes effect as in
        vLLM (`mamba_shared_prefix_checkpoint`): with EAGLE groups, partial hits and no
        re-prefilled tokens, a Mamba "align" state is also keyed at a request's
        `shared_prefix_boundary`. Features jaxkv does not have (hash lookahead, context
        parallelism, a watermark) must be left at their defaults. Integer arguments may
        be numpy integers (they are converted before anything is built).
        `tenant_block_quotas` (jaxkv's; None: off): the most blocks each listed
        `cache_salt` may hold in the prefix cache (`BlockPool`'s docstring).
        """
        (
            max_model_len,
            scheduler_block_lcm,
            hash_block_size,
            max_in_flight_tokens,
            num_prefill_lookahead,
        ) = self._check_arguments(
            kv_cache_config,
            max_model_len,
            hash_block_size,
            max_in_flight_tokens,
            enable_caching,
            use_eagle,
            num_prefill_lookahead,
            log_stats,
            enable_kv_cache_events,
            enable_mamba_shared_prefix_checkpoint,
            track_freed_block_ids,
            {
                "num_hash_lookahead_tokens": (num_hash_lookahead_tokens, 0),
                "dcp_world_size": (dcp_world_size, 1),
                "pcp_world_size": (pcp_world_size, 1),
                "watermark": (watermark, 0.0),
            },
        )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.hash_block_size = hash_block_size
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.watermark_blocks = 0
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            enable_caching,
            scheduler_block_lcm,
            hash_block_size,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            track_freed_block_ids=track_freed_block_ids,
            num_prefill_lookahead=num_prefill_lookahead,
            max_in_flight_tokens=max_in_flight_tokens,
        )
        if tenant_block_quotas is not None:
            self.coordinator.block_pool.set_tenant_block_quotas(tenant_block_quotas)
        self._check_scheduler_block_size(scheduler_block_size)
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and self.coordinator.enable_mamba_shared_prefix_checkpoint()
        )
        self._derive_state(kv_cache_config)

    def _check_scheduler_block_size(self, scheduler_block_size: int | None) -> None:
        """A given `scheduler_block_size` must be the coordinator's (the groups' LCM)."""
        if scheduler_block_size is not None and (
            check_int("scheduler_block_size", scheduler_block_size, min_value=1)
            != self.coordinator.scheduler_block_size
        ):
            raise ValueError(
                f"scheduler_block_size={scheduler_block_size} does not match the KV cache "
                f"groups, whose block sizes' LCM is {self.coordinator.scheduler_block_size}"
            )

    @staticmethod
    def _check_arguments(
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int | None,
        max_in_flight_tokens: int | None,
        enable_caching: bool,
        use_eagle: bool,
        num_prefill_lookahead: int,
        log_stats: bool,
        enable_kv_cache_events: bool,
        enable_mamba_shared_prefix_checkpoint: bool,
        track_freed_block_ids: bool,
        unsupported: dict[str, tuple[object, object]],
    ) -> tuple[int, int, int, int, int]:
        """The constructor's arguments checked (TypeError/ValueError naming the first bad
        one): (max_model_len, the LCM of the group block sizes, hash_block_size,
        max_in_flight_tokens, num_prefill_lookahead) as Python ints, defaults filled
        in. `unsupported` maps each feature jaxkv lacks to (given, the only allowed
        value)."""
        max_model_len = check_int("max_model_len", max_model_len, min_value=1)
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
        if not kv_cache_config.kv_cache_groups:
            raise ValueError("kv_cache_config needs at least one KV cache group")
        lcm_block_size, default_hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, enable_caching
        )
        if hash_block_size is None:
            hash_block_size = default_hash_block_size
        hash_block_size = check_int("hash_block_size", hash_block_size, min_value=1)
        if max_in_flight_tokens is not None:
            max_in_flight_tokens = check_int(
                "max_in_flight_tokens", max_in_flight_tokens, min_value=1
            )
        for name, value in (
            ("enable_caching", enable_caching),
            ("log_stats", log_stats),
            ("enable_kv_cache_events", enable_kv_cache_events),
            ("track_freed_block_ids", track_freed_block_ids),
            ("use_eagle", use_eagle),
            ("enable_mamba_shared_prefix_checkpoint", enable_mamba_shared_prefix_checkpoint),
        ):
            check_bool(name, value)
        num_prefill_lookahead = check_int(
            "num_prefill_lookahead", num_prefill_lookahead, min_value=0
        )
        for name, (value, default) in unsupported.items():
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                raise ValueError(
                    f"{name}={value!r} is not supported by jaxkv; only {default!r} is allowed "
                    "(docs/vllm-differences.md)"
                )
        max_in_flight_tokens = max_in_flight_tokens or max_model_len
        return (
            max_model_len,
            lcm_block_size,
            hash_block_size,
            max_in_flight_tokens,
            num_prefill_lookahead,
        )

    def _derive_state(self, kv_cache_config: KVCacheConfig) -> None:
        """The fields derived from the coordinator, and the per-request records (empty)."""
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = self.coordinator.num_groups
        # (spec kind, sliding window) per group, for the BlockStored events.
        self._event_metadata = tuple(
            (g.kv_cache_spec.kind.value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        self.block_pool.event_group_specs = self._event_metadata
        # The last hit `get_computed_blocks` returned: (blocks, tokens, the pool's
        # num_hash_removals then). Handed back unchanged to `allocate_slots` while no
        # hash was removed, its blocks are known to be this pool's cached blocks.
        self._last_lookup: tuple[KVCacheBlocks, int, int] | None = None
        # Request -> its `SlotState`, for every request holding blocks (keyed by the
        # object, so a second Request with a running request's id never matches).
        self._slot_states: dict[Request, SlotState] = {}
        # Off (tests only), every step takes every stage: the slot state is a shortcut.
        self._use_slot_state = True
        # request id -> the Request object holding blocks under that id.
        self._running: dict[str, Request] = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @classmethod
    def from_spec(
        cls, kv_cache_spec: KVCacheSpec, num_blocks: int, max_model_len: int, **kwargs
    ) -> KVCacheManager:
        """The common case: one group of layers sharing `kv_cache_spec`, `num_blocks` pages
        (at least 2: block 0 is the null block)."""
        num_blocks = check_num_blocks("num_blocks", num_blocks)
        return cls(KVCacheConfig.single_group(kv_cache_spec, num_blocks), max_model_len, **kwargs)

    # -- properties ----------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def scheduler_block_size(self) -> int:
        return self.coordinator.scheduler_block_size

    # -- scheduling ----------------------------------------------------------

    def _check_request(self, request: Request) -> None:
        """Admission checks: a Request, hashed at this manager's block size, that fits."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a jaxkv Request, got {request!r}")
        if request.hash_block_size is not None and request.hash_block_size != self.hash_block_size:
            raise ValueError(
                f"request {request.request_id!r} is hashed at block size "
                f"{request.hash_block_size} but this manager hashes at hash_block_size="
                f"{self.hash_block_size}; its cache keys would name other tokens' KV. Give it "
                f"block_hasher=get_request_block_hasher({self.hash_block_size}, hash_fn)"
            )
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks, hit tokens, shared_prefix_boundary), as vLLM returns them.

        The hit is the longest cached prefix, block aligned, of at most
        `max_cache_hit_length` tokens (default `num_tokens - 1`: the last token
        is always recomputed for its logits).

        `shared_prefix_boundary` (0 unless hybrid): where some group's cached
        prefix runs past the hit every group agrees on, i.e. a shared prefix a
        sliding-window or Mamba group has not cached yet. As vLLM's scheduler
        does, store it in `request.shared_prefix_boundary`: sparse retention
        then keeps the blocks ending there, so the junction stays reusable.
        """
        blocks, num_hit_tokens, num_uncached = self._find_hits(request, max_cache_hit_length)
        if blocks is None:
            return self.empty_kv_cache_blocks, 0, 0
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )
        hits = self.create_kv_cache_blocks(blocks)
        if num_hit_tokens:
            self._last_lookup = (hits, num_hit_tokens, self.block_pool.num_hash_removals)
        return hits, num_hit_tokens, num_hit_tokens + num_uncached if num_uncached else 0

    def get_num_cached_prefix_tokens(self, request: Request) -> int:
        """The hit length `get_computed_blocks(request)` would return now; changes nothing
        (no prefix-cache stats, no lookup remembered for `allocate_slots`). A router asks
        each data rank's manager where a new request's prefix is cached."""
        return self._find_hits(request, None)[1]

    def _find_hits(
        self, request: Request, max_cache_hit_length: int | None
    ) -> tuple[tuple[list[KVCacheBlock], ...] | None, int, int]:
        """(hit blocks per group or None when the request reads no cached prefix, hit
        tokens, uncached tokens of a longer shared prefix some group holds)."""
        self._check_request(request)
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        else:
            max_cache_hit_length = check_int(
                "max_cache_hit_length", max_cache_hit_length, min_value=0
            )
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return None, 0, 0
        return self.coordinator.find_longest_cache_hit(request.block_hashes, max_cache_hit_length)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` more tokens (plus hits and lookahead); None if out of blocks.

        vLLM's arguments in its order. A request's blocks, by the tokens they hold:

            -------------------------------------------------------------------------
            | < computed > | < new computed > | < external > | < new > | < lookahead > |
            -------------------------------------------------------------------------
                           |   local hits     | KV connector |  this step computes
            |<-- num_local_computed_tokens -->|
            |<------------ num_computed_tokens ------------>|
            |<------------------------ num_tokens ----------------------->|
            |<------------------------- num_slot_tokens (at most max_model_len) ------>|
            |<-- num_cacheable_tokens: min(num_tokens, request.num_tokens) -->|

        "computed" is `request.num_computed_tokens`; the new computed tokens are the
        hits `get_computed_blocks` returned (`new_computed_blocks`), the external ones
        the tokens a KV connector supplies (a request's first allocation only, no
        Mamba group; `num_new_tokens` may then be 0, an async load, and
        `skip_zeroing_group_ids` names the groups whose blocks the load writes).

        Four stages, each a method: validate (every argument checked, raising
        TypeError/ValueError before any change; a quiet step, see `SlotState`, is
        answered here), count (blocks that left an attention window are released,
        as vLLM does, even when the allocation then fails; then the blocks every
        group lacks for `num_slot_tokens`, None when fewer are free than that plus
        `reserved_blocks`; `full_sequence_must_fit` also wants the whole request to
        fit), take blocks (every group's hits before any group's new blocks), cache
        (the blocks `num_cacheable_tokens` fill, unless caching is off or
        `delay_cache_blocks`). On None nothing else changed. `num_encoder_tokens`
        sizes cross-attention groups; `has_scheduled_reqs` is accepted, unused.
        """
        try:
            state = self._slot_states.get(request)
        except TypeError:  # unhashable: not a Request
            raise TypeError(f"request must be a jaxkv Request, got {request!r}") from None
        if (
            state is not None
            and type(num_new_tokens) is int
            and type(num_lookahead_tokens) is int
            and num_new_tokens > 0
            and num_lookahead_tokens >= 0
            and request.num_computed_tokens + (num_new_tokens + num_lookahead_tokens)
            <= state.quiet_until
            and request.num_computed_tokens <= request.num_tokens
            and new_computed_blocks is None
            and not full_sequence_must_fit
            and type(num_new_computed_tokens)
            is type(num_external_computed_tokens)
            is type(reserved_blocks)
            is type(num_encoder_tokens)
            is int
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or reserved_blocks
                or num_encoder_tokens
            )
        ):
            return self.empty_kv_cache_blocks  # a quiet step: no stage would change anything
        step = self._validate(
            request,
            state,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            reserved_blocks,
            skip_zeroing_group_ids,
        )
        num_blocks = self._count_blocks(step, full_sequence_must_fit)
        if num_blocks is None:
            return None
        new_blocks = self._take_blocks(step, num_blocks)
        self._cache_and_record(step)
        return new_blocks

    def _validate(
        self,
        request: Request,
        state: SlotState | None,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        reserved_blocks: int,
        skip_zeroing_group_ids: Sequence[int],
    ) -> _Step:
        """Stage 1: `allocate_slots`' arguments checked, before any change; a request at
        its first allocation is checked too (one with a `state` holds blocks under this
        object and was checked then)."""
        plain = (
            type(num_new_tokens) is type(num_lookahead_tokens) is int
            and type(num_new_computed_tokens) is type(num_external_computed_tokens) is int
            and type(reserved_blocks) is type(num_encoder_tokens) is int
            and num_new_tokens > 0
            and num_lookahead_tokens >= 0
            and num_new_computed_tokens >= 0
            and not (num_external_computed_tokens or reserved_blocks or num_encoder_tokens)
        )
        step = _Step(
            request,
            state,
            plain,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            reserved_blocks,
            skip_zeroing_group_ids,
        )
        if not plain:
            self._check_counts(step)
        if state is None:
            self._check_new_request(request)
        self._check_num_computed_tokens(request, state)
        hits = None
        if new_computed_blocks is not None or step.num_new_computed_tokens:
            hits = self._check_hits(request, step.num_new_computed_tokens, new_computed_blocks)
        self._lay_out(step, hits, delay_cache_blocks)
        return step

    def _lay_out(
        self,
        step: _Step,
        hits: tuple[Sequence[KVCacheBlock], ...] | None,
        delay_cache_blocks: bool,
    ) -> None:
        """The step's block layout from its checked counts; raises (before any change)
        when it passes `max_model_len` or caching would lack block hashes."""
        request = step.request
        step.hits = hits or self.empty_kv_cache_blocks.blocks
        step.has_hits = hits is not None
        step.num_local_computed_tokens = request.num_computed_tokens + step.num_new_computed_tokens
        step.num_computed_tokens = (
            step.num_local_computed_tokens + step.num_external_computed_tokens
        )
        step.num_tokens = num_tokens = step.num_computed_tokens + step.num_new_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: {step.num_computed_tokens} computed + "
                f"{step.num_new_tokens} new tokens exceed max_model_len={self.max_model_len}"
            )
        num_slot_tokens = num_tokens + step.num_lookahead_tokens
        if num_slot_tokens > self.max_model_len:
            num_slot_tokens = self.max_model_len
        step.num_slot_tokens = num_slot_tokens
        step.num_tokens_main_model = (
            num_tokens
            if step.num_lookahead_tokens and self.coordinator.some_group_ignores_lookahead
            else None
        )
        step.num_cacheable_tokens = num_tokens
        if num_tokens > request.num_tokens:
            step.num_cacheable_tokens = request.num_tokens
        step.cache = self.enable_caching and not delay_cache_blocks
        # Caching needs a hash for every block it fills (it would fail half-way otherwise).
        if step.cache and len(request.block_hashes) < (
            num_full_blocks := step.num_cacheable_tokens // self.hash_block_size
        ):
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block "
                f"hashes but {num_full_blocks} full blocks of {self.hash_block_size} tokens "
                f"to cache; give it block_hasher=get_request_block_hasher("
                f"{self.hash_block_size}, hash_fn)"
            )

    @staticmethod
    def _check_num_computed_tokens(request: Request, state: SlotState | None) -> None:
        """A request's computed tokens are KV its blocks hold: at most its `num_tokens`,
        and none while it holds no blocks here (`state` None: a new, freed or preempted
        request restarts from 0, its prefix hits given as `num_new_computed_tokens`).
        Otherwise its slots would start past blocks nobody wrote, and caching them would
        key that unwritten KV under the request's real block hashes."""
        rid = request.request_id
        computed = check_int(
            f"request {rid!r}: num_computed_tokens", request.num_computed_tokens, min_value=0
        )
        if computed > request.num_tokens:
            raise ValueError(
                f"request {rid!r}: num_computed_tokens={computed} exceeds its num_tokens="
                f"{request.num_tokens} (tokens are computed only once they are in the request)"
            )
        if state is None and computed:
            raise ValueError(
                f"request {rid!r} holds no blocks here but has num_computed_tokens="
                f"{computed} (of num_tokens={request.num_tokens}): a new, freed or "
                "preempted request restarts from num_computed_tokens=0, its prefix hits "
                "given as num_new_computed_tokens"
            )

    def _check_new_request(self, request: Request) -> None:
        """A request's first allocation: a `Request` (`_check_request`) whose id no other
        Request object holds blocks under."""
        try:
            request_id = request.request_id
        except AttributeError:
            raise TypeError(f"request must be a jaxkv Request, got {request!r}") from None
        if self._running.get(request_id) is not None:
            raise ValueError(
                f"request id {request_id!r} belongs to a running request; a second "
                "Request object with that id cannot share its blocks (free the first one)"
            )
        self._check_request(request)

    def _count_blocks(self, step: _Step, full_sequence_must_fit: bool) -> int | None:
        """Stage 2: release what left an attention window, then the free blocks the step
        takes; None when fewer are free (less `reserved_blocks`).

        A plain step of a running request lacks none when its blocks hold its slots;
        else, when every group allocates by capacity, a group lacks at most
        cdiv(missing, its block size) blocks for the `missing` tokens past the smallest
        capacity, and that bound is taken when that many are free (every group then
        takes what it lacks). Otherwise each group is asked.
        """
        coordinator = self.coordinator
        request, state = step.request, step.state
        prefill_end = 0
        if coordinator.checkpoints_at_prefill_end:  # as the scheduler splits chunks
            prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit and not self._full_sequence_fits(step, prefill_end):
            return None
        if state is None or step.num_local_computed_tokens >= state.releases_at:
            coordinator.remove_skipped_blocks(
                request.request_id, step.num_computed_tokens, request.num_prompt_tokens
            )
        num_free = self.block_pool.free_block_queue.num_free_blocks - step.reserved_blocks
        if step.plain and state is not None:
            missing = step.num_slot_tokens - state.capacity
            if missing <= 0:
                return 0
            if coordinator.blocks_per_missing_block is not None:
                bound = cdiv(missing, coordinator.min_block_size)
                bound *= coordinator.blocks_per_missing_block
                if bound <= num_free:
                    return bound
        num_blocks = coordinator.get_num_blocks_to_allocate(
            request.request_id,
            step.num_slot_tokens,
            step.hits,
            step.num_encoder_tokens,
            step.num_computed_tokens,
            prefill_end=prefill_end,
            num_tokens_main_model=step.num_tokens_main_model,
            num_local_computed_tokens=step.num_local_computed_tokens,
        )
        return num_blocks if num_blocks <= num_free else None

    def _full_sequence_fits(self, step: _Step, prefill_end: int) -> bool:
        """Whether the blocks the whole request needs (window groups holding at most their
        admission cap at once) are free, less `reserved_blocks`."""
        request = step.request
        return (
            self.coordinator.get_num_blocks_to_allocate(
                request.request_id,
                min(request.num_tokens, self.max_model_len),
                step.hits,
                step.num_encoder_tokens,
                step.num_computed_tokens,
                apply_admission_cap=True,
                prefill_end=prefill_end,
                num_local_computed_tokens=step.num_local_computed_tokens,
            )
            <= self.block_pool.free_block_queue.num_free_blocks - step.reserved_blocks
        )

    def _take_blocks(self, step: _Step, num_blocks: int) -> KVCacheBlocks:
        """Stage 3: the hits and the KV connector's blocks (every group's hits first), then
        `num_blocks` new blocks across the groups; returns the new blocks."""
        coordinator = self.coordinator
        request_id = step.request.request_id
        if step.has_hits or step.num_external_computed_tokens:
            coordinator.allocate_new_computed_blocks(
                request_id,
                step.hits,
                step.num_local_computed_tokens,
                step.num_external_computed_tokens,
                step.skip_zeroing_group_ids,
            )
        if not num_blocks:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(
            coordinator.allocate_new_blocks(
                request_id,
                step.num_slot_tokens,
                step.num_encoder_tokens,
                step.num_tokens_main_model,
            )
        )

    def _cache_and_record(self, step: _Step) -> None:
        """Stage 4: cache the blocks the step filled (below the slot state's `caches_at`
        nothing fills), then record the request's new slot state."""
        request, state = step.request, step.state
        if step.cache and (state is None or step.num_cacheable_tokens >= state.caches_at):
            self.coordinator.cache_blocks(request, step.num_cacheable_tokens, step.num_tokens)
        if state is None:
            self._running[request.request_id] = request
        self._slot_states[request] = self._slot_state_for(request)

    def _check_counts(self, step: _Step) -> None:
        """`allocate_slots`' counts checked, in its order, and stored as Python ints (numpy
        integers converted); `skip_zeroing_group_ids` as a tuple of ints, checked with
        KV-connector tokens, the only time it takes effect, else (). Raises before
        anything changes."""
        rid = step.request.request_id
        num_new_tokens = check_int("num_new_tokens", step.num_new_tokens)
        step.num_new_computed_tokens = check_int(
            "num_new_computed_tokens", step.num_new_computed_tokens, min_value=0
        )
        step.num_lookahead_tokens = check_int(
            "num_lookahead_tokens", step.num_lookahead_tokens, min_value=0
        )
        step.reserved_blocks = check_int("reserved_blocks", step.reserved_blocks, min_value=0)
        step.num_encoder_tokens = check_int(
            "num_encoder_tokens", step.num_encoder_tokens, min_value=0
        )
        num_external = check_int(
            "num_external_computed_tokens", step.num_external_computed_tokens, min_value=0
        )
        # An async KV-connector load may adopt its tokens in a step computing none.
        if num_new_tokens < 0 or (num_new_tokens == 0 and not num_external):
            raise ValueError(
                f"request {rid!r}: num_new_tokens must be > 0 (something to allocate), or 0 "
                f"with num_external_computed_tokens > 0; got {num_new_tokens}"
            )
        step.num_new_tokens, step.num_external_computed_tokens = num_new_tokens, num_external
        given_group_ids, step.skip_zeroing_group_ids = step.skip_zeroing_group_ids, ()
        if num_external:
            num_local = step.request.num_computed_tokens + step.num_new_computed_tokens
            step.skip_zeroing_group_ids = self._check_external_tokens(
                step.request, num_local, num_external, given_group_ids
            )

    def _check_external_tokens(
        self,
        request: Request,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: object,
    ) -> tuple[int, ...]:
        """Tokens a KV connector computed come with a request's first allocation, are
        tokens of the request, and are for attention and scratch groups (a Mamba state
        loaded from outside is not handled). Returns `skip_zeroing_group_ids` as a tuple
        of ints (numpy integers converted)."""
        rid = request.request_id
        if num_local_computed_tokens + num_external_computed_tokens > request.num_tokens:
            raise ValueError(
                f"request {rid!r}: num_external_computed_tokens={num_external_computed_tokens} "
                f"after {num_local_computed_tokens} computed tokens passes its "
                f"{request.num_tokens} tokens"
            )
        try:
            holds = rid in self._running or self.coordinator.holds_blocks(rid)
        except TypeError:  # an unhashable id: refused with its own message later
            holds = False
        if holds:
            raise ValueError(
                f"request {rid!r} already holds blocks; num_external_computed_tokens (KV "
                "connector) can only be given at a request's first allocation"
            )
        for group_id in self.coordinator.mamba_group_ids:
            raise ValueError(
                f"num_external_computed_tokens with a Mamba group (group {group_id}) is not "
                "supported by jaxkv: a connector's Mamba state is not handled; give 0"
            )
        if isinstance(skip_zeroing_group_ids, (tuple, list, set, frozenset)):
            group_ids: list[int] = []
            for given in skip_zeroing_group_ids:
                skipped = as_int(given)
                if skipped is None or not 0 <= skipped < self.num_kv_cache_groups:
                    break
                group_ids.append(skipped)
            else:
                return tuple(group_ids)
        raise ValueError(
            f"skip_zeroing_group_ids must be KV cache group ids in "
            f"[0, {self.num_kv_cache_groups}), got {skip_zeroing_group_ids!r}"
        )

    def _check_hits(
        self,
        request: Request,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
    ) -> tuple[Sequence[KVCacheBlock], ...] | None:
        """The hit blocks per group, checked to be this pool's cached blocks for exactly
        `num_new_computed_tokens` tokens; None when there are none."""
        rid = request.request_id
        if new_computed_blocks is None:
            hits = None
        elif isinstance(new_computed_blocks, KVCacheBlocks):
            hits = new_computed_blocks.blocks if any(new_computed_blocks.blocks) else None
        else:
            raise TypeError(
                f"new_computed_blocks must be KVCacheBlocks or None, got {new_computed_blocks!r}"
            )
        if hits is None:
            if num_new_computed_tokens:
                raise ValueError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} but "
                    "new_computed_blocks holds no blocks; pass what get_computed_blocks returned"
                )
            return None
        if not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if self.coordinator.holds_blocks(rid):
            raise ValueError(
                f"request {rid!r} already holds blocks; cache hits (new_computed_blocks) can "
                "only be added when a request is first scheduled"
            )
        if len(hits) != self.num_kv_cache_groups:
            raise ValueError(
                f"new_computed_blocks has {len(hits)} groups, this manager "
                f"{self.num_kv_cache_groups}"
            )
        last, self._last_lookup = self._last_lookup, None
        if last is not None and (
            last[0] is new_computed_blocks
            and last[1] == num_new_computed_tokens
            and last[2] == self.block_pool.num_hash_removals
        ):
            return hits  # the lookup's own result, and no hash was removed since
        pool_blocks = self.block_pool.blocks
        for group_id, (manager, group_hits) in enumerate(
            zip(self.coordinator.single_type_managers, hits, strict=True)
        ):
            block_size = manager.block_size
            if not manager.kv_cache_spec.prefix_cacheable:
                expected = 0  # cross-attention never hits
            else:
                expected = -(-num_new_computed_tokens // block_size)
            # A hit ends on a block boundary, or inside a block on the finer hit grid of
            # partial (sub-block) hits.
            off_grid = num_new_computed_tokens % block_size and (
                manager.cache_hit_alignment_tokens >= block_size
                or num_new_computed_tokens % manager.cache_hit_alignment_tokens
            )
            if off_grid or len(group_hits) != expected:
                raise ValueError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} does "
                    f"not match new_computed_blocks' {len(group_hits)} hit blocks of group "
                    f"{group_id} (block size {manager.block_size}); pass what "
                    "get_computed_blocks returned"
                )
            null_allowed = manager.hit_may_hold_null_blocks
            try:
                for block in group_hits:  # the common case in one pass; errors below
                    if pool_blocks[block.block_id] is not block or (
                        block.group_id != group_id or block.block_hash_only is None
                    ):
                        break
                else:
                    if len(set(map(id, group_hits))) == len(group_hits):
                        continue
            except (AttributeError, IndexError, TypeError):
                pass
            self._refuse_hits(rid, group_id, group_hits, null_allowed)
        return hits

    def _refuse_hits(
        self, rid: str, group_id: int, group_hits: Sequence[object], null_allowed: bool
    ) -> None:
        """Raise the ValueError naming what is wrong with group `group_id`'s hit blocks
        (not this pool's, the null block, not cached in the group, given twice); return
        if nothing is (null blocks where the attention type allows them)."""
        seen: set[int] = set()
        for block in group_hits:
            if not self.block_pool.is_own_block(block):
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds {block!r}, which is not "
                    "a block of this pool"
                )
            block_id = block.block_id  # type: ignore[attr-defined]
            if block.is_null:  # type: ignore[attr-defined]
                if null_allowed:
                    continue
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds the null block, which "
                    "cannot be a cache hit"
                )
            if block.block_hash_only is None or block.group_id != group_id:  # type: ignore[attr-defined]
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds block {block_id}, which "
                    f"is not a cached block of group {group_id}"
                )
            if block_id in seen:
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds block {block_id} twice"
                )
            seen.add(block_id)

    def _slot_state_for(self, request: Request) -> SlotState:
        """The `SlotState` of a request holding blocks: over its groups, the fewest tokens
        held, the first block to fill and the first release (`coordinator.get_slot_state`),
        the capacity capped at `max_model_len`, caching never when it is off."""
        if not self._use_slot_state:
            return _NO_SLOT_STATE
        capacity, caches_at, releases_at = self.coordinator.get_slot_state(request.request_id)
        if capacity > self.max_model_len:
            capacity = self.max_model_len
        if not self.enable_caching:
            caches_at = NEVER
        # The fewest of the three limits (`SlotState`).
        quiet_until = caches_at - 1
        if capacity < quiet_until:
            quiet_until = capacity
        if releases_at < quiet_until:
            quiet_until = releases_at
        return SlotState(capacity, caches_at, releases_at, quiet_until)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group block lists; the shared (immutable) empty value when all are empty."""
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks)
        return self.empty_kv_cache_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks of the first `num_computed_tokens` (after a delayed allocation)."""
        self._check_request(request)
        num_computed_tokens = check_int("num_computed_tokens", num_computed_tokens, min_value=0)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))
            if request in self._slot_states:
                self._slot_states[request] = self._slot_state_for(request)

    def new_step_starts(self) -> None:
        """Call when the scheduler starts a step, as vLLM's does. Once it is called, a hit
        ending on a Mamba state cached during the current step waits for the next one
        (`allocate_slots` returns None): that state is written by this step's forward
        pass. Without these calls no hit is held back."""
        self.coordinator.new_step_starts()

    def free(self, request: Request) -> None:
        """Free the request's blocks, chain tail first; an unknown request is a no-op."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a jaxkv Request, got {request!r}")
        holder = self._running.pop(request.request_id, None)
        if holder is not None:
            del self._slot_states[holder]
        self.coordinator.free(request.request_id)

    # -- queries -------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if type(request_id) is not str:
            check_str("request_id", request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int | None = None
    ) -> list[int]:
        """Per group, the leading blocks of `running_request_id` that every running request
        holds; `num_running_requests` defaults to the number of requests holding blocks."""
        if num_running_requests is None:
            num_running_requests = len(self._running)
        num_running_requests = check_int("num_running_requests", num_running_requests, min_value=0)
        return self.coordinator.get_num_common_prefix_blocks(
            running_request_id, num_running_requests
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Stats since the last call (None when stats are off); the counters restart."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- maintenance ---------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache, held or free (a KV connector's failed load:
        their KV is bad). A running request keeps its blocks; as in vLLM, one whose
        prompt's partial tail was keyed on an evicted block keys it again at its next step
        (`note_evicted_blocks`), and no other evicted block it holds is cached again."""
        ids = list(block_ids)
        self.block_pool.evict_blocks(ids)
        evicted = set(ids)
        for manager in self.coordinator.single_type_managers:
            manager.note_evicted_blocks(evicted)
        for request in self._running.values():  # their next caching step may have moved
            self._slot_states[request] = self._slot_state_for(request)

    def take_events(self, deferred: bool = False) -> list[KVCacheEvent | DeferredKVCacheEvent]:
        """The step's events; `BlockStored` carries its group's spec kind and window.
        `deferred`: those of cached blocks may come unbuilt (`DeferredKVCacheEvent`, built
        by their `build()` at any time, on any thread), as the engine hands them to its
        publishing thread."""
        events = self.block_pool.take_events(deferred)
        metadata = self._event_metadata
        for event in events:
            # The pool stamps its own; one queued by hand may lack them.
            if type(event) is BlockStored and event.kv_cache_spec_kind is None:
                if not 0 <= event.group_idx < len(metadata):  # left as is
                    logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                    continue
                # The pool's events are fresh and this manager's alone: filled in place.
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[
                    event.group_idx
                ]
        return events

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """(the page copies queued since the last call, their retained blocks), as vLLM.

        A partial (sub-block) hit is redirected to a private copy of its shared tail
        block; the device must run each `KVCacheBlockCopy` before the step that writes
        into the copy. Both endpoints of every copy (`[src, dst]` per copy, in order)
        hold one reference each, kept so that nothing frees and reuses them before the
        copy has run: the caller releases them with `block_pool.free_blocks(retained)`
        once the copies have run, or have been ordered before any later write (a
        synchronous engine: right after handing the copies to the step, as
        `jaxkv.engine.Scheduler` does).
        """
        pending = [
            pair
            for manager in self.coordinator.single_type_managers
            for pair in manager.take_pending_cow_copies()
        ]
        if not pending:
            return [], []
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pending]
        return copies, [block for pair in pending for block in pair]

    def take_freed_block_ids(self) -> np.ndarray:
        return self.block_pool.take_freed_block_ids()
