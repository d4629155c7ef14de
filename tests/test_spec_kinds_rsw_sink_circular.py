"""vLLM's remaining spec kinds, exact numbers: R-SWA (`RSWASpec`), full attention
with static sinks (`SinkFullAttentionSpec`) and the circular buffer (`CircularBufferSpec`).
"""

from __future__ import annotations

import pytest

from jaxkv import (
    BlockPool,
    BlockStored,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    KVCacheSpecKind,
    Request,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_hash_fn_by_name,
    get_kv_cache_capacity,
    get_kv_cache_config,
    get_request_block_hasher,
)
from jaxkv.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from jaxkv.kv_cache_interface import (
    SpecMergeError,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from jaxkv.single_type_kv_cache_manager import (
    CircularBufferManager,
    RSWAManager,
    SinkFullAttentionManager,
    get_manager_for_kv_cache_spec,
    manager_class_for_spec,
)

SHA = get_hash_fn_by_name("sha256_cbor")
pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def rswa(window=8, bs=4, heads=1):
    return RSWASpec(bs, heads, 4, "float32", rswa_window=window)


def sink(sink_len=4, bs=4):
    return SinkFullAttentionSpec(bs, 1, 4, "float32", sink_len=sink_len)


def ring(bs=4):
    return CircularBufferSpec(bs, 1, 4, "float32")


def full(bs=4):
    return FullAttentionSpec(bs, 1, 4, "float32")


def manager_for(*specs, num_blocks=32, max_model_len=64, **kwargs) -> KVCacheManager:
    config = KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks)
    return KVCacheManager(config, max_model_len, **kwargs)


def request(rid, tokens, hash_block_size=4) -> Request:
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(hash_block_size, SHA))


def admit(m: KVCacheManager, req: Request) -> tuple[int, tuple[list[int], ...] | None]:
    """First scheduling of the whole prompt with its hit; (hit tokens, new ids per group)."""
    hits, num_hit = m.get_computed_blocks(req)[:2]
    new = m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if new is None:
        return num_hit, None
    req.num_computed_tokens = req.num_tokens
    return num_hit, new.get_block_ids()


def decode(m: KVCacheManager, req: Request, token=7) -> tuple[list[int], ...] | None:
    req.append_output_token_ids(token)
    new = m.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
        return new.get_block_ids()
    return None


# -- specs ---------------------------------------------------------------------


def test_rswa_spec_is_full_attention_with_a_decode_window():
    spec = RSWASpec(16, 2, 8, "float32", rswa_window=32)
    assert spec.kind is KVCacheSpecKind.FULL_ATTENTION  # as vLLM reports it
    assert spec.rswa_window == 32
    assert spec.page_size_bytes == 16 * 2 * (8 + 8) * 4 == 2048
    # Sized as full attention: the whole prompt may stay.
    assert spec.max_memory_usage_bytes(1000, 64) == 63 * 2048
    assert spec.max_num_blocks_per_req(1000, 64) == 63
    assert spec.prefix_cacheable
    assert get_kv_cache_spec_sliding_window(spec) is None
    assert RSWASpec.merge([spec, RSWASpec(16, 2, 8, "float32", rswa_window=32)]) == spec


@pytest.mark.parametrize("window", [0, -8])
def test_rswa_window_must_be_positive(window):
    with pytest.raises(ValueError, match=rf"RSWASpec: rswa_window must be a positive.*{window}"):
        rswa(window)


def test_rswa_spec_bad_input():
    with pytest.raises(TypeError, match="rswa_window"):
        RSWASpec(16, 2, 8, "float32")  # required
    with pytest.raises(TypeError, match="rswa_window"):
        rswa("8")
    with pytest.raises(SpecMergeError, match=r"share rswa_window, got \[8, 16\]"):
        RSWASpec.merge([rswa(8), rswa(16)])
    with pytest.raises(SpecMergeError, match="every layer must be an RSWASpec"):
        RSWASpec.merge([rswa(8), full()])
    # vLLM's FullAttentionSpec.merge would fold them into plain full attention.
    for mixed in ([full(), rswa(8)], [full(), sink(4)], [sink(4), rswa(8)]):
        with pytest.raises(SpecMergeError, match="merge only with their own kind"):
            FullAttentionSpec.merge(mixed)
    with pytest.raises(SpecMergeError, match="same attention spec"):
        RSWASpec.merge([rswa(8), rswa(8, heads=2)])


