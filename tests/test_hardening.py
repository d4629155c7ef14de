"""Issue 10, one test (or a few) per deliverable; each fails on the code before it.

Wrong KV impossible by mistake (item 2), raised errors change nothing (item 3),
integer sizes (item 4), the seed's encoder semantics (item 5), vLLM's
signatures (item 6), and the code-structure items that tests can see (item 7).
"""

from __future__ import annotations

import hashlib
import inspect
import json

import cbor2
import numpy as np
import pytest
from _state import manager_state, pool_state, queue_state

import jaxkv
import jaxkv.hashing as hashing
from jaxkv import (
    BlockPool,
    BlockTable,
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    SamplingParams,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.compat.vllm import Request as VLLMRequest
from jaxkv.hashing import make_block_hash_with_group_id

SHA_CBOR = get_hash_fn_by_name("sha256_cbor")
BS = 4

pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def make_manager(num_blocks: int = 12, block_size: int = BS, **kwargs) -> KVCacheManager:
    return KVCacheManager.from_spec(FullAttentionSpec(block_size), num_blocks, 64, **kwargs)


def make_request(rid: str, tokens, block_size: int = BS, **kwargs) -> Request:
    hasher = get_request_block_hasher(block_size, SHA_CBOR)
    return Request(rid, list(tokens), block_hasher=hasher, **kwargs)


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    hits, num_hits, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.request_id)[0]


def assert_refused(manager, call, error, match):
    before = manager_state(manager)
    with pytest.raises(error, match=match):
        call()
    assert manager_state(manager) == before


# ---------------------------------------------------------------------------
# Item 2: wrong KV must be impossible to get by mistake


def test_manager_refuses_request_hashed_at_another_block_size():
    m = make_manager(block_size=8)
    admit(m, make_request("a", range(17), block_size=8))
    other = make_request("b", range(17), block_size=4)  # hashes of 4-token blocks
    for call in (
        lambda: m.get_computed_blocks(other),
        lambda: m.allocate_slots(other, 17),
    ):
        assert_refused(m, call, ValueError, r"block size 4 .*hash_block_size=8")


def test_request_hasher_declares_block_size_and_none_hash():
    hasher = get_request_block_hasher(4, SHA_CBOR)
    assert isinstance(hasher, jaxkv.RequestBlockHasher)
    assert (hasher.block_size, hasher.none_hash) == (4, hashing.get_none_hash())
    before = Request("a", list(range(12)), block_hasher=hasher).block_hashes
    init_none_hash(SHA_CBOR, "another-seed")  # after requests exist
    request = Request("b", list(range(8)), block_hasher=hasher)
    request.append_output_token_ids(list(range(8, 12)))
    assert request.block_hashes == before, "one chain per hasher, never two mixed"
    assert request.hash_block_size == 4
    with pytest.raises(TypeError, match="block_hasher must come from get_request_block_hasher"):
        Request("c", [1, 2], block_hasher=lambda r: [])


def test_empty_salt_means_no_salt_as_in_vllm():
    tokens = list(range(8))
    unsalted = make_request("a", tokens).block_hashes
    assert make_request("b", tokens, cache_salt="").block_hashes == unsalted
    assert make_request("c", tokens, cache_salt="s").block_hashes[0] != unsalted[0]
    # vLLM's digest of block 0 without extra keys: sha256(cbor([NONE_HASH, tokens, None])).
    payload = cbor2.dumps((hashing.get_none_hash(), (0, 1, 2, 3), None), canonical=True)
    assert unsalted[0] == hashlib.sha256(payload).digest()
    m = make_manager()
    admit(m, make_request("u", tokens + [9]))
    _, num_hits, _ = m.get_computed_blocks(make_request("e", tokens + [9], cache_salt=""))
    assert num_hits == 8, "an empty salt shares with unsalted requests"


def _cached_manager() -> tuple[KVCacheManager, Request]:
    m = make_manager()
    admit(m, make_request("a", range(9)))  # blocks 1, 2 cached, 3 partial
    return m, make_request("b", range(9))


def test_allocate_slots_rejects_hits_that_are_not_this_pools_cached_blocks():
    m, b = _cached_manager()
    other, _ = _cached_manager()
    pool = m.block_pool
    free_uncached = pool.free_block_queue.get_all_free_blocks()[0]
    assert free_uncached.block_hash is None
    cached = pool.blocks[1]
    cases = {
        "another pool's": [other.block_pool.blocks[1], other.block_pool.blocks[2]],
        "null": [pool.null_block, cached],
        "never cached": [cached, free_uncached],
        "duplicate": [cached, cached],
        "not a block": [cached, "block"],
    }
    for blocks in cases.values():
        hits = KVCacheBlocks((blocks,))
        call = lambda hits=hits: m.allocate_slots(b, 1, 8, hits)  # noqa: E731
        assert_refused(m, call, ValueError, "new_computed_blocks")


