"""KVCacheManager (SPEC §5): exact block ids, eviction orders, events, stats, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheTensor,
    LoRARequest,
    MultiModalFeatureSpec,
    Request,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.hashing import make_block_hash_with_group_id

SHA_CBOR = get_hash_fn_by_name("sha256_cbor")
BS = 4


pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def make_manager(num_blocks=11, block_size=BS, max_model_len=64, **kwargs) -> KVCacheManager:
    return KVCacheManager.from_spec(
        FullAttentionSpec(block_size), num_blocks, max_model_len, **kwargs
    )


def make_request(rid, tokens, block_size=BS, **kwargs) -> Request:
    return Request(
        rid,
        list(tokens),
        block_hasher=get_request_block_hasher(block_size, SHA_CBOR),
        **kwargs,
    )


def admit(manager: KVCacheManager, req: Request, num_new_tokens: int | None = None, **kwargs):
    """Schedule a waiting request's prefill (or a chunk of it); returns (hit tokens, new ids)."""
    blocks, num_hit, _ = manager.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    new = manager.allocate_slots(req, num_new_tokens, num_hit, blocks, **kwargs)
    if new is None:
        return num_hit, None
    req.num_computed_tokens = num_hit + num_new_tokens
    return num_hit, new.get_block_ids()[0]


def ids(manager: KVCacheManager, rid: str) -> list[int]:
    return manager.get_block_ids(rid)[0]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in manager.block_pool.blocks]


def snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    return (
        ref_cnts(manager),
        free_ids(manager),
        manager.num_free_blocks,
        [b.block_hash for b in pool.blocks],
        sorted((k, [b.block_id for b in v]) for k, v in pool.cached_block_hash_to_block.items()),
        {
            rid: [b.block_id for b in blocks]
            for m in manager.coordinator.single_type_managers
            for rid, blocks in m.req_to_blocks.items()
        },
        [dict(m.num_cached_block) for m in manager.coordinator.single_type_managers],
    )


def key(block_hash: bytes, group_id: int = 0) -> bytes:
    return make_block_hash_with_group_id(block_hash, group_id)


# ---------------------------------------------------------------------------
# Prefix sharing, partial blocks, decode


def test_shared_prefix_exact_ids():
    m = make_manager()
    a = make_request("a", range(10))
    assert admit(m, a) == (0, [1, 2, 3])
    blocks = m.block_pool.blocks
    assert blocks[1].block_hash == key(a.block_hashes[0])
    assert blocks[2].block_hash == key(a.block_hashes[1])
    assert blocks[3].block_hash is None  # partial last block: never cached
    b = make_request("b", [*range(8), 100, 101, 102])
    assert admit(m, b) == (8, [4])
    assert ids(m, "b") == [1, 2, 4]
    assert ref_cnts(m)[:6] == [0, 2, 2, 1, 1, 0]
    assert m.num_free_blocks == 6
    assert free_ids(m) == [5, 6, 7, 8, 9, 10]
    # A request sharing only the first block.
    c = make_request("c", [0, 1, 2, 3, 50, 51, 52, 53, 54])
    assert admit(m, c) == (4, [5, 6])
    assert ids(m, "c") == [1, 5, 6]
    assert m.block_pool.blocks[5].block_hash == key(c.block_hashes[1])
    assert ref_cnts(m)[1] == 3


def test_partial_last_block_not_hit():
    m = make_manager()
    a = make_request("a", range(10))
    admit(m, a)
    b = make_request("b", range(10))
    blocks, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 8
    assert blocks.get_block_ids() == ([1, 2],)


