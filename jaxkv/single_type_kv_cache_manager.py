"""Per-attention-type managers: the blocks each request holds in one KV-cache group.

A manager owns `req_to_blocks` for its group and decides, for its attention
type, how many blocks a request needs and how long a cached prefix it can use.
All pages come from the shared `BlockPool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxkv.block_pool import BlockPool
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHash, BlockHashListWithBlockSize
from jaxkv.kv_cache_interface import FullAttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from jaxkv.request import Request


class SingleTypeKVCacheManager:
    """Blocks held per request in one group.

    Invariants: `req_to_blocks[r]` is request r's block table for this group,
    append-only while r runs (entries may turn into the null block when an
    attention type no longer needs them); `num_cached_block[r]` blocks of it are
    stamped with hashes; every non-null block listed holds one reference.
    """

    spec_types: ClassVar[tuple[type[KVCacheSpec], ...]] = ()

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks needed to hold `num_tokens`, counting hits that sit in the free queue."""
        held = self.req_to_blocks.get(request_id)
        num_new = (
            -(-num_tokens // self.block_size)
            - len(new_computed_blocks)
            - (len(held) if held is not None else 0)
        )
        if num_new < 0:
            num_new = 0
        if new_computed_blocks:
            for block in new_computed_blocks:
                if block.ref_cnt == 0 and not block.is_null:
                    num_new += 1
        return num_new

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start the request's block list with its cache hits (first scheduling only)."""
        if request_id in self.req_to_blocks:
            if new_computed_blocks:
                raise ValueError(
                    f"request {request_id!r} already holds blocks; cache hits can only be "
                    "added when a request is first scheduled"
                )
            return
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full

    def get_slot_state(self, request_id: str) -> tuple[int, int]:
        """(tokens the request's blocks can hold, token count at which its next block is full)."""
        block_size = self.block_size
        return (
            len(self.req_to_blocks[request_id]) * block_size,
            (self.num_cached_block[request_id] + 1) * block_size,
        )

    def free(self, request_id: str) -> None:
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(reversed(req_blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks this attention type no longer reads (none for full attention)."""

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

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        hash_block_size: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest cached prefix of at most `max_length` tokens, one block list per group."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Causal attention over the whole context: a hit is any cached prefix."""

    spec_types = (FullAttentionSpec,)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        hash_block_size: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        block_size = kv_cache_spec.block_size
        if block_size != hash_block_size:
            block_hashes = BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        if len(kv_cache_group_ids) == 1:
            return (
                block_pool.cached_block_hash_to_block.get_leading_blocks(
                    block_hashes, kv_cache_group_ids[0], max_num_blocks
                ),
            )
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for i in range(max_num_blocks):
            blocks = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if blocks is None:
                break
            for group_blocks, block in zip(computed, blocks, strict=True):
                group_blocks.append(block)
        return computed


SPEC_MANAGER_TYPES: tuple[type[SingleTypeKVCacheManager], ...] = (FullAttentionManager,)


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class whose `spec_types` match `kv_cache_spec` (most specific first)."""
    for manager_type in SPEC_MANAGER_TYPES:
        if type(kv_cache_spec) in manager_type.spec_types:
            return manager_type(kv_cache_spec, block_pool, kv_cache_group_id)
    supported = [t.__name__ for m in SPEC_MANAGER_TYPES for t in m.spec_types]
    raise ValueError(
        f"no manager for KV cache spec {type(kv_cache_spec).__name__}; supported: {supported}"
    )
