"""The KV cache manager: the scheduler's one entry point to KV-cache blocks (SPEC §5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.blocks import KVCacheBlock
from jaxkv.kv_cache_coordinator import get_kv_cache_coordinator
from jaxkv.kv_cache_interface import KVCacheConfig, KVCacheSpec
from jaxkv.kv_cache_utils import resolve_kv_cache_block_sizes
from jaxkv.kv_events import KVCacheEvent
from jaxkv.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed to or by the scheduler: one list per KV-cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)

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
        hash_block_size: int | None = None,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        track_freed_block_ids: bool = False,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        scheduler_block_size, default_hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, enable_caching
        )
        if hash_block_size is None:
            hash_block_size = default_hash_block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            enable_caching,
            scheduler_block_size,
            hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            track_freed_block_ids=track_freed_block_ids,
        )
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = self.coordinator.num_groups
        self.kv_cache_config = kv_cache_config
        # request id -> coordinator.get_slot_state(request id), refreshed after every change
        # to the request's blocks: a step that needs no new block and fills no block (most
        # decode steps) is answered from it without visiting the per-group managers. Off
        # for attention types that release blocks as a request advances.
        self._slot_state: dict[str, tuple[int, int]] = {}
        self._use_slot_state = not self.coordinator.skipping_managers
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @classmethod
    def from_spec(
        cls, kv_cache_spec: KVCacheSpec, num_blocks: int, max_model_len: int, **kwargs
    ) -> KVCacheManager:
        """The common case: one group of layers sharing `kv_cache_spec`, `num_blocks` pages."""
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

    def _check_prompt_length(self, request: Request) -> None:
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix (block aligned, at most num_tokens - 1 tokens)."""
        self._check_prompt_length(request)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit_tokens, _ = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )
        return KVCacheBlocks(blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` more tokens (plus hits and lookahead); None if out of blocks.

        On None nothing changed. Blocks that became full are cached, but never
        past `request.num_tokens` (unverified speculative tokens are not cached)
        and not at all with `delay_cache_blocks`.
        """
        slot_state = self._slot_state.get(request.request_id)
        if (
            slot_state is not None
            and new_computed_blocks is None
            and num_new_computed_tokens == 0
            and num_new_tokens > 0
            and num_lookahead_tokens >= 0
        ):
            # Most decode steps: the request's blocks hold the new tokens and no block
            # fills up, so nothing changes; answered without visiting the groups.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if (
                num_tokens + num_lookahead_tokens <= slot_state[0]
                and num_tokens <= self.max_model_len
                and (
                    delay_cache_blocks
                    or not self.enable_caching
                    or num_tokens < slot_state[1]  # i.e. min(num_tokens, request.num_tokens)
                    or request.num_tokens < slot_state[1]
                )
            ):
                return self.empty_kv_cache_blocks
        if num_new_tokens <= 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"request {request.request_id!r}: num_new_tokens must be > 0 (something to "
                f"allocate) and the other counts >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        request_id = request.request_id
        max_model_len = self.max_model_len
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed_tokens + num_new_tokens
        if num_tokens > max_model_len or request.num_prompt_tokens > max_model_len:
            self._check_prompt_length(request)
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed + {num_new_tokens} new "
                f"tokens exceed max_model_len={max_model_len}"
            )
        # Tokens whose full blocks get cached: never unverified (speculative) ones.
        num_tokens_to_cache = request.num_tokens
        if num_tokens < num_tokens_to_cache:
            num_tokens_to_cache = num_tokens
        cache = self.enable_caching and not delay_cache_blocks
        has_hits = new_computed_blocks is not None and any(new_computed_blocks.blocks)
        if cache:
            # Checked before any change: caching below would fail half-way otherwise.
            num_to_cache = num_tokens_to_cache // self.hash_block_size
            if len(request.block_hashes) < num_to_cache:
                raise ValueError(
                    f"request {request_id!r} has {len(request.block_hashes)} block hashes but "
                    f"{num_to_cache} full blocks of {self.hash_block_size} tokens to cache; give "
                    f"it block_hasher=get_request_block_hasher({self.hash_block_size}, hash_fn)"
                )
        coordinator = self.coordinator
        hit_blocks: tuple[Sequence[KVCacheBlock], ...] | None = None
        if has_hits:
            hit_blocks = new_computed_blocks.blocks  # type: ignore[union-attr]
            if not self.enable_caching:
                raise ValueError("new_computed_blocks given but prefix caching is disabled")
            if coordinator.holds_blocks(request_id):
                raise ValueError(
                    f"request {request_id!r} already holds blocks; cache hits can only be "
                    "added when a request is first scheduled"
                )
        num_tokens_need_slot = num_tokens + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        if coordinator.skipping_managers:
            # Before counting (as vLLM): blocks that left the window are released even
            # when the allocation then fails; they are never read again.
            coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hit_blocks or self.empty_kv_cache_blocks.blocks,
            total_computed_tokens=num_computed_tokens,
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if hit_blocks is not None:
            coordinator.allocate_new_computed_blocks(request_id, hit_blocks, num_computed_tokens)
        # Nothing to allocate in any group (most decode steps): skip the per-group calls.
        new_blocks = (
            coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
            if num_blocks_to_allocate
            else None
        )
        if cache:
            coordinator.cache_blocks(request, num_tokens_to_cache)
        if self._use_slot_state:
            self._slot_state[request_id] = coordinator.get_slot_state(request_id)
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(new_blocks)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group block lists; the shared (immutable) empty value when all are empty."""
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks)
        return self.empty_kv_cache_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks of the first `num_computed_tokens` (after a delayed allocation)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))
            if request.request_id in self._slot_state:
                self._slot_state[request.request_id] = self.coordinator.get_slot_state(
                    request.request_id
                )

    def free(self, request: Request) -> None:
        """Free the request's blocks, chain tail first; an unknown request is a no-op."""
        self._slot_state.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    # -- queries -------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
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

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def take_freed_block_ids(self) -> np.ndarray:
        return self.block_pool.take_freed_block_ids()