def test_sink_spec():
    spec = SinkFullAttentionSpec(16, 1, 64, "float32", sink_len=4)  # vLLM's own test's spec
    assert spec.kind is KVCacheSpecKind.SINK_FULL_ATTENTION
    assert get_kv_cache_spec_kind(spec) == "sink_full_attention"
    assert spec.page_size_bytes == 16 * 1 * 128 * 4
    assert spec.max_memory_usage_bytes(100, 8) == 7 * spec.page_size_bytes
    assert SinkFullAttentionSpec(16, 1, 64, "float32").sink_len is None  # vLLM's default
    # Full and sink layers together: vLLM reports the group as full attention.
    mixed = UniformTypeKVCacheSpecs(16, {"a": FullAttentionSpec(16, 1, 64, "float32"), "b": spec})
    assert mixed.kind is KVCacheSpecKind.FULL_ATTENTION
    assert SinkFullAttentionSpec.merge([spec, spec]) == spec
    with pytest.raises(ValueError, match="sink_len must be a positive integer, got 0"):
        sink(0)
    with pytest.raises(SpecMergeError, match=r"share sink_len, got \[4, 8\]"):
        SinkFullAttentionSpec.merge([sink(4), sink(8)])
    with pytest.raises(SpecMergeError, match="every layer must be a SinkFullAttentionSpec"):
        SinkFullAttentionSpec.merge([sink(4), full()])


def test_circular_buffer_spec_holds_one_page_per_request():
    spec = CircularBufferSpec(4, 1, 8, "float16")
    assert spec.kind is KVCacheSpecKind.UNKNOWN  # as vLLM reports it
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    assert spec.page_size_bytes == 4 * 1 * 16 * 2 == 128
    for max_model_len in (1, 100, 1 << 20):
        assert spec.max_memory_usage_bytes(max_model_len, 64) == 128
        assert spec.max_num_blocks_per_req(max_model_len, 64) == 1


def test_uniform_groups_of_the_new_kinds_need_equal_parameters():
    assert UniformTypeKVCacheSpecs.from_specs({"a": rswa(8), "b": rswa(8, heads=2)}) is not None
    assert UniformTypeKVCacheSpecs.from_specs({"a": rswa(8), "b": rswa(16)}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": sink(4), "b": sink(8)}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": rswa(8), "b": full()}) is None


# -- managers and coordinators -------------------------------------------------


def test_manager_classes():
    assert manager_class_for_spec(rswa()) is RSWAManager
    assert manager_class_for_spec(sink()) is SinkFullAttentionManager
    assert manager_class_for_spec(ring()) is CircularBufferManager
    uniform = UniformTypeKVCacheSpecs(4, {"a": rswa(8), "b": rswa(8, heads=2)})
    assert manager_class_for_spec(uniform) is RSWAManager
    pool = BlockPool(8, True, 4)
    manager = get_manager_for_kv_cache_spec(
        ring(), 64, 64, block_pool=pool, enable_caching=True, kv_cache_group_id=0
    )
    assert type(manager) is CircularBufferManager
    assert manager.max_admission_blocks_per_request is None


@pytest.mark.parametrize(
    "spec, match",
    [
        (sink(None), "sink_len=None must be a positive multiple of the block size"),
        (sink(6), r"sink_len=6 must be a positive multiple of the block size \(4\)"),
    ],
)
def test_sink_manager_needs_whole_sink_blocks(spec, match):
    with pytest.raises(ValueError, match=match):
        manager_for(spec)


def test_rswa_releases_the_gap_between_prompt_and_window():
    m = manager_for(rswa(window=8))
    assert isinstance(m.coordinator, UnitaryKVCacheCoordinator)
    a = request("a", range(10))  # the prompt's blocks: 0..2 (block 2 holds tokens 8..11)
    assert admit(m, a) == (0, ([1, 2, 3],))
    assert m.num_free_blocks == 28
    tables = {}
    for _ in range(20):
        computed = a.num_computed_tokens
        decode(m, a)
        tables[computed] = (m.get_block_ids("a")[0], m.num_free_blocks)
    assert tables[23] == ([1, 2, 3, 4, 5, 6], 25)
    # Computing token 25 (24 computed): the window starts at 16, so block 3 (tokens
    # 12..15) is wholly in the gap and released; block 2 holds prompt tokens: kept.
    assert tables[24] == ([1, 2, 3, 0, 5, 6, 7], 25)
    assert tables[27] == ([1, 2, 3, 0, 5, 6, 7], 25)
    assert tables[28] == ([1, 2, 3, 0, 0, 6, 7, 8], 25)
    # The released blocks keep their hashes: a later request can still hit them.
    assert m.block_pool.blocks[4].block_hash is not None
    assert m.block_pool.blocks[4].ref_cnt == 0
    # Allocation counts null slots as held: the next block is one block.
    assert m.coordinator.get_num_blocks_to_allocate("a", a.num_computed_tokens + 4, ((),)) == 1
    # Cascade attention's common prefix stops at the gap.
    assert m.get_num_common_prefix_blocks("a") == [3]
    m.free(a)
    assert m.num_free_blocks == 31


