"""The block-hash memo returns exactly what hashing returns, and really reuses work."""

from __future__ import annotations

import enum

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jaxkv import LoRARequest, Request, get_hash_fn_by_name, get_request_block_hasher
from jaxkv.hashing import get_none_hash, init_none_hash
from jaxkv.request_hashing import BlockHashMemo

BLOCK = 4
FN = get_hash_fn_by_name("sha256_cbor")


def _hashes(hasher, prompt, **kwargs) -> list[bytes]:
    return Request("r", prompt, block_hasher=hasher, **kwargs).block_hashes


@settings(max_examples=60, deadline=None)
@given(
    fn_name=st.sampled_from(["sha256_cbor", "xxhash_cbor", "sha256", "xxhash"]),
    prefixes=st.lists(
        st.lists(st.integers(0, 70_000), min_size=0, max_size=40), min_size=1, max_size=3
    ),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.lists(st.integers(0, 300), max_size=30),
            st.sampled_from([None, "salt-a"]),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    ),
    capacity=st.integers(1, 4),
)
def test_memo_matches_plain_hashing(fn_name, prefixes, requests, capacity):
    fn = get_hash_fn_by_name(fn_name)
    init_none_hash(fn, "memo-test")
    plain = get_request_block_hasher(BLOCK, fn, memo_capacity=0)
    memo = get_request_block_hasher(BLOCK, fn, memo_capacity=capacity)
    lora = LoRARequest("adapter", 1, "/a")
    for prefix_idx, suffix, salt, with_lora in requests:
        prompt = prefixes[prefix_idx % len(prefixes)] + suffix or [1]
        kwargs = {"cache_salt": salt, "lora_request": lora if with_lora else None}
        assert _hashes(memo, prompt, **kwargs) == _hashes(plain, prompt, **kwargs)


def test_memo_reuses_shared_prefix_and_respects_capacity():
    init_none_hash(FN, "memo-test")
    memo = BlockHashMemo(FN, capacity=2)
    system = list(range(100, 100 + 10 * BLOCK))
    first = memo.hash_blocks(get_none_hash(), system + [7] * 2 * BLOCK, BLOCK, [None] * 12)
    assert memo.num_reused_blocks == 0
    second = memo.hash_blocks(get_none_hash(), system + [8] * 2 * BLOCK, BLOCK, [None] * 12)
    assert memo.num_reused_blocks == 10  # the system prompt's blocks
    assert first[:10] == second[:10] and first[10:] != second[10:]
    assert second == FN.hash_blocks(get_none_hash(), system + [8] * 2 * BLOCK, BLOCK, [None] * 12)
    for start in (1000, 2000, 3000):  # three other runs push the system prompt out
        memo.hash_blocks(
            get_none_hash(), list(range(start, start + 10 * BLOCK)), BLOCK, [None] * 10
        )
    assert len(memo) == 2
    memo.hash_blocks(get_none_hash(), system + [9] * 2 * BLOCK, BLOCK, [None] * 12)
    assert memo.num_reused_blocks == 10


def test_memo_rejects_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        BlockHashMemo(FN, 0)
    with pytest.raises(ValueError, match="memo_capacity"):
        get_request_block_hasher(BLOCK, FN, memo_capacity=-1)


class _One(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize("first_keys", [(("x", 1),), (("x", True),), (("x", 1.0),)])
def test_memo_tells_apart_extra_keys_python_calls_equal(first_keys):
    """True == 1 == 1.0 in Python, but they encode differently: no reuse across them."""
    memo = BlockHashMemo(FN, capacity=4)
    tokens = list(range(12 * BLOCK))
    parent = b"p" * 32
    memo.hash_blocks(parent, tokens, BLOCK, [first_keys] * 12)
    for keys in [(("x", 1),), (("x", True),), (("x", 1.0),), [["x", 1]]]:
        got = memo.hash_blocks(parent, tokens, BLOCK, [keys] * 12)
        assert got == FN.hash_blocks(parent, tokens, BLOCK, [keys] * 12)
    # Keys marshal cannot write (an IntEnum member) are hashed, never matched.
    enum_keys = [(("x", _One.ONE),)] * 12
    assert memo.hash_blocks(parent, tokens, BLOCK, enum_keys) == FN.hash_blocks(
        parent, tokens, BLOCK, enum_keys
    )
    assert memo.num_reused_blocks == 12  # only the call with the same typed keys
