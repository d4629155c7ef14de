"""numpy integers are integers at the host core's entry points (issue 25).

A numpy integer given where an int is expected is converted where it enters, so
the call does exactly what the plain-int call does (twin managers and pools
compared after every call) and no inner layer ever holds one. Bools stay
refused. A refused call changes nothing, prefix hits included. Also: pool sizes
below 2 are refused (no silent 2-block pool), `BlockPool.touch` takes vLLM's flat
form beside the per-group one, and `SamplingParams` takes numpy values, vLLM's
`top_k=-1` and any int seed.
"""

from __future__ import annotations

import numpy as np
import pytest
from _state import manager_state, pool_state, queue_state
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import (
    BlockPool,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MultiModalFeatureSpec,
    Request,
    SamplingParams,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.kv_cache_utils import resolve_kv_cache_block_sizes

SHA_CBOR = get_hash_fn_by_name("sha256_cbor")
BS = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 11

INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
FLOAT_TYPES = (np.float16, np.float32, np.float64)

pytestmark = pytest.mark.usefixtures("fixed_none_hash")


def fitting_types(value: int) -> list[type]:
    """The numpy integer types that hold `value`."""
    return [t for t in INT_TYPES if np.iinfo(t).min <= value <= np.iinfo(t).max]


def as_numpy(data: st.DataObject, value: int) -> np.integer:
    """`value` as a numpy integer of a drawn type that holds it."""
    return data.draw(st.sampled_from(fitting_types(value)))(value)


def make_manager(num_blocks: int = NUM_BLOCKS) -> KVCacheManager:
    return KVCacheManager.from_spec(FullAttentionSpec(BS), num_blocks, MAX_MODEL_LEN)


def make_request(rid: str, tokens, **kwargs) -> Request:
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(BS, SHA_CBOR), **kwargs)


def all_python_ints(manager: KVCacheManager) -> bool:
    """Whether every count and id the manager and its pool hold is a Python int."""
    pool = manager.block_pool
    values: list[object] = [pool.num_gpu_blocks, pool.free_block_queue.num_free_blocks]
    for block in pool.blocks:
        values += [block.block_id, block.ref_cnt, block.group_id]
    for group in manager.coordinator.single_type_managers:
        values += list(group.num_cached_block.values())
        values += [b.block_id for blocks in group.req_to_blocks.values() for b in blocks]
    for state in manager._slot_states.values():
        values += [state.capacity, state.caches_at, state.releases_at, state.quiet_until]
    return all(type(v) is int for v in values)


def cached_prefix_manager() -> tuple[KVCacheManager, Request]:
    """A manager whose prefix cache holds 2 full blocks of tokens 0..8 (all free), and a
    waiting request that hits them."""
    manager = make_manager()
    first = make_request("first", range(9))
    assert manager.allocate_slots(first, 9) is not None
    first.num_computed_tokens = 9
    manager.free(first)
    return manager, make_request("second", range(9))


# -- the reported failure: numpy counts with prefix hits ------------------------


