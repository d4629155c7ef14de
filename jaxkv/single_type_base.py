"""The per-type manager's base: the blocks each request holds in one KV-cache group.

A manager owns `req_to_blocks` for its group and decides, for its attention
type, how long a cached prefix it can use (its hit rule), which blocks a
request no longer reads (its release rule) and how many blocks an allocation
takes. All pages come from the shared `BlockPool`. The rules are vLLM's. The
attention types' managers are in `jaxkv.single_type_kv_cache_manager`, Mamba's
in `jaxkv.mamba_manager`.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


HitBlocks = tuple[list[KVCacheBlock], ...]
NEVER = sys.maxsize


class SingleTypeKVCacheManager(ABC):
    """Blocks held per request in one group.

    Invariants: `req_to_blocks[r]` is request r's block table for this group,
    append-only while r runs except that entries turn into the null block when
    the attention type no longer reads them (those blocks go back to the pool):
    before the window (sliding window, chunked local, Mamba's earlier states)
    or, for R-SWA, in the gap between the prompt's blocks and the window's;
    `num_cached_block[r]` leading entries have been offered to the prefix cache;
    every non-null block listed holds one reference for r.

    The interface the coordinators call is this class's public methods; a subclass
    (one per attention type) must give `find_longest_cache_hit` (its hit rule) and
    overrides the others where its type differs. The class attributes below are
    facts of the type that the base's own methods read; the questions a caller asks
    (`ignores_lookahead_tokens`, `reserves_prefill_checkpoints`,
    `hit_may_hold_null_blocks`, `cache_step`) are answered by properties and methods.
    """

    spec_types: ClassVar[tuple[type[KVCacheSpec], ...]] = ()
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    # Whether remove_skipped_blocks can release anything (chosen per class).
    releases_blocks: ClassVar[bool] = False
    # Whether only some blocks can end a hit (reachable_block_mask thins the caching).
    sparse_hits: ClassVar[bool] = False
    # Whether a running request needs exactly the blocks its table lacks to hold
    # `num_tokens` (what `get_num_blocks_to_allocate` counts without hits).
    allocates_by_capacity: ClassVar[bool] = True
    # Whether a hit may hold the null block where the type no longer reads a block.
    hit_may_hold_null_blocks: ClassVar[bool] = False

    @property
    def ignores_lookahead_tokens(self) -> bool:
        """Whether lookahead (speculative) tokens get no slot in this group."""
        return False

    @property
    def reserves_prefill_checkpoints(self) -> bool:
        """Whether an allocation may reserve spare blocks for prefill checkpoints."""
        return False

    def cache_step(
        self,
        request: Request,
        num_cacheable_tokens: int,
        num_computed_tokens: int,
        step_end: int | None,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Cache what a step that computed up to `step_end` (None: `num_computed_tokens`)
        made final: the blocks the first `num_cacheable_tokens` tokens fill (the count on
        the hit grid)."""
        self.cache_blocks(request, num_cacheable_tokens, retention_interval, replay_boundaries)

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int | None = None,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """vLLM's arguments in its order (`scheduler_block_size` None: the block size).

        `needs_kv_cache_zeroing`: record the ids of newly allocated attention blocks
        for `take_new_block_ids` (the device side zeroes them). `max_admission_blocks_per_request`:
        the blocks a request can hold at once in a group that releases blocks (see
        `get_num_blocks_to_allocate`). Prefill context parallelism is not supported
        (`pcp_world_size` 1 only).
        """
        if pcp_world_size != 1:
            raise ValueError(f"pcp_world_size={pcp_world_size} is not supported (1 only)")
        self.kv_cache_spec = kv_cache_spec
        self._prefix_cacheable = kv_cache_spec.prefix_cacheable
        self.dcp_world_size = dcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.block_size = kv_cache_spec.block_size * self.dcp_world_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size or self.block_size
        # The coordinator lowers this to the hash unit for fine-grained hybrids.
        self.cache_hit_alignment_tokens = self.scheduler_block_size
        # Set by the coordinator: this group drops the last matched block for EAGLE.
        self.use_eagle = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # request id -> a token count before its next full block at which a step caches
        # (a group keying positions inside blocks: a prompt's partial tail, a junction),
        # until a step reaches it; `get_slot_state` reports it.
        self._pending_tails: dict[str, int] = {}
        # Attention types that release blocks: request id -> how many leading entries of
        # its table are the null block (absent: none); every later entry is held.
        self._num_null_prefix: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self._record_new_block_ids = needs_kv_cache_zeroing and isinstance(
            kv_cache_spec, AttentionSpec
        )
        self.new_block_ids: list[int] = []
        # Partial (sub-block) hits, vLLM's copy-on-write: request id -> (table index,
        # shared block) of a hit ending inside a block, redirected to a private copy at
        # the request's next allocation; and the (source, copy) pairs not yet handed to
        # the device (`take_pending_cow_copies`). Both endpoints of a pending pair hold
        # one extra reference (the retained blocks) until the copy has run.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    # -- allocation ----------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int = 0,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Free blocks needed to give the request `num_tokens` slots.

        Hits that sit in the free queue count (touching them takes them out of
        it); hits wholly outside the window that ends after `total_computed_tokens`
        (hits plus KV-connector tokens) do not (they become the null block). A hit
        ending inside a block (`num_local_computed_tokens`, None: the total) needs
        one more for its private copy. `apply_admission_cap` (admitting a whole
        request): a group that releases blocks as the request advances needs at
        most `max_admission_blocks_per_request` at once. vLLM's arguments;
        `num_tokens_main_model` and `prefill_end` change nothing here.
        """
        num_required = -(-num_tokens // self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held is not None else 0
        if request_id in self.num_cached_block:  # running: no new hits
            return num_required - num_held if num_required > num_held else 0
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local = len(new_computed_blocks) + num_held
        num_new = max(num_required - max(num_skipped_blocks, num_local), 0)
        start = max(0, num_skipped_blocks - num_held)
        for block in new_computed_blocks[start:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_new += 1
        if num_local_computed_tokens is None:
            num_local_computed_tokens = total_computed_tokens
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            num_new += 1  # the private copy of a partial hit's shared tail block
        return num_new

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Start the request's table with its hits (first scheduling only).

        Hits wholly outside the window that ends after the local and external
        (KV-connector) computed tokens are not touched: their slots are null.
        """
        if self.req_to_blocks.get(request_id):
            raise ValueError(
                f"request {request_id!r} already holds blocks; cache hits can only be "
                "added when a request is first scheduled"
            )
        num_skipped = (
            self.get_num_skipped_tokens(num_local_computed_tokens + num_external_computed_tokens)
            // self.block_size
        )
        kept = list(new_computed_blocks[num_skipped:])
        if kept:
            self.block_pool.touch_checked((kept,))
        req_blocks = [self._null_block] * num_skipped + kept
        self.req_to_blocks[request_id] = req_blocks
        self.num_cached_block[request_id] = len(req_blocks)
        if kept and num_local_computed_tokens % self.block_size:
            # A partial hit: the shared tail block is copied before this request writes
            # into it; the copy is cached once full, so it counts as not cached yet.
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, kept[-1])
            self.num_cached_block[request_id] = block_idx
        if self.releases_blocks:
            num_nulls = num_skipped
            while num_nulls < len(req_blocks) and req_blocks[num_nulls].is_null:
                num_nulls += 1  # a hit's own leading nulls (the blocks before its run)
            if num_nulls:
                self._num_null_prefix[request_id] = num_nulls

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Blocks for the tokens a KV connector computed, after the local hits (as vLLM does).

        Runs after every group's `add_local_computed_blocks`, so no group's new blocks can
        evict another group's hits. Only the external tokens inside the attention window
        get blocks; `record_for_zeroing` False: the connector's load writes them, so they
        are not reported for zeroing.
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total)
        if num_skipped > 0:
            num_external_computed_tokens = min(
                num_total - num_skipped, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = -(-num_total // self.block_size) - len(req_blocks)
        if num_new > 0:
            self._append_new_blocks(req_blocks, num_new, record_for_zeroing)

    def _append_new_blocks(
        self, req_blocks: list[KVCacheBlock], num_new: int, record_for_zeroing: bool = True
    ) -> list[KVCacheBlock]:
        """`num_new` blocks from the pool, appended to `req_blocks` (and reported for
        zeroing when this group records new ids)."""
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """New blocks so the request has slots for `num_tokens` tokens (vLLM's arguments;
        `num_tokens_main_model` changes nothing here)."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block.setdefault(request_id, 0)
        cow_blocks = self._redirect_partial_hit(request_id) if self._partial_hit_reqs else []
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        new_blocks = self._append_new_blocks(req_blocks, num_new)
        return cow_blocks + new_blocks if cow_blocks else new_blocks

    def _redirect_partial_hit(self, request_id: str) -> list[KVCacheBlock]:
        """[the private copy] replacing the request's shared partial tail block, if it has
        one pending (its extra block was counted by `get_num_blocks_to_allocate`)."""
        partial = self._partial_hit_reqs.pop(request_id, None)
        if partial is None:
            return []
        cow_block = self.block_pool.get_new_blocks(1)[0]
        self._apply_cow(request_id, partial[0], partial[1], cow_block)
        if self._record_new_block_ids:
            self.new_block_ids.append(cow_block.block_id)
        return [cow_block]

    def _apply_cow(
        self,
        request_id: str,
        block_idx: int,
        source_block: KVCacheBlock,
        cow_block: KVCacheBlock,
    ) -> None:
        """Put `cow_block` in the request's table in place of `source_block` and queue the
        copy. Both stay retained until the copy has run: `source_block` keeps the
        request's hit reference, `cow_block` takes one beyond the request's."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks[block_idx] is not source_block or source_block.ref_cnt <= 0:
            raise AssertionError(f"request {request_id!r} does not hold {source_block!r}")
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source_block, cow_block))
        cow_block.ref_cnt += 1

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The (source, copy) pairs queued since the last call; their retained references
        pass to the caller (`KVCacheManager.take_kv_cache_block_copies`)."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    @property
    def records_new_block_ids(self) -> bool:
        """Whether `take_new_block_ids` reports this group's new blocks."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        """Ids of the blocks allocated since the last call (with `needs_kv_cache_zeroing`)."""
        new_block_ids, self.new_block_ids = self.new_block_ids, []
        return new_block_ids

    def new_step_starts(self) -> None:
        """The scheduler starts a new step (vLLM's hook; only Mamba keeps per-step state)."""
        return None

    def note_evicted_blocks(self, block_ids: Collection[int]) -> None:
        """`evict_blocks` dropped every prefix-cache key of blocks `block_ids`, some maybe
        held by this group's requests. Held blocks stay uncached unless the group keys
        them at every step (full attention's partial tails)."""
        return None

    # -- caching -------------------------------------------------------------

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] = (),
    ) -> None:
        """Offer the blocks the first `num_tokens` tokens fill to the prefix cache.

        Groups with sparse hits cache only the blocks `reachable_block_mask`
        keeps: those that can end a hit at some aligned length, thinned out by
        `retention_interval`, plus the tails ending at `replay_boundaries` and
        at the request's `shared_prefix_boundary`.
        """
        if not self._prefix_cacheable:
            return
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        hash_block_size = self.block_pool.hash_block_size or self.block_size
        num_hashed_tokens = len(request.block_hashes) * hash_block_size
        if num_tokens > num_hashed_tokens:
            num_tokens = num_hashed_tokens
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        mask = None
        if self.sparse_hits and (retention_interval is not None or not self.dense_hit_grid()):
            mask = self._mask_for(
                request, num_cached, num_full, retention_interval, replay_boundaries
            )
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            mask,
        )
        self.num_cached_block[request_id] = num_full

    def _mask_for(
        self,
        request: Request,
        start_block: int,
        end_block: int,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """`reachable_block_mask` for this group: the replay boundaries plus the
        request's `shared_prefix_boundary` are kept reachable."""
        boundaries = list(replay_boundaries)
        shared_prefix_boundary = getattr(request, "shared_prefix_boundary", 0)
        if shared_prefix_boundary:
            boundaries.append(shared_prefix_boundary)
            if self.use_eagle:  # a sibling diverging there hits one block lower
                boundaries.append(shared_prefix_boundary - self.block_size)
        return self.reachable_block_mask(
            start_block,
            end_block,
            self.cache_hit_alignment_tokens,
            self.kv_cache_spec,
            self.use_eagle,
            retention_interval,
            boundaries,
            self.dcp_world_size,
        )

    def dense_hit_grid(self) -> bool:
        """Whether every block can end a hit on the alignment grid (then all are cached)."""
        return True

    @classmethod
    def reachable_block_mask(
        cls,
        start_block: int,
        end_block: int,
        alignment_tokens: int | None,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        retention_interval: int | None = None,
        reachable_boundaries: Sequence[int] = (),
        dcp_world_size: int = 1,
        final_segment_end_block: int | None = None,
    ) -> list[bool] | None:
        """Which of blocks [start_block, end_block) to offer to the prefix cache; None:
        all (vLLM's classmethod form). Groups whose hits need only some blocks
        (sliding window, Mamba) thin the caching to the blocks a hit at some multiple
        of `alignment_tokens` can end on, sparser with `retention_interval` (None:
        every boundary; 0: only `reachable_boundaries`; k > 0: one per k tokens),
        always keeping the blocks a hit at a `reachable_boundaries` position needs.
        `final_segment_end_block`: the end of the request's last (partial) segment,
        whose tail a non-EAGLE sliding-window group also keeps."""
        return None

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        """(tokens the request's blocks can hold, token count at which a step next caches:
        its next block full or its pending tail, computed-token count at which
        `remove_skipped_blocks` would release a block).

        Below all three a step changes nothing in this group.
        """
        block_size = self.block_size
        next_caching = (self.num_cached_block[request_id] + 1) * block_size
        if self._pending_tails:
            tail = self._pending_tails.get(request_id)
            if tail is not None and tail < next_caching:
                next_caching = tail
        return (
            len(self.req_to_blocks[request_id]) * block_size,
            next_caching,
            # The first held block is the one after the table's null prefix.
            self.release_threshold_for_block(self._num_null_prefix.get(request_id, 0))
            if self.releases_blocks
            else NEVER,
        )

    def release_threshold_for_block(self, block_index: int) -> int:
        """Smallest computed-token count whose skipped tokens cover block `block_index`."""
        return NEVER

    # -- release -------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first (the tail is evicted first)."""
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        num_nulls = self._num_null_prefix.pop(request_id, 0)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_held_blocks(
                reversed(req_blocks[num_nulls:] if num_nulls else req_blocks)
            )

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens this attention type no longer reads (none for full attention)."""
        return 0

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Turn blocks wholly outside the attention window into the null block, freeing them.

        `num_prompt_tokens` (vLLM's argument): only R-SWA, which releases the gap
        between the prompt and the decode window, reads it.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_tokens <= 0 or not blocks:
            return
        self._release_blocks(
            request_id, blocks, min(num_skipped_tokens // self.block_size, len(blocks))
        )

    def _release_blocks(self, request_id: str, blocks: list[KVCacheBlock], last: int) -> None:
        """Null and free `blocks[:last]` past the null prefix, tail first."""
        first = self._num_null_prefix.get(request_id, 0)
        if last <= first:
            return
        freed = blocks[first:last]
        blocks[first:last] = [self._null_block] * (last - first)
        self._num_null_prefix[request_id] = last
        freed.reverse()
        self.block_pool.free_held_blocks(freed)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> int:
        """Leading blocks of the request held by every running request."""
        num_common = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    # -- hits ----------------------------------------------------------------

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
    ) -> tuple[HitBlocks, int]:
        """(hit blocks per group, hit length in tokens) of at most `max_length` tokens.

        The length is a multiple of `alignment_tokens`; blocks the type does not
        read are the null block. `drop_eagle_block`: drop the last matched
        block (EAGLE recomputes it for its hidden states).
        """


def spec_block_size(kv_cache_spec: KVCacheSpec, dcp_world_size: int) -> int:
    return kv_cache_spec.block_size * (dcp_world_size if kv_cache_spec.dcp_sharded else 1)


def prompt_tail_boundary(request: Request, hash_block_size: int, use_eagle: bool) -> int:
    """The last hash boundary of the prompt a later request can hit at (vLLM's partial
    tail): a resend matches at most `num_prompt_tokens - 1` tokens, EAGLE reads the
    whole prompt before dropping a hash unit."""
    limit = request.num_prompt_tokens if use_eagle else request.num_prompt_tokens - 1
    return min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