@pytest.mark.parametrize("n,expected_hit", [(8, 4), (12, 8), (9, 8), (4, 0), (5, 4)])
def test_hit_never_covers_last_token(n, expected_hit):
    m = make_manager()
    admit(m, make_request("a", range(12)))  # blocks 1, 2, 3 all cached
    assert [b.block_hash is not None for b in m.block_pool.blocks[1:4]] == [True] * 3
    blocks, num_hit, _ = m.get_computed_blocks(make_request("b", range(n)))
    assert num_hit == expected_hit
    assert blocks.get_block_ids() == ([1, 2, 3][: expected_hit // BS],)


def test_get_computed_blocks_changes_no_state():
    m = make_manager()
    a = make_request("a", range(12))
    admit(m, a)
    m.free(a)
    before = snapshot(m)
    blocks, num_hit, _ = m.get_computed_blocks(make_request("b", range(13)))
    assert num_hit == 12 and blocks.get_block_ids() == ([1, 2, 3],)
    assert snapshot(m) == before


def test_decode_growth():
    m = make_manager()
    req = make_request("d", range(6))
    assert admit(m, req) == (0, [1, 2])
    pool_blocks = m.block_pool.blocks
    assert pool_blocks[1].block_hash == key(req.block_hashes[0])
    assert pool_blocks[2].block_hash is None
    new_per_step = []
    hashed_per_step = []
    for step in range(7):
        req.append_output_token_ids(1000 + step)
        new = m.allocate_slots(req, 1)
        assert new is not None
        new_per_step.append(new.get_block_ids()[0])
        req.num_computed_tokens += 1
        hashed_per_step.append([b.block_id for b in pool_blocks if b.block_hash is not None])
    # Tokens 7..13: a new block every 4 tokens, blocks cached as they fill.
    assert new_per_step == [[], [], [3], [], [], [], [4]]
    assert hashed_per_step == [[1], [1, 2], [1, 2], [1, 2], [1, 2], [1, 2, 3], [1, 2, 3]]
    assert ids(m, "d") == [1, 2, 3, 4]
    assert pool_blocks[3].block_hash == key(req.block_hashes[2])
    # A decoded block is a prefix hit for a request that continues the output.
    follow = make_request("f", req.all_token_ids)
    blocks, num_hit, _ = m.get_computed_blocks(follow)
    assert (num_hit, blocks.get_block_ids()) == (12, ([1, 2, 3],))


def test_chunked_prefill():
    m = make_manager()
    req = make_request("c", range(10))
    assert admit(m, req, num_new_tokens=5) == (0, [1, 2])
    assert [b.block_hash is not None for b in m.block_pool.blocks[1:3]] == [True, False]
    new = m.allocate_slots(req, 5)
    assert new.get_block_ids() == ([3],)
    req.num_computed_tokens = 10
    assert m.block_pool.blocks[2].block_hash == key(req.block_hashes[1])
    assert m.block_pool.blocks[3].block_hash is None


def test_eviction_chain_tail_first():
    m = make_manager(num_blocks=6, enable_kv_cache_events=True)
    a = make_request("a", range(12))
    assert admit(m, a) == (0, [1, 2, 3])
    m.free(a)
    assert free_ids(m) == [4, 5, 3, 2, 1]
    m.take_events()
    b = make_request("b", range(100, 116))
    assert admit(m, b) == (0, [4, 5, 3, 2])
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [
        BlockRemoved([a.block_hashes[2]], "GPU", 0),
        BlockRemoved([a.block_hashes[1]], "GPU", 0),
    ]
    c = make_request("c", range(12))
    blocks, num_hit, _ = m.get_computed_blocks(c)
    assert (num_hit, blocks.get_block_ids()) == (4, ([1],))


def test_lru_across_requests():
    m = make_manager(num_blocks=8)
    a = make_request("a", range(8))
    b = make_request("b", range(50, 58))
    admit(m, a)  # 1, 2
    admit(m, b)  # 3, 4
    m.free(b)
    m.free(a)
    assert free_ids(m) == [5, 6, 7, 4, 3, 2, 1]
    # Re-touching a's prefix moves it out of the queue; freed again it goes to the back.
    a2 = make_request("a2", [*range(8), 9])
    assert admit(m, a2) == (8, [5])
    m.free(a2)
    assert free_ids(m) == [5, 6, 7, 4, 3, 2, 1]  # 5 unhashed → front; 2, 1 hashed → back


# ---------------------------------------------------------------------------
# Isolation and extra keys


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cache_salt": "tenant-b"},
        {"lora_request": LoRARequest("ad", 1, "/ad")},
        {"mm_features": [MultiModalFeatureSpec("img", 1, 2)]},
    ],
    ids=["salt", "lora", "mm"],
)
def test_isolation(kwargs):
    m = make_manager()
    tokens = list(range(12))
    admit(m, make_request("a", tokens))
    blocks, num_hit, _ = m.get_computed_blocks(make_request("b", tokens, **kwargs))
    assert (num_hit, blocks.get_block_ids()) == (0, ([],))
    # A request with the same context hits the context's own blocks.
    assert admit(m, make_request("c", tokens, **kwargs)) == (0, [4, 5, 6])
    blocks, num_hit, _ = m.get_computed_blocks(make_request("d", [*tokens, 7], **kwargs))
    assert (num_hit, blocks.get_block_ids()) == (12, ([4, 5, 6],))
    blocks, num_hit, _ = m.get_computed_blocks(make_request("e", [*tokens, 7]))
    assert (num_hit, blocks.get_block_ids()) == (12, ([1, 2, 3],))


