"""KV-cache blocks and the O(1) LRU free queue threaded through them (SPEC §3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxkv.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)


class KVCacheBlock:
    """Metadata of one KV-cache page.

    `ref_cnt` counts the requests holding the block; a block with `ref_cnt == 0`
    (other than the null block) sits in the free queue. The hash key (block hash
    and KV cache group) is set once when the block becomes full and is cleared
    only by `reset_hash` on eviction.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "_group_id",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The key is kept as its two parts; `block_hash` joins them as vLLM's key.
        self._block_hash: BlockHash | None = None
        self._group_id = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        if self._block_hash is None:
            return None
        return make_block_hash_with_group_id(self._block_hash, self._group_id)

    @block_hash.setter
    def block_hash(self, key: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise ValueError(
                f"block {self.block_id} already has hash {self._block_hash.hex()} (group "
                f"{self._group_id}); a block hash is set once and cleared only by "
                "reset_hash() on eviction"
            )
        self._block_hash = get_block_hash(key)
        self._group_id = get_group_id(key)

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None}, is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (head is evicted first).

    Invariants: sentinel `head`/`tail` bracket the list; a block is linked iff
    it is in the queue; `num_free_blocks` equals the number of linked blocks.
    Every operation is O(1) per block, including `remove` from the middle.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free_block
        if first is self.tail or first is None:
            raise ValueError("no free blocks: the free queue is empty")
        self.head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: {self.num_free_blocks} are free")
        if n == 0:
            return []
        popped = []
        block = self.head.next_free_block
        for _ in range(n):
            popped.append(block)
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block = nxt
        self.head.next_free_block = block
        block.prev_free_block = self.head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the tail, in order (the last one is evicted last)."""
        last = self.tail.prev_free_block
        count = 0
        for block in blocks:
            last.next_free_block = block  # type: ignore[union-attr]
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self.tail  # type: ignore[union-attr]
        self.tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the head, in order (the first one is evicted first)."""
        first = self.head.next_free_block
        prev = self.head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = []
        block = self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block  # type: ignore[union-attr]
        return blocks
