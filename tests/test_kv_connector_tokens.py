"""Tokens a KV connector computed (`allocate_slots(num_external_computed_tokens=...)`).

vLLM's two-phase rule: every group touches its local hits, then every group gets
blocks for the connector's tokens inside its attention window, then the new tokens'
blocks. `tests/test_hybrid_vllm_diff.py` replays random traces of this against vLLM.
"""

from __future__ import annotations

import pytest

from jaxkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.kv_cache_coordinator import get_kv_cache_coordinator

SHA = get_hash_fn_by_name("sha256_cbor")
pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def full(bs=4):
    return FullAttentionSpec(bs, 1, 8, "float32")


def sw(window, bs=4):
    return SlidingWindowSpec(bs, 1, 8, "float32", sliding_window=window)


def config_for(*specs, num_blocks=32):
    return KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks)


def request(rid, tokens):
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(4, SHA))


def table(m, rid):
    return [[b.block_id for b in g] for g in m.coordinator.get_blocks(rid)]


def test_connector_tokens_get_blocks_inside_each_window_then_the_new_tokens():
    m = KVCacheManager(config_for(full(), sw(8)), 64)
    a = request("a", range(20))
    # 12 tokens from the connector, then 8 computed here. The connector's blocks come
    # first, every group's (full: 3; the window of 8 ending at token 12 skips tokens
    # [0, 5), so the window group's block 0 is null and it gets 2), then the new ones.
    new = m.allocate_slots(a, 8, 0, None, 0, 12)
    assert table(m, "a") == [[1, 2, 3, 6, 7], [0, 4, 5, 8, 9]]
    assert new.get_block_ids() == ([6, 7], [8, 9])  # only the new tokens' blocks
    # The connector's tokens count as computed and are cached like computed tokens.
    b = request("b", [*range(16), 99, 98, 97, 96, 95])
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 16
    assert hits.get_block_ids() == ([1, 2, 3, 6], [0, 0, 5, 8])  # the window: 2 blocks
    m.free(a)
    assert m.block_pool.get_num_free_blocks() == 31


def test_connector_tokens_after_a_local_hit_and_an_async_load():
    m = KVCacheManager(config_for(full(), sw(8)), 64)
    first = request("first", range(9))
    m.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    m.free(first)  # its two full blocks stay cached in each group: 1, 2 and 4, 5
    a = request("a", range(24))
    hits, num_hit, _ = m.get_computed_blocks(a)
    assert num_hit == 8
    # An async load: 8 tokens from the connector, nothing computed this step, nothing
    # cached until the load lands (delay_cache_blocks).
    new = m.allocate_slots(a, 0, num_hit, hits, 0, 8, delay_cache_blocks=True)
    assert new.get_block_ids() == ([], [])
    full_table, window_table = table(m, "a")
    assert full_table[:2] == hits.get_block_ids()[0] and len(full_table) == 4
    # The window ending at 16 skips tokens [0, 9): its first two blocks are null.
    assert window_table[:2] == [0, 0] and len(window_table) == 4
    assert all(b.block_hash is None for b in m.coordinator.get_blocks("a")[0][2:])
    # The window group's hits lie outside the window: left free, not touched.
    assert [b.ref_cnt for b in hits.blocks[1]] == [0, 0]
    assert m.block_pool.get_num_free_blocks() == 31 - 2 - 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_new_tokens=0), "num_new_tokens must be > 0"),
        (dict(num_external_computed_tokens=-1), "num_external_computed_tokens must be >= 0"),
        (
            dict(num_external_computed_tokens=4, skip_zeroing_group_ids=(2,)),
            r"skip_zeroing_group_ids must be KV cache group ids in \[0, 2\)",
        ),
        (
            dict(num_external_computed_tokens=13),
            "num_external_computed_tokens=13 after 0 computed tokens passes its 12 tokens",
        ),
    ],
)
def test_bad_connector_arguments_are_refused_and_change_nothing(kwargs, message):
    m = KVCacheManager(config_for(full(), sw(8)), 64)
    a = request("a", range(12))
    args = dict(num_new_tokens=4, num_external_computed_tokens=0) | kwargs
    with pytest.raises(ValueError, match=message):
        m.allocate_slots(a, args.pop("num_new_tokens"), **args)
    assert m.block_pool.get_num_free_blocks() == 31 and table(m, "a") == [[], []]


def test_connector_tokens_only_at_a_first_allocation_and_not_with_mamba():
    m = KVCacheManager(config_for(full(), sw(8)), 64)
    a = request("a", range(12))
    m.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    with pytest.raises(ValueError, match="only be given at a request's first allocation"):
        m.allocate_slots(a, 4, num_external_computed_tokens=4)
    assert table(m, "a") == [[1], [2]]
    mamba = MambaSpec(4, shapes=((2,),), dtypes=("float32",), mamba_cache_mode="align")
    m = KVCacheManager(config_for(full(), mamba), 64)
    with pytest.raises(ValueError, match=r"Mamba group \(group 1\) is not supported"):
        m.allocate_slots(request("b", range(12)), 4, num_external_computed_tokens=4)
    assert m.block_pool.get_num_free_blocks() == 31


def test_too_few_blocks_for_connector_tokens_returns_none_and_changes_nothing():
    m = KVCacheManager(config_for(full(), sw(8), num_blocks=6), 64)
    a = request("a", range(20))
    assert m.allocate_slots(a, 4, 0, None, 0, 12) is None  # 4 + 3 blocks needed, 5 free
    assert m.block_pool.get_num_free_blocks() == 5 and table(m, "a") == [[], []]
    assert m.allocate_slots(a, 4, 0, None, 0, 4) is not None  # 2 + 2


def test_blocks_a_connector_load_writes_are_not_reported_for_zeroing():
    config = config_for(full(), sw(8))
    coordinator = get_kv_cache_coordinator(config, 64, True, 4, 4, needs_kv_cache_zeroing=True)
    coordinator.allocate_new_computed_blocks("a", ([], []), 0, 12, skip_zeroing_group_ids=(1,))
    full_manager, window_manager = coordinator.single_type_managers
    assert full_manager.take_new_block_ids() == [1, 2, 3]
    assert window_manager.take_new_block_ids() == []  # the load writes them
    assert [b.block_id for b in window_manager.req_to_blocks["a"]] == [0, 4, 5]
