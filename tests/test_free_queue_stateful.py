"""Random operation sequences on `FreeKVCacheBlockQueue`, checked against a list model.

After every step: the queue holds exactly the model's blocks in the model's order,
the backward links mirror the forward ones, `num_free_blocks` is exact, and every
block outside the queue has both links cleared. Rejected calls change nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock

NUM_BLOCKS = 8


class FreeQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
        self.queue = FreeKVCacheBlockQueue(self.blocks)
        self.model: list[KVCacheBlock] = list(self.blocks)  # head first
        for block in self.blocks[::3]:  # some blocks carry a hash key (a cached page)
            block.set_hash(bytes([block.block_id]) * 32, 0)

    def _outside(self) -> list[KVCacheBlock]:
        return [b for b in self.blocks if b not in self.model]

    @rule()
    def popleft(self) -> None:
        if not self.model:
            with pytest.raises(ValueError, match="No free blocks available"):
                self.queue.popleft()
            return
        assert self.queue.popleft() is self.model.pop(0)

    @rule(n=st.integers(-1, NUM_BLOCKS + 1))
    def popleft_n(self, n: int) -> None:
        if not 0 <= n <= len(self.model):
            with pytest.raises(ValueError, match=f"cannot pop {n} blocks"):
                self.queue.popleft_n(n)
            return
        assert self.queue.popleft_n(n) == self.model[:n]
        del self.model[:n]

    @rule(n=st.integers(-1, NUM_BLOCKS + 1))
    def popleft_n_for_holders(self, n: int) -> None:
        if not 0 <= n <= len(self.model):
            with pytest.raises(ValueError, match=f"cannot pop {n} blocks"):
                self.queue.popleft_n_for_holders(n)
            return
        refs = [b.ref_cnt for b in self.model[:n]]
        popped, stamped = self.queue.popleft_n_for_holders(n)
        assert popped == self.model[:n]
        assert stamped == [b for b in popped if b.block_hash is not None]
        assert [b.ref_cnt for b in popped] == [r + 1 for r in refs]
        del self.model[:n]

    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        held = [b for b in self._outside() if b.ref_cnt > 0]
        chosen = data.draw(st.permutations(held)) if held else []
        chosen = chosen[: data.draw(st.integers(0, len(chosen)))]
        freed = [b for b in chosen if b.ref_cnt == 1]
        unhashed = [b for b in freed if b.block_hash is None]
        assert self.queue.release_held(iter(chosen)) == unhashed
        self.model = unhashed + self.model + [b for b in freed if b.block_hash is not None]

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.blocks))
        if block not in self.model:
            with pytest.raises(ValueError, match=f"block {block.block_id} is not in"):
                self.queue.remove(block)
            return
        self.queue.remove(block)
        self.model.remove(block)

    @rule(data=st.data(), at_tail=st.booleans())
    def put_back(self, data: st.DataObject, at_tail: bool) -> None:
        outside = self._outside()
        chosen = data.draw(st.permutations(outside)) if outside else []
        chosen = chosen[: data.draw(st.integers(0, len(chosen)))]
        if at_tail:
            if len(chosen) == 1 and data.draw(st.booleans()):
                self.queue.append(chosen[0])
            else:
                self.queue.append_n(iter(chosen))  # any iterable, consumed once
            self.model += chosen
        else:
            self.queue.prepend_n(iter(chosen))
            self.model[:0] = chosen

    @invariant()
    def queue_matches_model(self) -> None:
        forward = self.queue.get_all_free_blocks()
        assert forward == self.model
        backward, node = [], self.queue.tail.prev_free_block
        while node is not self.queue.head:
            backward.append(node)
            node = node.prev_free_block
        assert backward[::-1] == forward
        assert self.queue.num_free_blocks == len(self.model)
        for block in self._outside():
            assert block.prev_free_block is None and block.next_free_block is None


TestFreeQueue = FreeQueueMachine.TestCase
TestFreeQueue.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