def test_mm_item_only_breaks_from_its_block():
    m = make_manager()
    tokens = list(range(13))
    admit(m, make_request("a", tokens, mm_features=[MultiModalFeatureSpec("img", 5, 2)]))
    other = make_request("b", tokens, mm_features=[MultiModalFeatureSpec("other", 5, 2)])
    blocks, num_hit, _ = m.get_computed_blocks(other)
    assert (num_hit, blocks.get_block_ids()) == (4, ([1],))


def test_salt_different_tenants_same_tokens():
    m = make_manager()
    tokens = list(range(9))
    assert admit(m, make_request("a", tokens, cache_salt="x")) == (0, [1, 2, 3])
    assert admit(m, make_request("b", tokens, cache_salt="y")) == (0, [4, 5, 6])
    assert admit(m, make_request("c", tokens, cache_salt="x")) == (8, [7])


def test_prompt_embedding_keys():
    m = make_manager()
    emb = np.arange(9 * 2, dtype=np.float32).reshape(9, 2)
    admit(m, make_request("a", range(9), prompt_embeds=emb))
    same = make_request("b", range(9), prompt_embeds=emb.copy())
    assert m.get_computed_blocks(same)[1] == 8
    changed = emb.copy()
    changed[6, 0] = -1.0
    blocks, num_hit, _ = m.get_computed_blocks(make_request("c", range(9), prompt_embeds=changed))
    assert (num_hit, blocks.get_block_ids()) == (4, ([1],))
    assert m.get_computed_blocks(make_request("d", range(9)))[1] == 0


# ---------------------------------------------------------------------------
# Reset, lookahead, delayed caching


def test_reset_while_running_vs_after():
    m = make_manager(enable_kv_cache_events=True, log_stats=True)
    a = make_request("a", range(12))
    admit(m, a)
    m.take_events()
    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    assert m.take_events() == []
    assert m.make_prefix_cache_stats().reset is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert m.make_prefix_cache_stats().reset is True
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.num_free_blocks == 10
    assert m.get_computed_blocks(make_request("b", range(13)))[1] == 0


def test_lookahead_slots_never_cached():
    m = make_manager()
    req = make_request("s", range(6))
    assert admit(m, req) == (0, [1, 2])
    req.append_output_token_ids(100)  # 7 tokens; 3 draft tokens follow
    new = m.allocate_slots(req, 1 + 3)
    assert new.get_block_ids() == ([3],)
    # Slots for 10 tokens, but block 2 holds a draft position (7): not cached.
    assert m.block_pool.blocks[2].block_hash is None
    assert m.block_pool.blocks[3].block_hash is None
    # One draft accepted, plus the bonus token: 9 tokens, 8 verified computed.
    req.append_output_token_ids([101, 102])
    req.num_computed_tokens = 8
    new = m.allocate_slots(req, 1 + 3)
    assert new.get_block_ids() == ([],)
    assert m.block_pool.blocks[2].block_hash == key(req.block_hashes[1])
    assert m.block_pool.blocks[3].block_hash is None