def test_allocate_slots_rejects_mismatched_hit_counts_and_a_second_request_object():
    m, b = _cached_manager()
    hits, num_hits, _ = m.get_computed_blocks(b)
    assert num_hits == 8
    for num in (4, 12, 7):
        assert_refused(
            m,
            lambda num=num: m.allocate_slots(b, 1, num, hits),
            ValueError,
            "num_new_computed_tokens",
        )
    assert_refused(m, lambda: m.allocate_slots(b, 1, 8, None), ValueError, "holds no blocks")
    impostor = make_request("a", range(9))  # the running request's id, another object
    assert_refused(m, lambda: m.allocate_slots(impostor, 1), ValueError, "second Request")
    assert_refused(m, lambda: m.allocate_slots(impostor, 4), ValueError, "second Request")


@pytest.mark.parametrize("bad", [1.0, 1.5, True, np.float64(2), "1", None])
def test_allocate_slots_rejects_non_integer_counts_on_both_paths(bad):
    m, _ = _cached_manager()
    running = m._running["a"]
    running.append_output_token_ids(5)  # a decode step: the fast path would answer
    for kwargs in (
        {"num_new_tokens": bad},
        {"num_new_tokens": 1, "num_lookahead_tokens": bad},
        {"num_new_tokens": 1, "num_new_computed_tokens": bad},
        {"num_new_tokens": 1, "reserved_blocks": bad},
    ):
        name = next(k for k, v in kwargs.items() if v is bad)
        assert_refused(m, lambda kw=kwargs: m.allocate_slots(running, **kw), TypeError, name)
    fresh = make_request("f", range(3))
    assert_refused(m, lambda: m.allocate_slots(fresh, bad), TypeError, "num_new_tokens")


# ---------------------------------------------------------------------------
# Item 3: a raised error changes nothing


@pytest.mark.parametrize(
    "bad,error", [(-1, ValueError), (1.0, TypeError), (2**63, ValueError), ("7", TypeError),
                  ([[1]], TypeError), ([1, -2], ValueError), ([1, 2.5], TypeError),
                  (True, TypeError)]
)  # fmt: skip
def test_append_output_token_ids_checks_before_appending(bad, error):
    request = make_request("r", range(6))
    hashes = list(request.block_hashes)
    with pytest.raises(error, match="token_ids"):
        request.append_output_token_ids(bad)
    assert (request.num_tokens, request.output_token_ids, request.block_hashes) == (6, [], hashes)
    request.append_output_token_ids([6, 7])  # later appends are unaffected
    assert request.num_tokens == 8 and len(request.block_hashes) == 2
    assert request.block_hashes == make_request("s", range(8)).block_hashes


def test_cache_full_blocks_with_more_full_blocks_than_blocks_stamps_nothing():
    pool = BlockPool(8, hash_block_size=BS, enable_kv_cache_events=True)
    request = make_request("r", range(12))
    blocks = pool.get_new_blocks(2)
    before = pool_state(pool)
    with pytest.raises(ValueError, match=r"num_full_blocks must be in \[0, 2\], got 3"):
        pool.cache_full_blocks(request, blocks, 0, 3, BS, 0)
    assert pool_state(pool) == before


def test_free_queue_refuses_a_block_already_queued():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft_n(2)
    before = queue_state(queue)
    for call in (
        lambda: queue.append(blocks[3]),
        lambda: queue.append_n([popped[0], blocks[4]]),
        lambda: queue.prepend_n([popped[0], popped[1], blocks[2]]),
        lambda: queue.append_n([popped[0], popped[0]]),
        lambda: queue.prepend_n([popped[1], "block"]),
    ):
        with pytest.raises((ValueError, TypeError), match="free queue|KVCacheBlock"):
            call()
        assert queue_state(queue) == before
        assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    with pytest.raises(ValueError, match="given twice"):
        FreeKVCacheBlockQueue([KVCacheBlock(0), blocks[0]][:1] * 2)
    queue.append_n(popped)  # the queue still works
    assert queue_state(queue)[0] == [2, 3, 4, 0, 1]


