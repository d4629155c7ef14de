"""The prefix-cache map: (KV-cache group, block hash) -> cached blocks (SPEC §4).

`BlockPool` keeps one (`BlockPool.cached_block_hash_to_block`); it is its own module
because it is a self-contained data structure (its own invariants and tests), apart
from the pool's free queue and events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice, takewhile

from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

# A group's map: block hash -> the earliest cached block with that hash.
_GroupMap = dict[BlockHash, KVCacheBlock]
# A group's listed keys: block hash -> {block_id: block}, every block under that hash in
# insertion order (keys some block is cached under without being stamped with them).
_GroupListed = dict[BlockHash, dict[int, KVCacheBlock]]
_NO_BLOCKS: _GroupMap = {}  # read only: the map of a group nothing was cached for


class BlockHashToBlockMap:
    """(KV cache group, block hash) -> cached blocks, duplicates kept in insertion order.

    Identical blocks computed by different requests are not merged (block tables
    stay append-only), so a key may map to several blocks; lookups return the
    earliest inserted. Each group has its own dict keyed by the bare block hash,
    whose value is that earliest block (lookups use the request's hash objects,
    whose hash is cached, build no key, and need no per-entry unpacking).

    The other blocks under a key are chained through the blocks themselves, in
    insertion order: `next_same_key` leads from the earliest to the latest, and
    `prev_same_key` back, the earliest's pointing at the latest. Serving a busy
    pool, duplicates are common (requests that missed recompute a prefix that is
    still cached), and a chain adds and drops them with no dict work. A block
    is chained only under the key it is stamped with; a key that some block is
    cached under without being stamped with it (vLLM's `insert` with any key, a
    partial entry's further key) is listed instead: all its blocks in insertion
    order in the group's listed dict, none of them chained.

    Invariants: a block has chain links iff it is stamped with a chained key
    that holds two or more blocks; `_maps[g][h]` is the chain's head, or the
    first value of `_listed[g][h]` when that exists; `_listed[g]`, when
    present, is not empty.
    """

    __slots__ = ("_listed", "_maps")

    def __init__(self) -> None:
        self._maps: dict[int, _GroupMap] = {}
        self._listed: dict[int, _GroupListed] = {}

    def __len__(self) -> int:
        return sum(len(group_map) for group_map in self._maps.values())

    def get_one_block(
        self, key: BlockHashWithGroupId | BlockHash, group_id: int | None = None
    ) -> KVCacheBlock | None:
        """The earliest cached block for vLLM's combined `key` (block hash + group id), or
        for `key` as a bare block hash in `group_id`."""
        if group_id is None:
            block_hash, group_id = get_block_hash(key), get_group_id(key)  # type: ignore[arg-type]
        else:
            block_hash = key  # type: ignore[assignment]
        return self._maps.get(group_id, _NO_BLOCKS).get(block_hash)

    def get_leading_blocks(
        self, block_hashes: Sequence[BlockHash], group_id: int, max_blocks: int
    ) -> list[KVCacheBlock]:
        """For `block_hashes[i]`, i = 0, 1, ...: one block each until the first miss."""
        # Blocks are always truthy (KVCacheBlock has no __bool__ or __len__), so the run
        # ends at the first miss (None) without comparing blocks with None.
        get = self._maps.get(group_id, _NO_BLOCKS).get
        return list(takewhile(bool, map(get, islice(block_hashes, max_blocks))))

    def get_entries(
        self, block_hashes: Sequence[BlockHash], group_id: int, stop: int
    ) -> list[KVCacheBlock | None]:
        """The earliest cached block (None for a miss) of each of `block_hashes[:stop]`."""
        get = self._maps.get(group_id, _NO_BLOCKS).get
        if isinstance(block_hashes, list):
            return list(map(get, block_hashes[:stop]))
        return [get(block_hashes[i]) for i in range(stop)]

    def insert(
        self,
        key: BlockHashWithGroupId | BlockHash,
        group_id: int | KVCacheBlock,
        block: KVCacheBlock | None = None,
    ) -> None:
        """Cache a block: vLLM's ``insert(key, block)`` with the combined key (block hash +
        group id), or ``insert(block_hash, group_id, block)``. The block need not be
        stamped with the key; inserting it again under a key changes nothing."""
        if block is None:
            block, group_id = group_id, get_group_id(key)  # type: ignore[assignment]
            key = get_block_hash(key)  # type: ignore[arg-type]
        block_hash: BlockHash = key  # type: ignore[assignment]
        listed = self._listed.get(group_id)  # type: ignore[arg-type]
        if listed is not None and block_hash in listed:
            listed[block_hash].setdefault(block.block_id, block)
            return
        own_key = block._block_hash == block_hash and block._group_id == group_id
        if own_key:
            head = self._maps.get(group_id, _NO_BLOCKS).get(block_hash)  # type: ignore[arg-type]
            if head is not block and block.prev_same_key is None:  # not under it yet
                self.insert_stamped((block,), group_id)  # type: ignore[arg-type]
            return
        # Cached under a key it is not stamped with: the key is listed from now on.
        blocks = self._chain_of(block_hash, group_id)  # type: ignore[arg-type]
        for chained in blocks:
            chained.prev_same_key = chained.next_same_key = None
        same = {chained.block_id: chained for chained in blocks}
        same.setdefault(block.block_id, block)
        self._listed.setdefault(group_id, {})[block_hash] = same  # type: ignore[arg-type]
        self._maps.setdefault(group_id, {})[block_hash] = next(iter(same.values()))  # type: ignore[arg-type]

    def insert_stamped(self, blocks: Iterable[KVCacheBlock], group_id: int) -> None:
        """`insert` each block of group `group_id` under the hash it is stamped with (blocks
        not cached yet: the pool stamps them just before)."""
        # Each block's key is read off the block in this loop: a generator of keys would
        # resume a Python frame per block (the hot path of every caching step).
        group_map = self._maps.get(group_id)
        if group_map is None:
            group_map = self._maps[group_id] = {}
        setdefault = group_map.setdefault
        listed = self._listed.get(group_id)
        for block in blocks:
            block_hash = block._block_hash
            if listed and block_hash in listed:
                listed[block_hash].setdefault(block.block_id, block)  # type: ignore[index]
                continue
            head = setdefault(block_hash, block)  # type: ignore[arg-type]
            if head is block:
                continue
            last = head.prev_same_key or head  # the chain's latest block
            last.next_same_key = block
            block.prev_same_key = last
            head.prev_same_key = block

    def pop(
        self, key: BlockHashWithGroupId | BlockHash, group_id: int, block_id: int | None = None
    ) -> KVCacheBlock | None:
        """Remove one block from a key; it, or None if absent. vLLM's ``pop(key, block_id)``
        with the combined key, or ``pop(block_hash, group_id, block_id)``."""
        if block_id is None:
            block_hash, group_id, block_id = get_block_hash(key), get_group_id(key), group_id
        else:
            block_hash = key  # type: ignore[assignment]
        listed = self._listed.get(group_id)
        if listed is not None and block_hash in listed:
            block = listed[block_hash].get(block_id)
            if block is not None:
                self._pop_listed(block, block_hash, group_id)
            return block
        for block in self._chain_of(block_hash, group_id):
            if block.block_id == block_id:
                self.pop_stamped((block,))
                return block
        return None

    def pop_stamped(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`pop` each block from the key it is stamped with (a block not cached under it is
        skipped)."""
        # Keys are read off the blocks here, as in `insert_stamped`; a group's dicts are
        # looked up again only when the group changes (`is not` on the small-int ids: a
        # miss only looks them up again).
        maps, all_listed = self._maps, self._listed
        group_id: int | None = None
        group_map: _GroupMap = _NO_BLOCKS
        listed: _GroupListed | None = None
        for block in blocks:
            block_hash = block._block_hash
            if block._group_id is not group_id:
                group_id = block._group_id
                group_map = maps.get(group_id, _NO_BLOCKS)
                listed = all_listed.get(group_id)
            prev = block.prev_same_key
            if prev is None:  # alone under its key, or listed
                if listed and block_hash in listed:
                    self._pop_listed(block, block_hash, group_id)  # type: ignore[arg-type]
                    continue
                head = group_map.pop(block_hash, None)  # type: ignore[arg-type]
                if head is not block and head is not None:
                    group_map[block_hash] = head  # type: ignore[index]  # not this block's
                continue
            following = block.next_same_key
            block.prev_same_key = block.next_same_key = None
            if prev.next_same_key is not block:  # the head: the next block leads
                group_map[block_hash] = following  # type: ignore[index, assignment]
                following.prev_same_key = None if prev is following else prev  # type: ignore[union-attr]
                continue
            prev.next_same_key = following
            if following is not None:
                following.prev_same_key = prev
                continue
            head = group_map[block_hash]  # type: ignore[index]  # it was the latest
            head.prev_same_key = None if prev is head else prev

    def _pop_listed(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> None:
        listed = self._listed[group_id]
        same = listed[block_hash]
        if same.pop(block.block_id, None) is None:
            return
        group_map = self._maps[group_id]
        if not same:
            del group_map[block_hash], listed[block_hash]
            if not listed:
                del self._listed[group_id]
        elif group_map[block_hash] is block:
            group_map[block_hash] = next(iter(same.values()))

    def _chain_of(self, block_hash: BlockHash, group_id: int) -> list[KVCacheBlock]:
        """The blocks of a chained key, earliest first ([] when nothing is cached)."""
        block = self._maps.get(group_id, _NO_BLOCKS).get(block_hash)
        blocks = []
        while block is not None:
            blocks.append(block)
            block = block.next_same_key
        return blocks

    def num_blocks(self) -> int:
        return sum(
            len(self.blocks_of(block_hash, group_id))
            for group_id, group_map in self._maps.items()
            for block_hash in group_map
        )

    def blocks_of(self, block_hash: BlockHash, group_id: int) -> list[KVCacheBlock]:
        """Every block cached under (`block_hash`, `group_id`), in insertion order."""
        same = self._listed.get(group_id, {}).get(block_hash)
        if same is not None:
            return list(same.values())
        return self._chain_of(block_hash, group_id)

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, list[KVCacheBlock]]]:
        """(vLLM's key: block hash + group id, blocks) for every cached key."""
        for group_id, group_map in self._maps.items():
            for block_hash in group_map:
                key = make_block_hash_with_group_id(block_hash, group_id)
                yield key, self.blocks_of(block_hash, group_id)

    def clear(self) -> None:
        for group_id, group_map in self._maps.items():
            for block_hash in group_map:
                for block in self._chain_of(block_hash, group_id):
                    block.prev_same_key = block.next_same_key = None
        self._maps.clear()
        self._listed.clear()