def test_num_lookahead_tokens_allocated_not_cached():
    m = make_manager()
    req = make_request("l", range(8))
    assert admit(m, req, num_lookahead_tokens=5) == (0, [1, 2, 3, 4])
    hashed = [b.block_id for b in m.block_pool.blocks if b.block_hash is not None]
    assert hashed == [1, 2]


def test_lookahead_capped_at_max_model_len():
    m = make_manager(max_model_len=12)
    req = make_request("l", range(10))
    assert admit(m, req, num_lookahead_tokens=8) == (0, [1, 2, 3])


def test_delay_cache_blocks():
    m = make_manager(enable_kv_cache_events=True)
    req = make_request("d", range(9))
    assert admit(m, req, delay_cache_blocks=True) == (0, [1, 2, 3])
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.take_events() == []
    assert m.get_computed_blocks(make_request("x", range(9)))[1] == 0
    m.cache_blocks(req, 9)
    assert [b.block_hash is not None for b in m.block_pool.blocks[1:4]] == [True, True, False]
    (event,) = m.take_events()
    assert event.block_hashes == req.block_hashes[:2]
    assert m.get_computed_blocks(make_request("x", range(9)))[1] == 8


# ---------------------------------------------------------------------------
# Out of blocks


def test_out_of_blocks_returns_none_no_change():
    m = make_manager(num_blocks=5)
    a = make_request("a", range(12))
    assert admit(m, a) == (0, [1, 2, 3])
    m.free(a)
    assert free_ids(m) == [4, 3, 2, 1]
    before = snapshot(m)
    # 3 hits sitting in the free queue count as needing blocks: 3 + 2 new > 4.
    b = make_request("b", range(20))
    blocks, num_hit, _ = m.get_computed_blocks(b)
    assert (num_hit, blocks.get_block_ids()) == (12, ([1, 2, 3],))
    assert m.allocate_slots(b, 8, 12, blocks) is None
    assert snapshot(m) == before
    assert m.get_block_ids("b") == ([],)
    # 3 hits + 1 new = 4 free: fits exactly.
    c = make_request("c", range(16))
    assert admit(m, c) == (12, [4])
    assert ids(m, "c") == [1, 2, 3, 4]
    assert m.num_free_blocks == 0


def test_out_of_blocks_while_running():
    m = make_manager(num_blocks=6)
    a = make_request("a", range(12))
    admit(m, a)  # 1, 2, 3; free: 4, 5
    before = snapshot(m)
    b = make_request("b", range(100, 112))
    assert admit(m, b) == (0, None)
    assert snapshot(m) == before
    assert ref_cnts(m)[1:4] == [1, 1, 1]
    # Hits held by a running request need no free block: 3 held hits + 1 new.
    c = make_request("c", [*range(12), 7, 7, 7])
    assert admit(m, c) == (12, [4])
    assert ref_cnts(m)[1:5] == [2, 2, 2, 1]
    # Decode that needs a block it cannot get.
    d = make_request("d", range(200, 204))
    assert admit(m, d) == (0, [5])
    d.append_output_token_ids(1)
    before = snapshot(m)
    assert m.allocate_slots(d, 1) is None
    assert snapshot(m) == before


# ---------------------------------------------------------------------------
# Events, stats