def test_numpy_counts_with_prefix_hits_allocate_like_ints() -> None:
    plain, plain_req = cached_prefix_manager()
    twin, twin_req = cached_prefix_manager()
    hits, num_hits, _ = plain.get_computed_blocks(plain_req)
    twin_hits, twin_num_hits, _ = twin.get_computed_blocks(twin_req)
    assert num_hits == twin_num_hits == 8
    expected = plain.allocate_slots(plain_req, 9 - num_hits, num_hits, hits)
    got = twin.allocate_slots(
        twin_req,
        np.int64(9 - num_hits),
        np.int32(num_hits),
        twin_hits,
        num_lookahead_tokens=np.uint8(0),
        num_external_computed_tokens=np.int16(0),
        num_encoder_tokens=np.uint64(0),
        reserved_blocks=np.int8(0),
    )
    assert got is not None and expected is not None
    assert got.get_block_ids() == expected.get_block_ids()
    assert twin.get_block_ids("second") == plain.get_block_ids("second") == ([1, 2, 3],)
    assert pool_state(twin.block_pool) == pool_state(plain.block_pool)
    assert all_python_ints(twin)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_lookahead_tokens": np.int64(-1)}, ValueError, "num_lookahead_tokens"),
        ({"num_lookahead_tokens": np.float64(1.0)}, TypeError, "num_lookahead_tokens"),
        ({"num_lookahead_tokens": True}, TypeError, "num_lookahead_tokens"),
        ({"num_lookahead_tokens": np.True_}, TypeError, "num_lookahead_tokens"),
        ({"reserved_blocks": np.int32(-2)}, ValueError, "reserved_blocks"),
        ({"num_new_tokens": np.int64(MAX_MODEL_LEN)}, ValueError, "max_model_len"),
        ({"num_new_tokens": np.int64(0)}, ValueError, "num_new_tokens"),
        ({"num_new_computed_tokens": np.int64(4)}, ValueError, "num_new_computed_tokens"),
        ({"num_external_computed_tokens": np.int64(5)}, ValueError, "passes its 9 tokens"),
    ],
)
def test_allocate_slots_refusal_with_prefix_hits_changes_nothing(kwargs, error, match) -> None:
    """The hit blocks are free and cached: a refused allocation leaves them free (their
    ref counts 0, the free count as it was), as if the request was never seen."""
    manager, request = cached_prefix_manager()
    hits, num_hits, _ = manager.get_computed_blocks(request)
    assert num_hits == 8
    ref_cnts = [b.ref_cnt for b in manager.block_pool.blocks]
    num_free = manager.num_free_blocks
    before = manager_state(manager)
    args = {"num_new_tokens": np.int64(1), "num_new_computed_tokens": np.int64(num_hits)}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        manager.allocate_slots(request, new_computed_blocks=hits, **args)
    assert [b.ref_cnt for b in manager.block_pool.blocks] == ref_cnts
    assert manager.num_free_blocks == num_free
    assert manager_state(manager) == before
    # The same request is then admitted normally.
    assert manager.allocate_slots(request, 1, num_hits, hits).get_block_ids() == ([3],)


def test_allocate_slots_out_of_blocks_with_prefix_hits_changes_nothing() -> None:
    manager, request = cached_prefix_manager()
    hits, num_hits, _ = manager.get_computed_blocks(request)
    before = manager_state(manager)
    # 8 hit tokens + 40 new need 12 blocks: the pool has 10.
    assert manager.allocate_slots(request, np.int64(40), np.int64(num_hits), hits) is None
    assert manager_state(manager) == before


def test_get_computed_blocks_takes_a_numpy_max_cache_hit_length() -> None:
    manager, request = cached_prefix_manager()
    for max_length in (np.int64(5), np.uint16(8), np.int8(0)):
        blocks, num_hits, _ = manager.get_computed_blocks(request, max_length)
        assert type(num_hits) is int
        assert num_hits == manager.get_computed_blocks(request, int(max_length))[1]


def test_skip_zeroing_group_ids_take_numpy_ints() -> None:
    manager = make_manager()
    request = make_request("r", range(9))
    new = manager.allocate_slots(
        request, 0, num_external_computed_tokens=np.int64(8), skip_zeroing_group_ids=[np.int8(0)]
    )
    assert new is not None and manager.get_block_ids("r") == ([1, 2],)
    for bad in ([True], [np.True_], [np.int64(1)], [0.0], np.int64(0)):
        other = make_manager()
        before = manager_state(other)
        with pytest.raises(ValueError, match="skip_zeroing_group_ids"):
            other.allocate_slots(
                make_request("r", range(9)),
                0,
                num_external_computed_tokens=8,
                skip_zeroing_group_ids=bad,
            )
        assert manager_state(other) == before


def test_other_manager_entry_points_take_numpy_ints() -> None:
    manager = KVCacheManager.from_spec(
        FullAttentionSpec(BS),
        np.int64(NUM_BLOCKS),
        np.int32(MAX_MODEL_LEN),
        hash_block_size=np.uint8(BS),
        max_in_flight_tokens=np.int16(32),
        num_prefill_lookahead=np.uint32(0),
        scheduler_block_size=np.int64(BS),
    )
    for value in (
        manager.max_model_len,
        manager.max_in_flight_tokens,
        manager.hash_block_size,
        manager.block_pool.num_gpu_blocks,
        manager.block_pool.hash_block_size,
    ):
        assert type(value) is int
    request = make_request("r", range(9))
    assert manager.allocate_slots(request, 9, delay_cache_blocks=True) is not None
    request.num_computed_tokens = 9
    manager.cache_blocks(request, np.int64(9))
    assert [b.block_hash is not None for b in manager.block_pool.blocks[1:4]] == [
        True,
        True,
        False,
    ]
    assert manager.get_num_common_prefix_blocks("r", np.int64(1)) == [3]
    assert all_python_ints(manager)


