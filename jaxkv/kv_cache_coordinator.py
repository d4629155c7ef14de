"""The coordinator: one `BlockPool` shared by the managers of every KV-cache group.

It fans the KV cache manager's calls out to the per-group managers and finds
the longest prefix hit that *every* group can serve (SPEC §5, hybrid models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash
from jaxkv.kv_cache_interface import KVCacheConfig, KVCacheSpec
from jaxkv.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


class KVCacheCoordinator:
    """Per-group managers over one pool.

    Invariants: group i's blocks for a request are `managers[i].req_to_blocks`;
    `scheduler_block_size` (the LCM of group block sizes) divides every cache
    hit; `hash_block_size` divides every group's block size.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        track_freed_block_ids: bool = False,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("kv_cache_config needs at least one KV cache group")
        for group in groups:
            if group.kv_cache_spec.block_size % hash_block_size != 0:
                raise ValueError(
                    f"hash_block_size {hash_block_size} must divide every group's block size; "
                    f"group {group.layer_names} has block size {group.kv_cache_spec.block_size}"
                )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            track_freed_block_ids=track_freed_block_ids,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id)
            for group_id, group in enumerate(groups)
        )
        # Managers whose attention type releases blocks as a request advances.
        self.skipping_managers = tuple(
            m
            for m in self.single_type_managers
            if type(m).remove_skipped_blocks is not SingleTypeKVCacheManager.remove_skipped_blocks
        )
        self.scheduler_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in groups))
        # Groups of one attention type (same manager class and spec) are looked up together.
        by_type: dict[tuple[type, KVCacheSpec], list[int]] = {}
        for manager in self.single_type_managers:
            key = (type(manager), manager.kv_cache_spec)
            by_type.setdefault(key, []).append(manager.kv_cache_group_id)
        self.attention_groups = [(cls, spec, tuple(ids)) for (cls, spec), ids in by_type.items()]

    @property
    def num_groups(self) -> int:
        return len(self.single_type_managers)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
    ) -> int:
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            total += manager.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i]
            )
        return total

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        for manager, hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, hits)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        new_blocks = []
        for manager in self.single_type_managers:
            new_blocks.append(manager.allocate_new_blocks(request_id, num_tokens))
        return tuple(new_blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_tokens)

    def get_slot_state(self, request_id: str) -> tuple[int, int]:
        """Over all groups: (tokens the request's blocks hold, token count filling a block)."""
        capacity, next_full = self.single_type_managers[0].get_slot_state(request_id)
        for manager in self.single_type_managers[1:]:
            group_capacity, group_next_full = manager.get_slot_state(request_id)
            capacity = min(capacity, group_capacity)
            next_full = min(next_full, group_next_full)
        return capacity, next_full

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.single_type_managers[0].req_to_blocks

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.single_type_managers)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(running_request_id, num_running_requests)
            for m in self.single_type_managers
        ]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length in tokens.

        Each attention type can only shrink the candidate length; the search
        repeats until every type serves the same length, a multiple of the
        scheduler block size.
        """
        align = self.scheduler_block_size
        hit_length = max_length // align * align
        hits_by_type: list[tuple[list[KVCacheBlock], ...]] = []
        while True:
            hits_by_type.clear()
            shrunk = False
            for cls, spec, group_ids in self.attention_groups:
                hits = cls.find_longest_cache_hit(
                    block_hashes, hit_length, group_ids, self.block_pool, spec, self.hash_block_size
                )
                hits_by_type.append(hits)
                length = len(hits[0]) * spec.block_size // align * align
                if length < hit_length:
                    hit_length = length
                    shrunk = True
            if not shrunk or len(self.attention_groups) == 1:
                break
        blocks: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        for (_, spec, group_ids), hits in zip(self.attention_groups, hits_by_type, strict=True):
            num_blocks = hit_length // spec.block_size
            for group_id, group_hits in zip(group_ids, hits, strict=True):
                blocks[group_id] = group_hits[:num_blocks]
        return tuple(blocks), hit_length