def test_events_content():
    m = make_manager(num_blocks=5, enable_kv_cache_events=True)
    lora = LoRARequest("ad", 7, "/ad")
    a = make_request("a", range(10), lora_request=lora)
    admit(m, a)
    assert m.take_events() == [
        BlockStored(
            block_hashes=a.block_hashes[:2],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=BS,
            lora_id=7,
            medium="GPU",
            lora_name="ad",
            extra_keys=[("ad",), ("ad",)],  # untagged, one entry per block
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert m.take_events() == []
    a.append_output_token_ids([10, 11])
    m.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    assert m.take_events() == [
        BlockStored(
            block_hashes=[a.block_hashes[2]],
            parent_block_hash=a.block_hashes[1],
            token_ids=[8, 9, 10, 11],
            block_size=BS,
            lora_id=7,
            lora_name="ad",
            extra_keys=[("ad",)],
            kv_cache_spec_kind="full_attention",
        )
    ]
    m.free(a)
    assert free_ids(m) == [4, 3, 2, 1]
    b = make_request("b", range(100, 112))
    assert admit(m, b) == (0, [4, 3, 2])
    events = m.take_events()
    assert events == [
        BlockRemoved(block_hashes=[a.block_hashes[2]]),
        BlockRemoved(block_hashes=[a.block_hashes[1]]),
        BlockStored(
            block_hashes=b.block_hashes,
            parent_block_hash=None,
            token_ids=list(range(100, 112)),
            block_size=BS,
            lora_id=None,
            kv_cache_spec_kind="full_attention",
        ),
    ]


def test_events_disabled():
    m = make_manager(num_blocks=5)
    a = make_request("a", range(12))
    admit(m, a)
    m.free(a)
    admit(m, make_request("b", range(100, 116)))
    assert m.take_events() == []


def test_stats_off():
    m = make_manager()
    admit(m, make_request("a", range(8)))
    assert m.prefix_cache_stats is None
    assert m.make_prefix_cache_stats() is None


def test_stats_on():
    m = make_manager(log_stats=True)
    admit(m, make_request("a", range(10)))
    admit(m, make_request("b", [*range(8), 50, 51, 52]))
    p = make_request("p", [*range(9), 60])
    p.num_preemptions = 1
    admit(m, p)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 10, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)
    fresh = m.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.hits, fresh.preempted_requests) == (0, 0, 0, 0)
    assert fresh.hit_rate == 0.0
    # Skipped lookups are not queries.
    m.get_computed_blocks(make_request("s", range(10), skip_reading_prefix_cache=True))
    assert m.make_prefix_cache_stats().requests == 0


# ---------------------------------------------------------------------------
# Skip reading, caching disabled


def test_skip_reading_prefix_cache():
    m = make_manager()
    admit(m, make_request("a", range(10)))
    s = make_request("s", range(10), skip_reading_prefix_cache=True)
    blocks, num_hit, _ = m.get_computed_blocks(s)
    assert (num_hit, blocks.get_block_ids()) == (0, ([],))
    assert admit(m, s) == (0, [4, 5, 6])
    # Its blocks are still written to the cache (as duplicates, not merged).
    assert m.block_pool.blocks[4].block_hash == m.block_pool.blocks[1].block_hash
    assert m.block_pool.cached_block_hash_to_block.num_blocks() == 4
    assert m.get_computed_blocks(make_request("b", range(10)))[0].get_block_ids() == ([1, 2],)


def test_caching_disabled():
    m = make_manager(enable_caching=False, num_blocks=8)
    a = Request("a", list(range(10)))  # no block hasher needed
    assert admit(m, a) == (0, [1, 2, 3])
    b = make_request("b", range(10))
    assert admit(m, b) == (0, [4, 5, 6])
    assert all(blk.block_hash is None for blk in m.block_pool.blocks)
    m.free(a)
    assert free_ids(m) == [3, 2, 1, 7]
    m.free(b)
    assert free_ids(m) == [6, 5, 4, 3, 2, 1, 7]
    assert m.reset_prefix_cache() is True


# ---------------------------------------------------------------------------
# Bad input