# -- pools and queues --------------------------------------------------------


def test_get_new_blocks_and_popleft_n_take_numpy_ints() -> None:
    pool = BlockPool(10, True, BS)
    assert [b.block_id for b in pool.get_new_blocks(np.int64(2))] == [1, 2]
    assert [b.block_id for b in pool.get_new_blocks(np.uint8(0))] == []
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(6)])
    assert [b.block_id for b in queue.popleft_n(np.int32(2))] == [0, 1]
    popped, stamped = queue.popleft_n_for_holders(np.uint64(1), np.int8(2))
    assert [(b.block_id, b.ref_cnt) for b in popped] == [(2, 2)] and stamped == []


@pytest.mark.parametrize("count", [np.int64(20), np.uint8(8), 20])
def test_get_new_blocks_refusal_names_the_count_and_changes_nothing(count) -> None:
    pool = BlockPool(8, True, BS)  # 7 free
    before = pool_state(pool)
    with pytest.raises(ValueError, match=f"cannot get {int(count)} blocks: 7 are free"):
        pool.get_new_blocks(count)
    assert pool_state(pool) == before
    queue = pool.free_block_queue
    with pytest.raises(ValueError, match=f"cannot pop {int(count)} blocks: 7 are free"):
        queue.popleft_n(count)
    assert pool_state(pool) == before


@pytest.mark.parametrize("bad", [True, np.True_, np.float64(1.0), 1.0, None, "1"])
def test_counts_refuse_bools_and_non_integers(bad) -> None:
    pool = BlockPool(8, True, BS)
    before = pool_state(pool)
    with pytest.raises(TypeError, match="num_blocks"):
        pool.get_new_blocks(bad)
    with pytest.raises(TypeError, match="n must be an integer"):
        pool.free_block_queue.popleft_n(bad)
    with pytest.raises(TypeError, match="new_refs"):
        pool.free_block_queue.popleft_n_for_holders(1, bad)
    assert pool_state(pool) == before


def test_popleft_n_for_holders_refuses_negative_references() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(4)])
    before = queue_state(queue)
    with pytest.raises(ValueError, match="new_refs must be >= 0"):
        queue.popleft_n_for_holders(1, -1)
    assert queue_state(queue) == before


def test_block_and_cache_entry_points_store_python_ints() -> None:
    assert type(KVCacheBlock(np.int64(3)).block_id) is int
    block = KVCacheBlock(1)
    block.set_hash(b"h" * 32, np.uint8(2))
    assert type(block.group_id) is int and block.block_hash == b"h" * 32 + b"\0\0\0\2"
    plain, twin = BlockPool(10, True, BS), BlockPool(np.int64(10), True, np.int32(BS))
    assert type(twin.num_gpu_blocks) is int and type(twin.hash_block_size) is int
    request = make_request("r", range(9))
    for pool, ints in ((plain, int), (twin, np.int64)):
        blocks = pool.get_new_blocks(ints(3))
        pool.cache_full_blocks(request, blocks, ints(0), ints(2), ints(BS), ints(0))
    assert pool_state(twin) == pool_state(plain)
    assert all(type(b.group_id) is int for b in twin.blocks)


# -- pool sizes ----------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [0, -3, 1, np.int64(1)])
def test_from_spec_refuses_pools_below_two_blocks(num_blocks) -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be >= 2 \(block 0 is the null block\)"):
        KVCacheManager.from_spec(FullAttentionSpec(BS), num_blocks, MAX_MODEL_LEN)


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_a_config_below_two_blocks_is_refused(num_blocks) -> None:
    config = KVCacheConfig.single_group(FullAttentionSpec(BS), num_blocks)
    with pytest.raises(ValueError, match=r"kv_cache_config\.num_blocks must be >= 2"):
        KVCacheManager(config, MAX_MODEL_LEN)


