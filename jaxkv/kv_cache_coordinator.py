"""Coordinators: one `BlockPool` shared by the managers of every KV-cache group.

A coordinator fans the KV cache manager's calls out to the per-group managers
and finds the longest prefix hit that *every* group can serve (SPEC §5). The
configuration picks the class, as vLLM does: no prefix cache (any number
of groups, never a hit), one group, or a hybrid of several.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from jaxkv._checks import check_num_blocks
from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash
from jaxkv.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)
from jaxkv.kv_cache_utils import eagle_proof_margin, partial_hash_hits_enabled
from jaxkv.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    HitBlocks,
    MambaManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
    get_manager_for_kv_cache_spec,
    manager_class_for_spec,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


def resolve_cache_hit_alignment_tokens(
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
    hash_block_size: int,
    enable_prefix_caching: bool = True,
    dcp_world_size: int = 1,
) -> int:
    """Token granularity of prefix-cache hits: the hash unit for fine-grained
    (Mamba "align") hybrids, else the scheduler block size."""
    groups = kv_cache_config.kv_cache_groups
    if not enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    classes = [manager_class_for_spec(g.kv_cache_spec) for g in groups]
    if partial_hash_hits_enabled(groups, hash_block_size, dcp_world_size, classes):
        return hash_block_size
    return scheduler_block_size


def validate_prefix_cache_retention_interval(
    retention_interval: int | None, scheduler_block_size: int, kv_cache_config: KVCacheConfig
) -> None:
    """Sparse retention needs a sliding-window or Mamba group and a scheduler-block multiple."""
    if retention_interval is None:
        return
    sparse = any(
        isinstance(spec, (SlidingWindowSpec, MambaSpec))
        for g in kv_cache_config.kv_cache_groups
        for spec in iter_layer_specs(g.kv_cache_spec)
    )
    if not sparse:
        if retention_interval == 0:
            return
        raise ValueError(
            f"prefix_cache_retention_interval={retention_interval} is set but this model has no "
            "sliding-window or Mamba KV cache group, so retention has no effect; set it to 0 "
            "or None"
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) must be non-negative and a "
            f"multiple of scheduler_block_size ({scheduler_block_size})"
        )


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Positions a later request replaying this prompt can resume at.

    A resend of the identical prompt hits at most `num_tokens - 1` (its last
    token is recomputed for logits); with EAGLE the hit lands one scheduler
    block lower, for a resend and for a longer sibling alike.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def _check_block_sizes(
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
    hash_block_size: int,
    dcp_world_size: int,
) -> None:
    """`scheduler_block_size` must be a positive multiple of `hash_block_size` and of every
    group's block size (times `dcp_world_size` for a DCP-sharded group)."""
    block_sizes = [
        g.kv_cache_spec.block_size * (dcp_world_size if g.kv_cache_spec.dcp_sharded else 1)
        for g in kv_cache_config.kv_cache_groups
    ]
    if (
        scheduler_block_size <= 0
        or hash_block_size <= 0
        or scheduler_block_size % hash_block_size
        or any(scheduler_block_size % bs for bs in block_sizes)
    ):
        raise ValueError(
            f"scheduler_block_size ({scheduler_block_size}) must be a positive multiple of "
            f"hash_block_size ({hash_block_size}) and of every group's block size "
            f"({block_sizes})"
        )


