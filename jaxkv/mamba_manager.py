"""The Mamba (recurrent state) manager: one state block per request, as vLLM keeps it.

In "align" mode a request holds its running state in the block of its step's
last token (null blocks before it) and a state is cached where a step ended on
the hit grid; "all" mode keeps and caches every block's state. Also importable
from `jaxkv.single_type_kv_cache_manager`, where vLLM has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash, resolve_block_hashes
from jaxkv.kv_cache_interface import (
    KVCacheSpec,
    MambaSpec,
    cdiv,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from jaxkv.single_type_base import (
    NEVER,
    HitBlocks,
    SingleTypeKVCacheManager,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


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
    hit_may_hold_null_blocks = True
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
        # Set by the coordinator (`enable_mamba_shared_prefix_checkpoint`, narrowed as
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
        # `_pending_tails` (the base's): request id -> the next position its state may be
        # keyed at inside a block (the prompt's tail, or the junction), while a step has
        # yet to end there.

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if self.mamba_cache_mode == "all":
            return 0
        return num_computed_tokens - 1

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            return 0, 0, 0  # its next step copies the keyed state: never skipped
        capacity, next_caching, _ = super().get_slot_state(request_id)
        return capacity, next_caching, self._release_threshold(request_id)

    def _release_threshold(self, request_id: str) -> int:
        """Smallest computed-token count at which the first held state leaves the window."""
        if self.mamba_cache_mode == "all":
            return NEVER
        # Null gaps sit between states: the first held block after the retired ones.
        blocks = self.req_to_blocks[request_id]
        for i in range(self._num_retired_blocks.get(request_id, 0), len(blocks)):
            if not blocks[i].is_null:
                return (i + 1) * self.block_size + 1
        return NEVER

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
        num_required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
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
        num_required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
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

    @property
    def ignores_lookahead_tokens(self) -> bool:
        """An "align" group keeps one state per step: no slot for lookahead tokens."""
        return self.mamba_cache_mode == "align"

    @property
    def reserves_prefill_checkpoints(self) -> bool:
        return self.has_prefill_checkpoint_blocks

    def cache_step(
        self,
        request: Request,
        num_cacheable_tokens: int,
        num_computed_tokens: int,
        step_end: int | None,
        retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """A state describes one position: it is cached only when the step ended at the
        verified tokens' end (`step_end` None or `num_computed_tokens`), and is given
        that exact end, not the count on the hit grid."""
        if step_end is not None and step_end != num_computed_tokens:
            return  # the state holds unverified tokens
        self.cache_blocks(
            request,
            num_cacheable_tokens,
            retention_interval,
            replay_boundaries,
            num_computed_tokens,
        )

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
        checkpoint_idx = cdiv(query_end, self.block_size) - 2
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
        block_idx = cdiv(num_tokens, self.block_size) - 1
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