def test_allocate_nothing_or_negative():
    m = make_manager()
    req = make_request("a", range(8))
    before = snapshot(m)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(req, 0)
    for kwargs, name in (
        ({"num_new_tokens": -1}, "num_new_tokens"),
        ({"num_new_tokens": 4, "num_new_computed_tokens": -4}, "num_new_computed_tokens"),
        ({"num_new_tokens": 4, "num_lookahead_tokens": -1}, "num_lookahead_tokens"),
    ):
        with pytest.raises(ValueError, match=name):
            m.allocate_slots(req, **kwargs)
    assert snapshot(m) == before


def test_freed_request_that_keeps_its_computed_tokens_is_refused():
    """A freed (or preempted) request holds no blocks: its slots start at token 0, so
    a kept `num_computed_tokens` would skip blocks nobody wrote and cache them."""
    m = make_manager()
    req = make_request("a", range(8))
    assert admit(m, req) == (0, [1, 2])
    m.free(req)  # the caller forgot `req.num_computed_tokens = 0`
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"'a' holds no blocks here but has num_computed_tokens=8"):
        m.allocate_slots(req, 1)
    assert snapshot(m) == before and req.num_computed_tokens == 8
    assert m.get_block_ids("a") == ([],)
    req.num_computed_tokens = 0  # as preemption resets it: a prefix hit serves it again
    assert admit(m, req) == (4, [3])


def test_computed_tokens_past_the_request_are_refused():
    m = make_manager()
    req = make_request("a", range(8))
    assert admit(m, req) == (0, [1, 2])
    req.num_computed_tokens = 9  # past its 8 tokens
    before = snapshot(m)
    match = r"request 'a': num_computed_tokens=9 exceeds its num_tokens=8"
    with pytest.raises(ValueError, match=match):
        m.allocate_slots(req, 1)  # would be quiet (its blocks hold 8 slots)
    with pytest.raises(ValueError, match=match):
        m.allocate_slots(req, 4)  # would take a block
    assert snapshot(m) == before and req.num_computed_tokens == 9
    new = make_request("b", range(20, 28))
    new.num_computed_tokens = 12  # a first allocation too
    with pytest.raises(ValueError, match=r"'b': num_computed_tokens=12 exceeds its num_tokens=8"):
        m.allocate_slots(new, 4)
    new.num_computed_tokens = -1
    with pytest.raises(ValueError, match=r"'b': num_computed_tokens must be >= 0, got -1"):
        m.allocate_slots(new, 4)
    assert snapshot(m) == before
    # Lookahead slots and new tokens past the request stay allowed (its own tokens bound
    # only what is computed): a decode step of 1 token with 3 lookahead slots.
    req.num_computed_tokens = 8
    req.append_output_token_ids([5])
    assert m.allocate_slots(req, 1, num_lookahead_tokens=3).get_block_ids() == ([3],)


def test_prompt_longer_than_max_model_len():
    m = make_manager(max_model_len=16)
    req = make_request("long", range(17))
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_model_len=16"):
        m.get_computed_blocks(req)
    with pytest.raises(ValueError, match="17"):
        m.allocate_slots(req, 17)
    assert snapshot(m) == before


def test_beyond_max_model_len():
    m = make_manager(max_model_len=16)
    req = make_request("a", range(12))
    admit(m, req)
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_model_len=16"):
        m.allocate_slots(req, 5)
    assert snapshot(m) == before
    # Exactly max_model_len is fine.
    req.append_output_token_ids([1, 2, 3, 4])
    assert m.allocate_slots(req, 4).get_block_ids() == ([4],)


def test_hits_for_request_already_holding_blocks():
    m = make_manager()
    a = make_request("a", range(9))
    admit(m, a)
    b = make_request("b", range(9))
    blocks, num_hit, _ = m.get_computed_blocks(b)
    m.allocate_slots(b, 1, num_hit, blocks)
    b.num_computed_tokens = 9
    before = snapshot(m)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate_slots(b, 1, 0, blocks)
    assert snapshot(m) == before


