"""vLLM behaviours and call forms that vLLM's own v1/core tests showed missing.

Each test here is ours (not vLLM's); `tools/vllm_core_yardstick.py` runs vLLM's.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import (
    BlockPool,
    BlockStored,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheTensor,
    MambaSpec,
    PrefixCacheStats,
    Request,
    SamplingParams,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hashing,
)
from jaxkv.block_pool import BlockHashToBlockMap
from jaxkv.blocks import KVCacheBlock
from jaxkv.compat.vllm import Request as VLLMRequest
from jaxkv.compat.vllm import VLLMCacheView, install_private_views
from jaxkv.hashing import (
    BlockHashListWithBlockSize,
    make_block_hash_with_group_id,
    resolve_block_hashes,
    resolve_none_hash_seed,
)
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheSpecKind,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_full_attention_spec,
    iter_layer_specs,
)
from jaxkv.kv_cache_manager import CachingMetrics
from jaxkv.kv_cache_planning import unify_kv_cache_spec_page_size
from jaxkv.kv_cache_utils import resolve_dcp_kv_block_size, resolve_dcp_kv_cache_spec
from jaxkv.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

SHA = get_hash_fn_by_name("sha256_cbor")
pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def full(bs=16):
    return FullAttentionSpec(bs, 1, 1, "float32")


def swa(window, bs=16):
    return SlidingWindowSpec(bs, 1, 1, "float32", sliding_window=window)


def manager_for(*specs, num_blocks=64, max_model_len=1024, **kwargs) -> KVCacheManager:
    config = KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks)
    return KVCacheManager(config, max_model_len, **kwargs)


def request(rid, tokens, bs=16, **kwargs) -> Request:
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(bs, SHA), **kwargs)


# -- requests ------------------------------------------------------------------------


def test_prompt_logprobs_requests_skip_reading_the_prefix_cache():
    m = manager_for(full())
    first = request("a", range(40))
    assert m.allocate_slots(first, 40) is not None
    assert SamplingParams(prompt_logprobs=5).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
    assert (
        SamplingParams(prompt_logprobs=5, skip_reading_prefix_cache=False).skip_reading_prefix_cache
        is False
    )
    plp = request("b", range(40), sampling_params=SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert m.get_computed_blocks(plp)[1] == 0
    assert m.get_computed_blocks(request("c", range(40)))[1] == 32


def test_update_from_generation_config_keeps_only_the_eos_token():
    params = SamplingParams(max_tokens=3)
    params.update_from_generation_config({"eos_token_id": [7, 8]}, eos_token_id=100)
    assert params.eos_token_id == 100 and params.max_tokens == 3


def test_one_sampling_params_for_the_managers_and_the_engine():
    import jaxkv.engine

    assert jaxkv.engine.SamplingParams is SamplingParams
    params = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, prompt_logprobs=0)
    assert params.skip_reading_prefix_cache is True and not params.greedy
    assert request("a", range(20), sampling_params=params).max_tokens == 4
    for field, value in [
        ("prompt_logprobs", -2),
        ("skip_reading_prefix_cache", 1),
        ("eos_token_id", -2),
        ("ignore_eos", "yes"),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
            SamplingParams(**{field: value})


# -- specs ---------------------------------------------------------------------------


def test_mamba_flat_shape_is_one_state_and_bad_shapes_name_the_argument():
    spec = MambaSpec(16, shapes=(2, 3), dtypes=("float32",))
    assert spec.shapes == ((2, 3),) and spec.page_size_bytes == 2 * 3 * 4
    assert MambaSpec(16, shapes=((2, 3), (4,)), dtypes=("float32",) * 2).shapes == ((2, 3), (4,))
    with pytest.raises(TypeError, match="shapes must be a tuple of int tuples"):
        MambaSpec(16, shapes=((2, "x"),), dtypes=("float32",))
    with pytest.raises(TypeError, match="shapes"):
        MambaSpec(16, shapes=5, dtypes=("float32",))


def test_admission_caps_of_window_specs():
    # Issue #11's example: window 1024, 1024 tokens in flight, block 16 -> 129 pages.
    assert swa(1024).max_admission_blocks_per_request(1024, 16384) == 129
    assert swa(1024).max_admission_blocks_per_request(1024, 100) == 7 + 1  # max_model_len caps
    chunked = ChunkedLocalAttentionSpec(16, 1, 1, "float32", attention_chunk_size=64)
    assert chunked.max_admission_blocks_per_request(32, 4096) == 6
    assert swa(1024).max_memory_usage_bytes(16384, 1024) == 129 * swa(1024).page_size_bytes


# -- blocks and the hash map -----------------------------------------------------------


def test_set_block_hash_takes_the_combined_key_once():
    block = KVCacheBlock(3)
    key = make_block_hash_with_group_id(b"h" * 32, 2)
    block.set_block_hash(key)
    assert block.block_hash == key and block.group_id == 2
    with pytest.raises(ValueError, match="already has hash"):
        block.set_block_hash(make_block_hash_with_group_id(b"g" * 32, 2))


def test_hash_map_accepts_vllm_combined_keys():
    cache = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(b"k" * 32, 1)
    b1, b2 = KVCacheBlock(1), KVCacheBlock(2)
    cache.insert(key, b1)
    cache.insert(b"k" * 32, 1, b2)  # jaxkv's form, same key
    assert cache.get_one_block(key) is b1
    assert cache.pop(key, 5) is None  # no block 5 under the key
    assert cache.pop(key, 1) is b1 and cache.get_one_block(key) is b2
    assert cache.pop(b"k" * 32, 1, 2) is b2 and len(cache) == 0


keys = st.sampled_from(
    [make_block_hash_with_group_id(bytes([h]) * 8, g) for h in range(3) for g in range(2)]
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["insert", "pop", "del", "set"]), keys, st.integers(1, 6)))
)
def test_vllm_cache_view_matches_a_dict_model(ops):
    """`VLLMCacheView` (vLLM's `_cache` dict shape) stays equal to a model dict under
    random edits."""
    cache = BlockHashToBlockMap()
    view = VLLMCacheView(cache)
    blocks = {i: KVCacheBlock(i) for i in range(1, 7)}
    model: dict[bytes, dict[int, KVCacheBlock]] = {}
    for op, key, block_id in ops:
        if op == "insert":
            if block_id in model.get(key, {}):
                continue  # a block is cached once under a key
            cache.insert(key, blocks[block_id])
            model.setdefault(key, {})[block_id] = blocks[block_id]
        elif op == "pop":
            popped = cache.pop(key, block_id)
            assert popped is model.get(key, {}).pop(block_id, None)
            if key in model and not model[key]:
                del model[key]
        elif op == "del":
            if key in model:
                del view[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del view[key]
        else:
            view[key] = blocks[block_id]
            model[key] = {block_id: blocks[block_id]}
        expected = {k: next(iter(v.values())) if len(v) == 1 else v for k, v in model.items()}
        assert view == expected and copy.copy(view) == expected
        assert len(cache) == len(model) and set(view) == set(model)
    view.clear()
    assert len(cache) == 0 and dict(view) == {}


# -- events ---------------------------------------------------------------------------


def test_emit_cached_block_events_reports_reused_blocks_without_changing_them():
    pool = BlockPool(8, enable_caching=True, hash_block_size=4, enable_kv_cache_events=True)
    req = request("r", range(16), bs=4)
    free_before = pool.get_num_free_blocks()
    pool.emit_cached_block_events(req, 3, 4, 1)
    assert pool.get_num_free_blocks() == free_before and len(pool.cached_block_hash_to_block) == 0
    [event] = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == req.block_hashes[:3] and event.parent_block_hash is None
    assert list(event.token_ids) == list(range(12)) and event.group_idx == 1
    assert event.block_size == 4
    # Coarser blocks read the request's hashes in block-size views.
    pool.emit_cached_block_events(req, 2, 8, 0)
    [event] = pool.take_events()
    assert event.block_hashes == [req.block_hashes[1], req.block_hashes[3]]
    pool.emit_cached_block_events(req, 0, 4, 0)
    assert pool.take_events() == []
    with pytest.raises(ValueError, match="num_cached_blocks"):
        pool.emit_cached_block_events(req, 5, 4, 0)
    quiet = BlockPool(8, enable_caching=True, hash_block_size=4)
    quiet.emit_cached_block_events(req, 3, 4, 0)
    assert quiet.take_events() == []


def test_cache_full_blocks_events_unchanged_by_the_shared_builder():
    pool = BlockPool(8, enable_caching=True, hash_block_size=4, enable_kv_cache_events=True)
    req = request("r", range(14), bs=4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 1, 3, 4, 0)
    [event] = pool.take_events()
    assert event.block_hashes == req.block_hashes[1:3]
    assert event.parent_block_hash == req.block_hashes[0]
    assert list(event.token_ids) == list(range(4, 12))


# -- admission of a whole request -----------------------------------------------------


def swa_hybrid(num_blocks):
    return manager_for(
        full(), swa(64), num_blocks=num_blocks, max_model_len=1024, max_in_flight_tokens=128
    )


def test_full_sequence_must_fit_counts_window_groups_at_their_admission_cap():
    # Full attention needs 32 blocks for 512 tokens; the window group holds at most
    # cdiv(63 + 128, 16) + 1 = 13 at once, so 45 free blocks admit the request.
    m = swa_hybrid(num_blocks=46)  # the null block + 45
    long = request("long", range(512))
    assert m.allocate_slots(long, 16, full_sequence_must_fit=True) is not None
    # One block fewer and the request cannot run to the end: refused, nothing changes.
    m = swa_hybrid(num_blocks=45)
    free_before = m.num_free_blocks
    assert m.allocate_slots(request("long", range(512)), 16, full_sequence_must_fit=True) is None
    assert m.num_free_blocks == free_before


def test_manager_factory_takes_vllms_arguments_and_sets_the_cap():
    pool = BlockPool(64, enable_caching=True, hash_block_size=16)
    window = get_manager_for_kv_cache_spec(
        swa(64), 128, 1024, block_pool=pool, enable_caching=True, kv_cache_group_id=0
    )
    assert isinstance(window, SlidingWindowManager)
    assert window.max_admission_blocks_per_request == 13
    assert window.get_num_blocks_to_allocate("r", 512, [], 0, 0, 512) == 32
    assert (
        window.get_num_blocks_to_allocate("r", 512, [], 0, 0, 512, apply_admission_cap=True) == 13
    )
    plain = get_manager_for_kv_cache_spec(
        full(), 128, 1024, block_pool=pool, enable_caching=True, kv_cache_group_id=1
    )
    assert type(plain) is FullAttentionManager and plain.max_admission_blocks_per_request is None
    with pytest.raises(ValueError, match="role"):
        get_manager_for_kv_cache_spec(full(), 1, 1, role="x", block_pool=pool)
    with pytest.raises(ValueError, match="pcp_world_size"):
        FullAttentionManager(full(), pool, True, 0, pcp_world_size=2)


def test_new_attention_block_ids_are_recorded_for_zeroing():
    pool = BlockPool(16, enable_caching=False, hash_block_size=2)
    manager = SlidingWindowManager(
        swa(4, bs=2),
        block_pool=pool,
        enable_caching=False,
        kv_cache_group_id=0,
        needs_kv_cache_zeroing=True,
    )
    blocks = manager.allocate_new_blocks("r", 4, 4)
    assert manager.records_new_block_ids
    assert manager.take_new_block_ids() == [b.block_id for b in blocks] != []
    assert manager.take_new_block_ids() == []
    mamba = MambaManager(
        MambaSpec(2, shapes=((1,),), dtypes=("float32",)),
        block_pool=pool,
        enable_caching=False,
        kv_cache_group_id=1,
        needs_kv_cache_zeroing=True,
    )
    assert not mamba.records_new_block_ids  # a state block is not attention KV


def test_single_type_managers_take_connector_tokens_in_vllms_form():
    # vLLM's `allocate_external_computed_blocks(request_id, num_local, num_external)`:
    # blocks up to the connector's tokens, none when the request already holds more (a
    # speculative allocation may have), so the free count never goes up.
    pool = BlockPool(10, enable_caching=False, hash_block_size=4)
    manager = FullAttentionManager(full(bs=4), pool, False, 0)
    manager.allocate_new_blocks("r", 12)
    num_free = pool.get_num_free_blocks()
    manager.allocate_external_computed_blocks("r", 0, 4)
    assert pool.get_num_free_blocks() == num_free and len(manager.req_to_blocks["r"]) == 3
    manager.allocate_external_computed_blocks("r", 4, 16)
    assert pool.get_num_free_blocks() == num_free - 2 and len(manager.req_to_blocks["r"]) == 5


# -- Mamba states written in the current step ----------------------------------------


def mamba_hybrid():
    mamba = MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")
    return manager_for(full(), mamba, num_blocks=40, max_model_len=256)


def test_a_mamba_state_cached_this_step_is_a_hit_only_from_the_next_step():
    m = mamba_hybrid()
    m.new_step_starts()
    a = request("a", range(40))
    assert m.allocate_slots(a, 32) is not None  # caches the state at 32
    b = request("b", [*range(32), 7, 7, 7])
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 32
    free_before = m.num_free_blocks
    assert m.allocate_slots(b, 3, num_hit, hits) is None  # that state is not written yet
    assert m.num_free_blocks == free_before and m.get_block_ids("b") == ([], [])
    m.new_step_starts()
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 3, num_hit, hits) is not None


def test_without_step_reports_no_mamba_hit_is_held_back():
    m = mamba_hybrid()
    a = request("a", range(40))
    assert m.allocate_slots(a, 32) is not None
    b = request("b", [*range(32), 7, 7, 7])
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 32 and m.allocate_slots(b, 3, num_hit, hits) is not None


# -- smaller call forms ----------------------------------------------------------------


def test_get_block_ids_selects_groups():
    blocks = KVCacheBlocks(([KVCacheBlock(1)], [KVCacheBlock(2)], [KVCacheBlock(3)]))
    assert blocks.get_block_ids() == ([1], [2], [3])
    assert blocks.get_block_ids(group_ids=(2, 0)) == ([3], [1])


def test_none_hash_seed_rule(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    sha, xx = get_hash_fn_by_name("sha256"), get_hash_fn_by_name("xxhash")
    assert resolve_none_hash_seed(sha) == hashing.DEFAULT_NONE_HASH_SEED
    seeds = {resolve_none_hash_seed(xx) for _ in range(4)}
    assert len(seeds) == 4 and hashing.DEFAULT_NONE_HASH_SEED not in seeds
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert resolve_none_hash_seed(xx) == resolve_none_hash_seed(sha) == "42"
    assert sha.__name__ == "sha256"


def test_events_of_an_unknown_group_pass_through_unannotated(caplog):
    m = manager_for(full(), enable_kv_cache_events=True)
    stray = BlockStored([b"x"], None, [0] * 16, 16, None, group_idx=3)
    m.block_pool.kv_event_queue.append(stray)
    with caplog.at_level("WARNING", logger="jaxkv"):
        assert m.take_events() == [stray]
    assert "Group index `3` not in KV cache metadata" in caplog.text


def test_a_hash_view_is_only_read_at_its_own_block_size():
    raw = [bytes([i]) * 4 for i in range(8)]
    view = BlockHashListWithBlockSize(raw, 2, 4)
    assert resolve_block_hashes(view, 2, 4) is view
    with pytest.raises(ValueError, match="view of 8-token blocks"):
        resolve_block_hashes(BlockHashListWithBlockSize(raw, 2, 8), 2, 4)
    with pytest.raises(ValueError, match="view of 4-token blocks"):
        resolve_block_hashes(view, 2, 2)
    with pytest.raises(AssertionError):  # what vLLM raises there
        resolve_block_hashes(view, 2, 2)


def test_kv_cache_zeroing_is_needed_for_mamba_or_mixed_precision():
    def config(*specs):
        return KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], 8)

    mamba = MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")
    assert config(full(), mamba).needs_kv_cache_zeroing
    assert not config(full(), swa(64)).needs_kv_cache_zeroing  # both float32
    mixed = config(full(), SlidingWindowSpec(16, 1, 1, "bfloat16", sliding_window=64))
    assert mixed.has_mixed_precision_kv_cache and mixed.needs_kv_cache_zeroing


def test_an_embeddings_only_prompt_gets_placeholder_ids_and_embedding_keys():
    rng = np.random.default_rng(0)
    embeds_a, embeds_b = rng.standard_normal((8, 3)), rng.standard_normal((8, 3))
    a = Request("a", None, prompt_embeds=embeds_a, block_hasher=get_request_block_hasher(4, SHA))
    b = Request("b", None, prompt_embeds=embeds_b, block_hasher=get_request_block_hasher(4, SHA))
    assert a.prompt_token_ids == [0] * 8 and a.num_prompt_tokens == 8
    assert len(a.block_hashes) == 2 and a.block_hashes[0] != b.block_hashes[0]
    with pytest.raises(TypeError, match="prompt_token_ids"):
        Request("c", None)


def test_all_mode_mamba_states_cached_this_step_also_wait():
    mamba = MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="all")
    m = manager_for(full(), mamba, num_blocks=40, max_model_len=256)
    m.new_step_starts()
    assert m.allocate_slots(request("a", range(40)), 32) is not None
    b = request("b", [*range(32), 7, 7, 7])
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 32 and m.allocate_slots(b, 3, num_hit, hits) is None
    m.new_step_starts()
    hits, num_hit, _ = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 3, num_hit, hits) is not None


# -- windowed hit rate ----------------------------------------------------------------


def test_caching_metrics_window_exact_numbers():
    metrics = CachingMetrics(max_recent_requests=5)
    assert metrics.hit_rate == 0.0 and metrics.empty
    metrics.observe(PrefixCacheStats(requests=1, queries=20, hits=9))
    assert metrics.hit_rate == 0.45
    metrics.observe(PrefixCacheStats(requests=0, queries=0, hits=0))  # ignored
    metrics.observe(PrefixCacheStats(requests=4, queries=80, hits=16))
    assert metrics.hit_rate == 0.25
    metrics.observe(PrefixCacheStats(requests=1, queries=10, hits=2))  # (1, 20, 9) leaves
    assert (metrics.aggregated_requests, metrics.aggregated_query_total) == (5, 90)
    metrics.observe(PrefixCacheStats(requests=11, queries=20, hits=10))  # newest always kept
    assert (metrics.aggregated_requests, metrics.hit_rate) == (11, 0.5)
    metrics.observe(PrefixCacheStats(reset=True, requests=1, queries=4, hits=1))
    assert (metrics.aggregated_requests, metrics.hit_rate) == (1, 0.25)
    with pytest.raises(ValueError, match="max_recent_requests"):
        CachingMetrics(0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 30)), max_size=30),
)
def test_caching_metrics_match_a_recomputed_window(window, batches):
    """After every batch: the sums are those of the newest batches holding at most
    `window` requests (at least the newest one), counted since the last reset."""
    metrics = CachingMetrics(window)
    kept: list[tuple[int, int, int]] = []
    for reset, requests, queries in batches:
        hits = queries // 2
        metrics.observe(
            PrefixCacheStats(reset=reset, requests=requests, queries=queries, hits=hits)
        )
        if reset:
            kept = []
        if requests:
            kept.append((requests, queries, hits))
            while len(kept) > 1 and sum(k[0] for k in kept) > window:
                kept.pop(0)
        assert list(metrics.query_queue) == kept
        assert metrics.aggregated_requests == sum(k[0] for k in kept)
        assert metrics.aggregated_query_total == sum(k[1] for k in kept)
        assert metrics.aggregated_query_hit == sum(k[2] for k in kept)


# -- spec fields: padded pages, quant mode, windows on full attention, MLA formats ------


def test_page_size_padded_sets_the_page_and_is_checked_when_built():
    attn = FullAttentionSpec(16, 2, 64, "float32")
    assert attn.page_size_bytes == attn.unpadded_page_size_bytes == 16 * 2 * 128 * 4
    padded = replace(attn, page_size_padded=65536)
    assert padded.page_size_bytes == 65536
    assert padded.real_page_size_bytes == attn.page_size_bytes
    assert padded.max_memory_usage_bytes(64, 16) == 4 * 65536
    assert padded.tensor_parallel_bytes(2).page_size_bytes == 32768
    with pytest.raises(ValueError, match="page_size_padded=100 is smaller"):
        replace(attn, page_size_padded=100)
    with pytest.raises(TypeError, match="page_size_padded"):
        replace(attn, page_size_padded=65536.0)
    mamba = MambaSpec(16, shapes=((2, 512),), dtypes=("float32",))
    assert replace(mamba, page_size_padded=8192).page_size_bytes == 8192
    assert replace(mamba, page_size_padded=8192).real_page_size_bytes == 4096
    with pytest.raises(ValueError, match="MambaSpec: page_size_padded=4095"):
        replace(mamba, page_size_padded=4095)


def test_planning_pads_mamba_and_odd_attention_pages_but_not_mla():
    big = FullAttentionSpec(16, 8, 128)  # 65536-byte page
    mamba = MambaSpec(16, shapes=((2, 512),), dtypes=("float32",))
    odd = SlidingWindowSpec(16, 3, 128, sliding_window=64)
    unified = unify_kv_cache_spec_page_size({"f": big, "m": mamba, "s": odd})
    assert unified["f"] is big
    assert unified["m"] == replace(mamba, page_size_padded=65536)
    assert unified["s"] == replace(odd, page_size_padded=65536)
    # A dividing page still grows by its block size, not by padding.
    half = unify_kv_cache_spec_page_size({"f": big, "h": FullAttentionSpec(16, 4, 128)})["h"]
    assert (half.block_size, half.page_size_padded) == (32, None)
    with pytest.raises(ValueError, match="only Mamba and non-MLA attention pages are padded"):
        unify_kv_cache_spec_page_size({"f": big, "m": MLAAttentionSpec(16, 1, 96)})


def test_kv_quant_mode_is_carried_and_checked():
    spec = FullAttentionSpec(16, 1, 64, "uint8", kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert spec.kv_quant_mode is KVQuantMode.FP8_PER_TOKEN_HEAD
    assert spec.page_size_bytes == FullAttentionSpec(16, 1, 64, "uint8").page_size_bytes
    assert spec != FullAttentionSpec(16, 1, 64, "uint8")
    with pytest.raises(ValueError, match="kv_quant_mode 99"):
        FullAttentionSpec(16, 1, 64, kv_quant_mode=99)


def test_full_attention_windows_merge_as_vllm_does():
    plain = FullAttentionSpec(16, 4, 64, "float32")
    windowed = replace(plain, sliding_window=8)
    assert windowed.page_size_bytes == plain.page_size_bytes
    assert windowed.max_memory_usage_bytes(64, 16) == plain.max_memory_usage_bytes(64, 16)
    assert FullAttentionSpec.merge([plain, windowed]) == windowed
    assert plain.merge([plain, plain]) == plain
    with pytest.raises(ValueError, match="share sliding_window"):
        plain.merge([plain, windowed, replace(plain, sliding_window=16)])
    # Any other difference, or another spec class: both ValueError and AssertionError.
    for bad in ([plain, replace(plain, num_kv_heads=2)], [plain, swa(8)]):
        with pytest.raises(SpecMergeError):
            plain.merge(bad)
        with pytest.raises(AssertionError):
            bad[1].merge(bad)
    with pytest.raises(ValueError, match="at most one"):
        FullAttentionSpec(16, sliding_window=8, attention_chunk_size=16)
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        FullAttentionSpec(16, sliding_window=0)


def test_mla_cache_formats_and_sliding_window_mla():
    mla = MLAAttentionSpec(16, 1, 576, "float32")
    fp8 = replace(mla, cache_dtype_str="fp8_ds_mla")
    assert fp8.merge([fp8, fp8]) == fp8
    with pytest.raises(SpecMergeError):
        fp8.merge([fp8, mla])
    with pytest.raises(SpecMergeError):
        mla.merge([mla, FullAttentionSpec(16, 1, 576, "float32")])
    with pytest.raises(SpecMergeError):
        FullAttentionSpec.merge([FullAttentionSpec(16, 1, 576, "float32"), mla])
    swa_mla = SlidingWindowMLASpec(16, 1, 576, "float32", sliding_window=128)
    assert swa_mla.head_size_v == 0 and swa_mla.page_size_bytes == 16 * 576 * 4
    assert swa_mla.tensor_parallel_bytes(4).num_replicas == 4
    with pytest.raises(ValueError, match="one latent KV head"):
        SlidingWindowMLASpec(16, 2, 576, sliding_window=128)
    assert get_kv_cache_spec_kind(swa_mla) is KVCacheSpecKind.SLIDING_WINDOW_MLA
    assert get_kv_cache_spec_kind(mla) is KVCacheSpecKind.MLA_ATTENTION
    assert is_full_attention_spec(mla) and not is_full_attention_spec(swa_mla)
    # Managed as sliding-window attention: blocks behind the window are released.
    manager = manager_for(SlidingWindowMLASpec(4, 1, 8, sliding_window=4), num_blocks=32)
    req = request("r", range(32), bs=4)
    assert manager.allocate_slots(req, 32) is not None
    req.num_computed_tokens = 32
    assert manager.allocate_slots(req, 1) is not None
    ids = manager.get_block_ids("r")[0]
    assert ids[0] == 0 and ids[-1] != 0  # the null block stands for released ones


def test_a_mixed_uniform_type_group_is_built_but_never_served():
    a, b = FullAttentionSpec(4, 1, 1, "float32"), MLAAttentionSpec(4, 1, 1, "float32")
    sw = SlidingWindowMLASpec(4, 1, 1, "float32", sliding_window=8)
    mixed = UniformTypeKVCacheSpecs(4, kv_cache_specs={"a": a, "b": sw})
    assert list(iter_layer_specs(mixed)) == [a, sw]
    assert mixed.kind is KVCacheSpecKind.UNKNOWN and not is_full_attention_spec(mixed)
    assert get_kv_cache_spec_sliding_window(mixed) is None
    sw16 = SlidingWindowSpec(4, 1, 1, "float32", sliding_window=16)
    sw32 = replace(sw16, sliding_window=32)
    assert get_kv_cache_spec_sliding_window(UniformTypeKVCacheSpecs(4, {"a": sw16})) == 16
    assert (
        get_kv_cache_spec_sliding_window(UniformTypeKVCacheSpecs(4, {"a": sw16, "b": sw32})) is None
    )
    # Full and MLA layers: a full-attention mix.
    assert get_kv_cache_spec_kind(UniformTypeKVCacheSpecs(4, {"a": a, "b": b})) is (
        KVCacheSpecKind.FULL_ATTENTION
    )
    assert not is_full_attention_spec(UniformTypeKVCacheSpecs(4, {}))
    config = KVCacheConfig.from_groups([(mixed, ("a", "b"))], 16)
    with pytest.raises(ValueError, match="must share spec type, block size and window"):
        KVCacheManager(config, 64)
    with pytest.raises(ValueError, match="must share spec type"):
        get_manager_for_kv_cache_spec(mixed, 16, 64, block_pool=BlockPool(16))
    with pytest.raises(ValueError, match="must share spec type"):
        _ = UniformTypeKVCacheSpecs(8, {"a": a}).layer_type_spec  # block size differs


# -- sparse retention: vLLM's classmethod call form; Mamba groups thinned too -------


def test_sliding_window_reachable_block_mask_in_vllms_classmethod_form():
    spec = SlidingWindowSpec(16, 1, 1, "float32", sliding_window=33)  # a hit needs 2 blocks

    def kept(alignment, eagle=False, retention=None, boundaries=(), final=None, end=12):
        mask = SlidingWindowManager.reachable_block_mask(
            start_block=0,
            end_block=end,
            alignment_tokens=alignment,
            kv_cache_spec=spec,
            use_eagle=eagle,
            retention_interval=retention,
            reachable_boundaries=boundaries,
            final_segment_end_block=final,
        )
        return None if mask is None else {i for i, keep in enumerate(mask) if keep}

    assert kept(None) is None and kept(16) is None and kept(8) is None  # dense or sub-block
    assert kept(64) == {2, 3, 6, 7, 10, 11}  # the 2 blocks before each 64-token boundary
    assert kept(64, eagle=True) == {2, 3, 4, 6, 7, 8, 10, 11}  # 3 blocks, one past it
    assert kept(16, retention=0, boundaries=(100,)) == {4, 5}  # the run ending at 96
    assert kept(16, retention=128) == {6, 7}
    assert kept(16, retention=128, final=11) == {6, 7, 9, 10}  # the final segment's tail
    assert kept(16, retention=128, final=11, eagle=True) == {6, 7, 8}  # no final tail
    with pytest.raises(TypeError, match="SlidingWindowSpec"):
        SlidingWindowManager.reachable_block_mask(0, 1, 64, full(), False)


def test_mamba_reachable_block_mask_follows_vllms_retention_rule():
    spec = MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")

    def kept(retention, boundaries=(), start=0, end=10):
        mask = MambaManager.reachable_block_mask(start, end, 16, spec, False, retention, boundaries)
        return None if mask is None else {start + i for i, keep in enumerate(mask) if keep}

    assert kept(None) is None and kept(16) is None  # dense, or a boundary every block
    assert kept(48) == {2, 5, 8}  # the state ending each 48-token segment
    assert kept(48, boundaries=(100, 130)) == {2, 5, 7, 8}  # plus those ending at 96, 128
    assert kept(0, boundaries=(100,)) == {5}
    assert kept(48, start=4, end=9) == {5, 8}
    assert MambaManager.reachable_block_mask(0, 4, None, spec, False, 48) is None


@pytest.mark.parametrize("retention, expected_hit", [(None, 96), (64, 64), (0, 0)])
def test_mamba_align_states_are_thinned_by_prefix_cache_retention(retention, expected_hit):
    mamba = MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")
    config = KVCacheConfig.from_groups(
        [(full(), ("f",)), (mamba, ("m",))], 64, prefix_cache_retention_interval=retention
    )
    m = KVCacheManager(config, 512)
    a = request("a", range(160))
    for start in range(0, 160, 16):  # one block per step: a state at every boundary
        assert m.allocate_slots(a, 16) is not None
        a.num_computed_tokens = start + 16
    # A prompt sharing 100 tokens: dense caching hits the state at 96, retention 64
    # only the one at 64 (the replay boundary, block 8, is beyond the shared part).
    hits, num_hit, _ = m.get_computed_blocks(request("b", [*range(100), 7, 7, 7]))
    assert num_hit == expected_hit
    # The replay boundary (159 -> the state ending at 144) is kept in every mode.
    hits, num_hit, _ = m.get_computed_blocks(request("c", range(160)))
    assert num_hit == 144


def test_kv_cache_tensor_takes_vllms_placement_form():
    placed = KVCacheTensor(size=100, layers=["l1", "l2"], layer_stride=50, block_stride=10)
    assert placed.layers == ("l1", "l2") and placed.shared_by == () and placed.offset == 0
    assert KVCacheTensor(64, ("a", "b")).shared_by == ("a", "b")
    config = KVCacheConfig(10, [placed], [KVCacheGroupSpec(["l1", "l2"], full(4))])
    m = KVCacheManager(config, 100)
    assert m.allocate_slots(request("r", range(6), bs=4), 6) is not None
    with pytest.raises(ValueError, match="block_stride must be a positive"):
        KVCacheTensor(size=100, layers=["l1"], layer_stride=100)
    with pytest.raises(ValueError, match="not both"):
        KVCacheTensor(100, ("a",), layers=["b"], layer_stride=1, block_stride=1)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        KVCacheTensor(100, layers=["a"], layer_stride=1, block_stride=1, offset=-1)


def test_attention_specs_are_dcp_sharded_by_default_as_in_vllm():
    attn, mamba = full(16), MambaSpec(16, shapes=((4,),), dtypes=("float32",))
    assert attn.dcp_sharded and swa(32).dcp_sharded and not mamba.dcp_sharded
    assert resolve_dcp_kv_block_size(attn, 4) == 64 and resolve_dcp_kv_block_size(mamba, 4) == 16
    group = UniformTypeKVCacheSpecs(16, {"a": attn, "b": full(16)})
    assert group.dcp_sharded and resolve_dcp_kv_cache_spec(group, 4).block_size == 64
    unsharded = replace(attn, dcp_sharded=False)
    assert resolve_dcp_kv_cache_spec(unsharded, 4) is unsharded
    # Without decode context parallelism (jaxkv's managers: dcp 1) nothing changes.
    assert manager_for(attn).coordinator.single_type_managers[0].block_size == 16


def test_kv_cache_config_names_the_groups_a_connector_transfers():
    # vLLM's `enable_kv_transfer` and the config's views over it, which KV connectors
    # read: transferred groups, their per-layer index, their block ids, and the ones a
    # hash-addressed store may keep (scratch state such as cross-attention excluded).
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
    groups = [
        KVCacheGroupSpec(["a"], spec),
        KVCacheGroupSpec(["b"], spec, enable_kv_transfer=False),
        KVCacheGroupSpec(["c", "d"], spec),
        KVCacheGroupSpec(["x"], CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)),
    ]
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    assert config.transfer_group_ids == (0, 2, 3)
    assert config.transfer_groups == (groups[0], groups[2], groups[3])
    assert config.transfer_group_index_by_layer == {"a": 0, "c": 1, "d": 1, "x": 2}
    assert config.select_transfer_block_ids(([1], [2], [3, 4], [5])) == ([1], [3, 4], [5])
    assert config.prefix_cacheable_group_ids == (0, 2)
    assert config.prefix_cacheable_groups == (groups[0], groups[2])
    with pytest.raises(ValueError, match="expected block ids for 4 KV cache groups, got 2"):
        config.select_transfer_block_ids(([1], [2]))
    with pytest.raises(TypeError, match="enable_kv_transfer must be a bool"):
        KVCacheGroupSpec(["a"], spec, enable_kv_transfer=1)


def test_compat_request_takes_vllms_positional_shape():
    """vLLM's full positional signature; the arguments jaxkv has no use for are ignored."""
    request = VLLMRequest(
        "r", [1, 2, 3], None, None, 7, 1.5, None, None, None, None, "salt", 2, {"h": "v"},
        None, True, "session", None, None, False, None,
    )  # fmt: skip
    assert isinstance(request, jaxkv.Request)
    assert (request.client_index, request.arrival_time, request.cache_salt) == (7, 1.5, "salt")
    assert (request.priority, request.max_tokens) == (2, 16)


def test_install_private_views_gives_vllms_cache_view():
    cache = BlockHashToBlockMap()
    install_private_views()
    assert isinstance(cache._cache, VLLMCacheView)
    assert len(cache._cache) == 0


def test_the_core_never_imports_the_compat_layer():
    code = (
        "import sys, jaxkv, jaxkv.engine.scheduler, jaxkv.kv_cache_manager; "
        "print(sorted(m for m in sys.modules if m.startswith('jaxkv.compat')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
