"""Random ill-typed and out-of-range arguments to every host-side public entry point.

Each case corrupts one argument of an otherwise valid call. The call must raise
ValueError, TypeError or KeyError whose message names that argument, and the
object it was called on must be exactly as before (a full state snapshot).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from _state import encoder_state, manager_state, pool_state, queue_state
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv.hashing as hashing
from jaxkv import (
    BlockPool,
    BlockTable,
    EncoderBudget,
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    MultiModalFeatureSpec,
    Request,
    RSWASpec,
    SinkFullAttentionSpec,
    compute_encoder_budget,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    hash_mm_item,
    init_none_hash,
)
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.hashing import BlockHashListWithBlockSize, make_block_hash_with_group_id
from jaxkv.request_hashing import BlockHashMemo

SHA_CBOR = get_hash_fn_by_name("sha256_cbor")
BS = 4
MAX_MODEL_LEN = 64

# Values of the wrong type for anything expecting an integer (bool is not an integer).
NOT_INT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
    st.just(object()),
    st.just(np.float32(1.0)),
)


def bad_int(min_value: int | None = None, max_value: int | None = None) -> st.SearchStrategy:
    """Non-integers, and integers outside [min_value, max_value]."""
    options = [NOT_INT]
    if min_value is not None:
        options.append(st.integers(-(2**70), min_value - 1))
    if max_value is not None:
        options.append(st.integers(max_value + 1, 2**70))
    return st.one_of(options)


NOT_STR = st.one_of(st.integers(), st.floats(), st.binary(max_size=3), st.just(object()))
NOT_TOKENS = st.one_of(
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=9),
    st.lists(st.integers(-(2**70), -1), min_size=1, max_size=3).map(lambda bad: [1, 2, *bad]),
    st.lists(st.integers(2**63, 2**70), min_size=1, max_size=3),
    st.lists(st.text(max_size=2), min_size=1, max_size=3),
    st.just([[1, 2], [3]]),
    st.text(min_size=1, max_size=4),
    st.none(),
    st.floats(),
)


@dataclass
class Case:
    """One entry point: `call(obj, **kwargs)` on `make()`'s object, with `good` arguments.

    `bad` maps the arguments to corrupt to strategies of bad values; `state`
    snapshots the object (None for constructors and functions).
    """

    make: Callable[[], Any]
    call: Callable[..., Any]
    good: Callable[[Any], dict[str, Any]]
    bad: dict[str, st.SearchStrategy]
    state: Callable[[Any], Any] | None = None
    names: dict[str, str] = field(default_factory=dict)  # argument -> name in messages


def _hasher():
    return get_request_block_hasher(BS, SHA_CBOR)


def _request(rid: str = "r", n: int = 9, **kwargs) -> Request:
    return Request(rid, list(range(100, 100 + n)), block_hasher=_hasher(), **kwargs)


def _manager_with_running() -> tuple[KVCacheManager, Request, Request]:
    """A manager holding request "a" (running, mid-decode) and a cached prefix; and "b",
    a waiting request sharing that prefix."""
    manager = KVCacheManager.from_spec(FullAttentionSpec(BS), 16, MAX_MODEL_LEN)
    running = _request("a", 9)
    manager.allocate_slots(running, 9)
    running.num_computed_tokens = 9
    running.append_output_token_ids(1)
    return manager, running, _request("b", 9)


def _manager_obj():
    return _manager_with_running()


def _pool():
    pool = BlockPool(10, True, BS, True, track_freed_block_ids=True)
    pool.held = pool.get_new_blocks(2)
    return pool


def _queue():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.outside = queue.popleft_n(2)
    return queue


def _mm_request(rid: str = "r") -> Request:
    features = [MultiModalFeatureSpec("img-a", 2, 4), MultiModalFeatureSpec("img-b", 8, 3)]
    return Request(rid, list(range(12)), mm_features=features)


def _encoder(cls):
    def make():
        manager = cls(10)
        manager.held_request = _mm_request("held")
        manager.allocate(manager.held_request, 0)
        return manager

    return make


def _table():
    table = BlockTable(BS, 3, 4, num_blocks=16)
    table.add_row([1, 2], 0)
    table.add_row([3], 1)
    return table


def _table_state(table: BlockTable) -> tuple:
    return table.block_table.tolist(), table.num_blocks_per_row.tolist()


def _request_state(request: Request) -> tuple:
    return (request.num_tokens, list(request.all_token_ids), list(request.block_hashes))


def _global_hash_state(_obj) -> tuple:
    return hashing.NONE_HASH, hashing._none_hash_seed


NOT_REQUEST = st.one_of(st.text(max_size=3), st.none(), st.integers(), st.just(object()))
MANAGER_ALLOC = {
    "num_new_tokens": bad_int(1),
    "num_new_computed_tokens": bad_int(0),
    "num_lookahead_tokens": bad_int(0),
    "num_external_computed_tokens": bad_int(0, 0),  # a running request: none (see admission)
    "num_encoder_tokens": bad_int(0),  # sizes cross-attention groups; ignored without one
    "reserved_blocks": bad_int(0),
    "request": NOT_REQUEST,
}

CASES: dict[str, Case] = {
    "KVCacheManager": Case(
        make=lambda: None,
        call=lambda _o, **kw: KVCacheManager(**kw),
        good=lambda _o: {
            "kv_cache_config": KVCacheConfig.single_group(FullAttentionSpec(BS), 8),
            "max_model_len": 64,
            "scheduler_block_size": BS,
            "hash_block_size": BS,
            "enable_caching": True,
            "log_stats": False,
            "max_in_flight_tokens": None,
        },
        bad={
            "max_model_len": bad_int(1),
            "scheduler_block_size": st.one_of(
                bad_int(1).filter(lambda v: v is not None), st.sampled_from([2, 8, 12])
            ),
            "hash_block_size": st.one_of(
                bad_int(1).filter(lambda v: v is not None), st.sampled_from([3, 8])
            ),
            "enable_caching": NOT_INT.filter(lambda v: type(v) is not bool),
            "log_stats": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
            "max_in_flight_tokens": bad_int(1).filter(lambda v: v is not None),
            "kv_cache_config": st.one_of(st.none(), st.integers(), st.just(FullAttentionSpec(4))),
        },
    ),
    "KVCacheManager.allocate_slots (running)": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].allocate_slots(**kw),
        good=lambda o: {"request": o[1], "num_new_tokens": 1},
        bad=MANAGER_ALLOC,
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.allocate_slots (admission)": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].allocate_slots(**kw),
        good=lambda o: {"request": o[2], "num_new_tokens": 9},
        bad={
            **MANAGER_ALLOC,
            # A KV connector's tokens are tokens of the request (9 here).
            "num_external_computed_tokens": bad_int(0, 9),
            "new_computed_blocks": st.one_of(
                st.just(KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)],))),
                st.integers(),
                st.text(max_size=2),
            ),
        },
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.get_computed_blocks": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].get_computed_blocks(**kw),
        good=lambda o: {"request": o[2], "max_cache_hit_length": None},
        bad={
            "request": NOT_REQUEST,
            "max_cache_hit_length": bad_int(0).filter(lambda v: v is not None),
        },
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.cache_blocks": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].cache_blocks(**kw),
        good=lambda o: {"request": o[1], "num_computed_tokens": 8},
        bad={"request": NOT_REQUEST, "num_computed_tokens": bad_int(0)},
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.free": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].free(**kw),
        good=lambda o: {"request": o[1]},
        bad={"request": NOT_REQUEST},
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.get_num_common_prefix_blocks": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].get_num_common_prefix_blocks(**kw),
        good=lambda o: {"running_request_id": "a", "num_running_requests": 1},
        bad={"num_running_requests": bad_int(0).filter(lambda v: v is not None)},
        state=lambda o: manager_state(o[0]),
    ),
    "KVCacheManager.evict_blocks": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].evict_blocks(**kw),
        good=lambda o: {"block_ids": [1]},
        bad={
            "block_ids": st.one_of(
                st.lists(bad_int(1, 15), min_size=1, max_size=3).map(lambda b: [1, *b])
            )
        },
        state=lambda o: manager_state(o[0]),
        names={"block_ids": "block id"},
    ),
    "KVCacheManager.get_block_ids": Case(
        make=_manager_obj,
        call=lambda o, **kw: o[0].get_block_ids(**kw),
        good=lambda _o: {"request_id": "a"},
        bad={"request_id": NOT_STR},
        state=lambda o: manager_state(o[0]),
    ),
    "BlockHashMemo": Case(
        make=lambda: None,
        call=lambda _o, **kw: BlockHashMemo(**kw),
        good=lambda _o: {"hash_fn": SHA_CBOR, "capacity": 4},
        bad={"hash_fn": st.sampled_from([hash, "sha256"]), "capacity": bad_int(1)},
    ),
    "BlockHashListWithBlockSize": Case(
        make=lambda: None,
        call=lambda _o, **kw: BlockHashListWithBlockSize(**kw),
        good=lambda _o: {
            "block_hashes": [b"a", b"b"],
            "hash_block_size": 2,
            "target_block_size": 4,
        },
        bad={"hash_block_size": bad_int(1), "target_block_size": bad_int(1)},
    ),
    "make_block_hash_with_group_id": Case(
        make=lambda: None,
        call=lambda _o, **kw: make_block_hash_with_group_id(**kw),
        good=lambda _o: {"block_hash": b"x" * 32, "group_id": 1},
        bad={
            "block_hash": NOT_STR.filter(lambda v: not isinstance(v, bytes)),
            "group_id": bad_int(0, 2**32 - 1),
        },
    ),
    "BlockPool": Case(
        make=lambda: None,
        call=lambda _o, **kw: BlockPool(**kw),
        good=lambda _o: {"num_gpu_blocks": 8, "enable_caching": True, "hash_block_size": BS},
        bad={
            "num_gpu_blocks": bad_int(2),
            "enable_caching": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
            "hash_block_size": bad_int(1).filter(lambda v: v is not None),
        },
    ),
    "BlockPool.get_new_blocks": Case(
        make=_pool,
        call=lambda o, **kw: o.get_new_blocks(**kw),
        good=lambda _o: {"num_blocks": 2},
        bad={"num_blocks": bad_int(0, 7)},
        state=pool_state,
        names={"num_blocks": "num_blocks|blocks"},
    ),
    "BlockPool.cache_full_blocks": Case(
        make=_pool,
        call=lambda o, **kw: o.cache_full_blocks(**kw),
        good=lambda o: {
            "request": _request("c", 9),
            "blocks": o.held,
            "num_cached_blocks": 0,
            "num_full_blocks": 2,
            "block_size": BS,
            "kv_cache_group_id": 0,
        },
        bad={"num_cached_blocks": bad_int(0), "num_full_blocks": bad_int(0, 2)},
        state=pool_state,
    ),
    "BlockPool.touch": Case(
        make=_pool,
        call=lambda o, **kw: o.touch(**kw),
        good=lambda o: {"blocks": [o.held]},
        bad={
            "blocks": st.sampled_from(
                [[[KVCacheBlock(1)]], [["x"]], [[None]], [[BlockPool(4).blocks[1]]]]
            )
        },
        state=pool_state,
        names={"blocks": "touch"},
    ),
    "BlockPool.free_blocks": Case(
        make=_pool,
        call=lambda o, **kw: o.free_blocks(**kw),
        good=lambda o: {"ordered_blocks": o.held},
        bad={"ordered_blocks": st.sampled_from([["x"], [None], "ab", [1]])},
        state=pool_state,
        names={"ordered_blocks": "free_blocks"},
    ),
    "FreeKVCacheBlockQueue.popleft_n": Case(
        make=_queue,
        call=lambda o, **kw: o.popleft_n(**kw),
        good=lambda _o: {"n": 1},
        bad={"n": bad_int(0, 4)},
        state=queue_state,
        names={"n": "n|pop"},
    ),
    "FreeKVCacheBlockQueue.append_n": Case(
        make=_queue,
        call=lambda o, **kw: o.append_n(**kw),
        good=lambda o: {"blocks": o.outside},
        bad={"blocks": st.sampled_from([["x"], [None], [1, 2]])},
        state=queue_state,
        names={"blocks": "KVCacheBlock"},
    ),
    "FreeKVCacheBlockQueue.remove": Case(
        make=_queue,
        call=lambda o, **kw: o.remove(**kw),
        good=lambda o: {"block": o.head.next_free_block},
        bad={"block": st.sampled_from(["x", None, 3])},
        state=queue_state,
        names={"block": "block"},
    ),
    "Request": Case(
        make=lambda: None,
        call=lambda _o, **kw: Request(**kw),
        good=lambda _o: {
            "request_id": "r",
            "prompt_token_ids": [1, 2, 3, 4, 5],
            "max_tokens": 4,
            "cache_salt": None,
            "block_hasher": _hasher(),
            "lora_request": None,
            "mm_features": None,
        },
        bad={
            "request_id": NOT_STR,
            "prompt_token_ids": NOT_TOKENS,
            "max_tokens": bad_int(0).filter(lambda v: v is not None),
            "cache_salt": NOT_STR,
            "block_hasher": st.sampled_from([hash, "sha256", 4]),
            "lora_request": st.sampled_from(["lora", 1]),
            "mm_features": st.sampled_from([["img"], [None]]),
        },
    ),
    "Request.append_output_token_ids": Case(
        make=lambda: _request("r", 7),
        call=lambda o, **kw: o.append_output_token_ids(**kw),
        good=lambda _o: {"token_ids": 5},
        bad={
            "token_ids": st.one_of(
                NOT_TOKENS,
                st.integers(-(2**70), -1),
                st.integers(2**63, 2**70),
                st.floats(),
                st.booleans(),
            )
        },
        state=_request_state,
    ),
    "Request.get_num_encoder_embeds": Case(
        make=_mm_request,
        call=lambda o, **kw: o.get_num_encoder_embeds(**kw),
        good=lambda _o: {"input_id": 0},
        bad={"input_id": bad_int(0, 1)},
        state=_request_state,
    ),
    "MultiModalFeatureSpec": Case(
        make=lambda: None,
        call=lambda _o, **kw: MultiModalFeatureSpec(**kw),
        good=lambda _o: {"identifier": "x", "offset": 0, "length": 2},
        bad={"identifier": NOT_STR, "offset": bad_int(0), "length": bad_int(1)},
    ),
    "FullAttentionSpec": Case(
        make=lambda: None,
        call=lambda _o, **kw: FullAttentionSpec(**kw),
        good=lambda _o: {"block_size": 4, "num_kv_heads": 2, "head_size": 8},
        bad={"block_size": bad_int(1), "num_kv_heads": bad_int(1), "head_size": bad_int(1)},
        names={"num_kv_heads": "num_kv_heads", "head_size": "head_size"},
    ),
    "RSWASpec": Case(
        make=lambda: None,
        call=lambda _o, **kw: RSWASpec(**kw),
        good=lambda _o: {"block_size": 4, "rswa_window": 8},
        bad={"rswa_window": bad_int(1)},
    ),
    "SinkFullAttentionSpec": Case(
        make=lambda: None,
        call=lambda _o, **kw: SinkFullAttentionSpec(**kw),
        good=lambda _o: {"block_size": 4, "sink_len": 4},
        bad={"sink_len": bad_int(1).filter(lambda v: v is not None)},  # None: vLLM's default
    ),
    "get_request_block_hasher": Case(
        make=lambda: None,
        call=lambda _o, **kw: get_request_block_hasher(**kw),
        good=lambda _o: {
            "hash_block_size": 4,
            "caching_hash_fn": SHA_CBOR,
            "num_hash_lookahead_tokens": 0,
            "memo_capacity": 4,
        },
        bad={
            "hash_block_size": bad_int(1),
            "caching_hash_fn": st.sampled_from(["sha256", 1, None]),
            "num_hash_lookahead_tokens": bad_int(0, 0),
            "memo_capacity": bad_int(0),
        },
        names={"hash_block_size": "block_size", "caching_hash_fn": "hash_fn"},
    ),
    "hash_block_tokens": Case(
        make=lambda: None,
        call=lambda _o, **kw: hash_block_tokens(**kw),
        good=lambda _o: {
            "hash_fn": SHA_CBOR,
            "parent_block_hash": None,
            "curr_block_token_ids": [1, 2, 3],
        },
        bad={"curr_block_token_ids": NOT_TOKENS.filter(lambda v: v is not None)},
        names={"curr_block_token_ids": "token ids|integers"},
    ),
    "BlockHashFunction.hash_blocks": Case(
        make=lambda: SHA_CBOR,
        call=lambda o, **kw: o.hash_blocks(**kw),
        good=lambda _o: {
            "parent": b"p" * 32,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "extra_keys": [None, None],
        },
        bad={
            "parent": st.sampled_from([None, "p", 3]),
            "token_ids": NOT_TOKENS,
            "block_size": bad_int(1),
            "extra_keys": st.sampled_from([None, 3, "ab"]),
        },
        names={"token_ids": "token ids|integers|tokens"},
    ),
    "init_none_hash": Case(
        make=lambda: None,
        call=lambda _o, **kw: init_none_hash(**kw),
        good=lambda _o: {"hash_fn": SHA_CBOR, "seed": "s"},
        bad={"hash_fn": st.sampled_from(["sha256", None, 3]), "seed": NOT_STR},
        state=_global_hash_state,
    ),
    "get_hash_fn_by_name": Case(
        make=lambda: None,
        call=lambda _o, **kw: get_hash_fn_by_name(**kw),
        good=lambda _o: {"name": "sha256"},
        bad={"name": st.one_of(NOT_STR, st.text(max_size=4))},
        names={"name": "hash function"},
    ),
    "EncoderCacheManager": Case(
        make=lambda: None,
        call=lambda _o, **kw: EncoderCacheManager(**kw),
        good=lambda _o: {"cache_size": 10},
        bad={"cache_size": bad_int(0)},
    ),
    "EncoderBudget": Case(
        make=lambda: None,
        call=lambda _o, **kw: EncoderBudget(**kw),
        good=lambda _o: {"compute_budget": 10, "cache_size": 10},
        bad={"compute_budget": bad_int(0), "cache_size": bad_int(0)},
    ),
    "compute_encoder_budget": Case(
        make=lambda: None,
        call=lambda _o, **kw: compute_encoder_budget(**kw),
        good=lambda _o: {"max_tokens_per_item": {"image": 4}, "max_num_batched_tokens": 8},
        bad={"max_num_batched_tokens": bad_int(0)},
    ),
    "hash_mm_item": Case(
        make=lambda: None,
        call=lambda _o, **kw: hash_mm_item(**kw),
        good=lambda _o: {"item": b"abc", "modality": "image", "processor_kwargs": None},
        bad={
            "modality": st.one_of(NOT_STR, st.just("")),
            "processor_kwargs": st.sampled_from([3, "x", [1]]),
        },
    ),
    "BlockTable": Case(
        make=lambda: None,
        call=lambda _o, **kw: BlockTable(**kw),
        good=lambda _o: {"block_size": 4, "max_num_reqs": 2, "max_num_blocks_per_req": 3},
        bad={
            "block_size": bad_int(1),
            "max_num_reqs": bad_int(1),
            "max_num_blocks_per_req": bad_int(1),
        },
    ),
    "BlockTable.append_row": Case(
        make=_table,
        call=lambda o, **kw: o.append_row(**kw),
        good=lambda _o: {"block_ids": [4], "row_idx": 1},
        bad={
            "row_idx": bad_int(0, 2),
            "block_ids": st.sampled_from([[16], [-1], [1.5], [1, 2, 3, 4], [[1]]]),
        },
        state=_table_state,
        names={"block_ids": "block"},
    ),
    "BlockTable.move_row": Case(
        make=_table,
        call=lambda o, **kw: o.move_row(**kw),
        good=lambda _o: {"src": 0, "tgt": 2},
        bad={"src": bad_int(0, 2), "tgt": bad_int(0, 2)},
        state=_table_state,
    ),
    "BlockTable.condense": Case(
        make=_table,
        call=lambda o, **kw: o.condense(**kw),
        good=lambda _o: {"empty_rows": [0], "num_rows": 2},
        bad={
            "num_rows": bad_int(0, 3),
            "empty_rows": st.one_of(st.lists(bad_int(0, 1), min_size=1, max_size=2), st.just("0")),
        },
        state=_table_state,
    ),
    "BlockTable.compute_slot_mapping": Case(
        make=_table,
        call=lambda o, **kw: o.compute_slot_mapping(**kw),
        good=lambda _o: {"req_indices": [0, 0], "positions": [0, 5]},
        bad={
            "req_indices": st.sampled_from([[0, 3], [0, -1], [0.5, 0], [0]]),
            "positions": st.sampled_from([[0, 8], [-1, 0], [0.5, 1], [0, 16]]),
        },
        state=_table_state,
        names={"req_indices": "req_indices", "positions": "positions"},
    ),
}

for _cls in (EncoderCacheManager, EncoderDecoderCacheManager):
    _name = _cls.__name__
    CASES[f"{_name}.can_allocate"] = Case(
        make=_encoder(_cls),
        call=lambda o, **kw: o.can_allocate(**kw),
        good=lambda _o: {
            "request": _mm_request("q"),
            "input_id": 1,
            "encoder_compute_budget": 10,
            "num_embeds_to_schedule": 0,
        },
        bad={
            "input_id": bad_int(0, 1),
            "encoder_compute_budget": bad_int(0),
            "num_embeds_to_schedule": bad_int(0),
        },
        state=encoder_state,
    )
    for _method in ("check_and_update_cache", "allocate", "get_cached_num_encoder_embeds"):
        CASES[f"{_name}.{_method}"] = Case(
            make=_encoder(_cls),
            call=lambda o, _m=_method, **kw: getattr(o, _m)(**kw),
            good=lambda _o: {"request": _mm_request("q"), "input_id": 1},
            bad={"input_id": bad_int(0, 1)},
            state=encoder_state,
        )
    CASES[f"{_name}.free_encoder_input"] = Case(
        make=_encoder(_cls),
        call=lambda o, **kw: o.free_encoder_input(**kw),
        good=lambda o: {"request": o.held_request, "input_id": 0},
        bad={"input_id": NOT_INT},
        state=encoder_state,
    )
    CASES[f"{_name}.check_admission"] = Case(
        make=_encoder(_cls),
        call=lambda o, **kw: o.check_admission(**kw),
        good=lambda _o: {"request": _mm_request("q"), "encoder_compute_budget": 10},
        bad={"encoder_compute_budget": bad_int(0)},
        state=encoder_state,
    )


@pytest.mark.usefixtures("fixed_none_hash")
@pytest.mark.parametrize("case_name", sorted(CASES))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_bad_argument_is_named_and_changes_nothing(case_name, data):
    case = CASES[case_name]
    fresh = case.make()
    case.call(fresh, **case.good(fresh))  # the good call works
    obj = case.make()
    kwargs = case.good(obj)
    name = data.draw(st.sampled_from(sorted(case.bad)), label="argument")
    kwargs[name] = data.draw(case.bad[name], label=name)
    before = None if case.state is None else case.state(obj)
    with pytest.raises((ValueError, TypeError, KeyError)) as error:
        case.call(obj, **kwargs)
    pattern = case.names.get(name, name)
    assert re.search(pattern, str(error.value)), (name, str(error.value))
    if case.state is not None:
        assert case.state(obj) == before