def test_rswa_manager_gap_range():
    """vLLM's rule on the manager itself: without `num_prompt_tokens` nothing goes; the
    gap's blocks go tail first, the walk stopping at the first null block."""
    pool = BlockPool(16, True, 4)
    manager = RSWAManager(rswa(window=8), pool, True, 0)
    blocks = pool.get_new_blocks(10)
    manager.req_to_blocks["r"] = list(blocks)
    manager.num_cached_block["r"] = 0
    manager.remove_skipped_blocks("r", 28)
    assert [b.block_id for b in manager.req_to_blocks["r"]] == list(range(1, 11))
    manager.remove_skipped_blocks("r", 28, num_prompt_tokens=16)  # gap [16, 20): block 4
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [1, 2, 3, 4, 0, 6, 7, 8, 9, 10]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:1] == [5]
    assert manager.get_slot_state("r")[2] == 6 * 4 + 8  # block 5 leaves at 32 computed
    manager.remove_skipped_blocks("r", 36, num_prompt_tokens=16)  # gap [16, 28)
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [1, 2, 3, 4, 0, 0, 0, 8, 9, 10]
    # Tail first: block 7 (tokens 24..27) is evicted before block 6.
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:3] == [7, 6, 5]
    manager.free("r")
    assert pool.get_num_free_blocks() == 15 and not manager._gap_end


def test_rswa_release_is_the_same_with_and_without_the_slot_state():
    """The fast path skips steps only below the next release (`get_slot_state`)."""
    results = []
    for use_slot_state in (True, False):
        m = manager_for(rswa(window=5), full())
        m._use_slot_state = use_slot_state
        a = request("a", range(6))
        admit(m, a)
        trace = []
        for _ in range(40):
            decode(m, a)
            trace.append((m.get_block_ids("a"), m.num_free_blocks))
        results.append(trace)
    assert results[0] == results[1]
    assert results[0][-1][0][0][2:4] == [0, 0]


def test_rswa_gap_blocks_serve_a_later_hit():
    m = manager_for(rswa(window=8))
    a = request("a", range(10))
    admit(m, a)
    for _ in range(20):
        decode(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3, 0, 0, 6, 7, 8],)
    b = request("b", a.all_token_ids)  # a's prompt and output: 30 tokens
    hits, num_hit = m.get_computed_blocks(b)[:2]
    assert num_hit == 28
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7],)
    # Two hits come back from the free queue, plus one new block for tokens 28..29.
    assert m.coordinator.get_num_blocks_to_allocate("b", 30, hits.blocks, 0, 28) == 3
    assert m.allocate_slots(b, 2, 28, hits).get_block_ids() == ([9],)
    assert m.num_free_blocks == 25 - 3


def test_rswa_hits_never_hold_the_null_block():
    m = manager_for(rswa(window=8))
    a = request("a", range(10))
    admit(m, a)
    m.free(a)
    b = request("b", range(10))
    hits, num_hit = m.get_computed_blocks(b)[:2]
    assert num_hit == 8
    forged = KVCacheBlocks(([m.block_pool.null_block, hits.blocks[0][1]],))
    with pytest.raises(ValueError, match="holds the null block"):
        m.allocate_slots(b, 2, 8, forged)


def test_rswa_in_a_hybrid_hits_as_full_attention():
    m = manager_for(full(), rswa(window=4), SlidingWindowSpec(4, 1, 4, "float32", sliding_window=4))
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    groups = m.coordinator.attention_groups
    assert [type(g.spec).__name__ for g in groups][:2] == ["FullAttentionSpec", "RSWASpec"]
    a = request("a", range(20))
    admit(m, a)
    for _ in range(13):  # the last step computes token 33 from 32: the window starts at 28
        decode(m, a)
    table = m.get_block_ids("a")
    assert table[1][5:7] == [0, 0]  # R-SWA: prompt blocks 0..4 held, gap 5..6 released
    assert 0 not in table[1][7:]
    assert 0 not in table[1][:5] and 0 not in table[0]
    assert table[2][:4] == [0, 0, 0, 0]  # sliding window: only the window's blocks
    m.free(a)
    b = request("b", range(20))
    hits, num_hit = m.get_computed_blocks(b)[:2]
    assert num_hit == 16  # the 19-token limit on the 4-token grid
    assert [len(g) for g in hits.blocks] == [4, 4, 4]
    assert 0 not in hits.get_block_ids()[1]


