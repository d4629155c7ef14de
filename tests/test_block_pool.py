"""KVCacheBlock, FreeKVCacheBlockQueue and BlockPool (SPEC §3-§4)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    Request,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.block_pool import BlockHashToBlockMap, DeferredBlockStored
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.hashing import make_block_hash_with_group_id

BS = 4
SHA_CBOR = get_hash_fn_by_name("sha256_cbor")


pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _free_ids(pool: BlockPool) -> list[int]:
    return _ids(pool.free_block_queue.get_all_free_blocks())


def _request(tokens, rid="r", block_size=BS, **kwargs) -> Request:
    return Request(
        rid, list(tokens), block_hasher=get_request_block_hasher(block_size, SHA_CBOR), **kwargs
    )


def _cache(pool: BlockPool, req: Request, blocks, group_id=0, start=0) -> None:
    pool.cache_full_blocks(req, blocks, start, len(blocks), BS, group_id)


# ---------------------------------------------------------------------------
# KVCacheBlock


def test_block_hash_set_once_and_reset():
    block = KVCacheBlock(3)
    assert (block.block_id, block.ref_cnt, block.block_hash, block.is_null) == (3, 0, None, False)
    key = make_block_hash_with_group_id(_h(1), 0)
    block.block_hash = key
    assert block.block_hash == key
    with pytest.raises(ValueError, match="block 3"):
        block.block_hash = make_block_hash_with_group_id(_h(2), 0)
    assert block.block_hash == key  # unchanged by the failed set
    block.reset_hash()
    assert block.block_hash is None
    block.block_hash = make_block_hash_with_group_id(_h(2), 0)
    assert block.block_hash == make_block_hash_with_group_id(_h(2), 0)


def test_block_is_slotted():
    block = KVCacheBlock(0)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.some_attribute = 1  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# FreeKVCacheBlockQueue


def _queue(n: int):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def _check_links(queue: FreeKVCacheBlockQueue) -> None:
    forward = queue.get_all_free_blocks()
    backward = []
    node = queue.tail.prev_free_block
    while node is not queue.head:
        backward.append(node)
        node = node.prev_free_block
    assert backward[::-1] == forward
    assert queue.num_free_blocks == len(forward)


def test_queue_initial_order():
    blocks, q = _queue(5)
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5
    _check_links(q)


def test_queue_popleft_and_links_cleared():
    blocks, q = _queue(3)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free_block is None and b.next_free_block is None
    assert _ids(q.get_all_free_blocks()) == [1, 2]
    assert [q.popleft().block_id, q.popleft().block_id] == [1, 2]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    assert q.num_free_blocks == 0
    assert q.get_all_free_blocks() == []
    _check_links(q)


def test_queue_popleft_n():
    blocks, q = _queue(6)
    popped = q.popleft_n(3)
    assert _ids(popped) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert _ids(q.get_all_free_blocks()) == [3, 4, 5]
    assert q.popleft_n(0) == []
    with pytest.raises(ValueError):
        q.popleft_n(4)
    assert _ids(q.get_all_free_blocks()) == [3, 4, 5]
    assert _ids(q.popleft_n(3)) == [3, 4, 5]
    assert q.num_free_blocks == 0
    _check_links(q)


def test_queue_popleft_n_for_holders_takes_references_and_finds_stamped_blocks():
    blocks, q = _queue(6)
    blocks[1].set_hash(_h(1), 0)
    blocks[3].set_hash(_h(3), 1)
    popped, stamped = q.popleft_n_for_holders(4)
    assert _ids(popped) == [0, 1, 2, 3] and _ids(stamped) == [1, 3]
    assert [b.ref_cnt for b in popped] == [1, 1, 1, 1]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert q.popleft_n_for_holders(0) == ([], [])
    with pytest.raises(ValueError, match="cannot pop 3 blocks: 2 are free"):
        q.popleft_n_for_holders(3)
    assert _ids(q.get_all_free_blocks()) == [4, 5] and q.num_free_blocks == 2
    assert [b.ref_cnt for b in q.popleft_n(2)] == [0, 0]  # popleft_n takes no reference
    _check_links(q)


def test_queue_release_held_queues_blocks_reaching_zero():
    """Stamped blocks join the tail as they reach 0, unhashed ones the head in order;
    blocks still held elsewhere and the null block stay out."""
    blocks, q = _queue(7)
    held, _ = q.popleft_n_for_holders(6)  # blocks 0-5; block 6 stays free
    null = KVCacheBlock(99)
    null.is_null = True
    held[1].set_hash(_h(1), 0)
    held[4].set_hash(_h(4), 0)
    held[3].ref_cnt = 2  # another request holds it too
    unhashed = q.release_held([held[4], null, held[0], held[3], held[1], held[2], held[5]])
    assert _ids(unhashed) == [0, 2, 5]
    assert _ids(q.get_all_free_blocks()) == [0, 2, 5, 6, 4, 1]
    assert q.num_free_blocks == 6 and held[3].ref_cnt == 1 and null.ref_cnt == 0
    assert _ids(q.release_held([held[3]])) == [3]
    assert _ids(q.get_all_free_blocks()) == [3, 0, 2, 5, 6, 4, 1]
    _check_links(q)


def test_queue_remove_middle_head_tail():
    blocks, q = _queue(5)
    q.remove(blocks[2])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert _ids(q.get_all_free_blocks()) == [1, 3]
    assert q.num_free_blocks == 2
    with pytest.raises(ValueError, match="block 2"):
        q.remove(blocks[2])
    assert q.num_free_blocks == 2
    _check_links(q)


def test_queue_append_append_n_prepend_n():
    blocks, q = _queue(6)
    taken = q.popleft_n(6)
    q.append(taken[3])
    q.append_n([taken[1], taken[5]])
    assert _ids(q.get_all_free_blocks()) == [3, 1, 5]
    q.prepend_n([taken[0], taken[4]])
    assert _ids(q.get_all_free_blocks()) == [0, 4, 3, 1, 5]
    q.prepend_n([])
    q.append_n([])
    q.append(taken[2])
    assert _ids(q.get_all_free_blocks()) == [0, 4, 3, 1, 5, 2]
    assert q.num_free_blocks == 6
    _check_links(q)
    assert _ids([q.popleft(), q.popleft()]) == [0, 4]


def test_queue_prepend_into_empty():
    blocks, q = _queue(2)
    taken = q.popleft_n(2)
    q.prepend_n([taken[1], taken[0]])
    assert _ids(q.get_all_free_blocks()) == [1, 0]
    _check_links(q)


# ---------------------------------------------------------------------------
# BlockPool: null block, allocation


def test_pool_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(1)


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert _free_ids(pool) == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    assert _ids(blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    # Freeing the null block is ignored; touching it takes no reference.
    pool.free_blocks([pool.null_block])
    pool.touch([[pool.null_block]])
    assert pool.null_block.ref_cnt == 0
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks(reversed(blocks))
    assert 0 not in _free_ids(pool)
    assert pool.get_num_free_blocks() == 4


def test_null_block_never_cached():
    pool = BlockPool(6, enable_kv_cache_events=True)
    req = _request(range(12))
    blocks = [pool.null_block, *pool.get_new_blocks(2)]
    _cache(pool, req, blocks)
    assert pool.null_block.block_hash is None
    assert blocks[1].block_hash == make_block_hash_with_group_id(req.block_hashes[1], 0)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    (event,) = pool.take_events()
    assert event.block_hashes == req.block_hashes[1:3]


def test_get_new_blocks_short_changes_nothing():
    pool = BlockPool(5)
    held = pool.get_new_blocks(2)
    before = (_free_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(ValueError, match="3"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert (_free_ids(pool), [b.ref_cnt for b in pool.blocks]) == before
    assert _ids(held) == [1, 2]


def test_usage():
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    blocks += pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(blocks[:2])
    assert pool.get_usage() == pytest.approx(0.5)


# ---------------------------------------------------------------------------
# Caching and lookups


def test_get_cached_block_across_groups():
    pool = BlockPool(8)
    req = _request(range(8))
    g0 = pool.get_new_blocks(2)
    g1 = pool.get_new_blocks(2)
    _cache(pool, req, g0, group_id=0)
    h0, h1 = req.block_hashes
    assert pool.get_cached_block(h0, [0]) == [g0[0]]
    assert pool.get_cached_block(h0, [0, 1]) is None  # group 1 misses
    assert pool.get_cached_block(h0, [1]) is None
    _cache(pool, req, g1, group_id=1)
    assert pool.get_cached_block(h0, [0, 1]) == [g0[0], g1[0]]
    assert pool.get_cached_block(h1, [1, 0]) == [g1[1], g0[1]]
    assert pool.get_cached_block(_h(99), [0]) is None
    assert g1[1].block_hash == make_block_hash_with_group_id(h1, 1)


def test_duplicates_not_merged_earliest_returned():
    pool = BlockPool(8)
    a, b, c = _request(range(4), "a"), _request(range(4), "b"), _request(range(4), "c")
    ba = pool.get_new_blocks(1)
    bb = pool.get_new_blocks(1)
    bc = pool.get_new_blocks(1)
    _cache(pool, a, ba)
    _cache(pool, b, bb)
    _cache(pool, c, bc)
    h = a.block_hashes[0]
    assert ba[0].block_hash == bb[0].block_hash == bc[0].block_hash
    assert pool.cached_block_hash_to_block.num_blocks() == 3
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.get_cached_block(h, [0]) == ba  # earliest inserted: block 1
    # Removing one duplicate (evicting block 1) keeps the others, earliest first.
    pool.evict_blocks([1])
    assert pool.get_cached_block(h, [0]) == bb
    pool.evict_blocks([3])
    assert pool.get_cached_block(h, [0]) == bb
    pool.evict_blocks([2])
    assert pool.get_cached_block(h, [0]) is None
    assert len(pool.cached_block_hash_to_block) == 0


def test_cached_block_findable_while_free_dropped_on_reuse():
    pool = BlockPool(4, enable_kv_cache_events=True)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)  # [1, 2]
    _cache(pool, req, blocks)
    stored = pool.take_events()
    assert stored == [
        BlockStored(
            block_hashes=req.block_hashes,
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=BS,
            lora_id=None,
            medium="GPU",
            group_idx=0,
        )
    ]
    pool.free_blocks(reversed(blocks))
    assert _free_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    assert pool.take_events() == []
    # Block 3 (never hashed) is reused first: no removal.
    assert _ids(pool.get_new_blocks(1)) == [3]
    assert pool.take_events() == []
    # Next comes block 2 (the chain tail): its hash is dropped with an event.
    new = pool.get_new_blocks(1)
    assert _ids(new) == [2]
    assert new[0].block_hash is None and new[0].ref_cnt == 1
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[req.block_hashes[1]], medium="GPU", group_idx=0)
    ]


def test_touch():
    pool = BlockPool(5)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.free_blocks(reversed(blocks))
    assert _free_ids(pool) == [3, 4, 2, 1]
    pool.touch([[blocks[0]]])
    assert blocks[0].ref_cnt == 1
    assert _free_ids(pool) == [3, 4, 2]
    pool.touch([[blocks[0], blocks[1]]])
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (2, 1)
    assert _free_ids(pool) == [3, 4]
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and _free_ids(pool) == [3, 4]


def test_cache_full_blocks_partial_ranges_and_parent():
    pool = BlockPool(8, enable_kv_cache_events=True)
    req = _request(range(16), lora_request=None)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 1, BS, 0)
    pool.cache_full_blocks(req, blocks, 1, 3, BS, 0)
    pool.cache_full_blocks(req, blocks, 3, 3, BS, 0)  # nothing to do: no event
    events = pool.take_events()
    assert len(events) == 2
    assert events[0].block_hashes == req.block_hashes[:1]
    assert events[0].parent_block_hash is None
    assert events[1].block_hashes == req.block_hashes[1:3]
    assert events[1].parent_block_hash == req.block_hashes[0]
    assert events[1].token_ids == list(range(4, 12))
    assert blocks[3].block_hash is None
    # Re-stamping with the same key is a no-op; another key is refused.
    pool.cache_full_blocks(req, blocks, 0, 1, BS, 0)
    other = _request(range(100, 116), "o")
    with pytest.raises(ValueError, match="block 1"):
        pool.cache_full_blocks(other, blocks, 0, 1, BS, 0)
    assert blocks[0].block_hash == make_block_hash_with_group_id(req.block_hashes[0], 0)


def test_cache_full_blocks_conflict_changes_nothing():
    """A block cached under another hash halfway through the range: the call is refused
    and the blocks before it are left unstamped, unmapped and unreported."""
    pool = BlockPool(8, enable_kv_cache_events=True)
    req = _request(range(12))
    other = _request(range(100, 112), "o")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(other, blocks, 1, 2, BS, 0)  # blocks[1]: other's second hash
    pool.take_events()
    with pytest.raises(ValueError, match=f"block {blocks[1].block_id} is already cached"):
        pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
    assert blocks[0].block_hash is None and blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.take_events() == []


def test_cache_full_blocks_needs_hashes():
    pool = BlockPool(8)
    req = Request("nohash", list(range(8)))
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block hash"):
        pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    assert all(b.block_hash is None for b in blocks)
    assert len(pool.cached_block_hash_to_block) == 0


def test_cache_full_blocks_lora_event():
    from jaxkv import LoRARequest

    pool = BlockPool(4, enable_kv_cache_events=True)
    req = _request(range(4), lora_request=LoRARequest("ad", 42, "/p"))
    _cache(pool, req, pool.get_new_blocks(1), group_id=3)
    (event,) = pool.take_events()
    assert (event.lora_id, event.group_idx, event.block_size) == (42, 3, BS)


def test_events_off_by_default():
    pool = BlockPool(4)
    req = _request(range(4))
    blocks = pool.get_new_blocks(1)
    _cache(pool, req, blocks)
    pool.evict_blocks([1])
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == []


# ---------------------------------------------------------------------------
# Free order


def test_free_order_reverse_per_request_unhashed_front_hashed_back():
    pool = BlockPool(11)
    req_a = _request(range(12), "a")
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(3)  # 4, 5, 6
    c = pool.get_new_blocks(2)  # 7, 8
    _cache(pool, req_a, a)
    assert _free_ids(pool) == [9, 10]
    pool.free_blocks(reversed(a))  # hashed: back, chain tail first
    assert _free_ids(pool) == [9, 10, 3, 2, 1]
    pool.free_blocks(reversed(b))  # unhashed: front, in eviction order 6, 5, 4
    assert _free_ids(pool) == [6, 5, 4, 9, 10, 3, 2, 1]
    # Mixed request: block 7 hashed, block 8 not.
    req_c = _request(range(100, 104), "c")
    pool.cache_full_blocks(req_c, c, 0, 1, BS, 0)
    pool.free_blocks(reversed(c))
    assert _free_ids(pool) == [8, 6, 5, 4, 9, 10, 3, 2, 1, 7]
    assert pool.get_num_free_blocks() == 10
    # Eviction follows the queue: unhashed first, then least recently freed.
    assert _ids(pool.get_new_blocks(7)) == [8, 6, 5, 4, 9, 10, 3]
    assert pool.get_cached_block(req_a.block_hashes[2], [0]) is None
    assert pool.get_cached_block(req_a.block_hashes[1], [0]) == [a[1]]


def test_free_shared_block_only_at_zero():
    pool = BlockPool(6)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.touch([blocks])  # a second request holds both
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert _free_ids(pool) == [3, 4, 5]
    pool.free_blocks(reversed(blocks))
    assert _free_ids(pool) == [3, 4, 5, 2, 1]


def test_free_already_free_raises_without_change():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks([blocks[1]])
    before = (_free_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(ValueError, match="block 2"):
        pool.free_blocks([blocks[0], blocks[1]])
    assert (_free_ids(pool), [b.ref_cnt for b in pool.blocks]) == before


def test_caching_disabled_everything_front():
    pool = BlockPool(7, enable_caching=False)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert _free_ids(pool) == [3, 2, 1, 6]
    pool.free_blocks(reversed(b))
    assert _free_ids(pool) == [5, 4, 3, 2, 1, 6]
    assert len(pool.cached_block_hash_to_block) == 0


# ---------------------------------------------------------------------------
# evict_blocks, reset_prefix_cache, freed ids


def test_evict_blocks():
    pool = BlockPool(6, enable_kv_cache_events=True)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.take_events()
    pool.evict_blocks([2, 3])  # 3 never cached: ignored
    assert blocks[1].block_hash is None and blocks[1].ref_cnt == 1
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [BlockRemoved([req.block_hashes[1]], "GPU", 0)]
    assert _free_ids(pool) == [3, 4, 5]  # the queue is not touched
    pool.evict_blocks(np.array([1]))
    assert len(pool.cached_block_hash_to_block) == 0


@pytest.mark.parametrize("bad", [0, 6, -1, 100, 1.0, "1"])
def test_evict_blocks_out_of_range(bad):
    pool = BlockPool(6)
    req = _request(range(4))
    blocks = pool.get_new_blocks(1)
    _cache(pool, req, blocks)
    with pytest.raises(ValueError, match="1..5"):
        pool.evict_blocks([1, bad])
    # Validated up front: the valid id in the same call is not evicted.
    assert pool.get_cached_block(req.block_hashes[0], [0]) == blocks


@pytest.mark.parametrize("bad", [5, None, "12", b"\x01"])
def test_evict_blocks_wants_an_iterable_of_ids(bad):
    pool = BlockPool(6)
    req = _request(range(4))
    blocks = pool.get_new_blocks(1)
    _cache(pool, req, blocks)
    num_free = pool.get_num_free_blocks()
    with pytest.raises(TypeError, match=r"block_ids must be an iterable of block ids .*got "):
        pool.evict_blocks(bad)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == blocks
    assert pool.get_num_free_blocks() == num_free


def test_reset_prefix_cache():
    pool = BlockPool(5, enable_kv_cache_events=True)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.take_events()
    # A block is held: refused, nothing changes.
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert blocks[0].block_hash is not None
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks[1:]))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    pool.free_blocks([blocks[0]])
    free_before = _free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert len(pool.cached_block_hash_to_block) == 0
    assert _free_ids(pool) == free_before
    assert pool.get_num_free_blocks() == 4


def test_take_freed_block_ids():
    pool = BlockPool(8, track_freed_block_ids=True)
    req = _request(range(8))
    a = pool.get_new_blocks(2)  # 1, 2 (hashed below)
    b = pool.get_new_blocks(2)  # 3, 4 (never hashed)
    _cache(pool, req, a)
    ids = pool.take_freed_block_ids()
    assert ids.dtype == np.int32 and ids.tolist() == []
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))  # hashed: contents kept, not garbage yet
    assert pool.take_freed_block_ids().tolist() == [3, 4]
    assert pool.take_freed_block_ids().tolist() == []
    # Free queue: [4, 3, 5, 6, 7, 2, 1]; take 6 → evicts block 2's hash.
    got = pool.get_new_blocks(6)
    assert _ids(got) == [4, 3, 5, 6, 7, 2]
    assert pool.take_freed_block_ids().tolist() == [2]
    pool.evict_blocks([1])
    assert pool.take_freed_block_ids().tolist() == [1]


def test_freed_block_ids_after_reset():
    """Blocks that lose their hash in a reset hold garbage: reported for zeroing."""
    pool = BlockPool(5, track_freed_block_ids=True)
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.free_blocks(reversed(blocks))
    assert pool.take_freed_block_ids().tolist() == []
    assert pool.reset_prefix_cache() is True
    assert pool.take_freed_block_ids().tolist() == [1, 2]


def test_take_freed_block_ids_requires_tracking():
    with pytest.raises(ValueError, match="track_freed_block_ids"):
        BlockPool(4).take_freed_block_ids()


def test_evicting_a_held_block_does_not_report_it_for_zeroing():
    pool = BlockPool(6, enable_caching=True, hash_block_size=2, track_freed_block_ids=True)
    request = Request("r", [1, 2, 3, 4], block_hasher=get_request_block_hasher(2, SHA_CBOR))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 2, 0)
    pool.take_freed_block_ids()
    pool.evict_blocks([blocks[0].block_id])  # its KV turned out bad, but a request holds it
    assert blocks[0].block_hash is None
    assert pool.take_freed_block_ids().tolist() == []  # zeroing it would corrupt a live page
    pool.free_blocks(reversed(blocks))
    assert pool.take_freed_block_ids().tolist() == [blocks[0].block_id]


_MAP_OPS = ("stamp_insert", "stamp_api_insert", "foreign_insert", "pop", "pop_stamped", "clear")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_MAP_OPS),
            st.integers(0, 2),
            st.integers(0, 1),
            st.lists(st.integers(0, 6), min_size=1, max_size=3),
        ),
        max_size=60,
    )
)
def test_hash_map_with_duplicates_matches_a_list_model(ops):
    """Random inserts (under a block's own key, as the pool does, or under any key, as
    vLLM's `insert` allows), pops (single and batched) and clears against lists in
    insertion order: lookups give the earliest block, items and counts agree, a block
    is chained only while it shares its own key, nothing is left over."""
    cache_map = BlockHashToBlockMap()
    blocks = [KVCacheBlock(i) for i in range(7)]
    model: dict[tuple[bytes, int], list[KVCacheBlock]] = {}

    def own_key(block):
        return (block.block_hash_only, block.group_id)

    def drop(block, key):
        model[key].remove(block)
        if not model[key]:
            del model[key]

    for op, hash_index, group, block_ids in ops:
        key = (_h(hash_index), group)
        block = blocks[block_ids[0]]
        if op in ("stamp_insert", "stamp_api_insert") and block.block_hash is None:
            block.set_hash(*key)
            if op == "stamp_insert":
                cache_map.insert_stamped([block], group)
            else:
                cache_map.insert(key[0], group, block)
            if block not in model.get(key, []):  # a block is under a key once
                model.setdefault(key, []).append(block)
        elif op == "foreign_insert" and (block.block_hash is None or own_key(block) != key):
            cache_map.insert(key[0], group, block)
            if block not in model.get(key, []):
                model.setdefault(key, []).append(block)
        elif op == "pop":
            expected = block if block in model.get(key, []) else None
            assert cache_map.pop(key[0], group, block.block_id) is expected
            if expected is not None:
                drop(block, key)
                if own_key(block) == key:
                    block.reset_hash()
        elif op == "pop_stamped":
            batch = [blocks[i] for i in dict.fromkeys(block_ids)]
            batch = [
                b for b in batch if b.block_hash is not None and b in model.get(own_key(b), [])
            ]
            cache_map.pop_stamped(batch)
            for popped in batch:
                drop(popped, own_key(popped))
                popped.reset_hash()
        elif op == "clear":
            cache_map.clear()
            model.clear()
            KVCacheBlock.reset_hashes(blocks)
        for (block_hash, group_id), listed in model.items():
            assert cache_map.get_one_block(block_hash, group_id) is listed[0]
            assert cache_map.blocks_of(block_hash, group_id) == listed
        assert cache_map.num_blocks() == sum(map(len, model.values()))
        assert len(cache_map) == len(model)
        assert sorted((k, _ids(v)) for k, v in cache_map.items()) == sorted(
            (make_block_hash_with_group_id(*k), _ids(v)) for k, v in model.items()
        )
        for b in blocks:  # chain links only on blocks sharing their own key
            if b.prev_same_key is not None or b.next_same_key is not None:
                assert b.block_hash is not None and len(model[own_key(b)]) >= 2
    for key, listed in list(model.items()):
        for b in list(listed):
            assert cache_map.pop(key[0], key[1], b.block_id) is b
    assert cache_map.num_blocks() == 0 and len(cache_map) == 0
    assert all(b.prev_same_key is None and b.next_same_key is None for b in blocks)
    assert cache_map.pop(_h(99), 0, 1) is None


def test_hash_map_keys_of_unstamped_blocks_and_stamped_batches():
    """`insert`/`pop` take an explicit key (the block need not be stamped with it, as in
    vLLM's map); `insert_stamped`/`pop_stamped` read each block's own key, across groups
    and with duplicates, and leave nothing behind."""
    cache_map = BlockHashToBlockMap()
    loose = KVCacheBlock(3)  # never stamped
    cache_map.insert(_h(1), 0, loose)
    assert cache_map.get_one_block(_h(1), 0) is loose
    blocks = [KVCacheBlock(i) for i in range(4, 8)]
    for block, (hash_index, group) in zip(blocks, [(1, 0), (2, 1), (1, 0), (2, 1)], strict=True):
        block.set_hash(_h(hash_index), group)
    cache_map.insert_stamped(blocks[0::2], 0)
    cache_map.insert_stamped(blocks[1::2], 1)
    assert cache_map.num_blocks() == 5 and cache_map.get_one_block(_h(1), 0) is loose
    assert cache_map.pop(_h(1), 0, 3) is loose
    assert cache_map.get_one_block(_h(1), 0) is blocks[0]
    cache_map.pop_stamped([blocks[3], blocks[0], blocks[1], blocks[2]])
    assert cache_map.num_blocks() == 0 and len(cache_map) == 0


# ---------------------------------------------------------------------------
def test_on_evict_sees_cached_free_blocks_still_keyed_before_reuse():
    """`on_evict` (the host tier's store at eviction) is told of the cached free blocks
    popped for reuse or given up for a tenant cap, while they still hold their keys;
    `evict_blocks` (bad KV) is not reported."""
    pool = BlockPool(10, tenant_block_quotas={"a": 1})
    seen = []
    pool.on_evict = lambda blocks: seen.append([(b.block_id, b.block_hash) for b in blocks])
    req = _request(range(8))
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    keys = [b.block_hash for b in blocks]
    pool.free_blocks(reversed(blocks))
    assert pool.get_new_blocks(7) and seen == []  # the uncached free blocks went first
    pool.get_new_blocks(1)
    assert seen == [[(blocks[1].block_id, keys[1])]] and blocks[1].block_hash is None
    pool.evict_blocks([blocks[0].block_id])
    assert len(seen) == 1
    salted = BlockPool(10, tenant_block_quotas={"a": 1})
    salted.on_evict = pool.on_evict
    first, second = (
        _request(range(4), "1", cache_salt="a"),
        _request(range(9, 13), "2", cache_salt="a"),
    )
    (block,) = salted.get_new_blocks(1)
    _cache(salted, first, [block])
    key = block.block_hash
    salted.free_blocks([block])
    _cache(salted, second, salted.get_new_blocks(1))  # "a"'s cap gives up its free block
    assert seen[1:] == [[(block.block_id, key)]]


# Per-tenant caps (`tenant_block_quotas`)


def test_tenant_cap_evicts_the_salts_own_lru_free_block_and_spares_the_others():
    pool = BlockPool(10, enable_kv_cache_events=True, tenant_block_quotas={"a": 2})
    other = _request(range(100, 108), "o", cache_salt="b")
    other_blocks = pool.get_new_blocks(2)
    _cache(pool, other, other_blocks)
    first = _request(range(8), "r1", cache_salt="a")
    blocks1 = pool.get_new_blocks(2)
    _cache(pool, first, blocks1)
    assert pool.tenant_cached_blocks() == {"a": 2, "b": 2}  # "b" counted, not capped
    pool.free_blocks(reversed(blocks1))  # a's free order: its block 2, then block 1
    pool.free_blocks(reversed(other_blocks))
    pool.take_events()
    second = _request(range(20, 24), "r2", cache_salt="a")
    (block,) = pool.get_new_blocks(1)
    _cache(pool, second, [block])
    # a's least recently freed cached block (its chain tail, freed first) made room.
    assert pool.take_events()[0] == BlockRemoved(
        block_hashes=[first.block_hashes[1]], medium="GPU", group_idx=0
    )
    assert blocks1[1].block_hash is None and blocks1[0].block_hash is not None
    assert all(b.block_hash is not None for b in other_blocks)  # b untouched
    assert pool.tenant_cached_blocks() == {"a": 2, "b": 2}
    assert _free_ids(pool)[0] == blocks1[1].block_id  # nothing left to lose: reused first


def test_tenant_cap_leaves_the_block_uncached_when_all_of_the_salts_blocks_are_held():
    pool = BlockPool(10, enable_kv_cache_events=True, tenant_block_quotas={"a": 1, "z": 0})
    req = _request(range(12), cache_salt="a")
    blocks = pool.get_new_blocks(3)
    _cache(pool, req, blocks)
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    (stored,) = pool.take_events()
    assert stored.block_hashes == req.block_hashes[:1]
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    zero = _request(range(4), "z", cache_salt="z")
    (block,) = pool.get_new_blocks(1)
    _cache(pool, zero, [block])
    assert block.block_hash is None and pool.take_events() == []
    # Unsalted requests are never capped.
    plain = _request(range(8), "p")
    plain_blocks = pool.get_new_blocks(2)
    _cache(pool, plain, plain_blocks)
    assert all(b.block_hash is not None for b in plain_blocks)
    assert pool.tenant_cached_blocks() == {"a": 1}
    pool.free_blocks([*reversed(blocks), block, *plain_blocks])
    assert pool.reset_prefix_cache() and pool.tenant_cached_blocks() == {}


def test_tenant_hits_take_blocks_out_of_the_salts_free_set():
    pool = BlockPool(10, tenant_block_quotas={"a": 2})
    first = _request(range(8), "r1", cache_salt="a")
    blocks = pool.get_new_blocks(2)
    _cache(pool, first, blocks)
    pool.free_blocks(reversed(blocks))
    pool.touch(blocks)  # a hit: both held again
    new = _request(range(8, 12), "r2", cache_salt="a")
    (block,) = pool.get_new_blocks(1)
    _cache(pool, new, [block])
    assert block.block_hash is None  # no free block of "a" to give up
    assert all(b.block_hash is not None for b in blocks)


def test_the_default_key_caps_every_salt_not_listed_and_never_unsalted_requests():
    pool = BlockPool(16, tenant_block_quotas={"*": 1, "big": 3})
    for salt, expected in (("x", 1), ("y", 1), ("big", 3), ("*", 1), (None, 3)):
        req = _request(range(12), f"r-{salt}", cache_salt=salt)
        blocks = pool.get_new_blocks(3)
        _cache(pool, req, blocks)
        assert sum(b.block_hash is not None for b in blocks) == expected, salt
        if salt is not None:
            assert pool.tenant_block_quota(salt) == (3 if salt == "big" else 1)
    assert pool.tenant_cached_blocks() == {"x": 1, "y": 1, "big": 3, "*": 1}


def test_tenant_caps_off_by_default_count_nothing():
    pool = BlockPool(6)
    req = _request(range(8), cache_salt="a")
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks)
    pool.free_blocks(blocks)
    assert pool.tenant_block_quotas is None and pool.tenant_cached_blocks() == {}
    assert not pool._tenant_of and not pool._tenant_free


@pytest.mark.parametrize(
    ("quotas", "error", "match"),
    [
        ({"a": -1}, ValueError, r"tenant_block_quotas\['a'\] must be >= 0"),
        ({"a": 1.5}, TypeError, r"tenant_block_quotas\['a'\] must be an integer"),
        ({"a": True}, TypeError, r"tenant_block_quotas\['a'\] must be an integer"),
        ({1: 2}, TypeError, "tenant_block_quotas key"),
        ({"": 2}, ValueError, r"tenant_block_quotas has the key ''; '' is no salt"),
        ([("a", 1)], TypeError, "tenant_block_quotas must map cache_salt"),
    ],
)
def test_tenant_caps_bad_input_is_refused_naming_the_setting(quotas, error, match):
    with pytest.raises(error, match=match):
        BlockPool(6, tenant_block_quotas=quotas)
    pool = BlockPool(6)
    req = _request(range(4))
    _cache(pool, req, pool.get_new_blocks(1))
    with pytest.raises(ValueError, match="only while no block is cached"):
        pool.set_tenant_block_quotas({"a": 1})


def _reference_block_stored(request, hashes, indices, start, end, block_size, group_id):
    """`BlockStored` as the general builder makes it (per-block extra keys)."""
    from jaxkv.kv_events import to_event_extra_keys
    from jaxkv.request_hashing import generate_block_hash_extra_keys

    keys, mm_idx = [], 0
    for i in indices:
        block_keys, mm_idx = generate_block_hash_extra_keys(
            request, i * block_size, (i + 1) * block_size, mm_idx
        )
        keys.append(block_keys)
    lora = request.lora_request
    return BlockStored(
        block_hashes=[hashes[i] for i in indices],
        parent_block_hash=hashes[start - 1] if start else None,
        token_ids=list(request.all_token_ids)[start * block_size : end * block_size],
        block_size=block_size,
        lora_id=request.lora_int_id,
        lora_name=lora.lora_name if lora is not None else None,
        extra_keys=to_event_extra_keys(keys),
        group_idx=group_id,
    )


@settings(max_examples=150, deadline=None)
@given(
    num_prompt=st.integers(1, 20),
    num_output=st.integers(0, 20),
    span=st.tuples(st.integers(0, 10), st.integers(0, 10)),
    skip=st.sets(st.integers(0, 10)),
    salt=st.sampled_from([None, "", "tenant"]),
    lora=st.booleans(),
    group_id=st.integers(0, 2),
)
def test_block_stored_events_with_and_without_extra_keys(
    num_prompt, num_output, span, skip, salt, lora, group_id
):
    """A `DeferredBlockStored` builds the per-block reference event, with its group's spec
    (none past the recorded groups), whether or not the request's blocks can have extra
    keys (a decode step's events have none); blocks that straddle the prompt and the
    output take tokens from both. Built after the request has grown, it is the same event
    (what it is built from only grows)."""
    from jaxkv.request import LoRARequest

    request = Request(
        "r", list(range(100, 100 + num_prompt)), cache_salt=salt,
        lora_request=LoRARequest("adapter", 7, "/a") if lora else None,
        block_hasher=get_request_block_hasher(BS, SHA_CBOR),
    )  # fmt: skip
    request.append_output_token_ids(list(range(500, 500 + num_output)))
    num_full = len(request.block_hashes)
    start, end = sorted(min(x, num_full) for x in span)
    records = []
    for indices in (range(start, end), [i for i in range(start, end) if i not in skip]):
        record = DeferredBlockStored(
            request, request.block_hashes, indices, start, end, BS, group_id, GROUP_SPECS
        )
        want = _reference_block_stored(
            request, request.block_hashes, indices, start, end, BS, group_id
        )
        if group_id < len(GROUP_SPECS):
            want.kv_cache_spec_kind, want.kv_cache_spec_sliding_window = GROUP_SPECS[group_id]
        event = record.build()
        assert event == want
        assert type(event.block_hashes) is list and type(event.token_ids) is list
        if salt is None and not lora:  # nothing but the blocks themselves
            assert event.extra_keys is None and event.lora_id is None
        records.append((record, want))
    request.append_output_token_ids(list(range(900, 900 + 3 * BS)))
    assert [record.build() for record, _ in records] == [want for _, want in records]


GROUP_SPECS = (("full_attention", None), ("sliding_window", 64))


def test_deferred_events_build_the_same_on_another_thread_while_the_request_grows():
    """The engine's publishing thread builds a step's `BlockStored` events while the
    stepping thread appends to the requests: every build is the event of the blocks as
    they were cached."""
    import threading

    pool = BlockPool(64, True, BS, enable_kv_cache_events=True)
    request = Request(
        "r", list(range(3, 3 + 2 * BS)), block_hasher=get_request_block_hasher(BS, SHA_CBOR)
    )
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, BS, 0)
    (record,) = pool.take_events(deferred=True)
    want = record.build()
    assert pool.take_events() == [] and want.token_ids == list(range(3, 3 + 2 * BS))
    builds, stop = [], threading.Event()

    def build_until_stopped() -> None:
        while not stop.is_set():
            builds.append(record.build())

    builder = threading.Thread(target=build_until_stopped)
    builder.start()
    for token in range(2000):
        request.append_output_token_ids(token)
    stop.set()
    builder.join()
    assert builds and all(event == want for event in builds)


def test_cached_free_blocks_evicted_first_stay_findable():
    """After a weight update: cached free blocks move to the queue's front, in order,
    still findable (no event); held and uncached blocks keep their places."""
    pool = BlockPool(8, enable_kv_cache_events=True)
    req = _request(range(8))
    blocks = pool.get_new_blocks(4)
    _cache(pool, req, blocks[:2])
    pool.take_events()
    pool.free_blocks(blocks[:3])  # 2 cached, 1 uncached; blocks[3] stays held
    before = _free_ids(pool)
    assert pool.evict_cached_free_blocks_first() == 2
    after = _free_ids(pool)
    cached = [i for i in before if i in _ids(blocks[:2])]
    assert after == cached + [i for i in before if i not in cached]
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [] and blocks[3].ref_cnt == 1
    assert pool.get_new_blocks(2) == [pool.blocks[i] for i in cached]  # evicted first


def test_weight_version_keys_every_block_hash_only_when_set():
    plain = _request(range(12))
    keyed = _request(range(12), weight_version=3)
    assert len(keyed.block_hashes) == 3
    assert not set(plain.block_hashes) & set(keyed.block_hashes)  # chained from block 0
    assert _request(range(12), weight_version=None).block_hashes == plain.block_hashes
    keyed.set_weight_version(None)
    assert keyed.block_hashes == plain.block_hashes