@pytest.mark.parametrize("num_blocks", [1.0, True, "4", None])
def test_from_spec_refuses_non_integer_pool_sizes(num_blocks) -> None:
    with pytest.raises(TypeError, match="num_blocks must be an integer"):
        KVCacheManager.from_spec(FullAttentionSpec(BS), num_blocks, MAX_MODEL_LEN)


def test_smallest_pool_has_one_usable_block() -> None:
    manager = make_manager(np.uint8(2))
    assert manager.block_pool.num_gpu_blocks == 2 and manager.num_free_blocks == 1


# -- touch --------------------------------------------------------------------


def _touch_pool() -> tuple[BlockPool, list[KVCacheBlock]]:
    pool = BlockPool(8, True, BS)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks[:2])  # blocks 1 and 2 free, block 3 held
    return pool, blocks


@pytest.mark.parametrize(
    "form",
    [
        lambda blocks: blocks,  # vLLM: a flat sequence
        lambda blocks: tuple(blocks),
        lambda blocks: iter(blocks),
        lambda blocks: [blocks],  # one sequence per group
        lambda blocks: ([blocks[0]], blocks[1:]),
        lambda blocks: [[], blocks],
    ],
)
def test_touch_takes_the_flat_and_the_per_group_form(form) -> None:
    pool, blocks = _touch_pool()
    pool.touch(form([blocks[0], blocks[2], pool.null_block]))
    assert [b.ref_cnt for b in pool.blocks[:4]] == [0, 1, 0, 2]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [2, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda pool, blocks: [blocks[0], [blocks[1]]],  # flat, then a list
        lambda pool, blocks: [[blocks[0]], blocks[1]],  # per group, then a block
        lambda pool, blocks: [blocks[0], KVCacheBlock(2)],  # not this pool's block
        lambda pool, blocks: [blocks[0], "x"],
        lambda pool, blocks: [[blocks[0]], [None]],
        lambda pool, blocks: [3],
    ],
)
def test_touch_refuses_mixed_or_foreign_blocks_and_changes_nothing(make_bad) -> None:
    pool, blocks = _touch_pool()
    before = pool_state(pool)
    with pytest.raises((TypeError, ValueError), match="touch"):
        pool.touch(make_bad(pool, blocks))
    assert pool_state(pool) == before


def test_touch_with_nothing_changes_nothing() -> None:
    pool, _ = _touch_pool()
    before = pool_state(pool)
    pool.touch([])
    pool.touch([[], []])
    assert pool_state(pool) == before


# -- requests, multimodal items, block sizes ----------------------------------


def test_request_entry_points_store_python_ints() -> None:
    feature = MultiModalFeatureSpec("img", np.int64(2), np.uint8(3))
    assert type(feature.offset) is int and type(feature.length) is int
    assert type(feature.mm_position.offset) is int
    request = Request("r", [1, 2, 3, 4, 5, 6], mm_features=[feature], max_tokens=np.int32(4))
    assert type(request.max_tokens) is int and request.max_tokens == 4
    assert request.get_num_encoder_embeds(np.int64(0)) == 3
    with pytest.raises(ValueError, match="input_id 1 is out of range"):
        request.get_num_encoder_embeds(np.int64(1))
    with pytest.raises(TypeError, match="input_id"):
        request.get_num_encoder_embeds(np.True_)


def test_prefix_match_unit_takes_numpy_ints_and_refuses_bools() -> None:
    config = KVCacheConfig.single_group(FullAttentionSpec(BS), 8)
    sizes = resolve_kv_cache_block_sizes(config, prefix_match_unit=np.int64(BS))
    assert sizes == (BS, BS) and all(type(s) is int for s in sizes)
    for bad in (True, np.True_, 4.0, 0, np.int64(-4)):
        with pytest.raises(ValueError, match="prefix_match_unit"):
            resolve_kv_cache_block_sizes(config, prefix_match_unit=bad)


