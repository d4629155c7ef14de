"""Per-attention-type managers: the blocks each request holds in one KV-cache group.

A manager owns `req_to_blocks` for its group and decides, for its attention
type, how long a cached prefix it can use (its hit rule), which blocks a
request no longer reads (its release rule) and how many blocks an allocation
takes. All pages come from the shared `BlockPool`. The rules are vLLM's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash, BlockHashListWithBlockSize, resolve_block_hashes
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)
from jaxkv.mamba_manager import MambaManager
from jaxkv.single_type_base import (
    NEVER,
    HitBlocks,
    SingleTypeKVCacheManager,
    prompt_tail_boundary,
    spec_block_size,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


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
        # The hash unit when the prompt's partial tail is keyed (a cacheable group hashed
        # finer than its blocks), else None: the methods below then do nothing more than
        # the base's.
        self._tail_hash_block_size: int | None = (
            hash_block_size
            if self.block_size != hash_block_size and self._prefix_cacheable
            else None
        )
        # `_pending_tails` (the base's): request id -> its prompt's partial tail boundary,
        # while no key names it: until a step reaches it, and again once `evict_blocks`
        # dropped its block's keys.
        # request id -> the boundary of its partial tail, once a step has keyed it.
        self._keyed_tails: dict[str, int] = {}

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] = (),
    ) -> None:
        """The base's, then the prompt's partial tail once `num_tokens` reaches it."""
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries)
        if self._tail_hash_block_size is None:
            return
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

    def free(self, request_id: str) -> None:
        self._pending_tails.pop(request_id, None)
        self._keyed_tails.pop(request_id, None)
        super().free(request_id)

    def note_evicted_blocks(self, block_ids: Collection[int]) -> None:
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
        block_size = spec_block_size(kv_cache_spec, dcp_world_size)
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
        num_blocks = cdiv(hit_length, block_size)
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
        first = cdiv(num_prompt_tokens, block_size)
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
            return NEVER
        first = cdiv(num_prompt_tokens, self.block_size)
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
    hit_may_hold_null_blocks = True

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
        return cdiv(window - 1, block_size) + (1 if use_eagle else 0)

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
    hit_may_hold_null_blocks = True

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def release_threshold_for_block(self, block_index: int) -> int:
        chunk = self.attention_chunk_size
        return cdiv((block_index + 1) * self.block_size, chunk) * chunk

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
        return NEVER, NEVER, NEVER

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
