"""The KV cache manager: the scheduler's one entry point to KV-cache blocks (SPEC §5)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from jaxkv._checks import as_int, check_bool, check_int, check_num_blocks, check_str
from jaxkv.blocks import KVCacheBlock
from jaxkv.kv_cache_coordinator import get_kv_cache_coordinator
from jaxkv.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    get_kv_cache_spec_sliding_window,
)
from jaxkv.kv_cache_utils import KVCacheBlockCopy, resolve_kv_cache_block_sizes
from jaxkv.kv_events import BlockStored, KVCacheEvent
from jaxkv.request import Request
from jaxkv.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SinkFullAttentionManager,
)

logger = logging.getLogger("jaxkv")


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


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last `make_prefix_cache_stats()`.

    Requests that were preempted before are counted apart: their hits are
    re-reads of their own KV, not sharing between requests.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class CachingMetrics:
    """Prefix-cache hit rate over the most recent `max_recent_requests` requests (vLLM's).

    `observe` takes one `PrefixCacheStats` batch (`make_prefix_cache_stats()` per step).
    Invariants: `aggregated_*` are the sums over `query_queue` (one
    `(requests, queries, hits)` entry per non-empty batch, oldest first); batches are
    dropped from the old end while more than `max_recent_requests` requests are held,
    but the newest batch always stays. A batch with `reset` starts over.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        max_recent_requests = check_int("max_recent_requests", max_recent_requests, min_value=1)
        self.max_recent_requests = max_recent_requests
        self.query_queue: deque[tuple[int, int, int]] = deque()
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if not stats.requests:
            return  # an empty batch would push real ones out of the window
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.query_queue.clear()
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0

    @property
    def empty(self) -> bool:
        return not self.query_queue

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens in the window (0 when nothing was queried)."""
        if not self.aggregated_query_total:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


class KVCacheManager:
    """Prefix-caching block manager for one pool and one or more KV-cache groups.

    Invariants (kept by the layers below): every block is free xor held; a
    request's held blocks are exactly `get_block_ids(request_id)`; a failed
    `allocate_slots` (it returns None) changes no state.
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
        """
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
        ):
            check_bool(name, value)
        check_bool("use_eagle", use_eagle)
        check_bool("enable_mamba_shared_prefix_checkpoint", enable_mamba_shared_prefix_checkpoint)
        num_prefill_lookahead = check_int(
            "num_prefill_lookahead", num_prefill_lookahead, min_value=0
        )
        unsupported = {
            "num_hash_lookahead_tokens": (num_hash_lookahead_tokens, 0),
            "dcp_world_size": (dcp_world_size, 1),
            "pcp_world_size": (pcp_world_size, 1),
            "watermark": (watermark, 0.0),
        }
        for name, (value, default) in unsupported.items():
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                raise ValueError(
                    f"{name}={value!r} is not supported by jaxkv; only {default!r} is allowed "
                    "(docs/vllm-differences.md)"
                )
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens or max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.hash_block_size = hash_block_size
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            enable_caching,
            lcm_block_size,
            hash_block_size,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            track_freed_block_ids=track_freed_block_ids,
            num_prefill_lookahead=num_prefill_lookahead,
            max_in_flight_tokens=self.max_in_flight_tokens,
        )
        coordinator = self.coordinator
        # vLLM's narrowing: EAGLE groups, partial hits, no re-prefilled (MTP) tokens.
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and bool(coordinator.eagle_group_ids)
            and getattr(coordinator, "enable_partial_hash_hits", False)
            and coordinator.num_reprefillable_tokens == 0
        )
        if self.mamba_shared_prefix_checkpoint:
            for manager in coordinator.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.shared_prefix_checkpoint = True
        if scheduler_block_size is not None and (
            check_int("scheduler_block_size", scheduler_block_size, min_value=1)
            != self.coordinator.scheduler_block_size
        ):
            raise ValueError(
                f"scheduler_block_size={scheduler_block_size} does not match the KV cache "
                f"groups, whose block sizes' LCM is {self.coordinator.scheduler_block_size}"
            )
        self.block_pool = self.coordinator.block_pool
        # A single full-attention (or sink full-attention) group with nothing hybrid
        # about it (no retention thinning, no re-prefilled tokens): its manager, which
        # lookups, allocations, the slot state and `free` call directly, skipping the
        # coordinator's per-group loops (same results:
        # tests/test_kv_cache_manager_slot_state.py). None otherwise.
        managers = self.coordinator.single_type_managers
        self._sole_manager: FullAttentionManager | None = (
            managers[0]
            if len(managers) == 1
            and type(managers[0]) in (FullAttentionManager, SinkFullAttentionManager)
            and self.coordinator.retention_interval is None
            and not self.coordinator.num_reprefillable_tokens
            else None
        )
        self._sole_hashes_per_block = self._sole_manager is not None and (
            self.block_pool.hash_block_size in (None, self._sole_manager.block_size)
        )
        # (spec kind, sliding window) per group, for the BlockStored events.
        self._event_metadata = tuple(
            (g.kv_cache_spec.kind.value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        self.num_kv_cache_groups = self.coordinator.num_groups
        # A running request's steps need at most this many blocks per `smallest block size`
        # tokens beyond its capacity (every group allocates by capacity), or None.
        self._blocks_per_missing_block: int | None = (
            self.num_kv_cache_groups if all(m.allocates_by_capacity for m in managers) else None
        )
        self._min_block_size = min(m.block_size for m in managers)
        # With `prefix_cache_retention_interval` 0 a Mamba group reserves a prefill
        # checkpoint only on the chunk reaching the prefill's end (as vLLM does), which the
        # counts are then told.
        self._checkpoints_at_prefill_end = self.coordinator.retention_interval == 0 and any(
            getattr(m, "has_prefill_checkpoint_blocks", False) for m in managers
        )
        # A Mamba "align" group gets no state slots for lookahead tokens (as vLLM does), so
        # the counts are told the tokens without them.
        self._some_group_ignores_lookahead = any(
            getattr(m, "mamba_cache_mode", None) == "align" for m in managers
        )
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = 0
        # The last hit `get_computed_blocks` returned: (blocks, tokens, the pool's
        # num_hash_removals then). Handed back unchanged to `allocate_slots` while no
        # hash was removed, its blocks are known to be this pool's cached blocks.
        self._last_lookup: tuple[KVCacheBlocks, int, int] | None = None
        # Request -> `_get_slot_state(request)` for every request holding blocks (keyed by
        # the object, so a second Request with a running request's id never matches),
        # refreshed after every change to its blocks: a step that needs no new block and
        # fills no block (most decode steps) nor releases one that left an attention
        # window is answered from it without visiting the per-group managers.
        self._slot_state: dict[Request, tuple[int, int, int, int]] = {}
        # Off (tests only), every step takes the general path: the state is a shortcut.
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
        sole = self._sole_manager
        if sole is not None and self._sole_hashes_per_block and not sole.use_eagle:
            # The unitary coordinator's answer when one request hash covers one block
            # and no block is dropped for EAGLE: the leading cached blocks.
            block_hashes = request.block_hashes
            num_blocks = max_cache_hit_length // sole.block_size
            if num_blocks > len(block_hashes):
                num_blocks = len(block_hashes)
            leading = self.block_pool.cached_block_hash_to_block.get_leading_blocks(
                block_hashes, 0, num_blocks
            )
            return (leading,), len(leading) * sole.block_size, 0
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

        vLLM's arguments in its order. On None nothing changed; bad input
        raises (ValueError/TypeError) before anything changes. Blocks that
        became full are cached, but never past `request.num_tokens` (unverified
        speculative tokens are not cached) and not at all with
        `delay_cache_blocks`. `full_sequence_must_fit` admits only when the
        whole request fits; `reserved_blocks` stay free for others.
        `num_encoder_tokens` sizes cross-attention groups (encoder-decoder
        models). `num_external_computed_tokens`: tokens after the hits whose KV a
        KV connector supplies (a request's first allocation only, no Mamba group):
        they get blocks inside each group's window before the new tokens do, count
        as computed, and are cached like computed tokens; `num_new_tokens` may then
        be 0 (an async load), and `skip_zeroing_group_ids` names the groups whose
        external-token blocks the load writes (not reported for zeroing).

        Hybrid models: blocks a sliding-window, chunked-local or Mamba group no
        longer reads are released first (as vLLM does), even when the
        allocation then returns None; they are never read again.
        """
        try:
            state = self._slot_state.get(request)
        except TypeError:  # unhashable: not a Request
            raise TypeError(f"request must be a jaxkv Request, got {request!r}") from None
        # The counts of most steps: no KV-connector, encoder or reservation arguments, and
        # integers in range. Anything else is checked in detail below, before any change.
        plain_counts = (
            type(num_new_tokens) is int
            and num_new_tokens > 0
            and type(num_lookahead_tokens) is int
            and num_lookahead_tokens >= 0
            and type(num_external_computed_tokens) is int
            and type(reserved_blocks) is int
            and type(num_encoder_tokens) is int
            and not (num_external_computed_tokens or reserved_blocks or num_encoder_tokens)
        )
        if plain_counts and type(num_new_computed_tokens) is int and not num_new_computed_tokens:
            if (
                state is not None
                and new_computed_blocks is None
                and not full_sequence_must_fit
                and request.num_computed_tokens + num_new_tokens + num_lookahead_tokens <= state[3]
            ):
                # Most decode steps: the request's blocks hold the new tokens, no block
                # fills up and none leaves an attention window, so the general path below
                # would change nothing (`state[3]`: see `_get_slot_state`).
                return self.empty_kv_cache_blocks
        elif not (
            plain_counts and type(num_new_computed_tokens) is int and num_new_computed_tokens > 0
        ):
            # From here on every count is a Python int (numpy integers are converted).
            (
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                num_encoder_tokens,
                reserved_blocks,
                skip_zeroing_group_ids,
            ) = self._check_counts(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                num_encoder_tokens,
                reserved_blocks,
                skip_zeroing_group_ids,
            )
        # Every other step. A request is checked at its first allocation (one with a
        # `state` holds blocks under exactly this object, and was checked then).
        if state is None:
            try:
                request_id = request.request_id
            except AttributeError:
                raise TypeError(f"request must be a jaxkv Request, got {request!r}") from None
            holder = self._running.get(request_id)
            if holder is not None:
                raise ValueError(
                    f"request id {request_id!r} belongs to a running request; a second "
                    "Request object with that id cannot share its blocks (free the first one)"
                )
            self._check_request(request)
        else:
            request_id = request.request_id
        coordinator = self.coordinator
        hit_blocks = (
            None
            if new_computed_blocks is None and not num_new_computed_tokens
            else self._check_hits(request, num_new_computed_tokens, new_computed_blocks)
        )
        max_model_len = self.max_model_len
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        # Local hits plus the tokens a KV connector computed (0 but at a first allocation).
        total_computed_tokens = num_computed_tokens + num_external_computed_tokens
        num_tokens = total_computed_tokens + num_new_tokens
        if num_tokens > max_model_len:
            raise ValueError(
                f"request {request_id!r}: {total_computed_tokens} computed + {num_new_tokens} "
                f"new tokens exceed max_model_len={max_model_len}"
            )
        num_tokens_to_cache = request.num_tokens
        if num_tokens < num_tokens_to_cache:  # never unverified (speculative) tokens
            num_tokens_to_cache = num_tokens
        cache = self.enable_caching and not delay_cache_blocks
        if cache:
            # Checked before any change: caching below would fail half-way otherwise.
            num_to_cache = num_tokens_to_cache // self.hash_block_size
            if len(request.block_hashes) < num_to_cache:
                raise ValueError(
                    f"request {request_id!r} has {len(request.block_hashes)} block hashes but "
                    f"{num_to_cache} full blocks of {self.hash_block_size} tokens to cache; give "
                    f"it block_hasher=get_request_block_hasher({self.hash_block_size}, hash_fn)"
                )
        hits_or_none = hit_blocks or self.empty_kv_cache_blocks.blocks
        free_block_queue = self.block_pool.free_block_queue
        prefill_end = 0
        if self._checkpoints_at_prefill_end:  # as the scheduler splits chunks against it
            prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, max_model_len)
            # Window groups release blocks as the request advances: each needs at most
            # its admission cap at once (vLLM's rule).
            num_blocks_full = coordinator.get_num_blocks_to_allocate(
                request_id,
                num_full,
                hits_or_none,
                num_encoder_tokens,
                total_computed_tokens,
                apply_admission_cap=True,
                prefill_end=prefill_end,
                num_local_computed_tokens=num_computed_tokens,
            )
            if num_blocks_full > free_block_queue.num_free_blocks - reserved_blocks:
                return None
        num_tokens_need_slot = num_tokens + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        num_tokens_main_model = (
            num_tokens if num_lookahead_tokens and self._some_group_ignores_lookahead else None
        )
        if coordinator.skipping_managers and (state is None or num_computed_tokens >= state[2]):
            # As vLLM, before counting: blocks that left the attention window are
            # released even when the allocation then fails (they are never read again).
            # Below `state[2]` no group would release one.
            coordinator.remove_skipped_blocks(
                request_id, total_computed_tokens, request.num_prompt_tokens
            )
        sole = self._sole_manager
        num_blocks_to_allocate = -1  # not known yet
        if plain_counts and state is not None:
            missing = num_tokens_need_slot - state[0]
            if missing <= 0:
                num_blocks_to_allocate = 0  # its blocks hold these tokens (a block fills up)
            elif self._blocks_per_missing_block is not None:
                # A running request: a group lacks at most cdiv(missing, its block size)
                # blocks, `missing` being the tokens beyond the smallest capacity
                # (`state[0]`). With that many free, no group needs counting.
                bound = -(-missing // self._min_block_size) * self._blocks_per_missing_block
                if bound <= free_block_queue.num_free_blocks:
                    num_blocks_to_allocate = bound
        if num_blocks_to_allocate >= 0:
            pass
        elif sole is not None:
            num_blocks_to_allocate = sole.get_num_blocks_to_allocate(
                request_id,
                num_tokens_need_slot,
                hits_or_none[0],
                total_computed_tokens,
                num_computed_tokens,
            )
        else:
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
                request_id,
                num_tokens_need_slot,
                hits_or_none,
                num_encoder_tokens,
                total_computed_tokens,
                prefill_end=prefill_end,
                num_tokens_main_model=num_tokens_main_model,
                num_local_computed_tokens=num_computed_tokens,
            )
        if num_blocks_to_allocate > free_block_queue.num_free_blocks - reserved_blocks:
            return None
        if hit_blocks is not None or num_external_computed_tokens:
            # Two-phase: every group takes its hits before any group takes new blocks.
            coordinator.allocate_new_computed_blocks(
                request_id,
                hits_or_none,
                num_computed_tokens,
                num_external_computed_tokens,
                skip_zeroing_group_ids,
            )
        # Nothing to allocate in any group (most decode steps): skip the per-group calls.
        if not num_blocks_to_allocate:
            new_blocks = None
        elif sole is not None:
            new_blocks = (sole.allocate_new_blocks(request_id, num_tokens_need_slot),)
        else:
            new_blocks = coordinator.allocate_new_blocks(
                request_id, num_tokens_need_slot, num_encoder_tokens, num_tokens_main_model
            )
        # A running request's `state` says when its next block fills: below that, caching
        # would stamp nothing (half the steps that allocate a block).
        if cache and (state is None or num_tokens_to_cache >= state[1]):
            if sole is not None:
                sole.cache_blocks(request, num_tokens_to_cache)
            else:
                coordinator.cache_blocks(request, num_tokens_to_cache, num_tokens)
        if state is None:
            self._running[request_id] = request
        self._slot_state[request] = self._get_slot_state(request)
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(new_blocks)

    def _check_counts(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_encoder_tokens: int,
        reserved_blocks: int,
        skip_zeroing_group_ids: Sequence[int],
    ) -> tuple[int, int, int, int, int, int, tuple[int, ...]]:
        """`allocate_slots`' counts checked, in its order, as Python ints (numpy integers
        converted), then `skip_zeroing_group_ids` as a tuple of ints: checked with
        KV-connector tokens, the only time it takes effect, else (). Raises before
        anything changes."""
        rid = request.request_id
        num_new_tokens = check_int("num_new_tokens", num_new_tokens)
        num_new_computed_tokens = check_int(
            "num_new_computed_tokens", num_new_computed_tokens, min_value=0
        )
        num_lookahead_tokens = check_int("num_lookahead_tokens", num_lookahead_tokens, min_value=0)
        reserved_blocks = check_int("reserved_blocks", reserved_blocks, min_value=0)
        num_encoder_tokens = check_int("num_encoder_tokens", num_encoder_tokens, min_value=0)
        num_external = check_int(
            "num_external_computed_tokens", num_external_computed_tokens, min_value=0
        )
        # An async KV-connector load may adopt its tokens in a step computing none.
        if num_new_tokens < 0 or (num_new_tokens == 0 and not num_external):
            raise ValueError(
                f"request {rid!r}: num_new_tokens must be > 0 (something to allocate), or 0 "
                f"with num_external_computed_tokens > 0; got {num_new_tokens}"
            )
        skipped_group_ids: tuple[int, ...] = ()
        if num_external:
            num_local = request.num_computed_tokens + num_new_computed_tokens
            skipped_group_ids = self._check_external_tokens(
                request, num_local, num_external, skip_zeroing_group_ids
            )
        return (
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            num_external,
            num_encoder_tokens,
            reserved_blocks,
            skipped_group_ids,
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
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            if isinstance(manager, MambaManager):
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
            # Only attention types whose hits skip blocks may hold the null block in a hit
            # (R-SWA releases blocks but hits as full attention: never a null).
            null_allowed = manager in self.coordinator.skipping_managers and not isinstance(
                manager, FullAttentionManager
            )
            try:
                for block in group_hits:  # the common case in one pass; errors below
                    if pool_blocks[block.block_id] is not block or (
                        block._group_id != group_id or block._block_hash is None
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
            if block._block_hash is None or block._group_id != group_id:  # type: ignore[attr-defined]
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds block {block_id}, which "
                    f"is not a cached block of group {group_id}"
                )
            if block_id in seen:
                raise ValueError(
                    f"request {rid!r}: new_computed_blocks holds block {block_id} twice"
                )
            seen.add(block_id)

    def _get_slot_state(self, request: Request) -> tuple[int, int, int, int]:
        """The `_slot_state` entry of a request holding blocks.

        (the most tokens plus lookahead a step may reach without `allocate_slots`
        allocating a block, the number of tokens to cache at which it would cache
        one, the computed-token count at which it would release a block that left
        an attention window, the most tokens plus lookahead of a step that does
        none of the three): the first is the tokens the request's blocks hold,
        capped at `max_model_len`; the second the token count that fills the next
        block, or never when caching is off; the third never without sliding-window,
        chunked-local or Mamba groups; the fourth `min(first, second - 1, third)`,
        so a step of `n >= 1` new tokens from `c` computed ones with
        `c + n + lookahead <= fourth` stays within the first, caches nothing and
        has `c` below the third.
        """
        if not self._use_slot_state:
            return (0, 0, 0, 0)  # nothing is answered from it
        groups = self._sole_manager or self.coordinator
        capacity, next_full, release_at = groups.get_slot_state(request.request_id)
        if capacity > self.max_model_len:
            capacity = self.max_model_len
        if not self.enable_caching:
            next_full = 1 << 62
        quiet = capacity if capacity < next_full else next_full - 1
        if release_at < quiet:
            quiet = release_at
        return (capacity, next_full, release_at, quiet)

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
            if request in self._slot_state:
                self._slot_state[request] = self._get_slot_state(request)

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
            del self._slot_state[holder]
        (self._sole_manager or self.coordinator).free(request.request_id)

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
            self._slot_state[request] = self._get_slot_state(request)

    def take_events(self) -> list[KVCacheEvent]:
        """The step's events; `BlockStored` carries its group's spec kind and window."""
        events = self.block_pool.take_events()
        metadata = self._event_metadata
        for i, event in enumerate(events):
            if type(event) is BlockStored:
                if not 0 <= event.group_idx < len(metadata):  # queued by hand: left as is
                    logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                    continue
                kind, window = metadata[event.group_idx]
                events[i] = replace(
                    event, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window
                )
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
        pending: list[tuple[KVCacheBlock, KVCacheBlock]] | None = None
        for manager in self.coordinator.single_type_managers:
            if manager._pending_cow_copies:  # most steps: none anywhere
                if pending is None:
                    pending = []
                pending.extend(manager.take_pending_cow_copies())
        if pending is None:
            return [], []
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pending]
        return copies, [block for pair in pending for block in pair]

    def take_freed_block_ids(self) -> np.ndarray:
        return self.block_pool.take_freed_block_ids()