def test_float_token_ids_are_rejected_everywhere():
    """Multi-block float prompts used to be truncated and share [1]*8's cache entries."""
    for prompt in ([1.5] * 8, [1.0] * 8, [1] * 7 + [1.5], np.array([1.5] * 8)):
        with pytest.raises(TypeError, match="prompt_token_ids"):
            make_request("f", prompt)
        with pytest.raises(TypeError, match="prompt_token_ids"):
            Request("g", prompt)
    for call in (
        lambda: SHA_CBOR.hash_blocks(b"p" * 32, [1.5] * 8, 4, [None, None]),
        lambda: SHA_CBOR.hash_blocks(b"p" * 32, [1.5] * 4, 4, [None]),
        lambda: hash_block_tokens(SHA_CBOR, None, [1.5, 2.0]),
        lambda: hash_block_tokens(hash, None, [1.5, 2.0]),
    ):
        with pytest.raises(TypeError, match="integers"):
            call()


# ---------------------------------------------------------------------------
# Item 4: non-integer sizes are errors, not coerced


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: BlockPool(8.5), "num_gpu_blocks"),
        (lambda: KVCacheManager.from_spec(FullAttentionSpec(4), 8.5, 64), "num_blocks"),
        (lambda: FullAttentionSpec(block_size="4"), "block_size"),
        (lambda: FullAttentionSpec(block_size=4.0), "block_size"),
        (lambda: KVCacheManager.from_spec(FullAttentionSpec(4), 8, 64.0), "max_model_len"),
        (lambda: BlockTable(4, 2, 2).add_row([1], row_idx=True), "row_idx"),
        (lambda: BlockTable(4.0, 2, 2), "block_size"),
        (lambda: EncoderCacheManager(10.0), "cache_size"),
        (lambda: get_request_block_hasher("4", SHA_CBOR), "block_size"),
        (lambda: BlockPool(8).get_new_blocks(1.0), "num_blocks"),
    ],
)
def test_non_integer_sizes_are_type_errors_naming_the_argument(call, name):
    with pytest.raises(TypeError, match=name):
        call()


# ---------------------------------------------------------------------------
# Item 5: the seed's encoder-cache semantics


def _mm_request(rid: str, *sizes: int) -> Request:
    features = [MultiModalFeatureSpec(f"img{i}-{n}", 2 + 10 * i, n) for i, n in enumerate(sizes)]
    return Request(rid, list(range(10 * len(sizes) + 4)), mm_features=features)


@pytest.mark.parametrize("cls", [EncoderCacheManager, EncoderDecoderCacheManager])
def test_free_encoder_input_of_an_input_not_held_is_a_noop(cls):
    manager = cls(20)
    request = _mm_request("r", 4, 5)
    manager.allocate(request, 0)
    free_slots = manager.num_free_slots
    for _ in range(2):  # never allocated, then freed twice
        manager.free_encoder_input(request, 1)
        assert manager.num_free_slots == free_slots
    manager.free_encoder_input(request, 0)
    manager.free_encoder_input(request, 0)
    assert manager.get_cached_input_ids(request) == frozenset()
    if cls is EncoderDecoderCacheManager:
        assert manager.num_free_slots == 20


@pytest.mark.parametrize("cls", [EncoderCacheManager, EncoderDecoderCacheManager])
def test_admission_check_fails_an_item_that_could_never_be_scheduled(cls):
    manager = cls(8)
    manager.check_admission(_mm_request("ok", 4, 8), encoder_compute_budget=8)
    with pytest.raises(ValueError, match=r"input 1 .*needs 9 .*cache size"):
        manager.check_admission(_mm_request("big", 4, 9), encoder_compute_budget=16)
    with pytest.raises(ValueError, match=r"input 0 .*needs 6 .*compute budget"):
        manager.check_admission(_mm_request("slow", 6), encoder_compute_budget=5)
    request = _mm_request("big", 9)
    assert not manager.can_allocate(request, 0, 16, 0)  # what a scheduler would loop on


# ---------------------------------------------------------------------------
# Item 6: vLLM's signatures