def test_free_unknown_request_is_noop():
    m = make_manager()
    admit(m, make_request("a", range(9)))
    before = snapshot(m)
    m.free(make_request("ghost", range(9)))
    assert snapshot(m) == before
    a2 = make_request("a2", range(5))
    admit(m, a2)
    m.free(a2)
    after = snapshot(m)
    m.free(a2)  # double free
    assert snapshot(m) == after


def test_usage_and_block_ids():
    m = make_manager(num_blocks=5)
    assert m.usage == 0.0
    req = make_request("a", range(5))
    admit(m, req)
    assert m.usage == pytest.approx(0.5)
    assert m.get_block_ids("a") == ([1, 2],)
    assert m.get_block_ids("nobody") == ([],)
    assert m.get_blocks("a").get_unhashed_block_ids() == [2]
    m.free(req)
    assert m.usage == 0.0


def test_take_freed_block_ids_via_manager():
    m = make_manager(num_blocks=6, track_freed_block_ids=True)
    a = make_request("a", range(6))
    admit(m, a)  # 1 hashed, 2 not
    m.free(a)
    assert m.take_freed_block_ids().tolist() == [2]
    assert admit(m, make_request("b", range(100, 120))) == (0, [2, 3, 4, 5, 1])  # evicts 1
    assert m.take_freed_block_ids().tolist() == [1]


# ---------------------------------------------------------------------------
# Block size != hash block size, several groups


def test_hash_block_size_smaller_than_block_size():
    m = make_manager(block_size=8, hash_block_size=4, num_blocks=11)
    a = make_request("a", range(20), block_size=4)
    assert admit(m, a) == (0, [1, 2, 3])
    blocks = m.block_pool.blocks
    assert blocks[1].block_hash == key(a.block_hashes[1])
    assert blocks[2].block_hash == key(a.block_hashes[3])
    assert blocks[3].block_hash is None
    cases = [
        ([*range(12), 99, 99, 99, 99, 99], 8, [1]),  # 12 shared tokens → 8
        ([*range(16), 5], 16, [1, 2]),
        (range(16), 8, [1]),  # exact multiple: at most 15 → 8
        ([*range(7), 99, *range(8, 20)], 0, []),
    ]
    for tokens, hit, hit_ids in cases:
        got_blocks, num_hit, _ = m.get_computed_blocks(make_request("x", tokens, block_size=4))
        assert (num_hit, got_blocks.get_block_ids()) == (hit, (hit_ids,))
    b = make_request("b", [*range(16), 1, 2, 3], block_size=4)
    assert admit(m, b) == (16, [4])
    assert ids(m, "b") == [1, 2, 4]


def test_hash_block_size_must_divide():
    with pytest.raises(ValueError, match="hash_block_size"):
        make_manager(block_size=8, hash_block_size=3)


def _two_group_manager(spec0, spec1, num_blocks=13, **kwargs) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(KVCacheTensor(1, ("l0",)), KVCacheTensor(1, ("l1",))),
        kv_cache_groups=(KVCacheGroupSpec(("l0",), spec0), KVCacheGroupSpec(("l1",), spec1)),
    )
    return KVCacheManager(config, max_model_len=64, **kwargs)