# -- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize("int_type", INT_TYPES)
@pytest.mark.parametrize("float_type", FLOAT_TYPES)
def test_sampling_params_take_numpy_values_as_python_ones(int_type, float_type) -> None:
    params = SamplingParams(
        max_tokens=int_type(5),
        temperature=float_type(0.5),
        top_k=int_type(7),
        top_p=float_type(0.75),
        seed=int_type(9),
        stop_token_ids=[int_type(3)],
        prompt_logprobs=int_type(1),
        eos_token_id=int_type(2),
    )
    assert params == SamplingParams(
        max_tokens=5,
        temperature=0.5,
        top_k=7,
        top_p=0.75,
        seed=9,
        stop_token_ids=(3,),
        prompt_logprobs=1,
        eos_token_id=2,
    )
    for name in ("max_tokens", "top_k", "seed", "prompt_logprobs", "eos_token_id"):
        assert type(getattr(params, name)) is int, name
    assert type(params.temperature) is float and type(params.top_p) is float
    assert type(params.stop_token_ids[0]) is int
    # An integer temperature or top_p is a float once built.
    assert type(SamplingParams(temperature=int_type(1), top_p=int_type(1)).top_p) is float


def test_sampling_params_take_vllm_disabled_top_k_and_any_int_seed() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=np.int8(-1)).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    for seed in (0, -2, 2**31, 2**64 + 5, -(2**70), np.uint64(2**64 - 1)):
        assert SamplingParams(seed=seed).seed == int(seed)


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("top_k", -2, ValueError, r"top_k must be an int >= -1 \(0 and -1 disable top-k\)"),
        ("top_k", np.int64(-5), ValueError, "top_k must be an int >= -1"),
        ("top_k", True, ValueError, "top_k"),
        ("top_k", 2.0, ValueError, "top_k"),
        ("seed", 1.5, ValueError, r"seed must be None or an int \(-1 means None\)"),
        ("seed", np.True_, ValueError, "seed"),
        ("max_tokens", np.int64(0), ValueError, r"max_tokens must be None \(up to the model"),
        ("max_tokens", np.float32(3.0), ValueError, "max_tokens"),
        ("max_tokens", True, ValueError, "max_tokens"),
        ("temperature", np.float32("nan"), ValueError, "temperature must be a float in \\[0, 2\\]"),
        ("temperature", True, ValueError, "temperature"),
        ("temperature", np.float64(-0.5), ValueError, "temperature"),
        ("top_p", np.float16(0.0), ValueError, r"top_p must be a float in \(0, 1\]"),
        ("top_p", np.True_, ValueError, "top_p"),
        ("stop_token_ids", [np.int64(1), np.int64(-2)], ValueError, "stop_token_ids"),
        ("stop_token_ids", [np.True_], ValueError, "stop_token_ids"),
        ("eos_token_id", np.int32(-1), ValueError, "eos_token_id"),
        ("prompt_logprobs", np.bool_(False), ValueError, "prompt_logprobs"),
    ],
)
def test_sampling_params_refusals_name_the_field(field, value, error, match) -> None:
    with pytest.raises(error, match=f"SamplingParams.{match}"):
        SamplingParams(**{field: value})


def test_update_from_generation_config_checks_the_eos_token_id() -> None:
    params = SamplingParams()
    params.update_from_generation_config({}, np.int64(7))
    assert params.eos_token_id == 7 and type(params.eos_token_id) is int
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="eos_token_id"):
            params.update_from_generation_config({}, bad)
        assert params.eos_token_id == 7


# -- twins: numpy-typed calls do what plain-int calls do -------------------------------


def _same_result_with_numpy_ints(data, sides, counts, count_kwargs, **flags):
    """`allocate_slots(request, *counts, [hit_blocks], **count_kwargs, **flags)` on each
    `(manager, request, hit_blocks or None)` of `sides`: the counts as ints on the first,
    as numpy integers on the twin; both give the same block ids, `None` or error."""
    results = []
    for (manager, request, blocks), to in zip(
        sides, (int, lambda v: as_numpy(data, v)), strict=True
    ):
        args = [to(c) for c in counts] + ([] if blocks is None else [blocks])
        kwargs = {name: to(value) for name, value in count_kwargs.items()}
        try:
            new = manager.allocate_slots(request, *args, **kwargs, **flags)
            results.append(None if new is None else new.get_block_ids())
        except ValueError as error:
            results.append(str(error))
    assert results[0] == results[1]
    return results[0]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_get_new_blocks_with_numpy_ints_matches_plain_ints(data) -> None:
    plain, twin = BlockPool(9, True, BS), BlockPool(9, True, BS)
    held: list[tuple[list[KVCacheBlock], list[KVCacheBlock]]] = []
    for _ in range(data.draw(st.integers(1, 8))):
        if held and data.draw(st.booleans()):
            plain_blocks, twin_blocks = held.pop(data.draw(st.integers(0, len(held) - 1)))
            plain.free_blocks(plain_blocks)
            twin.free_blocks(twin_blocks)
        else:
            count = data.draw(st.integers(0, 10))
            try:
                expected: list[KVCacheBlock] | Exception = plain.get_new_blocks(count)
            except ValueError as error:
                expected = error
            try:
                got: list[KVCacheBlock] | Exception = twin.get_new_blocks(as_numpy(data, count))
            except ValueError as error:
                got = error
            if isinstance(expected, Exception):
                assert isinstance(got, ValueError) and str(got) == str(expected)
            else:
                assert not isinstance(got, Exception)
                assert [b.block_id for b in got] == [b.block_id for b in expected]
                held.append((expected, got))
        assert pool_state(twin) == pool_state(plain)


