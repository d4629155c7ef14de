"""KV-cache blocks and the O(1) LRU free queue threaded through them (SPEC §3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxkv._checks import check_int
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
    only by `reset_hash` on eviction. `prev_same_key`/`next_same_key` belong to
    the prefix-cache map (`BlockHashToBlockMap`): they chain the blocks cached
    under one key. `block_id` and the group id are Python ints (numpy integers
    given to the constructor or a `set_hash` are converted).
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "_group_id",
        "prev_free_block",
        "next_free_block",
        "prev_same_key",
        "next_same_key",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        if type(block_id) is not int:
            block_id = check_int("block_id", block_id)
        self.block_id = block_id
        self.ref_cnt = 0
        # The key is kept as its two parts; `block_hash` joins them as vLLM's key.
        self._block_hash: BlockHash | None = None
        self._group_id = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.prev_same_key: KVCacheBlock | None = None
        self.next_same_key: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        if self._block_hash is None:
            return None
        return make_block_hash_with_group_id(self._block_hash, self._group_id)

    @block_hash.setter
    def block_hash(self, key: BlockHashWithGroupId) -> None:
        self.set_hash(get_block_hash(key), get_group_id(key))

    def set_block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        """vLLM's name for ``block.block_hash = key`` (the combined key; set once)."""
        self.set_hash(get_block_hash(block_hash), get_group_id(block_hash))

    def set_hash(self, block_hash: BlockHash, group_id: int) -> None:
        """Stamp the block with its key, given as its two parts (what `block_hash = key`
        does without joining and splitting the key). Set once, like `block_hash`."""
        if not self.try_set_hash(block_hash, group_id):
            raise ValueError(
                f"block {self.block_id} already has hash {self._block_hash.hex()} (group "  # type: ignore[union-attr]
                f"{self._group_id}); a block hash is set once and cleared only by "
                "reset_hash() on eviction"
            )

    def try_set_hash(self, block_hash: BlockHash, group_id: int) -> bool:
        """`set_hash` unless the block already has a hash (then nothing changes); whether it
        was stamped."""
        if type(group_id) is not int:
            group_id = check_int("group_id", group_id)
        if self._block_hash is not None:
            return False
        self._block_hash = block_hash
        self._group_id = group_id
        return True

    @staticmethod
    def try_set_hashes(
        blocks: Iterable[KVCacheBlock], block_hashes: Iterable[BlockHash], group_id: int
    ) -> list[KVCacheBlock]:
        """`try_set_hash` of each block with its hash (one call for a caching step's
        blocks; null blocks are skipped); the blocks this call stamped, in order.

        A block already stamped with this key stays as it is; one stamped with
        another key is a ValueError, raised after this call's stamps are undone.
        """
        if type(group_id) is not int:
            group_id = check_int("group_id", group_id)
        stamped: list[KVCacheBlock] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block._block_hash is None:
                if block.is_null:
                    continue
                block._block_hash = block_hash
                block._group_id = group_id
                stamped.append(block)
            elif block._block_hash != block_hash or block._group_id != group_id:
                if block.is_null:
                    continue
                KVCacheBlock.reset_hashes(stamped)
                raise ValueError(
                    f"block {block.block_id} is already cached under another hash; "
                    "cannot re-stamp it"
                )
        return stamped

    @property
    def block_hash_only(self) -> BlockHash | None:
        """The block hash without the group id (None when the block is not cached)."""
        return self._block_hash

    @property
    def group_id(self) -> int:
        """The KV cache group of the block's hash key (meaningful while it is cached)."""
        return self._group_id

    def reset_hash(self) -> None:
        self._block_hash = None

    @staticmethod
    def reset_hashes(blocks: Iterable[KVCacheBlock]) -> None:
        """`reset_hash` of each block (one call for an eviction's whole batch)."""
        for block in blocks:
            block._block_hash = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None}, is_null={self.is_null})"
        )


