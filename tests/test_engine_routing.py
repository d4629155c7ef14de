"""Data-parallel routing: a new request goes where its prefix is cached, within a load slack."""

from __future__ import annotations

from jaxkv import FullAttentionSpec, KVCacheManager, Request, get_request_block_hasher
from jaxkv.engine.engine import choose_data_rank
from jaxkv.hashing import get_hash_fn_by_name, init_none_hash

HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)
HASHER = get_request_block_hasher(16, HASH)


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
    return KVCacheManager.from_spec(spec, num_blocks=32, max_model_len=256, log_stats=True)


def request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), block_hasher=HASHER)


def test_cached_prefix_count_changes_nothing():
    m = manager()
    first = request("a", range(48))
    blocks, hits, _ = m.get_computed_blocks(first)
    assert hits == 0 and m.allocate_slots(first, 48, hits, blocks) is not None
    stats = m.make_prefix_cache_stats()
    second = request("b", list(range(40)) + [999] * 8)
    assert m.get_num_cached_prefix_tokens(second) == 32
    assert m.make_prefix_cache_stats().requests == 0, "a peek records no lookup"
    assert stats.requests == 1
    assert m._last_lookup is None, "a peek leaves nothing for allocate_slots to trust"
    assert m.get_computed_blocks(second)[1] == 32


def test_routing_prefers_the_rank_holding_the_prefix():
    cached = {0: 0, 1: 32, 2: 16}
    assert choose_data_rank([1, 2, 1], cached.__getitem__, slack=2) == 1
    # A rank more than `slack` requests busier than the least loaded is not a candidate.
    assert choose_data_rank([1, 4, 1], cached.__getitem__, slack=2) == 2
    # No hit anywhere (or slack 0): the least loaded rank, the lowest on a tie.
    assert choose_data_rank([3, 1, 1], lambda k: 0, slack=2) == 1
    assert choose_data_rank([2, 2, 3], {0: 0, 1: 0, 2: 48}.__getitem__, slack=0) == 0


def test_shared_prefix_requests_stay_together_until_the_slack_runs_out():
    managers = [manager(), manager()]
    loads = [0, 0]
    placed = []
    system = list(range(32))
    for i in range(4):
        r = request(f"r{i}", system + [100 + i] * 5)
        rank = choose_data_rank(
            loads, lambda k, r=r: managers[k].get_num_cached_prefix_tokens(r), 1
        )
        blocks, hits, _ = managers[rank].get_computed_blocks(r)
        assert managers[rank].allocate_slots(r, r.num_tokens - hits, hits, blocks) is not None
        loads[rank] += 1
        placed.append((rank, hits))
    # r0 -> rank 0 (no hits anywhere); r1 follows the prefix; r2 would make rank 0 two
    # busier than rank 1, so it goes there (and caches the prefix there); r3 hits on both,
    # so the less loaded one takes it.
    assert placed == [(0, 0), (0, 32), (1, 0), (1, 32)]