class KVCacheCoordinator:
    """Per-group managers over one pool.

    Invariants: group i's blocks for a request are `single_type_managers[i]
    .req_to_blocks`; no block id is held by two groups (they share the pool and
    a block has one owner key); `scheduler_block_size` is a multiple of every
    group's block size and of `hash_block_size`.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        track_freed_block_ids: bool = False,
        dcp_world_size: int = 1,
        num_prefill_lookahead: int = 0,
        max_in_flight_tokens: int | None = None,
        needs_kv_cache_zeroing: bool = False,
    ) -> None:
        """`max_in_flight_tokens` (default `max_model_len`): tokens scheduled but not yet
        computed; it bounds what a window group holds per request (admission cap).
        `needs_kv_cache_zeroing`: managers record new attention blocks' ids.
        `kv_cache_config.num_blocks` must be at least 2 (block 0 is the null block)."""
        num_blocks = check_num_blocks("kv_cache_config.num_blocks", kv_cache_config.num_blocks)
        groups = kv_cache_config.kv_cache_groups
        _check_block_sizes(kv_cache_config, scheduler_block_size, hash_block_size, dcp_world_size)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        if enable_caching and self.eagle_group_ids and scheduler_block_size < num_prefill_lookahead:
            raise ValueError(
                f"multi-token EAGLE/MTP with prefix caching requires scheduler_block_size "
                f"(={scheduler_block_size}) >= num_speculative_tokens (={num_prefill_lookahead})"
            )
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        validate_prefix_cache_retention_interval(
            self.retention_interval, scheduler_block_size, kv_cache_config
        )
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            track_freed_block_ids=track_freed_block_ids,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                max_in_flight_tokens or max_model_len,
                max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=group_id,
                scheduler_block_size=scheduler_block_size,
                dcp_world_size=dcp_world_size,
                needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            )
            for group_id, group in enumerate(groups)
        )
        if use_eagle:  # Mamba checkpoints follow EAGLE's replay boundary (vLLM's rule)
            for manager in self.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True
        self._summarize_managers()

    def _summarize_managers(self) -> None:
        """What the step paths ask of all groups at once, read off the managers once."""
        managers = self.single_type_managers
        # Managers whose attention type releases blocks as a request advances.
        self.skipping_managers = tuple(m for m in managers if m.releases_blocks)
        self._cross_attention = tuple(isinstance(m, CrossAttentionManager) for m in managers)
        self.mamba_group_ids = tuple(
            i for i, m in enumerate(managers) if isinstance(m, MambaManager)
        )
        # With `prefix_cache_retention_interval` 0 a Mamba group reserves a prefill
        # checkpoint only on the chunk reaching the prefill's end (as vLLM does), which
        # `get_num_blocks_to_allocate` is then told.
        self.checkpoints_at_prefill_end = self.retention_interval == 0 and any(
            m.reserves_prefill_checkpoints for m in managers
        )
        # Some group gets no slots for lookahead tokens (a Mamba "align" group), so the
        # counts are also told the tokens without them.
        self.some_group_ignores_lookahead = any(m.ignores_lookahead_tokens for m in managers)
        # A running request's steps need at most this many blocks per `min_block_size`
        # tokens beyond its smallest capacity (every group allocates by capacity), or None.
        self.blocks_per_missing_block: int | None = (
            len(managers) if all(m.allocates_by_capacity for m in managers) else None
        )
        self.min_block_size = min(m.block_size for m in managers)

    # Hits finer than a block (a hybrid with a Mamba "align" group sets it).
    enable_partial_hash_hits = False

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def enable_mamba_shared_prefix_checkpoint(self) -> bool:
        """Turn on vLLM's `mamba_shared_prefix_checkpoint` where it applies (EAGLE groups,
        partial hits, no re-prefilled tokens): Mamba "align" states are then also keyed
        at a request's `shared_prefix_boundary`. Returns whether it applies."""
        applies = (
            bool(self.eagle_group_ids)
            and self.enable_partial_hash_hits
            and self.num_reprefillable_tokens == 0
        )
        if applies:
            for group_id in self.mamba_group_ids:
                self.single_type_managers[group_id].shared_prefix_checkpoint = True
        return applies

    # -- allocation ----------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        num_tokens_main_model: int | None = None,
        num_local_computed_tokens: int | None = None,
    ) -> int:
        """Free blocks all groups together need; cross-attention takes the encoder length.
        `total_computed_tokens`: hits plus KV-connector tokens; `num_local_computed_tokens`:
        the hits alone (None: the same).
        `apply_admission_cap`: window groups count only what a request holds at once.
        `prefill_end`: where the request's prefill ends; with `retention_interval` 0 a
        Mamba group reserves a prefill checkpoint only on the chunk reaching it (ignored
        otherwise: every chunk's checkpoint may be kept). `num_tokens_main_model`:
        `num_tokens` less the lookahead tokens, which a Mamba "align" group gets no slot
        for (None: no lookahead)."""
        if prefill_end and self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if self._cross_attention[i]:
                total += manager.get_num_blocks_to_allocate(request_id, num_encoder_tokens, ())
            elif apply_admission_cap or prefill_end or num_tokens_main_model is not None:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model=num_tokens_main_model,
                    apply_admission_cap=apply_admission_cap,
                    prefill_end=prefill_end,
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_local_computed_tokens,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> None:
        """Add the hits, and blocks for the tokens a KV connector computed, to a newly
        scheduled request, every group's hits before any new block.

        Two-phase: every group touches its hits before any group takes new
        blocks, so one group's allocation cannot evict another group's hit.
        `skip_zeroing_group_ids`: groups whose external-token blocks the
        connector's load writes (not reported for zeroing).
        """
        managers = self.single_type_managers
        for manager, hits in zip(managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(
                request_id, hits, num_local_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens:
            for group_id, manager in enumerate(managers):
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    group_id not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        # A loop, not a generator: resuming a generator frame per group costs more here.
        new_blocks = []
        for manager, cross_attention in zip(
            self.single_type_managers, self._cross_attention, strict=True
        ):
            if cross_attention:
                new_blocks.append(manager.allocate_new_blocks(request_id, num_encoder_tokens))
            else:
                new_blocks.append(
                    manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                )
        return tuple(new_blocks)

    # -- caching -------------------------------------------------------------

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Tokens of group `kv_cache_group_id` whose KV is final and may be cached."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(
        self, request: Request, num_computed_tokens: int, step_end: int | None = None
    ) -> None:
        """Cache every group's blocks that the first `num_computed_tokens` tokens fill.

        `step_end`: the token count the step computed up to (more than
        `num_computed_tokens` when it includes unverified speculative tokens); a
        group caching a recurrent state caches only when they agree.
        """
        retention_interval = self.retention_interval
        boundaries: tuple[int, ...] = ()
        if retention_interval is not None:  # only sparse retention keeps them specially
            boundaries = replay_boundaries(
                request.num_prompt_tokens,
                self.scheduler_block_size,
                bool(self.drop_eagle_group_ids),
            )
        for group_id, manager in enumerate(self.single_type_managers):
            manager.cache_step(
                request,
                self.get_num_cacheable_tokens(num_computed_tokens, group_id),
                num_computed_tokens,
                step_end,
                retention_interval,
                boundaries,
            )

    # -- release and queries -------------------------------------------------

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def new_step_starts(self) -> None:
        """The scheduler starts a new step: every group's manager is told."""
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Release what every group no longer reads (`num_prompt_tokens`: for R-SWA's gap)."""
        for manager in self.skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    def holds_blocks(self, request_id: str) -> bool:
        for manager in self.single_type_managers:
            if request_id in manager.num_cached_block:
                return True
        return False

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        """Over all groups, the smallest of each of the managers' `get_slot_state` values:
        (tokens the request's blocks hold, token count filling a block, computed-token
        count releasing a block). Below all three a step changes nothing."""
        managers = self.single_type_managers
        capacity, next_full, release_at = managers[0].get_slot_state(request_id)
        for i in range(1, len(managers)):
            group_capacity, group_next_full, group_release_at = managers[i].get_slot_state(
                request_id
            )
            if group_capacity < capacity:
                capacity = group_capacity
            if group_next_full < next_full:
                next_full = group_next_full
            if group_release_at < release_at:
                release_at = group_release_at
        return capacity, next_full, release_at

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(running_request_id, num_running_requests)
            for m in self.single_type_managers
        ]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int, int]:
        """(hit blocks per group, hit length, uncached common prefix tokens)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, never a hit."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, **kwargs) -> None:
        kwargs["enable_caching"] = False
        super().__init__(kv_cache_config, max_model_len, **kwargs)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group: its manager's hit rule on its own block size.

    With one group there is nothing to coordinate: queries and releases go to the
    manager directly. A plain full-attention group (full or sink full attention, no
    sparse retention, no re-prefilled tokens) also allocates and caches directly, and,
    when one request hash covers one block and no block is dropped for EAGLE, its hit
    is the leading cached blocks. Results equal the general path's
    (tests/test_kv_cache_manager_slot_state.py).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, **kwargs) -> None:
        super().__init__(kv_cache_config, max_model_len, **kwargs)
        if len(self.single_type_managers) != 1:
            raise ValueError("UnitaryKVCacheCoordinator serves exactly one KV cache group")
        manager = self.single_type_managers[0]
        if manager.block_size % self.hash_block_size:
            raise ValueError(
                f"hash_block_size ({self.hash_block_size}) must divide the group's block size "
                f"({manager.block_size})"
            )
        manager.use_eagle = 0 in self.drop_eagle_group_ids
        self.manager = manager
        self.plain_full_attention = (
            type(manager) in (FullAttentionManager, SinkFullAttentionManager)
            and self.retention_interval is None
            and not self.num_reprefillable_tokens
        )
        self.hits_are_leading_blocks = (
            self.plain_full_attention
            and self.block_pool.hash_block_size in (None, manager.block_size)
            and not manager.use_eagle
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        num_tokens_main_model: int | None = None,
        num_local_computed_tokens: int | None = None,
    ) -> int:
        if not self.plain_full_attention or apply_admission_cap:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                num_encoder_tokens,
                total_computed_tokens,
                apply_admission_cap,
                prefill_end,
                num_tokens_main_model,
                num_local_computed_tokens,
            )
        return self.manager.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks[0],
            total_computed_tokens,
            num_local_computed_tokens,
        )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        if not self.plain_full_attention:
            return super().allocate_new_blocks(
                request_id, num_tokens, num_encoder_tokens, num_tokens_main_model
            )
        return (self.manager.allocate_new_blocks(request_id, num_tokens),)

    def cache_blocks(
        self, request: Request, num_computed_tokens: int, step_end: int | None = None
    ) -> None:
        if not self.plain_full_attention:
            super().cache_blocks(request, num_computed_tokens, step_end)
        else:
            self.manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)

    def get_slot_state(self, request_id: str) -> tuple[int, int, int]:
        return self.manager.get_slot_state(request_id)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int, int]:
        manager = self.manager
        if self.hits_are_leading_blocks:
            num_blocks = min(max_cache_hit_length // manager.block_size, len(block_hashes))
            leading = self.block_pool.cached_block_hash_to_block.get_leading_blocks(
                block_hashes, 0, num_blocks
            )
            return (leading,), len(leading) * manager.block_size, 0
        if not manager.kv_cache_spec.prefix_cacheable:
            return ([],), 0, 0
        blocks, length = type(manager).find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            manager.kv_cache_spec,
            manager.use_eagle,
            manager.block_size,
            manager.dcp_world_size,
        )
        return blocks, length, 0


class SpecGroup(NamedTuple):
    """Groups sharing one spec (and manager class), looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups of different attention types.

    The hit length is a fixed point: starting from the candidate, each
    attention type either accepts it or shrinks it, and the search repeats
    until no type shrinks it. Hits are multiples of the scheduler block size
    (of the hash unit when fine-grained Mamba hits are on).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        allow_partial_hash_hits: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, **kwargs)
        groups = kv_cache_config.kv_cache_groups
        for manager, group in zip(self.single_type_managers, groups, strict=True):
            if group.kv_cache_spec.prefix_cacheable and manager.block_size % self.hash_block_size:
                raise ValueError(
                    f"every prefix-cacheable group's block size must be a multiple of "
                    f"hash_block_size={self.hash_block_size}; group {manager.kv_cache_group_id} "
                    f"has block size {manager.block_size}"
                )
        self.enable_partial_hash_hits = allow_partial_hash_hits and partial_hash_hits_enabled(
            groups, self.hash_block_size, 1, [type(m) for m in self.single_type_managers]
        )
        self.cache_hit_alignment_tokens = (
            self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size
        )
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = self.cache_hit_alignment_tokens
        self.attention_groups: list[SpecGroup] = []
        for i, manager in enumerate(self.single_type_managers):
            spec = manager.kv_cache_spec
            if not spec.prefix_cacheable:
                continue  # per-request scratch (cross-attention): never hit
            use_eagle = i in self.drop_eagle_group_ids
            for idx, group in enumerate(self.attention_groups):
                if group.spec == spec and group.manager_cls is type(manager):
                    group.group_ids.append(i)
                    if use_eagle and not group.use_eagle:
                        self.attention_groups[idx] = group._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(SpecGroup(spec, [i], type(manager), use_eagle))
        if not self.attention_groups and self.enable_caching:
            raise ValueError("a hybrid coordinator with prefix caching needs a cacheable group")
        # Full attention first: its left-to-right scan gives the tightest first bound.
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        for group in self.attention_groups:
            if group.use_eagle:
                for gid in group.group_ids:
                    self.single_type_managers[gid].use_eagle = True

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Aligned down to the hit grid; an EAGLE group also caches the block it drops."""
        grid = 1 if self.enable_partial_hash_hits else self.scheduler_block_size
        cacheable = num_computed_tokens // grid * grid
        manager = self.single_type_managers[kv_cache_group_id]
        if manager.use_eagle and cacheable > 0:
            finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(finalized, finalized // grid * grid + manager.block_size)
        return cacheable

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[HitBlocks, int, int]:
        num_groups = len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * num_groups
        group_hit_length = [0] * num_groups
        simple = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0].spec, FullAttentionSpec
        )
        eagle_verified: set[int] = set()
        managers = self.single_type_managers
        while True:
            candidate = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle) in enumerate(self.attention_groups):
                first = group_ids[0]
                manager = managers[first]
                if isinstance(spec, FullAttentionSpec) and hit_blocks[first] is not None:
                    # Full attention is downward-closed: trim, never look up again.
                    candidate = min(candidate, group_hit_length[first])
                    continue
                drop_eagle = use_eagle and idx not in eagle_verified
                max_length = candidate
                if drop_eagle and not isinstance(spec, MambaSpec):
                    margin = eagle_proof_margin(
                        manager.block_size,
                        self.hash_block_size,
                        self.enable_partial_hash_hits
                        and manager_cls.supports_fine_grained_hash_lookup,
                    )
                    max_length = min(candidate + margin, len(block_hashes) * self.hash_block_size)
                blocks, length = manager_cls.find_longest_cache_hit(
                    block_hashes,
                    max_length,
                    group_ids,
                    self.block_pool,
                    spec,
                    drop_eagle,
                    self.cache_hit_alignment_tokens,
                    manager.dcp_world_size,
                )
                if drop_eagle:
                    eagle_verified.add(idx)
                elif length < candidate:
                    eagle_verified.clear()
                candidate = length
                for gid, group_blocks in zip(group_ids, blocks, strict=True):
                    hit_blocks[gid] = group_blocks
                    group_hit_length[gid] = length
                longest_hit_length = max(longest_hit_length, candidate)
            if candidate >= hit_length:
                break
            hit_length = candidate
            if simple:
                break
        for group in self.attention_groups:
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            num_blocks = -(-hit_length // managers[group.group_ids[0]].block_size)
            for gid in group.group_ids:
                group_blocks = hit_blocks[gid]
                if group_blocks is not None:
                    del group_blocks[num_blocks:]
        # A longer hit in some group is a shared prefix a lagging group has not cached yet.
        return (
            tuple([b if b is not None else [] for b in hit_blocks]),
            hit_length,
            longest_hit_length - hit_length,
        )


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    scheduler_block_size: int,
    hash_block_size: int,
    use_eagle: bool = False,
    enable_kv_cache_events: bool = False,
    track_freed_block_ids: bool = False,
    dcp_world_size: int = 1,
    num_prefill_lookahead: int = 0,
    allow_partial_hash_hits: bool = True,
    max_in_flight_tokens: int | None = None,
    needs_kv_cache_zeroing: bool = False,
) -> KVCacheCoordinator:
    """The coordinator class the configuration calls for.

    `allow_partial_hash_hits`: fine-grained hits inside a block where vLLM
    enables them (`partial_hash_hits_enabled`: a Mamba "align" group coarser than
    the hash unit, every other cacheable group able to look up at hash units). A
    hit ending inside a block is redirected to a private copy of that block (the
    managers' copy-on-write, drained by `KVCacheManager.take_kv_cache_block_copies`).
    """
    kwargs = dict(
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        use_eagle=use_eagle,
        enable_kv_cache_events=enable_kv_cache_events,
        track_freed_block_ids=track_freed_block_ids,
        dcp_world_size=dcp_world_size,
        num_prefill_lookahead=num_prefill_lookahead,
        max_in_flight_tokens=max_in_flight_tokens,
        needs_kv_cache_zeroing=needs_kv_cache_zeroing,
    )
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_model_len, **kwargs)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, enable_caching=True, **kwargs
        )
    return HybridKVCacheCoordinator(
        kv_cache_config,
        max_model_len,
        allow_partial_hash_hits=allow_partial_hash_hits,
        enable_caching=True,
        **kwargs,
    )