def test_two_full_attention_groups_share_pool():
    m = _two_group_manager(FullAttentionSpec(BS), FullAttentionSpec(BS))
    a = make_request("a", range(10))
    blocks, num_hit, _ = m.get_computed_blocks(a)
    new = m.allocate_slots(a, 10, num_hit, blocks)
    assert new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
    a.num_computed_tokens = 10
    pool = m.block_pool
    assert pool.blocks[1].block_hash == key(a.block_hashes[0], 0)
    assert pool.blocks[4].block_hash == key(a.block_hashes[0], 1)
    assert pool.blocks[5].block_hash == key(a.block_hashes[1], 1)
    b = make_request("b", [*range(8), 40, 41])
    blocks, num_hit, _ = m.get_computed_blocks(b)
    assert (num_hit, blocks.get_block_ids()) == (8, ([1, 2], [4, 5]))
    new = m.allocate_slots(b, 2, num_hit, blocks)
    assert new.get_block_ids() == ([7], [8])
    assert m.get_block_ids("b") == ([1, 2, 7], [4, 5, 8])
    assert m.num_free_blocks == 12 - 8
    # One group losing a block shrinks the hit for both.
    m.evict_blocks([5])
    blocks, num_hit, _ = m.get_computed_blocks(make_request("c", range(10)))
    assert (num_hit, blocks.get_block_ids()) == (4, ([1], [4]))
    m.free(a)
    m.free(b)
    # Per group, reversed: unhashed (3, 6, then 7, 8 and the evicted 5) to the front,
    # hashed blocks reaching 0 (2, 1 of group 0, then 4 of group 1) to the back.
    assert free_ids(m) == [8, 5, 7, 6, 3, 9, 10, 11, 12, 2, 1, 4]
    assert m.num_free_blocks == 12
    # Out of blocks across both groups: 28 tokens need 7 + 7 > 12 blocks.
    before = snapshot(m)
    big = make_request("big", range(300, 328))
    assert m.allocate_slots(big, 28) is None
    assert snapshot(m) == before


def test_two_groups_different_block_sizes():
    m = _two_group_manager(FullAttentionSpec(4), FullAttentionSpec(8), num_blocks=20)
    assert m.scheduler_block_size == 8
    a = make_request("a", range(20))
    blocks, num_hit, _ = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 20).get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8])
    a.num_computed_tokens = 20
    pool = m.block_pool
    assert pool.blocks[6].block_hash == key(a.block_hashes[1], 1)
    assert pool.blocks[7].block_hash == key(a.block_hashes[3], 1)
    assert pool.blocks[8].block_hash is None
    # As vLLM's hybrid coordinator: only the scheduler-block-aligned 16 tokens are
    # cached (a hit can never end at 20), so group 0's fifth block stays unhashed.
    assert pool.blocks[4].block_hash == key(a.block_hashes[3], 0)
    assert pool.blocks[5].block_hash is None
    blocks, num_hit, _ = m.get_computed_blocks(make_request("b", [*range(20), 1, 2, 3, 4]))
    assert (num_hit, blocks.get_block_ids()) == (16, ([1, 2, 3, 4], [6, 7]))
    # 12 shared tokens: group 0 could serve 12, but hits are multiples of 8.
    blocks, num_hit, _ = m.get_computed_blocks(make_request("c", [*range(12), 9, 9, 9, 9, 9]))
    assert (num_hit, blocks.get_block_ids()) == (8, ([1, 2], [6]))


def test_kv_cache_blocks_helpers():
    m = make_manager()
    admit(m, make_request("a", range(10)))
    blocks = m.get_blocks("a")
    assert isinstance(blocks, KVCacheBlocks)
    both = blocks + m.get_blocks("nobody")
    assert both.get_block_ids() == ([1, 2, 3],)
    assert blocks.new_empty().get_block_ids() == ([],)


def test_request_without_matching_hashes_rejected_before_any_change():
    m = make_manager()
    admit(m, make_request("a", range(9)))
    before = snapshot(m)
    no_hasher = Request("n", list(range(9)))
    with pytest.raises(ValueError, match="block hashes"):
        m.allocate_slots(no_hasher, 9)
    coarse = make_request("c", range(9), block_size=8)  # hashes of 8, manager hashes by 4
    with pytest.raises(ValueError, match="get_request_block_hasher"):
        m.allocate_slots(coarse, 9)
    assert snapshot(m) == before
    # Nothing to cache yet (fewer tokens than a block): no hashes needed.
    assert admit(m, Request("s", [1, 2, 3])) == (0, [4])
