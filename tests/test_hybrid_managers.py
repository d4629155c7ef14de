"""Per-type managers and the hybrid coordinator (SPEC §5, hybrid models), exact numbers."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import (
    BlockPool,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheBlockCopy,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    MultiModalFeatureSpec,
    Request,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.hashing import make_block_hash_with_group_id
from jaxkv.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from jaxkv.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    _rightmost_aligned_run,
    _rightmost_run,
)

SHA = get_hash_fn_by_name("sha256_cbor")
pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def full(bs=16):
    return FullAttentionSpec(bs, 2, 8, "float32")


def sw(window, bs=16):
    return SlidingWindowSpec(bs, 2, 8, "float32", sliding_window=window)


def chunked(chunk, bs=16):
    return ChunkedLocalAttentionSpec(bs, 2, 8, "float32", attention_chunk_size=chunk)


def mamba(bs=16, mode="align"):
    return MambaSpec(bs, shapes=((4, 8),), dtypes=("float32",), mamba_cache_mode=mode)


def manager_for(*specs, num_blocks=64, max_model_len=256, **kwargs) -> KVCacheManager:
    config = KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks)
    return KVCacheManager(config, max_model_len, **kwargs)


def request(rid, tokens, hash_block_size=16) -> Request:
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(hash_block_size, SHA))


def computed(m: KVCacheManager, req: Request):
    result = m.get_computed_blocks(req)
    return result[0], result[1]


def schedule(m: KVCacheManager, req: Request, num_new: int | None = None):
    """One scheduling step (a hit on first scheduling); returns (hit tokens, new ids per group)."""
    hits, num_hit = (None, 0)
    if req.num_computed_tokens == 0:
        hits, num_hit = computed(m, req)
    if num_new is None:
        num_new = req.num_tokens - req.num_computed_tokens - num_hit
    new = m.allocate_slots(req, num_new, num_hit, hits)
    if new is None:
        return num_hit, None
    req.num_computed_tokens += num_hit + num_new
    return num_hit, new.get_block_ids()


def ids(m, rid):
    return m.get_block_ids(rid)


def block_keys(pool: BlockPool, block) -> set:
    """Every prefix-cache key of `block`: its own and the further (partial) ones."""
    keys = {
        make_block_hash_with_group_id(h, g) for h, g in pool._secondary_keys.get(block.block_id, ())
    }
    if block.block_hash is not None:
        keys.add(block.block_hash)
    return keys


def check_invariants(m: KVCacheManager) -> None:
    """Per group and over the pool: ref counts (the requests' tables plus both endpoints
    of every copy not yet taken), free queue, no block in two groups, every key names a
    block holding it."""
    pool = m.block_pool
    holders: dict[int, set[int]] = {}
    refs: dict[int, int] = {}
    for manager in m.coordinator.single_type_managers:
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                if b.is_null:
                    continue
                holders.setdefault(b.block_id, set()).add(manager.kv_cache_group_id)
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for pair in manager._pending_cow_copies:
            for b in pair:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for rid, (block_idx, source) in manager._partial_hit_reqs.items():
            assert manager.req_to_blocks[rid][block_idx] is source  # still to be copied
    assert all(len(g) == 1 for g in holders.values()), holders
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert (block.block_id in free) == (block.ref_cnt == 0)
    assert pool.get_num_free_blocks() == len(free)
    for key, blocks in pool.cached_block_hash_to_block.items():
        for b in blocks:
            assert key in block_keys(pool, b)


# -- sliding window ------------------------------------------------------------


def cached_pool(pattern, group_ids=(0,), num_blocks=32):
    """A pool where hash i is cached (in every group) iff pattern[i]; returns (pool, hashes)."""
    pool = BlockPool(num_blocks, True, 2)
    hashes = [bytes([i + 1]) * 8 for i in range(len(pattern))]
    next_id = 1
    for i, hit in enumerate(pattern):
        if hit:
            for g in group_ids:
                block = pool.blocks[next_id]
                next_id += 1
                block._block_hash, block._group_id = hashes[i], g
                pool.cached_block_hash_to_block.insert(hashes[i], g, block)
    return pool, hashes


def hit_ids(blocks):
    return [b.block_id for b in blocks[0]]


@pytest.mark.parametrize(
    "pattern, max_length, expect_len, expect_ids",
    [
        # window 4, block 2: a hit needs ceil(3 / 2) = 2 contiguous blocks ending at it.
        ([1, 1, 0, 0, 1, 1, 1, 0], 16, 14, [0, 0, 0, 0, 0, 4, 5]),
        ([1, 1, 0, 0, 1, 1, 1, 0], 10, 4, [1, 2]),  # the run at 8..10 is too short
        ([1, 0, 1, 0, 1, 0, 1, 0], 16, 2, [1]),  # no run of 2: only the run from the start
        ([0, 1, 1, 1, 1, 0], 12, 10, [0, 0, 0, 3, 4]),
        ([0, 0, 0, 0], 8, 0, []),
        ([1, 1, 1, 1], 7, 6, [0, 2, 3]),  # max_length cuts a block off
    ],
)
def test_sliding_window_hits(pattern, max_length, expect_len, expect_ids):
    pool, hashes = cached_pool(pattern)
    spec = SlidingWindowSpec(2, 1, 4, "float32", sliding_window=4)
    blocks, length = SlidingWindowManager.find_longest_cache_hit(
        hashes, max_length, [0], pool, spec, False, 2
    )
    assert (length, hit_ids(blocks)) == (expect_len, expect_ids)


def test_sliding_window_hit_with_eagle_and_alignment():
    pool, hashes = cached_pool([1, 1, 0, 0, 1, 1, 1, 0])
    spec = SlidingWindowSpec(2, 1, 4, "float32", sliding_window=4)
    # EAGLE: 3 contiguous blocks, the last dropped.
    blocks, length = SlidingWindowManager.find_longest_cache_hit(
        hashes, 16, [0], pool, spec, True, 2
    )
    assert (length, hit_ids(blocks)) == (12, [0, 0, 0, 0, 3, 4])
    # Alignment 4 tokens: the run must end on an even block boundary.
    blocks, length = SlidingWindowManager.find_longest_cache_hit(
        hashes, 16, [0], pool, spec, False, 4
    )
    assert (length, hit_ids(blocks)) == (12, [0, 0, 0, 0, 3, 4])


def test_sliding_window_releases_blocks_as_tokens_grow():
    m = manager_for(sw(32, bs=8), num_blocks=20, max_model_len=128)
    req = request("a", range(40), hash_block_size=8)
    assert schedule(m, req) == (0, ([1, 2, 3, 4, 5],))
    # Next token at 40 reads 9..40: tokens 0..8 are out -> block 0 becomes null.
    for _ in range(3):
        req.append_output_token_ids(7)
        assert schedule(m, req, 1)[1] is not None
    assert ids(m, "a") == ([0, 2, 3, 4, 5, 6],)
    # The released block is cached: it goes to the back of the free queue, still a hit.
    assert m.block_pool.blocks[1].ref_cnt == 0 and m.block_pool.blocks[1].block_hash is not None
    for _ in range(10):
        req.append_output_token_ids(7)
        schedule(m, req, 1)
    # 53 tokens computed: 53 - 32 + 1 = 22 skipped -> blocks 0, 1 are null.
    assert ids(m, "a")[0][:3] == [0, 0, 3]
    check_invariants(m)
    m.free(req)
    check_invariants(m)
    assert m.num_free_blocks == 19


def test_released_window_block_counts_as_free_for_the_allocation_check():
    # 6 usable blocks; window 8 at block 4: a request holds at most ceil(7/4)+1 real blocks.
    m = manager_for(sw(8, bs=4), num_blocks=7, max_model_len=64)
    req = request("a", range(24), hash_block_size=4)
    assert schedule(m, req) == (0, ([1, 2, 3, 4, 5, 6],))
    req.append_output_token_ids(1)
    # The pool is empty, but 24 - 8 + 1 = 17 tokens left the window: 4 blocks are
    # released (tail first, still cached) and the decode step takes one of them.
    assert m.num_free_blocks == 0
    assert schedule(m, req, 1) == (0, ([4],))
    assert ids(m, "a") == ([0, 0, 0, 0, 5, 6, 4],)
    check_invariants(m)


# -- chunked local ----------------------------------------------------------------


def test_chunked_local_hits_and_release():
    pool, hashes = cached_pool([1, 1, 1, 1, 1, 0, 1, 1])
    spec = ChunkedLocalAttentionSpec(2, 1, 4, "float32", attention_chunk_size=4)
    find = ChunkedLocalAttentionManager.find_longest_cache_hit
    # max 15: chunk [12, 16) -> blocks 0..5 null, look up block 6 (cached).
    blocks, length = find(hashes, 15, [0], pool, spec, False, 2)
    assert (length, hit_ids(blocks)) == (14, [0, 0, 0, 0, 0, 0, 6])
    # max 11: chunk [8, 12) -> blocks 0..3 null, block 4 cached, block 5 not.
    blocks, length = find(hashes, 11, [0], pool, spec, False, 2)
    assert (length, hit_ids(blocks)) == (10, [0, 0, 0, 0, 5])
    # max 16: the next token starts a chunk: everything is outside it.
    blocks, length = find(hashes, 16, [0], pool, spec, False, 2)
    assert (length, hit_ids(blocks)) == (16, [0] * 8)
    m = manager_for(chunked(16, bs=8), num_blocks=20, max_model_len=128)
    req = request("a", range(30), hash_block_size=8)
    # A pure chunked-local model: the tokens before the current chunk are never read.
    assert schedule(m, req) == (16, ([1, 2],))
    assert ids(m, "a") == ([0, 0, 1, 2],)
    for _ in range(3):
        req.append_output_token_ids(1)
        schedule(m, req, 1)
    # 32 computed: the next token starts chunk [32, 48); blocks 2, 3 are released.
    assert ids(m, "a") == ([0, 0, 0, 0, 3],)
    check_invariants(m)


# -- mamba ----------------------------------------------------------------------


def test_mamba_last_state_hits_and_align_caching():
    m = manager_for(full(), mamba(), num_blocks=40)
    a = request("a", range(70))
    assert schedule(m, a, 32) == (0, ([1, 2], [3]))  # state at 32: one block, nulls before
    assert ids(m, "a") == ([1, 2], [0, 3])
    assert m.block_pool.blocks[3].block_hash is not None  # state landed on a boundary
    assert schedule(m, a, 38)[1] == ([4, 5, 6], [7])  # state at 70, mid-block
    assert ids(m, "a") == ([1, 2, 4, 5, 6], [0, 3, 0, 0, 7])
    assert m.block_pool.blocks[7].block_hash is None  # a mid-block state is never cached
    a.append_output_token_ids(1)
    schedule(m, a, 1)  # the state block before the current one is released
    assert ids(m, "a")[1] == [0, 0, 0, 0, 7]
    b = request("b", [*range(64), 9, 9])
    blocks, num_hit = computed(m, b)
    # Full attention could serve 64, Mamba has a state only at 32.
    assert num_hit == 32 and blocks.get_block_ids() == ([1, 2], [0, 3])
    check_invariants(m)


def test_mamba_coarser_block_hits_at_hash_units_with_copy_on_write():
    # Mamba block 32, attention 16, hashed per 16: partial (sub-block) hits are on, as in
    # vLLM; a hit inside a Mamba block is served from a private copy of its state.
    m = manager_for(full(16), mamba(32), num_blocks=40)
    coordinator = m.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert coordinator.enable_partial_hash_hits
    assert coordinator.cache_hit_alignment_tokens == 16 and m.hash_block_size == 16
    a = request("a", range(64))
    # The step ends at 48, the prompt's last hit boundary: the running state (block 4)
    # is keyed there (the partial tail).
    assert schedule(m, a, 48) == (0, ([1, 2, 3], [4]))
    assert m.take_kv_cache_block_copies() == ([], [])
    # Its next step keeps updating block 4, so the key moves to a copy (block 6).
    assert schedule(m, a, 16) == (0, ([5], []))
    copies, retained = m.take_kv_cache_block_copies()
    assert copies == [KVCacheBlockCopy(4, 6)] and [b.block_id for b in retained] == [4, 6]
    assert [b.ref_cnt for b in retained] == [2, 1]  # a's reference + the retained ones
    m.block_pool.free_blocks(retained)  # the copy ran
    assert m.block_pool.blocks[6].ref_cnt == 0 and m.block_pool.blocks[6].block_hash
    blocks, num_hit = computed(m, request("b", [*range(64), 5]))
    assert num_hit == 64 and blocks.get_block_ids() == ([1, 2, 3, 5], [0, 4])
    c = request("c", [*range(56), 5])
    blocks, num_hit = computed(m, c)
    assert num_hit == 48 and blocks.get_block_ids() == ([1, 2, 3], [0, 6])
    # c's hit ends inside Mamba block 1: block 6 is copied to c's private block 8.
    assert schedule(m, c) == (48, ([7], [8]))
    assert ids(m, "c") == ([1, 2, 3, 7], [0, 8])
    copies, retained = m.take_kv_cache_block_copies()
    assert copies == [KVCacheBlockCopy(6, 8)] and [b.ref_cnt for b in retained] == [1, 2]
    m.block_pool.free_blocks(retained)
    check_invariants(m)
    m.free(a)
    m.free(c)
    assert m.block_pool.get_num_free_blocks() == 39


def test_mamba_fine_grained_finder_hits_at_hash_units():
    pool, hashes = cached_pool([1, 0, 1, 1, 0, 1, 0, 0])
    spec = MambaSpec(8, shapes=((2,),), dtypes=("float32",), mamba_cache_mode="align")
    # Hash unit 2 inside Mamba block 8: the last cached state at or below the candidate.
    blocks, length = MambaManager.find_longest_cache_hit(hashes, 16, [0], pool, spec, False, 2)
    assert (length, hit_ids(blocks)) == (12, [0, 4])  # hash unit 5 ends at 12, in block 1
    blocks, length = MambaManager.find_longest_cache_hit(hashes, 9, [0], pool, spec, False, 2)
    assert (length, hit_ids(blocks)) == (8, [3])
    # Block granularity: block i is hash unit 4i + 3 (cached for block 0, not block 1).
    blocks, length = MambaManager.find_longest_cache_hit(hashes, 16, [0], pool, spec, False, 8)
    assert (length, hit_ids(blocks)) == (8, [3])
    partial = get_kv_cache_coordinator(
        KVCacheConfig.from_groups([(full(16), ("a",)), (mamba(32), ("b",))], 8),
        64,
        True,
        32,
        16,
        allow_partial_hash_hits=True,
    )
    assert partial.enable_partial_hash_hits and partial.cache_hit_alignment_tokens == 16


def test_mamba_none_mode_rejects_caching():
    with pytest.raises(ValueError, match="mamba_cache_mode='align' or 'all'"):
        manager_for(full(), mamba(mode="none"))
    m = manager_for(full(), mamba(mode="none"), enable_caching=False)
    a = request("a", range(40))
    assert schedule(m, a) == (0, ([1, 2, 3], [4]))
    assert ids(m, "a") == ([1, 2, 3], [0, 0, 4])


# -- cross attention -------------------------------------------------------------


def test_cross_attention_fixed_allocation_never_cached():
    config = KVCacheConfig.from_groups(
        [(full(), ("self",)), (CrossAttentionSpec(16, 2, 8, "float32"), ("cross",))], 40
    )
    coordinator = get_kv_cache_coordinator(config, 256, True, 16, 16)
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [g.group_ids for g in coordinator.attention_groups] == [[0]]
    empty = ((), ())
    assert coordinator.get_num_blocks_to_allocate("a", 20, empty, num_encoder_tokens=100) == 2 + 7
    new = coordinator.allocate_new_blocks("a", 20, num_encoder_tokens=100)
    assert [[b.block_id for b in g] for g in new] == [[1, 2], list(range(3, 10))]
    # Decoding never adds cross-attention blocks.
    assert coordinator.get_num_blocks_to_allocate("a", 40, empty, num_encoder_tokens=100) == 1


# -- hybrid coordinator ------------------------------------------------------------


def test_full_and_two_sliding_windows_share_a_48_token_prefix():
    m = manager_for(full(), sw(16), sw(32), num_blocks=64)
    a = request("a", range(60))
    assert schedule(m, a) == (0, ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]))
    b = request("b", [*range(48), 100, 101, 102])
    blocks, num_hit = computed(m, b)
    # window 16 needs 1 block ending at 48, window 32 needs 2: the rest are null.
    assert num_hit == 48
    assert blocks.get_block_ids() == ([1, 2, 3], [0, 0, 7], [0, 10, 11])
    assert schedule(m, b)[1] == ([13], [14], [15])
    assert ids(m, "b") == ([1, 2, 3, 13], [0, 0, 7, 14], [0, 10, 11, 15])
    check_invariants(m)


def test_full_block_32_with_sliding_block_16_hits_on_the_32_grid():
    m = manager_for(full(32), sw(32, bs=16), num_blocks=64)
    assert m.scheduler_block_size == 32 and m.hash_block_size == 16
    a = request("a", range(100))
    schedule(m, a)
    # 50 shared: the sliding group alone could serve 48; hits stay on the 32 grid.
    for shared, expect in ((80, 64), (50, 32), (63, 32), (64, 64), (65, 64), (31, 0)):
        b = request(f"b{shared}", [*range(shared), 999, 998])
        _, num_hit = computed(m, b)
        assert num_hit == expect, shared
    check_invariants(m)


def test_evicting_one_groups_block_shrinks_every_groups_hit():
    m = manager_for(full(), sw(32), num_blocks=64)
    a = request("a", range(80))
    schedule(m, a)
    b_tokens = [*range(64), 7, 7]
    assert computed(m, request("b", b_tokens))[1] == 64
    sw_blocks = ids(m, "a")[1]
    m.evict_blocks([sw_blocks[2]])  # the sliding group's block for tokens 32..47
    blocks, num_hit = computed(m, request("b", b_tokens))
    # Window 32 needs 2 contiguous blocks ending at the hit: 64 breaks, 32 works.
    assert num_hit == 32
    assert blocks.get_block_ids() == (ids(m, "a")[0][:2], sw_blocks[:2])
    m.evict_blocks([ids(m, "a")[0][0]])  # a full-attention block: nothing hits
    assert computed(m, request("b", b_tokens))[1] == 0


MIX_SPECS = {
    "full": lambda: full(),
    "sw": lambda: sw(64),
    "chunked": lambda: chunked(64),
    "mamba": lambda: mamba(),
}


@pytest.mark.parametrize(
    "mix",
    [c for n in (2, 3, 4) for c in itertools.combinations_with_replacement(MIX_SPECS, n)],
    ids="-".join,
)
def test_every_mix_fully_hits_a_shared_prefix_shorter_than_every_window(mix):
    specs = [MIX_SPECS[name]() for name in mix]
    m = manager_for(*specs, num_blocks=80)
    a = request("a", [*range(32), *[5] * 10])
    schedule(m, a, 32)  # a chunk ending on the prefix: Mamba keeps a state there
    schedule(m, a)
    b = request("b", [*range(32), 9, 9, 9, 9, 9])
    blocks, num_hit = computed(m, b)
    assert num_hit == 32
    schedule(m, b)
    check_invariants(m)
    for r in (a, b):
        m.free(r)
    check_invariants(m)
    assert m.num_free_blocks == 79


def test_failed_allocation_leaves_no_group_half_allocated():
    m = manager_for(full(), sw(32), num_blocks=9)
    a = request("a", range(40))
    schedule(m, a)  # 3 + 3 blocks
    before = [list(g) for g in ids(m, "a")], m.num_free_blocks
    big = request("big", range(100, 140))
    assert schedule(m, big) == (0, None)
    assert [list(g) for g in ids(m, "a")] == before[0] and m.num_free_blocks == before[1]
    assert ids(m, "big") == ([], [])
    check_invariants(m)


def test_coordinator_choice_and_bad_block_sizes():
    one = KVCacheConfig.single_group(full(), 8)
    two = KVCacheConfig.from_groups([(full(), ("a",)), (sw(32), ("b",))], 8)
    assert type(get_kv_cache_coordinator(one, 64, True, 16, 16)) is UnitaryKVCacheCoordinator
    assert type(get_kv_cache_coordinator(two, 64, True, 16, 16)) is HybridKVCacheCoordinator
    no_cache = get_kv_cache_coordinator(two, 64, False, 16, 16)
    assert type(no_cache) is KVCacheCoordinatorNoPrefixCache
    assert no_cache.find_longest_cache_hit([b"x"] * 4, 64) == (([], []), 0, 0)
    with pytest.raises(
        ValueError, match="scheduler_block_size \\(24\\) must be a positive multiple"
    ):
        get_kv_cache_coordinator(two, 64, True, 24, 8)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval \\(24\\)"):
        three = KVCacheConfig.from_groups([(full(), ("a",)), (sw(32), ("b",))], 8, 24)
        get_kv_cache_coordinator(three, 64, True, 16, 16)
    with pytest.raises(ValueError, match="no sliding-window or Mamba"):
        four = KVCacheConfig.from_groups([(full(), ("a",)), (full(32), ("b",))], 8, 32)
        get_kv_cache_coordinator(four, 64, True, 32, 16)


def test_mamba_manager_is_the_spec_manager():
    m = manager_for(full(), mamba(), sw(32))
    kinds = [type(s) for s in m.coordinator.single_type_managers]
    assert kinds[1] is MambaManager and kinds[2] is SlidingWindowManager


# -- events -----------------------------------------------------------------------


def test_hybrid_events_name_their_group_kind_window_and_untagged_extra_keys():
    m = manager_for(full(8), sw(4, bs=4), num_blocks=40, enable_kv_cache_events=True)
    assert (m.scheduler_block_size, m.hash_block_size) == (8, 4)
    image = MultiModalFeatureSpec("img0", offset=6, length=4)
    req = Request(
        "a",
        list(range(20)),
        block_hasher=get_request_block_hasher(4, SHA),
        mm_features=[image],
        cache_salt="salt",
    )
    schedule(m, req)
    events = m.take_events()
    assert [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", 4),
    ]
    full_event, sw_event = events
    hashes = req.block_hashes
    # 16 tokens are on the scheduler grid: two 8-token blocks, keyed by their last hash unit.
    assert full_event.block_hashes == [hashes[1], hashes[3]] and full_event.block_size == 8
    # Untagged extra keys: the salt bare, the image as (identifier, offset in the block).
    assert full_event.extra_keys == [(("img0", 6), "salt"), (("img0", -2),)]
    assert full_event.token_ids == list(range(16)) and full_event.lora_name is None
    # The window (4 tokens) needs 1 block ending on the 8 grid: only blocks 1 and 3 are cached.
    assert sw_event.block_hashes == [hashes[1], hashes[3]] and sw_event.block_size == 4
    assert sw_event.extra_keys == [(("img0", 2),), None]
    assert m.take_events() == []


def test_a_partial_tail_evicted_while_held_is_keyed_again_at_the_next_step():
    """As vLLM, which keys a prompt's partial tail at every caching step: after
    `evict_blocks` drops it from a block its request still holds, the request's next step
    keys it again (a `BlockStored`); an evicted full block stays uncached."""
    m = manager_for(full(8), sw(4, bs=4), num_blocks=40, enable_kv_cache_events=True)
    pool = m.block_pool
    a = request("a", range(14), hash_block_size=4)  # the prompt's tail boundary: 12
    schedule(m, a)
    for _ in range(2):  # 16 tokens: on the scheduler grid, block 1 is full
        a.append_output_token_ids(7)
        schedule(m, a, 1)
    (first, tail), _ = ids(m, "a")
    hashes = a.block_hashes
    key12 = make_block_hash_with_group_id(hashes[2], 0)
    assert pool.blocks[tail].block_hash == make_block_hash_with_group_id(hashes[3], 0)
    assert pool.get_one_block(key12) is pool.blocks[tail]  # the tail: a further key
    m.take_events()
    m.evict_blocks([first, tail])
    assert pool.get_one_block(key12) is None
    # Block by block, each block's own key before its further one.
    assert [e.block_hashes for e in m.take_events() if e.group_idx == 0] == [
        [hashes[1]],
        [hashes[3]],
        [hashes[2]],
    ]
    a.append_output_token_ids(7)
    schedule(m, a, 1)  # a decode step: no block fills up
    assert pool.get_one_block(key12) is pool.blocks[tail]
    assert pool.partial_entry_tokens(pool.blocks[tail]) == 12
    assert pool.blocks[first].block_hash is None  # its index was cached: not again
    (event,) = m.take_events()
    assert (event.block_hashes, event.parent_block_hash) == ([hashes[2]], hashes[1])
    assert (event.token_ids, event.block_size, event.group_idx) == ([8, 9, 10, 11], 4, 0)
    a.append_output_token_ids(7)
    schedule(m, a, 1)
    assert m.take_events() == []  # keyed once
    check_invariants(m)


def test_shared_prefix_boundary_names_the_prefix_a_lagging_group_lacks():
    m = manager_for(full(), sw(32), num_blocks=40)
    a = request("a", range(64))
    schedule(m, a)
    m.evict_blocks(ids(m, "a")[1])  # the sliding group's copies are gone, full attention's stay
    b = request("b", [*range(64), 7])
    blocks, num_hit, boundary = m.get_computed_blocks(b)
    # Full attention could serve 64 tokens, the sliding group none: hit 0, junction at 64.
    assert (num_hit, boundary) == (0, 64)
    schedule(m, request("c", range(64)))  # c hits nothing, computes all, caches the window
    assert m.get_computed_blocks(request("d", [*range(64), 7]))[1:] == (64, 0)


def test_cross_attention_through_the_manager():
    config = KVCacheConfig.from_groups(
        [(full(), ("self",)), (CrossAttentionSpec(16, 2, 8, "float32"), ("cross",))], 40
    )
    m = KVCacheManager(config, 256)
    a = request("a", range(20))
    new = m.allocate_slots(a, 20, num_encoder_tokens=100)
    assert new.get_block_ids() == ([1, 2], list(range(3, 10)))
    a.num_computed_tokens = 20
    a.append_output_token_ids(5)
    assert m.allocate_slots(a, 1, num_encoder_tokens=100).get_block_ids() == ([], [])
    blocks, num_hit, _ = m.get_computed_blocks(request("b", [*range(20), 3]))
    assert num_hit == 16 and blocks.get_block_ids() == ([1], [])
    with pytest.raises(ValueError, match="num_encoder_tokens must be >= 0"):
        m.allocate_slots(request("c", range(4)), 4, num_encoder_tokens=-1)
    m.free(a)
    assert m.num_free_blocks == 39


def test_eagle_drops_the_last_matched_block():
    m = manager_for(full(), sw(32), num_blocks=40, use_eagle=True)
    a = request("a", range(64))
    schedule(m, a)
    # 64 shared tokens: the last matched 16-token block is recomputed for EAGLE.
    assert computed(m, request("b", [*range(64), 7]))[1] == 48


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 8), st.booleans())
def test_gap_by_gap_run_search_equals_the_block_by_block_scan(is_cached, need, eagle):
    """On the block grid the sliding-window hit run found gap by gap is the scan's."""
    cached = [object() if c else None for c in is_cached]
    expected = _rightmost_aligned_run(cached, need, 16, 16, eagle)
    assert _rightmost_run(cached, need) == expected
    start, end = expected
    assert all(c is not None for c in cached[start:end])
    assert end - start == need or start == 0


def test_patching_a_base_class_method_reaches_every_subclass():
    """A method the per-type managers inherit is looked up on the base class, so
    `mock.patch.object(SingleTypeKVCacheManager, ...)` sees every group's calls."""
    calls = []
    original = SingleTypeKVCacheManager.allocate_new_blocks

    def spy(self, *args, **kwargs):
        calls.append(type(self))
        return original(self, *args, **kwargs)

    m = manager_for(full(), sw(32), num_blocks=32)
    with mock.patch.object(SingleTypeKVCacheManager, "allocate_new_blocks", spy):
        assert m.allocate_slots(request("a", range(40)), 40) is not None
    assert calls == [FullAttentionManager, SlidingWindowManager]
    m.free(request("a", range(40)))
