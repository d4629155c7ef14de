"""Per-attention-type managers: the blocks each request holds in one KV-cache group.

A manager owns `req_to_blocks` for its group and decides, for its attention
type, how long a cached prefix it can use (its hit rule), which blocks a
request no longer reads (its release rule) and how many blocks an allocation
takes. All pages come from the shared `BlockPool`. The rules are vLLM's.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash, BlockHashListWithBlockSize
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from jaxkv.kv_cache_utils import resolve_block_hashes

if TYPE_CHECKING:
    from jaxkv.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


HitBlocks = tuple[list[KVCacheBlock], ...]
_NEVER = sys.maxsize


class SingleTypeKVCacheManager:
    """Blocks held per request in one group.

    Invariants: `req_to_blocks[r]` is request r's block table for this group,
    append-only while r runs except that entries turn into the null block when
    the attention type no longer reads them (those blocks go back to the pool):
    before the window (sliding window, chunked local, Mamba's earlier states)
    or, for R-SWA, in the gap between the prompt's blocks and the window's;
    `num_cached_block[r]` leading entries have been offered to the prefix cache;
    every non-null block listed holds one reference for r.
    """

    spec_types: ClassVar[tuple[type[KVCacheSpec], ...]] = ()
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    # Whether remove_skipped_blocks can release anything (chosen per class).
    releases_blocks: ClassVar[bool] = False
    # Whether only some blocks can end a hit (reachable_block_mask thins the caching).
    sparse_hits: ClassVar[bool] = False
    # Whether cache_blocks must be given the step's exact end (a recurrent state
    # describes one position), not the count aligned to the hit grid.
    caches_at_step_end: ClassVar[bool] = False
    # Whether a running request needs exactly the blocks its table lacks to hold
    # `num_tokens` (what `get_num_blocks_to_allocate` counts without hits).
    allocates_by_capacity: ClassVar[bool] = True

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

    def note_evicted_blocks(self, block_ids: Collection[int]) -> None:
        """`evict_blocks` dropped every prefix-cache key of blocks `block_ids`, some maybe
        held by this group's requests. Held blocks stay uncached unless the group keys
        them at every step (full attention's partial tails)."""

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
        """(tokens the request's blocks can hold, token count at which its next block is
        full, computed-token count at which `remove_skipped_blocks` would release a block).

        Below all three a step changes nothing in this group.
        """
        block_size = self.block_size
        blocks = self.req_to_blocks[request_id]
        return (
            len(blocks) * block_size,
            (self.num_cached_block[request_id] + 1) * block_size,
            # The first held block is the one after the table's null prefix.
            self.release_threshold_for_block(self._num_null_prefix.get(request_id, 0))
            if self.releases_blocks
            else _NEVER,
        )

    def release_threshold_for_block(self, block_index: int) -> int:
        """Smallest computed-token count whose skipped tokens cover block `block_index`."""
        return _NEVER

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
        raise NotImplementedError


def _spec_block_size(kv_cache_spec: KVCacheSpec, dcp_world_size: int) -> int:
    return kv_cache_spec.block_size * (dcp_world_size if kv_cache_spec.dcp_sharded else 1)


def prompt_tail_boundary(request: Request, hash_block_size: int, use_eagle: bool) -> int:
    """The last hash boundary of the prompt a later request can hit at (vLLM's partial
    tail): a resend matches at most `num_prompt_tokens - 1` tokens, EAGLE reads the
    whole prompt before dropping a hash unit."""
    limit = request.num_prompt_tokens if use_eagle else request.num_prompt_tokens - 1
    return min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size


class FullAttentionManager(SingleTypeKVCacheManager):
    """Causal attention over the whole context: a hit is any cached prefix.

    A block coarser than the hash unit also registers the prompt's partial tail (the
    block holding the prompt's last hash boundary, keyed at that boundary) so that a
    fine-grained lookup can hit inside it, as vLLM does.
    """

    spec_types = (FullAttentionSpec,)
    supports_fine_grained_hash_lookup = True

    def __init__(self, kv_cache_spec: FullAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        hash_block_size = self.block_pool.hash_block_size or self.block_size
        if self.block_size != hash_block_size and self._prefix_cacheable:
            # Only such groups pay for the partial tail: the instance's methods wrap the
            # class's (a subclass's own included) with it; single-group managers keep
            # the plain ones.
            self._tail_hash_block_size = hash_block_size
            # request id -> its prompt's partial tail boundary, while no key names it: until
            # a step reaches it, and again once `evict_blocks` dropped its block's keys.
            self._pending_tails: dict[str, int] = {}
            # request id -> the boundary of its partial tail, once a step has keyed it.
            self._keyed_tails: dict[str, int] = {}
            self.cache_blocks = self._cache_blocks_and_partial_tail  # type: ignore[method-assign]
            self.get_slot_state = self._get_slot_state_before_partial_tail  # type: ignore[method-assign]
            self.free = self._free_and_forget_tail  # type: ignore[method-assign]
            self.note_evicted_blocks = self._requeue_evicted_tails  # type: ignore[method-assign]

    def _cache_blocks_and_partial_tail(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] = (),
    ) -> None:
        """`cache_blocks`, then the prompt's partial tail once `num_tokens` reaches it."""
        type(self).cache_blocks(self, request, num_tokens, retention_interval, replay_boundaries)
        boundary = prompt_tail_boundary(request, self._tail_hash_block_size, self.use_eagle)
        if boundary == 0 or boundary % self.block_size == 0:
            return
        if boundary > num_tokens:
            self._pending_tails[request.request_id] = boundary
            return
        self._pending_tails.pop(request.request_id, None)
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary // self.block_size
        if block_idx < len(blocks):
            self.block_pool.cache_partial_block(
                request, blocks[block_idx], boundary, self.kv_cache_group_id, self.block_size
            )
            self._keyed_tails[request.request_id] = boundary

    def _get_slot_state_before_partial_tail(self, request_id: str) -> tuple[int, int, int]:
        """`get_slot_state`, with the next caching due at the prompt's partial tail while
        that is not keyed (not yet, or again after `evict_blocks`), so the next step
        reaching it caches."""
        capacity, next_full, release_at = type(self).get_slot_state(self, request_id)
        boundary = self._pending_tails.get(request_id)
        if boundary is not None and boundary < next_full:
            next_full = boundary
        return capacity, next_full, release_at

    def _free_and_forget_tail(self, request_id: str) -> None:
        self._pending_tails.pop(request_id, None)
        self._keyed_tails.pop(request_id, None)
        type(self).free(self, request_id)

    def _requeue_evicted_tails(self, block_ids: Collection[int]) -> None:
        """`note_evicted_blocks`: a request whose keyed partial tail lies in one of
        `block_ids` keys it again at its next caching step (vLLM keys the tail at
        every step, so a tail evicted while held is cached again at the next one)."""
        for request_id, boundary in self._keyed_tails.items():
            block = self.req_to_blocks[request_id][boundary // self.block_size]
            if block.block_id in block_ids:
                self._pending_tails[request_id] = boundary

    @classmethod
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
        block_size = _spec_block_size(kv_cache_spec, dcp_world_size)
        hash_block_size = block_pool.hash_block_size or block_size
        fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
        raw = block_hashes
        block_hashes = resolve_block_hashes(
            block_hashes,
            hash_block_size,
            block_size,
            supports_fine_grained_hash_lookup=True,
            alignment_tokens=alignment_tokens,
        )
        full_hashes = (
            BlockHashListWithBlockSize(block_hashes, alignment_tokens, block_size)
            if fine_grained
            else block_hashes
        )
        max_num_blocks = min(max_length // block_size, len(full_hashes))
        if len(kv_cache_group_ids) == 1:
            computed: HitBlocks = (
                block_pool.cached_block_hash_to_block.get_leading_blocks(
                    full_hashes, kv_cache_group_ids[0], max_num_blocks
                ),
            )
        else:
            computed = tuple([] for _ in kv_cache_group_ids)
            for i in range(max_num_blocks):
                blocks = block_pool.get_cached_block(full_hashes[i], kv_cache_group_ids)
                if blocks is None:
                    break
                for group_blocks, block in zip(computed, blocks, strict=True):
                    group_blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if fine_grained:
            # Extend into the first partial block, probing its hash units high to low.
            scale = block_size // alignment_tokens
            first = len(computed[0]) * scale
            last = min(first + scale - 1, max_length // alignment_tokens, len(raw))
            for fine_idx in range(last - 1, first - 1, -1):
                tail = block_pool.get_cached_block(raw[fine_idx], kv_cache_group_ids)
                if tail is None:
                    continue
                for group_blocks, block in zip(computed, tail, strict=True):
                    group_blocks.append(block)
                hit_length = (fine_idx + 1) * alignment_tokens
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_blocks = _cdiv(hit_length, block_size)
        for group_blocks in computed:
            del group_blocks[num_blocks:]
        return computed, hit_length


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with static sink tokens: full attention's rules unchanged (the
    sinks' K/V are the model's, outside the request's blocks); the sinks must fill
    whole blocks (`sink_len` a multiple of the block size), as vLLM requires."""

    spec_types = (SinkFullAttentionSpec,)

    def __init__(self, kv_cache_spec: SinkFullAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if sink_len is None or sink_len % self.block_size:
            raise ValueError(
                f"SinkFullAttentionManager: sink_len={sink_len!r} must be a positive multiple "
                f"of the block size ({self.block_size}); the sink tokens fill whole blocks"
            )
        self.sink_len = sink_len


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention: full attention's hits, allocation and caching;
    the decode blocks between the prompt and the window are released.

    `remove_skipped_blocks(request, c, num_prompt_tokens=P)` nulls and frees the
    blocks wholly inside the gap `[ceil(P / block) * block, max(P, c - rswa_window))`,
    walking down from the gap's end and stopping at the first null block (vLLM's
     rule). Without `num_prompt_tokens` nothing is released. The table then
    holds null blocks between the prompt's blocks and the window's, not only at
    its front; the released gap only grows while the request runs.
    """

    spec_types = (RSWASpec,)
    releases_blocks = True

    def __init__(self, kv_cache_spec: RSWASpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window
        # Per running request, from its latest `remove_skipped_blocks` with a prompt
        # length: that length, and the end of the released gap (its blocks
        # [ceil(prompt / block), end) are null).
        self._num_prompt_tokens: dict[str, int] = {}
        self._gap_end: dict[str, int] = {}

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        if num_prompt_tokens is None:
            return
        self._num_prompt_tokens[request_id] = num_prompt_tokens
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        block_size = self.block_size
        first = _cdiv(num_prompt_tokens, block_size)
        window_start = max(num_prompt_tokens, num_computed_tokens - self.rswa_window)
        last = min(window_start // block_size, len(blocks))
        if last <= self._gap_end.get(request_id, first):
            return
        self._gap_end[request_id] = last
        null = self._null_block
        freed = []
        for i in range(last - 1, first - 1, -1):  # tail first: the later blocks evict first
            block = blocks[i]
            if block.is_null:
                break
            freed.append(block)
            blocks[i] = null
        if freed:
            self.block_pool.free_held_blocks(freed)

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        capacity, next_full, _ = super().get_slot_state(request_id)
        return capacity, next_full, self._release_threshold(request_id)

    def _release_threshold(self, request_id: str) -> int:
        """Smallest computed-token count at which the next gap block leaves (the gap's
        blocks are null; the prompt's and the window's are not)."""
        num_prompt_tokens = self._num_prompt_tokens.get(request_id)
        if num_prompt_tokens is None:  # never told the prompt: nothing is released
            return _NEVER
        first = _cdiv(num_prompt_tokens, self.block_size)
        next_block = max(first, self._gap_end.get(request_id, first))
        return (next_block + 1) * self.block_size + self.rswa_window

    def free(self, request_id: str) -> None:
        self._num_prompt_tokens.pop(request_id, None)
        self._gap_end.pop(request_id, None)
        super().free(request_id)


def _rightmost_run(cached: list[KVCacheBlock | None], need: int) -> tuple[int, int]:
    """[start, end) of the rightmost `need` consecutive cached (non-None) entries, or,
    when no run is that long, of the cached run starting at entry 0 (maybe empty).

    `_rightmost_aligned_run` with every block on the alignment grid and `need >= 1`,
    searched gap by gap (`list.index`) instead of entry by entry.
    """
    num = len(cached)
    if all(cached):  # no gap (the common case; blocks are truthy, None is not)
        return (num - need, num) if num >= need else (0, num)
    reversed_cached = cached[::-1]
    reversed_cached.append(None)  # a sentinel gap left of entry 0
    pos = 0  # entries [num - pos, num) lie right of the run being looked at
    while True:
        gap = reversed_cached.index(None, pos)
        if gap - pos >= need:
            return num - pos - need, num - pos
        if gap == num:
            return 0, num - pos
        pos = gap + 1


def _rightmost_aligned_run(
    cached: list[KVCacheBlock | None],
    need: int,
    block_size: int,
    alignment_tokens: int,
    drop_eagle_block: bool,
) -> tuple[int, int]:
    """[start, end) of the cached (non-None) run that ends a sliding-window hit: scanning
    right to left, the first run of `need` entries whose end (one block earlier with
    `drop_eagle_block`) lies on the `alignment_tokens` grid; when none is that long, the
    cached run starting at entry 0 (maybe empty)."""
    run_end = run_start = len(cached)
    for i in range(len(cached) - 1, -1, -1):  # right to left, stop at the first run
        if cached[i] is None:
            run_end = run_start = i
            continue
        if run_start == run_end and block_size != alignment_tokens:
            ends_at = i if drop_eagle_block else i + 1
            if ends_at * block_size % alignment_tokens:
                run_end = run_start = i
                continue  # a run must end on the alignment grid
        run_start = i
        if run_end - run_start >= need:
            break
    return run_start, run_end


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Attention over the last `sliding_window` tokens.

    A hit needs the contiguous cached run covering the window that ends at the
    hit (`ceil((window - 1) / block_size)` blocks, one more with EAGLE); blocks
    before it are the null block. Blocks wholly outside the window of the next
    token are released as the request advances.
    """

    spec_types = (SlidingWindowSpec,)
    releases_blocks = True
    sparse_hits = True

    def __init__(self, kv_cache_spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        # contiguous_blocks_for_hit without and with EAGLE, indexed by `use_eagle`.
        self._blocks_for_hit = tuple(
            self.contiguous_blocks_for_hit(self.sliding_window, self.block_size, eagle)
            for eagle in (False, True)
        )

    @staticmethod
    def contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
        return _cdiv(window - 1, block_size) + (1 if use_eagle else 0)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def dense_hit_grid(self) -> bool:
        alignment, block_size = self.cache_hit_alignment_tokens, self.block_size
        need = self._blocks_for_hit[self.use_eagle]
        return alignment % block_size != 0 or need >= alignment // block_size

    def release_threshold_for_block(self, block_index: int) -> int:
        return (block_index + 1) * self.block_size + self.sliding_window - 1

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
        """Cache only the `need` blocks ending at each hit boundary a later request can use.

        Dense (`retention_interval` None): every alignment boundary; k > 0: one
        per k-token segment (and, without EAGLE, the tail of the final partial
        segment ending at `final_segment_end_block`); 0: none. Plus, under
        sparse retention, the tails ending at `reachable_boundaries`. With
        EAGLE the run ends one block past the boundary (the peeked block).
        """
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise TypeError(f"kv_cache_spec must be a SlidingWindowSpec, got {kv_cache_spec!r}")
        if alignment_tokens is None:
            return None
        block_size = kv_cache_spec.block_size * dcp_world_size
        if alignment_tokens % block_size:
            return None  # a sub-block grid cannot be masked per block: cache all
        need = cls.contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size, use_eagle)
        shift = 1 if use_eagle else 0
        mask = [False] * (end_block - start_block)
        segment = alignment_tokens if retention_interval is None else retention_interval or None
        if segment is not None:
            per_segment = segment // block_size
            if need >= per_segment:
                return None  # every block can end a hit
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            final_size = (final_segment_end_block or 0) % per_segment
            if final_size and not use_eagle:
                final_end: int = final_segment_end_block  # type: ignore[assignment]
                tail_start = max(final_end - final_size, final_end - need, start_block)
                for i in range(tail_start, min(end_block, final_end)):
                    mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = boundary // alignment_tokens * alignment_tokens // block_size + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    @classmethod
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
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        block_hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size or block_size, block_size
        )
        need = cls.contiguous_blocks_for_hit(
            kv_cache_spec.sliding_window, block_size, drop_eagle_block
        )
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        # Each group's cached blocks for the candidate blocks, one pass each; a block is
        # cached for this lookup when every group has it.
        cache_map = block_pool.cached_block_hash_to_block
        entries = [
            cache_map.get_entries(block_hashes, g, max_num_blocks) for g in kv_cache_group_ids
        ]
        cached = entries[0]
        if len(entries) > 1:
            cached = [e if all(other[i] is not None for other in entries[1:]) else None
                      for i, e in enumerate(cached)]  # fmt: skip
        if block_size == alignment_tokens and need > 0:
            run_start, run_end = _rightmost_run(cached, need)
        else:
            run_start, run_end = _rightmost_aligned_run(
                cached, need, block_size, alignment_tokens, drop_eagle_block
            )
        null = block_pool.null_block
        computed: HitBlocks = tuple(
            [null] * run_start + group_entries[run_start:run_end]  # type: ignore[operator]
            for group_entries in entries
        )
        if run_end - run_start < need:
            cls._align(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for group_blocks in computed:
                group_blocks.pop()
            cls._align(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    @staticmethod
    def _align(computed: HitBlocks, block_size: int, alignment_tokens: int) -> None:
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens:
            for group_blocks in computed:
                group_blocks.pop()


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Attention within fixed chunks: blocks before the current chunk are null.

    A hit marks every block before the chunk holding `max_length` computed (as
    null blocks) and looks up the blocks of that chunk left to right.
    """

    spec_types = (ChunkedLocalAttentionSpec,)
    releases_blocks = True

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def release_threshold_for_block(self, block_index: int) -> int:
        chunk = self.attention_chunk_size
        return _cdiv((block_index + 1) * self.block_size, chunk) * chunk

    @classmethod
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
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        block_size = kv_cache_spec.block_size
        if drop_eagle_block:
            raise ValueError("EAGLE is not supported with chunked local attention groups")
        if block_size != alignment_tokens:
            raise ValueError(
                f"chunked local attention needs hits on its own block size ({block_size}); "
                f"the coordinator aligns hits to {alignment_tokens} tokens"
            )
        block_hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size or block_size, block_size
        )
        chunk = kv_cache_spec.attention_chunk_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        start_block = (max_length // chunk * chunk) // block_size if max_length > 0 else 0
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, max_num_blocks):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for group_blocks, block in zip(computed, cached, strict=True):
                group_blocks.append(block)
        return computed, len(computed[0]) * block_size


class MambaManager(SingleTypeKVCacheManager):
    """State-space layers: a block holds the recurrent state after its last token.

    "none"/"align": only the last state is kept (earlier blocks become null and
    are freed); an allocation pads the table with null blocks and takes only
    the block the step's state lands in. "align" caches a state when a step ends
    exactly on a block boundary, and, as vLLM, keys the running state when a
    step ends at the prompt's last hit boundary inside a block (the partial tail:
    the key moves to a copy at the request's next allocation, since the request
    keeps updating that block). A hit is the last cached state at or below the
    candidate (found right to left), at hash-unit granularity when the
    coordinator enables fine-grained hits; a hit inside a block is copied to a
    private block before the request writes (copy-on-write). "all": every block's state is kept
    and cached. Under sparse retention (`prefix_cache_retention_interval`) only
    the states `reachable_block_mask` keeps are cached, in both modes.
    """

    spec_types = (MambaSpec,)
    supports_fine_grained_hash_lookup = True
    releases_blocks = True
    caches_at_step_end = True
    sparse_hits = True  # dense_hit_grid: thinned only under sparse retention
    allocates_by_capacity = False  # pads with nulls, takes spare state blocks

    def __init__(self, kv_cache_spec: MambaSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        if self.enable_caching and self.mamba_cache_mode == "none":
            raise ValueError(
                "Mamba prefix caching requires mamba_cache_mode='align' or 'all', got 'none'; "
                "disable prefix caching or change the mode"
            )
        # Leading blocks already released (the table has null gaps between states).
        self._num_retired_blocks: dict[str, int] = {}
        # Ids of the blocks cached during the current step: their state is written by
        # this step's forward, so a hit on one waits for the next step (vLLM's rule).
        # None until the scheduler reports steps (`new_step_starts`): without step
        # boundaries no hit is held back.
        self.cached_blocks_this_step: set[int] | None = None
        # Set by the coordinator under EAGLE: checkpoints follow its replay boundary.
        self.drop_eagle_checkpoint_block = False
        # Set by `KVCacheManager` (`enable_mamba_shared_prefix_checkpoint`, narrowed as
        # vLLM does): a prefill step ending at the request's shared-prefix junction
        # keys its state there too.
        self.shared_prefix_checkpoint = False
        # Requests that keyed their own running state at the prompt's partial tail
        # (`_cache_partial_tail_block`): their next allocation moves that key to a copy.
        self._producer_tails: set[str] = set()
        # Prefill checkpoints (as vLLM does): the backend exports the state at a chunk's last
        # hit boundary into a spare block; request id -> (that position, the block's
        # index), set by `get_num_blocks_to_allocate` for the allocation it sizes.
        self.has_prefill_checkpoint_blocks = (
            self.mamba_cache_mode == "align" and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        )
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # request id -> the blocks whose state is the one at their end (a step ended
        # there), not cached yet: cached once the cacheable count passes them.
        self._boundary_states: dict[str, set[int]] = {}
        # request id -> the next position its state may be keyed at inside a block (the
        # prompt's tail, or the junction), while a step has yet to end there: the slot
        # state then has the step that reaches it cache.
        self._pending_tails: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if self.mamba_cache_mode == "all":
            return 0
        return num_computed_tokens - 1

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            return 0, 0, 0  # its next step copies the keyed state: never skipped
        capacity, next_full, _ = super().get_slot_state(request_id)
        if self._pending_tails:
            pending = self._pending_tails.get(request_id)
            if pending is not None and pending < next_full:
                next_full = pending  # a step reaching a tail or junction caches
        return capacity, next_full, self._release_threshold(request_id)

    def _release_threshold(self, request_id: str) -> int:
        """Smallest computed-token count at which the first held state leaves the window."""
        if self.mamba_cache_mode == "all":
            return _NEVER
        # Null gaps sit between states: the first held block after the retired ones.
        blocks = self.req_to_blocks[request_id]
        for i in range(self._num_retired_blocks.get(request_id, 0), len(blocks)):
            if not blocks[i].is_null:
                return (i + 1) * self.block_size + 1
        return _NEVER

    def _keeps_last_state_only(self) -> bool:
        return self.mamba_cache_mode != "all"

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
        """As the base class; a hit ending on a state cached during this step asks for
        more blocks than the pool has, so the request waits for the next step."""
        cached_this_step = self.cached_blocks_this_step
        if (
            cached_this_step
            and new_computed_blocks
            and new_computed_blocks[-1].block_id in cached_this_step
        ):
            return self.block_pool.num_gpu_blocks + 1
        if not self._keeps_last_state_only():
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens
            )
        if num_tokens_main_model is not None and self.mamba_cache_mode == "align":
            num_tokens = num_tokens_main_model  # no state slots for lookahead tokens (vLLM)
        num_required = _cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        held = self.req_to_blocks.get(request_id)
        num_local = len(new_computed_blocks) + (len(held) if held is not None else 0)
        checkpoint_block = 0
        if self.has_prefill_checkpoint_blocks:
            checkpoint_block = self._plan_checkpoint(
                request_id,
                total_computed_tokens,
                num_tokens,
                apply_admission_cap,
                prefill_end,
            )
        # The table is padded with nulls up to the block before the state's (before the
        # checkpoint's, which takes the block before the state's).
        num_new = max(
            num_required
            - max(num_local, num_required - self.num_speculative_blocks - 1 - checkpoint_block),
            0,
        )
        if (new_computed_blocks and total_computed_tokens % self.block_size) or (
            self._partial_hit_reqs and request_id in self._partial_hit_reqs
        ):
            num_new += 1  # the copy of a state keyed inside a block
        return num_new + sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        if not self._keeps_last_state_only():
            return super().allocate_new_blocks(request_id, num_tokens)
        if num_tokens_main_model is not None and self.mamba_cache_mode == "align":
            num_tokens = num_tokens_main_model
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_required = _cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        partial = self._partial_hit_reqs.pop(request_id, None) if self._partial_hit_reqs else None
        checkpoint_block = 1 if self._checkpoints and request_id in self._checkpoints else 0
        if num_required <= len(req_blocks) and partial is None and not checkpoint_block:
            return []
        num_nulls = num_required - self.num_speculative_blocks - 1 - checkpoint_block
        num_nulls -= len(req_blocks)
        if num_nulls > 0:
            req_blocks.extend([self._null_block] * num_nulls)
        num_new = max(num_required - len(req_blocks), 0)
        if partial is None:
            new_blocks = self.block_pool.get_new_blocks(num_new)
            req_blocks.extend(new_blocks)
            return new_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new + 1)
        cow_block = new_blocks.pop(0)
        block_idx, source_block = partial
        req_blocks.extend(new_blocks)
        if request_id in self._producer_tails:
            # The request's own running state was keyed at the prompt's partial tail; it
            # keeps updating that block in place, so the key moves to the copy, which
            # the queued copy fills before this step's forward overwrites the source.
            self._producer_tails.discard(request_id)
            self.block_pool.move_block_hashes(source_block, cow_block)
            self._pending_cow_copies.append((source_block, cow_block))
            source_block.ref_cnt += 1
            if self.cached_blocks_this_step is not None:
                self.cached_blocks_this_step.add(cow_block.block_id)
            return new_blocks
        self._apply_cow(request_id, block_idx, source_block, cow_block)
        return [cow_block, *new_blocks]

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] = (),
        step_end: int | None = None,
    ) -> None:
        """vLLM's arguments; `step_end`: where the step's state stands ("align"; default
        `num_tokens`, which is then also what may be cached)."""
        if self.mamba_cache_mode != "align":
            request_id = request.request_id
            num_cached = self.num_cached_block.get(request_id, 0)
            if step_end is not None:
                num_tokens = step_end  # "all" keeps every state: each block's is final
            super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
            if self.cached_blocks_this_step is not None:
                self.cached_blocks_this_step.update(
                    block.block_id
                    for block in self.req_to_blocks[request_id][
                        num_cached : self.num_cached_block.get(request_id, 0)
                    ]
                    if block.block_hash_only is not None
                )
            return
        # `step_end` is where the step's state stands, `num_tokens` what may be cached (the
        # coordinator's count: aligned to the hit grid). A state exactly on a block
        # boundary is cached once that count passes it (while its block is held), one
        # inside a block only at the prompt's partial tail (or the junction).
        request_id = request.request_id
        end = num_tokens if step_end is None else step_end
        hash_block_size = self.block_pool.hash_block_size or self.block_size
        self._note_pending_tail(request, end, hash_block_size)
        num_hashed_tokens = len(request.block_hashes) * hash_block_size
        checkpoint = self._checkpoints.get(request_id) if self._checkpoints else None
        if checkpoint is not None:
            self._cache_checkpoint(request, checkpoint, retention_interval)
        ends_on_tail = num_tokens == end <= num_hashed_tokens and checkpoint is None
        on_boundary = end % self.block_size == 0 and end <= num_hashed_tokens
        if on_boundary:
            boundary_states = self._boundary_states.setdefault(request_id, set())
            boundary_states.add(end // self.block_size - 1)
        else:
            if ends_on_tail:
                self._cache_partial_tail_block(request, end)
            boundary_states = self._boundary_states.get(request_id)
        if boundary_states:
            self._cache_boundary_states(
                request,
                num_tokens,
                num_hashed_tokens,
                boundary_states,
                retention_interval,
                replay_boundaries,
            )
        if on_boundary and ends_on_tail:
            # A tail (or junction) state on a block boundary is keyed even where sparse
            # retention dropped its block (as vLLM does); kept already, it is left alone.
            self._cache_partial_tail_block(request, end)

    def _cache_boundary_states(
        self,
        request: Request,
        num_tokens: int,
        num_hashed_tokens: int,
        boundary_states: set[int],
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """Cache the held states of `boundary_states` (block indices a step ended at) that
        the cacheable count `num_tokens` has passed, as retention keeps them."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request_id]
        mask = None
        if retention_interval is not None:
            mask = self._mask_for(
                request, num_cached, num_full, retention_interval, replay_boundaries
            )
        for i in sorted(boundary_states):
            if i < num_cached or i >= num_full:
                continue
            if not blocks[i].is_null and (mask is None or mask[i - num_cached]):
                self.block_pool.cache_full_blocks(
                    request, blocks, i, i + 1, self.block_size, self.kv_cache_group_id
                )
                if self.cached_blocks_this_step is not None:
                    self.cached_blocks_this_step.add(blocks[i].block_id)
        boundary_states.difference_update(range(num_cached, num_full))
        self.num_cached_block[request_id] = num_full

    def _plan_checkpoint(
        self,
        request_id: str,
        query_start: int,
        query_end: int,
        apply_admission_cap: bool,
        prefill_end: int,
    ) -> int:
        """1 when the step `[query_start, query_end)` exports a prefill checkpoint into a
        spare block (vLLM's `_needs_internal_checkpoint`: only a step reaching
        `prefill_end`), else 0; recorded for the allocation unless only sizing an
        admission."""
        position = get_mamba_prefill_checkpoint_position(
            query_end, self.cache_hit_alignment_tokens, self.drop_eagle_checkpoint_block
        )
        checkpoint_idx = _cdiv(query_end, self.block_size) - 2
        blocks = self.req_to_blocks.get(request_id) or []
        needed = (
            checkpoint_idx >= 0
            and query_end >= prefill_end
            and is_mamba_prefill_checkpoint_valid(
                query_start,
                query_end,
                position,
                self.block_pool.hash_block_size or self.block_size,
                self.block_size,
                self.kv_cache_spec.prefill_checkpoint_alignment,  # type: ignore[attr-defined]
            )
            and (
                checkpoint_idx >= len(blocks)
                or blocks[checkpoint_idx].is_null
                or checkpoint_idx >= len(blocks) - self.num_speculative_blocks
            )
        )
        if not apply_admission_cap:
            if needed:
                self._checkpoints[request_id] = (position, checkpoint_idx)
            else:
                self._checkpoints.pop(request_id, None)
        return 1 if needed else 0

    def _cache_checkpoint(
        self, request: Request, checkpoint: tuple[int, int], retention_interval: int | None
    ) -> None:
        """Key the checkpoint block at its position, or drop its keys when no later request
        can resume there (vLLM: kept at the prompt's checkpoint, a retained boundary
        or the shared-prefix junction)."""
        position, checkpoint_idx = checkpoint
        block = self.req_to_blocks[request.request_id][checkpoint_idx]
        pool = self.block_pool
        keep = position == get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens,
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
        ) or position == getattr(request, "shared_prefix_boundary", 0)
        if not keep and position % self.block_size == 0:
            block_idx = position // self.block_size - 1
            retained = self.reachable_block_mask(
                block_idx,
                block_idx + 1,
                self.cache_hit_alignment_tokens,
                self.kv_cache_spec,
                self.drop_eagle_checkpoint_block,
                retention_interval,
            )
            keep = retained is None or retained[0]
        if not keep:
            if block.block_hash_only is not None:  # a transient state: never reusable
                pool.evict_blocks((block.block_id,))
            return
        if pool.partial_entry_tokens(block) == position:
            return
        if (
            pool.cache_partial_block(
                request,
                block,
                position,
                self.kv_cache_group_id,
                self.block_size,
                replace_existing_hashes=True,
            )
            is not None
            and self.cached_blocks_this_step is not None
        ):
            self.cached_blocks_this_step.add(block.block_id)

    def _tail_positions(self, request: Request, hash_block_size: int) -> tuple[int, int]:
        """(the prompt's tail position, the junction or 0) a state may be keyed at."""
        tail = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hash_block_size, self.drop_eagle_checkpoint_block
        )
        junction = 0
        if self.shared_prefix_checkpoint:
            junction = getattr(request, "shared_prefix_boundary", 0)
            if junction > request.num_prompt_tokens:
                junction = 0
        return tail, junction

    def _note_pending_tail(self, request: Request, end: int, hash_block_size: int) -> None:
        ahead = [
            p
            for p in self._tail_positions(request, hash_block_size)
            if p > end and p % self.block_size
        ]
        if ahead:
            self._pending_tails[request.request_id] = min(ahead)
        elif self._pending_tails:
            self._pending_tails.pop(request.request_id, None)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Key the running state when a step ends exactly at the prompt's last hit
        boundary (vLLM's partial tail, `get_mamba_prefill_checkpoint_position`), or,
        with `shared_prefix_checkpoint`, at the request's shared-prefix junction.

        A state inside a block is then moved to a private copy at the request's next
        allocation (the request keeps updating its running state in place).
        """
        hash_block_size = self.block_pool.hash_block_size or self.block_size
        if num_tokens % hash_block_size:
            return
        tail, junction = self._tail_positions(request, hash_block_size)
        # The junction a sibling was seen to stop at counts while the prompt is computed
        # (in decode the running state changes in place before its key would hold).
        if num_tokens != tail and not (
            num_tokens == junction and request.num_computed_tokens < num_tokens
        ):
            return
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        block_idx = _cdiv(num_tokens, self.block_size) - 1
        if block_idx >= len(blocks) or blocks[block_idx].is_null:
            return
        source_block = blocks[block_idx]
        pool = self.block_pool
        if pool.partial_entry_tokens(source_block) == num_tokens:
            return  # keyed here already (by a hit or an earlier step)
        on_boundary = num_tokens % self.block_size == 0
        if on_boundary and source_block.block_hash_only is not None:
            return  # cached as a whole block (its key is this boundary's)
        if (
            pool.cache_partial_block(
                request, source_block, num_tokens, self.kv_cache_group_id, self.block_size
            )
            is None
        ):
            return
        if self.cached_blocks_this_step is not None:
            self.cached_blocks_this_step.add(source_block.block_id)
        if on_boundary:
            return  # the state is final: no copy, no producer
        self._partial_hit_reqs[request_id] = (block_idx, source_block)
        self._producer_tails.add(request_id)
        self.num_cached_block[request_id] = block_idx

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step = set()

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
        """Sparse state retention: a hit needs only the one state ending on it.

        None (cache all) unless `retention_interval` is set; then the state
        ending each `retention_interval`-token segment (none for 0; all when the
        segment is at most one block) and the state ending on each
        `reachable_boundaries` position rounded down to `alignment_tokens`.
        """
        if retention_interval is None or alignment_tokens is None:
            return None
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError(f"kv_cache_spec must be a MambaSpec, got {kv_cache_spec!r}")
        block_size = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None
            for i in range(start_block, end_block):
                mask[i - start_block] = (i + 1) % per_segment == 0
        for boundary in reachable_boundaries:
            block = boundary // alignment_tokens * alignment_tokens // block_size - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask

    def _release_blocks(self, request_id: str, blocks: list[KVCacheBlock], last: int) -> None:
        first = self._num_retired_blocks.get(request_id, 0)
        freed = [b for b in blocks[first:last] if not b.is_null]
        for i in range(first, max(first, last)):
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_held_blocks(reversed(freed))
        self._num_retired_blocks[request_id] = max(first, last)

    def free(self, request_id: str) -> None:
        self._num_retired_blocks.pop(request_id, None)
        self._producer_tails.discard(request_id)
        self._pending_tails.pop(request_id, None)
        self._boundary_states.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        super().free(request_id)

    @classmethod
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
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        hash_block_size = block_pool.hash_block_size or block_size
        null = block_pool.null_block
        computed: HitBlocks = tuple([] for _ in kv_cache_group_ids)
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            # Fine-grained: the state at any hash unit, searched right to left.
            scale = block_size // alignment_tokens
            for fine_idx in range(
                min(max_length // alignment_tokens, len(block_hashes)) - 1, -1, -1
            ):
                cached = block_pool.get_cached_block(block_hashes[fine_idx], kv_cache_group_ids)
                if cached is not None:
                    for group_blocks, block in zip(computed, cached, strict=True):
                        group_blocks.extend([null] * (fine_idx // scale))
                        group_blocks.append(block)
                    return computed, (fine_idx + 1) * alignment_tokens
            return computed, 0
        block_hashes = resolve_block_hashes(block_hashes, hash_block_size, block_size)
        for i in range(min(max_length // block_size, len(block_hashes)) - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for group_blocks, block in zip(computed, cached, strict=True):
                group_blocks.extend([null] * i)
                group_blocks.append(block)
            return computed, (i + 1) * block_size
        return computed, 0


class _ScratchManager(SingleTypeKVCacheManager):
    """Blocks private to one request: never cached, so never hit, and a fixed
    allocation that decoding never changes (`get_slot_state` is never)."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        if new_computed_blocks:
            raise ValueError(
                f"{type(self).__name__}: its blocks are never cached, so never hit; got "
                f"{len(new_computed_blocks)} hit blocks"
            )

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] = (),
    ) -> None:
        return

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Nothing: a connector loads no scratch blocks (the ring is claimed as a request's
        first allocation claims it)."""
        return

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        return _NEVER, _NEVER, _NEVER

    @classmethod
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
        return tuple([] for _ in kv_cache_group_ids), 0


class CrossAttentionManager(_ScratchManager):
    """Cross-attention: a fixed allocation by encoder length, never cached.

    The coordinator passes the request's encoder token count as `num_tokens`.
    """

    spec_types = (CrossAttentionSpec,)


class CircularBufferManager(_ScratchManager):
    """A circular buffer: one ring block per request, claimed at its first allocation
    and held until it finishes, whatever `num_tokens` asks; never cached and never
    recorded for zeroing (vLLM's rules)."""

    spec_types = (CircularBufferSpec,)
    allocates_by_capacity = False  # one ring block, whatever the tokens

    def __init__(self, kv_cache_spec: CircularBufferSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self._record_new_block_ids = False

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
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        if self.req_to_blocks.get(request_id):
            return []
        ring = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = list(ring)
        self.num_cached_block.setdefault(request_id, 0)
        return ring

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """The ring is claimed here when a connector loads computed tokens (vLLM's
        order: before any group's new blocks)."""
        self.allocate_new_blocks(request_id, 0)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int = 0
    ) -> int:
        """0: a ring block is never shared."""
        return 0


# Subclasses before their bases: the first class whose `spec_types` match serves a spec.
SPEC_MANAGER_TYPES: tuple[type[SingleTypeKVCacheManager], ...] = (
    RSWAManager,
    SinkFullAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    ChunkedLocalAttentionManager,
    MambaManager,
    CrossAttentionManager,
    CircularBufferManager,
)


def manager_class_for_spec(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class serving `kv_cache_spec` (a uniform-type group: its layers' type)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        kv_cache_spec = kv_cache_spec.layer_type_spec
    for manager_type in SPEC_MANAGER_TYPES:
        if isinstance(kv_cache_spec, manager_type.spec_types):
            return manager_type
    supported = [t.__name__ for m in SPEC_MANAGER_TYPES for t in m.spec_types]
    raise ValueError(
        f"no manager for KV cache spec {type(kv_cache_spec).__name__}; supported: {supported}"
    )


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_in_flight_tokens: int,
    max_model_len: int,
    role: str | None = None,
    **kwargs,
) -> SingleTypeKVCacheManager:
    """A manager of the class whose `spec_types` match `kv_cache_spec` (vLLM's
    arguments; `kwargs` are the manager's, `role` must be None).

    A uniform-type group is served by its layers' manager, reading its first
    layer's spec (the layers share block size and window). Groups that release
    blocks as a request advances get the spec's per-request admission cap.
    """
    if role is not None:
        raise ValueError(f"KV cache group role {role!r} is not supported (None only)")
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        kv_cache_spec = kv_cache_spec.layer_type_spec
    if isinstance(kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        kwargs.setdefault(
            "max_admission_blocks_per_request",
            kv_cache_spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len),
        )
    return manager_class_for_spec(kv_cache_spec)(kv_cache_spec, **kwargs)