def _not_queueable(block: object) -> ValueError | TypeError:
    """The error for a block that cannot join the free queue (not a block, or queued)."""
    if not isinstance(block, KVCacheBlock):
        return TypeError(f"blocks must be KVCacheBlock objects, got {block!r}")
    return ValueError(
        f"block {block.block_id} is already in the free queue (or given twice); queuing it "
        "again would corrupt the queue's links"
    )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (head is evicted first).

    Invariants: sentinel `head`/`tail` (vLLM's `fake_free_list_head`/`_tail`)
    bracket the list; a block is linked (both links set) iff it is in the
    queue, so a block already queued is refused by every insertion, which
    then changes nothing; `num_free_blocks` equals the number of linked
    blocks. Every operation is O(1) per block, including `remove` from the
    middle.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.append_n(blocks)

    @property
    def fake_free_list_head(self) -> KVCacheBlock:
        return self.head

    @property
    def fake_free_list_tail(self) -> KVCacheBlock:
        return self.tail

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free_block
        if first is self.tail or first is None:
            raise ValueError("No free blocks available")  # vLLM's message
        self.head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return self.popleft_n_for_holders(n, 0)[0]

    def popleft_n_for_holders(
        self, n: int, new_refs: int = 1
    ) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """Pop `n` blocks from the head for new holders: each block's `ref_cnt` rises by
        `new_refs`. Returns (the blocks in order, those among them still stamped with a
        hash key: the caller evicts them from the prefix cache).

        One pass does what allocation otherwise does in three (unlink, take the
        reference, find the stamped blocks): it runs for every block allocated.
        `n` and `new_refs` may be numpy integers (converted first); a refusal
        changes nothing.
        """
        if type(n) is not int:
            n = check_int("n", n)
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: {self.num_free_blocks} are free")
        if type(new_refs) is not int or new_refs < 0:
            new_refs = check_int("new_refs", new_refs, min_value=0)
        popped: list[KVCacheBlock] = []
        stamped: list[KVCacheBlock] = []
        if n == 0:
            return popped, stamped
        block = self.head.next_free_block
        for _ in range(n):
            popped.append(block)  # type: ignore[arg-type]
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block.ref_cnt += new_refs  # type: ignore[union-attr]
            if block._block_hash is not None:  # type: ignore[union-attr]
                stamped.append(block)  # type: ignore[arg-type]
            block = nxt
        self.head.next_free_block = block
        block.prev_free_block = self.head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return popped, stamped

    def remove(self, block: KVCacheBlock) -> None:
        if not isinstance(block, KVCacheBlock):
            raise TypeError(f"block must be a KVCacheBlock, got {block!r}")
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
        start = self.tail.prev_free_block
        self.num_free_blocks += self._link_after(start, blocks, self.tail)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the head, in order (the first one is evicted first)."""
        self.num_free_blocks += self._link_after(self.head, blocks, self.head.next_free_block)

    def release_held(self, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """Drop one reference from each block, each of which its caller holds (unchecked;
        the null block is skipped). Blocks reaching 0 join the queue: stamped ones at the
        tail as they reach 0, unhashed ones at the head in order (nothing to lose by
        evicting them first). Returns the unhashed ones.

        One pass frees and links the stamped blocks: it runs for every block freed.
        """
        unhashed: list[KVCacheBlock] = []
        tail = self.tail
        last = tail.prev_free_block
        count = 0
        try:
            for block in blocks:
                if block.is_null:
                    continue
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    if block._block_hash is None:
                        unhashed.append(block)
                    else:
                        last.next_free_block = block  # type: ignore[union-attr]
                        block.prev_free_block = last
                        last = block
                        count += 1
        finally:  # the links made so far stay consistent whatever happens
            last.next_free_block = tail  # type: ignore[union-attr]
            tail.prev_free_block = last
            self.num_free_blocks += count
        if unhashed:
            self.prepend_n(unhashed)
        return unhashed

    @staticmethod
    def _link_after(
        start: KVCacheBlock, blocks: Iterable[KVCacheBlock], end: KVCacheBlock | None
    ) -> int:
        """Link `blocks` in order between adjacent `start` and `end`; their count.

        A block already linked (queued, or given twice) is refused: the links made
        so far are undone and `start`-`end` adjacency restored before raising.
        """
        last = start
        count = 0
        block: object = None
        try:
            for block in blocks:
                if block.prev_free_block is not None:  # type: ignore[attr-defined]
                    break
                last.next_free_block = block  # type: ignore[assignment]
                block.prev_free_block = last  # type: ignore[attr-defined]
                last = block  # type: ignore[assignment]
                count += 1
            else:
                last.next_free_block = end
                end.prev_free_block = last  # type: ignore[union-attr]
                return count
        except AttributeError:  # not a block
            pass
        refused = block
        while last is not start:  # undo: unlink what this call linked
            prev = last.prev_free_block
            last.prev_free_block = last.next_free_block = None
            last = prev  # type: ignore[assignment]
        start.next_free_block = end
        raise _not_queueable(refused)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = []
        block = self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block  # type: ignore[union-attr]
        return blocks