VLLM_SIGNATURES = {
    KVCacheManager.__init__: [
        "self", "kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size",
        "max_in_flight_tokens", "enable_caching", "use_eagle", "num_hash_lookahead_tokens",
        "num_prefill_lookahead", "log_stats", "enable_kv_cache_events", "dcp_world_size",
        "pcp_world_size", "metrics_collector", "watermark",
        "enable_mamba_shared_prefix_checkpoint",
    ],
    KVCacheManager.allocate_slots: [
        "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
        "skip_zeroing_group_ids",
    ],
    KVCacheManager.get_computed_blocks: ["self", "request", "max_cache_hit_length"],
    VLLMRequest.__init__: [
        "self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params",
        "client_index", "arrival_time", "prompt_embeds", "prompt_is_token_ids", "mm_features",
        "lora_request", "cache_salt", "priority", "trace_headers", "block_hasher", "resumable",
        "session_id", "reasoning_ended", "reasoning_parser_kwargs", "abort_immediately",
        "kv_hints",
    ],
    BlockPool.__init__: [
        "self", "num_gpu_blocks", "enable_caching", "hash_block_size", "enable_kv_cache_events",
        "metrics_collector", "num_hash_lookahead_tokens", "medium",
    ],
    EncoderCacheManager.__init__: ["self", "cache_size"],
    EncoderDecoderCacheManager.__init__: ["self", "cache_size"],
    EncoderCacheManager.can_allocate: [
        "self", "request", "input_id", "encoder_compute_budget", "num_embeds_to_schedule",
    ],
    get_request_block_hasher: ["hash_block_size", "caching_hash_fn", "num_hash_lookahead_tokens"],
    hash_block_tokens: ["hash_fn", "parent_block_hash", "curr_block_token_ids", "extra_keys"],
}  # fmt: skip


@pytest.mark.parametrize("fn", list(VLLM_SIGNATURES), ids=lambda f: f.__qualname__)
def test_positional_parameters_are_vllms(fn):
    """vLLM's positional parameters, in its order (jaxkv's extras are keyword-only)."""
    positional = [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    assert positional == VLLM_SIGNATURES[fn]


def test_vllm_style_calls_mean_the_same_thing():
    config = KVCacheConfig.single_group(FullAttentionSpec(BS), 12)
    m = KVCacheManager(config, 64, BS, BS, None, True)  # vLLM's positional call
    assert (m.scheduler_block_size, m.hash_block_size, m.enable_caching) == (BS, BS, True)
    with pytest.raises(ValueError, match="scheduler_block_size=8"):
        KVCacheManager(config, 64, 8, BS)  # the old third positional was hash_block_size
    with pytest.raises(ValueError, match="dcp_world_size"):  # use_eagle is supported (#11)
        KVCacheManager(config, 64, BS, BS, dcp_world_size=2)
    request = Request("r", list(range(9)), SamplingParams(max_tokens=5), None,
                      block_hasher=get_request_block_hasher(BS, SHA_CBOR))  # fmt: skip
    assert request.max_tokens == 5
    assert Request("p", [1], None, object()).max_tokens == 1  # pooling
    blocks, num_hits, boundary = m.get_computed_blocks(request)
    assert (blocks.get_block_ids(), num_hits, boundary) == (([],), 0, 0)
    # allocate_slots(request, new, new_computed, blocks, lookahead, external, delay_cache)
    new = m.allocate_slots(request, 9, 0, None, 0, 0, True)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert all(b.block_hash is None for b in m.block_pool.blocks), "delay_cache_blocks"
    pool = BlockPool(10, True, BS, False, None, 0, "GPU")
    assert (pool.hash_block_size, pool.enable_kv_cache_events, pool.medium) == (BS, False, "GPU")
    assert EncoderCacheManager.create_manager(cache_size=5, vllm_config=None).cache_size == 5


def test_full_sequence_must_fit_and_reserved_blocks():
    m = make_manager(num_blocks=6)  # 5 usable blocks
    request = make_request("r", range(24))  # 6 blocks in all
    before = manager_state(m)
    assert m.allocate_slots(request, 8, full_sequence_must_fit=True) is None
    assert m.allocate_slots(request, 8, reserved_blocks=4) is None
    assert manager_state(m) == before
    assert m.allocate_slots(request, 8, reserved_blocks=3).get_block_ids() == ([1, 2],)


def test_any_callable_is_a_hash_function_as_in_vllm():
    """vLLM's callers pass e.g. the builtin `hash` (it returns ints, not bytes)."""
    h0 = hash_block_tokens(hash, None, [1, 2])
    assert h0 == hash((hashing.get_none_hash(), (1, 2), None))
    assert hash_block_tokens(hash, h0, [3, 4], ("x",)) == hash((h0, (3, 4), ("x",)))
    hasher = get_request_block_hasher(2, hash)
    request = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
    assert request.block_hashes == [h0, hash_block_tokens(hash, h0, [3, 4])]

    def sha(obj) -> bytes:
        return hashlib.sha256(repr(obj).encode()).digest()

    request = Request("s", [1, 2, 3, 4], block_hasher=get_request_block_hasher(2, sha))
    first = sha((hashing.get_none_hash(), (1, 2), None))
    assert request.block_hashes == [first, sha((first, (3, 4), None))]


def test_get_one_block_takes_vllms_combined_key():
    m = make_manager()
    request = make_request("a", range(9))
    admit(m, request)
    key = make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert m.block_pool.get_one_block(key) is m.block_pool.blocks[2]
    assert m.block_pool.cached_block_hash_to_block.get_one_block(key) is m.block_pool.blocks[2]
    assert m.block_pool.get_one_block(make_block_hash_with_group_id(b"x" * 32, 0)) is None
    with pytest.raises(TypeError, match="key"):
        m.block_pool.get_one_block(request.block_hashes[1].hex())


def test_encoder_request_cached_ids_and_mm_position():
    manager = EncoderCacheManager(20)
    request = _mm_request("r", 4, 5)
    manager.allocate(request, 1)
    assert manager.request_cached_ids == {"r": {1}}
    manager.request_cached_ids["r"].add(0)  # a copy: the manager's state is its own
    assert manager.get_cached_input_ids(request) == {1}
    is_embed = np.array([True, False, True])
    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="img",
        mm_position=PlaceholderRange(offset=2, length=3, is_embed=is_embed),
    )
    assert (feature.offset, feature.length, feature.num_embeds) == (2, 3, 2)
    positioned = MultiModalFeatureSpec("img", 2, 3, is_embed)
    assert (positioned.mm_position.offset, positioned.mm_position.length) == (2, 3)
    assert positioned.mm_position.is_embed is positioned.is_embed