def _step_args(request: Request, data: st.DataObject) -> tuple[int, int]:
    """(new tokens, lookahead tokens) for a running request's next step."""
    remaining = request.num_tokens - request.num_computed_tokens
    if remaining <= 0:
        return 1, data.draw(st.integers(0, 3))
    return data.draw(st.integers(1, remaining)), data.draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_allocate_slots_with_numpy_ints_matches_plain_ints(data) -> None:
    """Admissions (with prefix hits), prefill chunks, decode steps with lookahead and
    frees, each run on two managers: one given plain ints, one numpy integers of drawn
    types. Every result, every refusal and the whole state after each call agree."""
    plain, twin = make_manager(), make_manager()
    waiting: list[tuple[Request, Request]] = []
    running: list[tuple[Request, Request]] = []
    for i in range(data.draw(st.integers(1, 14))):
        action = data.draw(st.sampled_from(["new", "admit", "step", "free"]))
        if action == "new":
            shared = data.draw(st.integers(0, 12))
            own = data.draw(st.integers(1 if shared == 0 else 0, 12))
            tokens = list(range(shared)) + list(range(1000 * (i + 1), 1000 * (i + 1) + own))
            waiting.append((make_request(f"r{i}", tokens), make_request(f"r{i}", tokens)))
        elif action == "admit" and waiting:
            pair = waiting.pop(data.draw(st.integers(0, len(waiting) - 1)))
            (hits, num_hits, _), (twin_hits, twin_num_hits, _) = (
                plain.get_computed_blocks(pair[0]),
                twin.get_computed_blocks(pair[1]),
            )
            assert twin_num_hits == num_hits
            num_new = data.draw(st.integers(0, pair[0].num_tokens - num_hits))
            lookahead = data.draw(st.integers(0, 3))
            reserved = data.draw(st.integers(0, 3))
            must_fit = data.draw(st.booleans())
            result = _same_result_with_numpy_ints(
                data,
                [(plain, pair[0], hits), (twin, pair[1], twin_hits)],
                (num_new, num_hits),
                {"num_lookahead_tokens": lookahead, "reserved_blocks": reserved},
                full_sequence_must_fit=must_fit,
            )
            if isinstance(result, tuple):
                for request in pair:
                    request.num_computed_tokens = num_hits + num_new
                running.append(pair)
            else:
                waiting.append(pair)
        elif action == "step" and running:
            pair = running[data.draw(st.integers(0, len(running) - 1))]
            if pair[0].num_computed_tokens >= pair[0].num_tokens:
                token = data.draw(st.integers(0, 50))
                for request in pair:
                    request.append_output_token_ids(token)
            num_new, lookahead = _step_args(pair[0], data)
            result = _same_result_with_numpy_ints(
                data,
                [(plain, pair[0], None), (twin, pair[1], None)],
                (num_new,),
                {"num_lookahead_tokens": lookahead},
            )
            if isinstance(result, tuple):
                for request in pair:
                    request.num_computed_tokens += num_new
        elif action == "free" and running:
            pair = running.pop(data.draw(st.integers(0, len(running) - 1)))
            plain.free(pair[0])
            twin.free(pair[1])
        assert pool_state(twin.block_pool) == pool_state(plain.block_pool)
        for pair in running:
            rid = pair[0].request_id
            assert twin.get_block_ids(rid) == plain.get_block_ids(rid)
    assert all_python_ints(twin)
