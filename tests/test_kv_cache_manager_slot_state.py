"""The per-request slot state (with the allocation bound it gives a running request) and
the single-group path (the sole manager called directly, not through the coordinator)
are pure shortcuts: with them on or off, every call agrees; for full attention, sink
full attention (both take the single-group path), R-SWA (its release threshold), a
circular buffer (never a new block after the first) and a hybrid of full attention and
a sliding window with different block sizes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from jaxkv import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    KVCacheSpec,
    Request,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_hash_fn_by_name,
)
from jaxkv.hashing import init_none_hash
from jaxkv.request_hashing import get_request_block_hasher

BLOCK = 4
FN = get_hash_fn_by_name("sha256")


SPECS = {
    "full": FullAttentionSpec(BLOCK, 1, 8, "float32"),
    "sink": SinkFullAttentionSpec(BLOCK, 1, 8, "float32", sink_len=BLOCK),
    "rswa": RSWASpec(BLOCK, 1, 8, "float32", rswa_window=1),  # a gap after few decodes
    "ring": CircularBufferSpec(BLOCK, 1, 8, "float32"),
    "hybrid": (
        FullAttentionSpec(2 * BLOCK, 1, 8, "float32"),
        SlidingWindowSpec(BLOCK, 1, 8, "float32", sliding_window=6),
    ),
}


def _manager(
    spec: KVCacheSpec | tuple[KVCacheSpec, ...],
    use_slot_state: bool,
    single_group_path: bool = True,
) -> KVCacheManager:
    if isinstance(spec, tuple):
        config = KVCacheConfig.from_groups([(s, (f"layer.{i}",)) for i, s in enumerate(spec)], 24)
        manager = KVCacheManager(config, 64, enable_kv_cache_events=True)
    else:
        manager = KVCacheManager.from_spec(spec, 24, 64, enable_kv_cache_events=True)
    # A plain (or sink) full-attention group takes the single-group coordinator's direct
    # path; the others never do.
    coordinator = manager.coordinator
    takes_direct_path = type(spec) in (FullAttentionSpec, SinkFullAttentionSpec)
    assert getattr(coordinator, "plain_full_attention", False) == takes_direct_path
    manager._use_slot_state = use_slot_state
    if not use_slot_state:
        coordinator.blocks_per_missing_block = None  # every allocation is counted per group
    if not single_group_path and takes_direct_path:
        # Every step goes through the general per-group path.
        coordinator.plain_full_attention = coordinator.hits_are_leading_blocks = False
    return manager


def _pool_state(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((k, [b.block_id for b in v]) for k, v in pool.cached_block_hash_to_block.items()),
    )


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decode", "decode", "decode", "cache", "free"]),
        st.integers(0, 3),  # request index
        st.sampled_from([0, 0, 0, 0, 1, 3, 6]),  # lookahead (decode) / prompt variant (admit)
        st.sampled_from([False, False, False, True]),  # delay_cache_blocks
    ),
    max_size=60,
)


# Long decodes of one request: random lists rarely reach R-SWA's gap release.
LONG_DECODES = (
    [("admit", 0, 0, False)]
    + [("decode", 0, 0, False)] * 14
    + [("admit", 1, 3, True)]
    + [("decode", 1, 1, False), ("decode", 1, 0, True)] * 6
)


@pytest.mark.parametrize("kind", list(SPECS))
@settings(max_examples=100, deadline=None)
@given(ops=operations)
@example(ops=LONG_DECODES)
def test_slot_state_changes_no_result(kind, ops):
    init_none_hash(FN, "slot-state")
    spec = SPECS[kind]
    hasher = get_request_block_hasher(BLOCK, FN)  # the hybrid hashes at the smaller size
    managers = [
        _manager(spec, True),
        _manager(spec, False),
        _manager(spec, True, single_group_path=False),
    ]
    requests: list[dict[int, Request]] = [{}, {}, {}]
    for kind, index, extra, delay in ops:
        results = []
        for manager, live in zip(managers, requests, strict=True):
            request = live.get(index)
            if kind == "admit" and request is None:
                prompt = [7, 7, 7, 7, 1, 2, 3][: 3 + extra] + [index] * 3
                request = Request(str(index), prompt, block_hasher=hasher)
                hits, num_hits, _ = manager.get_computed_blocks(request)
                blocks = manager.allocate_slots(
                    request,
                    request.num_tokens - num_hits,
                    num_hits,
                    hits,
                    delay_cache_blocks=delay,
                )
                if blocks is not None:
                    request.num_computed_tokens = request.num_tokens
                    live[index] = request
                results.append(None if blocks is None else blocks.get_block_ids())
            elif kind == "decode" and request is not None:
                if request.num_tokens + 1 + extra > manager.max_model_len:
                    continue
                request.append_output_token_ids(100 + request.num_tokens)
                blocks = manager.allocate_slots(
                    request, 1, num_lookahead_tokens=extra, delay_cache_blocks=delay
                )
                if blocks is not None:
                    request.num_computed_tokens = request.num_tokens
                results.append(None if blocks is None else blocks.get_block_ids())
            elif kind == "cache" and request is not None:
                manager.cache_blocks(request, request.num_computed_tokens)
            elif kind == "free" and request is not None:
                manager.free(request)
                del live[index]
        assert results == results[:1] * len(results)
        events = managers[0].take_events()
        for other in managers[1:]:
            assert _pool_state(managers[0]) == _pool_state(other)
            assert other.take_events() == events
            for request_id in map(str, range(4)):
                assert managers[0].get_block_ids(request_id) == other.get_block_ids(request_id)


def test_running_hybrid_request_takes_the_last_free_block_its_groups_lack():
    """The allocation bound of a running request (2 groups x 1 block here) is only a
    shortcut: with fewer blocks free than the bound, the groups' needs are counted, and
    the one block the sliding-window group lacks is the last free one."""
    init_none_hash(FN, "slot-state")
    manager = _manager(SPECS["hybrid"], True)
    request = Request("a", list(range(8)), block_hasher=get_request_block_hasher(BLOCK, FN))
    assert manager.allocate_slots(request, 8) is not None
    request.num_computed_tokens = 8
    request.append_output_token_ids(100)
    assert [len(g) for g in manager.allocate_slots(request, 1).get_block_ids()] == [1, 1]
    request.num_computed_tokens = 9
    for token in range(101, 104):  # up to 12 tokens: both groups' blocks hold them
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    pool = manager.block_pool
    held_elsewhere = pool.get_new_blocks(pool.get_num_free_blocks() - 1)
    request.append_output_token_ids(104)  # token 13: full attention holds 16, the window 12
    before = _pool_state(manager)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None and [len(g) for g in new_blocks.get_block_ids()] == [0, 1]
    assert pool.get_num_free_blocks() == 0 and _pool_state(manager) != before
    request.num_computed_tokens = 13
    for token in range(105, 108):
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    request.append_output_token_ids(108)  # token 17: both groups lack a block
    assert pool.get_num_free_blocks() == 1  # the window released one since
    before = _pool_state(manager)
    assert manager.allocate_slots(request, 1) is None
    assert _pool_state(manager) == before
    pool.free_blocks(held_elsewhere)
    manager.free(request)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