def test_free_queue_sentinels_have_vllms_names():
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1), KVCacheBlock(2)])
    assert queue.fake_free_list_head is queue.head and queue.fake_free_list_tail is queue.tail
    assert queue.fake_free_list_head.next_free_block.block_id == 1
    assert queue.fake_free_list_tail.prev_free_block.block_id == 2


# ---------------------------------------------------------------------------
# Item 7: what tests can see of the structure


def test_blocks_are_stamped_through_the_blocks_api(monkeypatch):
    calls = []
    original = KVCacheBlock.try_set_hashes

    def spy(blocks, block_hashes, group_id):
        stamped = original(blocks, block_hashes, group_id)
        calls.extend(block.block_id for block in stamped)
        return stamped

    monkeypatch.setattr(KVCacheBlock, "try_set_hashes", staticmethod(spy))
    m = make_manager()
    admit(m, make_request("a", range(9)))
    assert calls == [1, 2]
    with pytest.raises(ValueError, match="set once"):
        m.block_pool.blocks[1].set_hash(b"x" * 32, 0)


def test_decode_shortcut_and_general_path_agree_on_every_step():
    """The shortcut answers from limits `_slot_state_for` derives; with it off, the general
    path must give the same results on the same steps."""
    results = []
    for use_shortcut in (True, False):
        m = make_manager(num_blocks=20)
        m._use_slot_state = use_shortcut
        requests = [make_request(f"r{i}", range(i, i + 6)) for i in range(3)]
        out = []
        for r in requests:
            admit(m, r)
        for step in range(14):
            for r in requests:
                new = m.allocate_slots(r, 1, num_lookahead_tokens=step % 3)
                out.append(None if new is None else new.get_block_ids())
                r.num_computed_tokens = r.num_tokens
                r.append_output_token_ids(step)
        results.append((out, pool_state(m.block_pool)))
    assert results[0] == results[1]


def test_benchmarks_record_only_when_asked(tmp_path, monkeypatch):
    from benchmarks import _common

    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(_common, "OUT_DIR", tmp_path / "out")
    unrecorded = _common.write_json("x", {"a": 1})
    assert unrecorded.parent == tmp_path / "out" and not (tmp_path / "results").exists()
    recorded = _common.write_json("x", {"a": 2}, record=True)
    assert recorded == tmp_path / "results" / "x.json"
    assert json.loads(recorded.read_text())["a"] == 2


def test_benchmarks_import_without_path_edits():
    import benchmarks.bench_encoder
    import benchmarks.bench_host

    for module in (benchmarks.bench_host, benchmarks.bench_encoder):
        assert "sys.path" not in inspect.getsource(module)


def test_cbor_fast_module_documents_what_it_equals():
    import jaxkv.cbor_fast as cbor_fast

    doc = cbor_fast.__doc__
    assert "canonical=True" in doc and "test_cbor_uint_arrays_equal_cbor2_canonical" in doc