def test_sink_behaves_as_full_attention():
    m = manager_for(sink(sink_len=8))
    assert m.coordinator.plain_full_attention  # the single-group direct path, as full attention
    a = request("a", range(13))
    assert admit(m, a) == (0, ([1, 2, 3, 4],))
    m.free(a)
    b = request("b", range(13))
    assert admit(m, b) == (12, ([4],))  # a's unhashed tail block, first in the free queue
    assert m.get_block_ids("b") == ([1, 2, 3, 4],)


@pytest.mark.parametrize(
    "spec, kind", [(sink(), "sink_full_attention"), (rswa(), "full_attention")]
)
def test_events_report_the_groups_kind(spec, kind):
    m = manager_for(spec, enable_kv_cache_events=True)
    admit(m, request("a", range(9)))
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (kind, None)
    ]


def test_circular_buffer_holds_one_block_for_the_request_lifetime():
    m = manager_for(ring(bs=8), enable_kv_cache_events=True)
    a = request("a", range(40), hash_block_size=8)
    assert admit(m, a) == (0, ([1],))
    for _ in range(10):
        assert decode(m, a) == ([],)
    assert m.get_block_ids("a") == ([1],)
    assert m.block_pool.blocks[1].block_hash is None  # scratch: never cached
    assert m.take_events() == []
    assert m.get_num_common_prefix_blocks("a") == [0]
    b = request("b", range(40), hash_block_size=8)
    assert m.get_computed_blocks(b)[1] == 0
    m.free(a)
    assert m.num_free_blocks == 31


def test_circular_buffer_beside_full_attention():
    m = manager_for(full(bs=4), ring(bs=8), num_blocks=16)
    # The ring is not prefix-cacheable: hashes at the full group's 4 tokens, scheduled
    # at the LCM 8.
    assert (m.hash_block_size, m.scheduler_block_size) == (4, 8)
    a = request("a", range(19))
    assert admit(m, a) == (0, ([1, 2, 3, 4, 5], [6]))
    assert decode(m, a) == ([], [])  # token 19 fits block 4; the ring never grows
    m.free(a)
    b = request("b", range(20))
    hits, num_hit = m.get_computed_blocks(b)[:2]
    assert num_hit == 16  # the full group's hit on the 8-token grid; the ring never hits
    assert hits.get_block_ids() == ([1, 2, 3, 4], [])
    # a freed its uncached tail block 5, then its ring 6: both at the free queue's head.
    assert m.allocate_slots(b, 4, 16, hits).get_block_ids() == ([6], [5])


def test_circular_buffer_is_not_recorded_for_zeroing():
    config = KVCacheConfig.from_groups([(full(), ("f",)), (ring(), ("r",))], 16)
    coordinator = get_kv_cache_coordinator(config, 64, True, 4, 4, needs_kv_cache_zeroing=True)
    new = coordinator.allocate_new_blocks("a", 9)
    assert [len(g) for g in new] == [3, 1]
    assert coordinator.single_type_managers[0].take_new_block_ids() == [b.block_id for b in new[0]]
    assert coordinator.single_type_managers[1].take_new_block_ids() == []
    assert not coordinator.single_type_managers[1].records_new_block_ids


def test_circular_buffer_refuses_hits():
    pool = BlockPool(8, True, 4)
    manager = CircularBufferManager(ring(), pool, True, 0)
    with pytest.raises(ValueError, match="never cached, so never hit; got 1 hit blocks"):
        manager.add_local_computed_blocks("a", [pool.blocks[1]], 4)
    assert manager.req_to_blocks == {}


# -- planning --------------------------------------------------------------------


def test_capacity_with_a_ring_and_rswa_layers():
    specs = {"full": full(bs=16), "rswa": RSWASpec(16, 1, 4, "float32", rswa_window=64)}
    specs["ring"] = CircularBufferSpec(16, 1, 4, "float32")
    page = 16 * 1 * 8 * 4  # 512 bytes, every layer
    config = get_kv_cache_config(specs, 100 * 3 * page, 1024, 256)
    # One tensor slot shared by the three single-layer groups: 512 bytes a block.
    assert config.num_blocks == 300
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups)
    assert kinds == ["CircularBufferSpec", "FullAttentionSpec", "RSWASpec"]
    capacity = get_kv_cache_capacity(config, 1024, 256)
    # 64 blocks per request for full and for R-SWA (sized as full attention), 1 ring.
    assert capacity.max_concurrency == pytest.approx(300 / (64 + 64 + 1))


def test_device_refuses_the_kinds_it_cannot_mask():
    from jaxkv.device.kv_cache import PagedKVCache

    for spec, what in [
        (rswa(), "the prompt plus the last rswa_window generated tokens"),
        (sink(), "static sink tokens"),
        (ring(), "a per-request ring"),
    ]:
        with pytest.raises(ValueError, match=f"cannot serve {type(spec).__name__}.*{what}"):
            PagedKVCache(spec, 8)
