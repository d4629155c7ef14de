"""Block hashing: vLLM-identical vectors, NONE_HASH seeds, extra keys, incremental hashing."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv.hashing as hashing
from jaxkv import (
    LoRARequest,
    MultiModalFeatureSpec,
    Request,
    get_hash_fn_by_name,
    get_none_hash,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from jaxkv.hashing import (
    BlockHashListWithBlockSize,
    get_block_hash,
    get_group_id,
    get_none_hash_seed,
    make_block_hash_with_group_id,
)
from jaxkv.request_hashing import generate_block_hash_extra_keys

# Digests computed by vLLM (sha256_cbor / xxhash_cbor), kept in the repo.
VECTORS_DIR = Path(__file__).resolve().parent / "data"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHA_CBOR = get_hash_fn_by_name("sha256_cbor")
XX_CBOR = get_hash_fn_by_name("xxhash_cbor")
SHA = get_hash_fn_by_name("sha256")
XX = get_hash_fn_by_name("xxhash")


def _load(name: str) -> dict:
    return json.loads((VECTORS_DIR / name).read_text())


def _tuplify(obj):
    if isinstance(obj, list):
        return tuple(_tuplify(x) for x in obj)
    return obj


def _ref_cbor(digest, parent: bytes, tokens, extra) -> bytes:
    """The reference: vLLM's hash of one block, payload built by cbor2 directly."""
    return digest(cbor2.dumps((parent, tuple(tokens), extra), canonical=True))


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _request(tokens, block_size=4, fn=SHA_CBOR, **kwargs) -> Request:
    return Request(
        "r", list(tokens), block_hasher=get_request_block_hasher(block_size, fn), **kwargs
    )


# ---------------------------------------------------------------------------
# Vector files


BLOCK_VECTORS = _load("block_hashes.json")
REQUEST_VECTORS = _load("request_block_hashes.json")


def test_vector_files_are_nonempty():
    assert {s["hash_fn"] for s in BLOCK_VECTORS["sets"]} == {"sha256_cbor", "xxhash_cbor"}
    assert sum(len(s["cases"]) for s in BLOCK_VECTORS["sets"]) >= 20
    assert len(REQUEST_VECTORS["cases"]) >= 20


@pytest.mark.parametrize(
    "set_idx,case_idx",
    [(si, ci) for si, s in enumerate(BLOCK_VECTORS["sets"]) for ci in range(len(s["cases"]))],
)
def test_block_hash_vectors(set_idx, case_idx):
    vset = BLOCK_VECTORS["sets"][set_idx]
    case = vset["cases"][case_idx]
    fn = get_hash_fn_by_name(vset["hash_fn"])
    none_hash = init_none_hash(fn, vset["none_hash_seed"])
    assert none_hash.hex() == vset["none_hash"]
    assert get_none_hash() == none_hash
    assert get_none_hash_seed() == vset["none_hash_seed"]
    bs = case["block_size"]
    tokens = case["token_ids"]
    parent = None
    got = []
    for i, extra in enumerate(case["extra_keys"]):
        parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], _tuplify(extra))
        got.append(parent.hex())
    assert got == case["block_hashes"]
    # Extra keys straight from JSON (lists) encode like tuples.
    parent = None
    for i, extra in enumerate(case["extra_keys"]):
        parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], extra)
    assert parent.hex() == case["block_hashes"][-1]
    # The batched chain path gives the same digests.
    batched = fn.hash_blocks(
        none_hash,
        np.asarray(tokens, dtype=np.int64),
        bs,
        [_tuplify(e) for e in case["extra_keys"]],
    )
    assert [h.hex() for h in batched] == case["block_hashes"]


def _vector_request(case, hasher) -> Request:
    lora = case["lora"]
    return Request(
        "vec",
        case["prompt_token_ids"],
        mm_features=[
            MultiModalFeatureSpec(f["identifier"], f["offset"], f["length"])
            for f in case["mm_features"]
        ],
        lora_request=None
        if lora is None
        else LoRARequest(lora["name"], lora["int_id"], lora["path"]),
        cache_salt=case["cache_salt"],
        block_hasher=hasher,
    )


@pytest.mark.parametrize("case_idx", range(len(REQUEST_VECTORS["cases"])))
@pytest.mark.parametrize("append", ["one_at_a_time", "one_call"])
def test_request_block_hash_vectors(case_idx, append):
    case = REQUEST_VECTORS["cases"][case_idx]
    fn = get_hash_fn_by_name(REQUEST_VECTORS["hash_fn"])
    init_none_hash(fn, REQUEST_VECTORS["none_hash_seed"])
    bs = case["block_size"]
    req = _vector_request(case, get_request_block_hasher(bs, fn))
    assert len(req.block_hashes) == len(case["prompt_token_ids"]) // bs
    outputs = case["output_token_ids"]
    if append == "one_at_a_time":
        for tok in outputs:
            req.append_output_token_ids(tok)
            assert len(req.block_hashes) == req.num_tokens // bs
    elif outputs:
        req.append_output_token_ids(outputs)
    assert req.num_tokens == len(case["prompt_token_ids"]) + len(outputs)
    assert [h.hex() for h in req.block_hashes] == case["block_hashes"]


# ---------------------------------------------------------------------------
# Hash functions, NONE_HASH seeds


def test_unknown_hash_name_lists_choices():
    with pytest.raises(ValueError) as exc:
        get_hash_fn_by_name("md5")
    msg = str(exc.value)
    assert "md5" in msg
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert name in msg


def test_explicit_seed_beats_env(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    nh = init_none_hash(SHA_CBOR, "explicit")
    assert get_none_hash_seed() == "explicit"
    assert nh == _sha(cbor2.dumps("explicit", canonical=True))
    assert get_none_hash() == nh


@pytest.mark.parametrize("fn", [SHA_CBOR, XX_CBOR, SHA, XX], ids=lambda f: f.name)
def test_env_seed_beats_defaults(monkeypatch, fn):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    nh = init_none_hash(fn)
    assert get_none_hash_seed() == "123"
    assert nh == fn.digest(cbor2.dumps("123", canonical=True))
    assert init_none_hash(fn) == nh  # deterministic under the env seed


@pytest.mark.parametrize("fn", [SHA_CBOR, SHA], ids=lambda f: f.name)
def test_sha_family_default_seed(fn):
    nh = init_none_hash(fn)
    assert get_none_hash_seed() == hashing.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert nh == _sha(cbor2.dumps("vllm-none-hash", canonical=True))
    assert len(nh) == 32


@pytest.mark.parametrize("fn", [XX_CBOR, XX], ids=lambda f: f.name)
def test_xxhash_family_random_seed(fn):
    nh1 = init_none_hash(fn)
    seed1 = get_none_hash_seed()
    nh2 = init_none_hash(fn)
    seed2 = get_none_hash_seed()
    assert seed1 != seed2
    assert seed1 != hashing.DEFAULT_NONE_HASH_SEED
    assert nh1 != nh2
    assert len(nh1) == 16
    assert nh2 == xxhash.xxh3_128_digest(cbor2.dumps(seed2, canonical=True))


def _stdout_of_fresh_process(code: str) -> str:
    """Run `code` in a new interpreter without PYTHONHASHSEED; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout


def test_sha256_cbor_default_reproducible_across_processes():
    code = (
        "from jaxkv.hashing import get_hash_fn_by_name, init_none_hash, get_none_hash_seed\n"
        "print(init_none_hash(get_hash_fn_by_name('sha256_cbor')).hex(), get_none_hash_seed())\n"
    )
    outs = [_stdout_of_fresh_process(code).split() for _ in range(2)]
    expected = _sha(cbor2.dumps("vllm-none-hash", canonical=True)).hex()
    assert outs[0] == outs[1] == [expected, "vllm-none-hash"]
    assert expected == BLOCK_VECTORS["sets"][0]["none_hash"]


def test_xxhash_default_differs_across_processes():
    code = (
        "from jaxkv import get_hash_fn_by_name, init_none_hash\n"
        "print(init_none_hash(get_hash_fn_by_name('xxhash_cbor')).hex())\n"
    )
    outs = {_stdout_of_fresh_process(code).strip() for _ in range(2)}
    assert len(outs) == 2


def test_hash_block_tokens_parent_none_is_none_hash():
    nh = init_none_hash(SHA_CBOR, "seed")
    assert hash_block_tokens(SHA_CBOR, None, [1, 2]) == hash_block_tokens(SHA_CBOR, nh, [1, 2])
    assert hash_block_tokens(SHA_CBOR, None, [1, 2]) == _ref_cbor(_sha, nh, [1, 2], None)


@pytest.mark.parametrize("fn", [SHA, XX], ids=lambda f: f.name)
def test_jaxkv_encoding_documented_layout(fn):
    nh = init_none_hash(fn, "seed")
    tokens = [5, 2**40, 7]
    expected = fn.digest(
        nh + (3).to_bytes(4, "little") + np.asarray(tokens, "<i8").tobytes() + b"\x00"
    )
    assert hash_block_tokens(fn, None, tokens) == expected
    extra = (("lora", "a", "/p"),)
    expected = fn.digest(
        nh
        + (3).to_bytes(4, "little")
        + np.asarray(tokens, "<i8").tobytes()
        + b"\x01"
        + cbor2.dumps(extra, canonical=True)
    )
    assert hash_block_tokens(fn, None, tokens, extra) == expected


@pytest.mark.parametrize("fn", [SHA, XX, SHA_CBOR, XX_CBOR], ids=lambda f: f.name)
def test_distinct_inputs_distinct_digests(fn):
    init_none_hash(fn, "seed")
    base = hash_block_tokens(fn, None, [1, 2, 3, 4])
    assert base == hash_block_tokens(fn, None, [1, 2, 3, 4])
    assert base == hash_block_tokens(fn, None, np.array([1, 2, 3, 4]))
    others = [
        hash_block_tokens(fn, None, [1, 2, 3, 5]),
        hash_block_tokens(fn, None, [4, 3, 2, 1]),
        hash_block_tokens(fn, None, [1, 2, 3, 4], (("cache_salt", "s"),)),
        hash_block_tokens(fn, None, [1, 2, 3, 4], (("cache_salt", "t"),)),
        hash_block_tokens(fn, None, [1, 2, 3, 4], (("mm", "img", 0),)),
        hash_block_tokens(fn, None, [1, 2, 3, 4], (("mm", "img", 1),)),
        hash_block_tokens(fn, b"\x01" * fn.digest_size, [1, 2, 3, 4]),
    ]
    assert len({base, *others}) == len(others) + 1
    assert all(len(h) == fn.digest_size for h in others)
    assert hash_block_tokens(fn, None, [1, 2, 3, 4], (("cache_salt", "s"),)) == others[2]


@pytest.mark.parametrize("fn", [SHA, XX, SHA_CBOR, XX_CBOR], ids=lambda f: f.name)
def test_chaining(fn):
    init_none_hash(fn, "seed")
    bs = 4
    tokens = list(range(100, 116))
    a = _request(tokens, bs, fn).block_hashes
    changed = list(tokens)
    changed[0] = 999
    b = _request(changed, bs, fn).block_hashes
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))
    # Changing block 2 keeps blocks 0-1, changes 2-3.
    changed = list(tokens)
    changed[9] = 999
    c = _request(changed, bs, fn).block_hashes
    assert c[:2] == a[:2] and c[2] != a[2] and c[3] != a[3]
    # Each hash is hash_block_tokens of its parent.
    parent = None
    for i, h in enumerate(a):
        parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs])
        assert parent == h


def test_jaxkv_default_encoding_differs_from_cbor():
    init_none_hash(SHA, "seed")
    nh = get_none_hash()
    assert hash_block_tokens(SHA, nh, [1, 2]) != hash_block_tokens(SHA_CBOR, nh, [1, 2])


# ---------------------------------------------------------------------------
# CBOR encoding widths


@pytest.mark.parametrize("fn,digest", [(SHA_CBOR, _sha), (XX_CBOR, xxhash.xxh3_128_digest)])
@pytest.mark.parametrize("block_size", [1, 5, 23, 24, 25, 255, 256, 300])
def test_cbor_widths_match_cbor2(fn, digest, block_size):
    nh = init_none_hash(fn, "w")
    edges = [
        0, 1, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537,
        2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**63 - 1,
    ]  # fmt: skip
    rng = np.random.default_rng(block_size)
    tokens = [edges[i % len(edges)] for i in range(block_size)]
    rng.shuffle(tokens)
    tokens = [int(t) for t in tokens]
    extra = (("mm", "img", -3), ("cache_salt", "x" * 30))
    assert hash_block_tokens(fn, None, tokens) == _ref_cbor(digest, nh, tokens, None)
    h1 = hash_block_tokens(fn, None, tokens, extra)
    assert h1 == _ref_cbor(digest, nh, tokens, extra)
    h2 = hash_block_tokens(fn, h1, tokens[::-1])
    assert h2 == _ref_cbor(digest, h1, tokens[::-1], None)
    # Chained batch over two blocks.
    batched = fn.hash_blocks(
        nh, np.asarray(tokens + tokens[::-1], dtype=np.int64), block_size, [extra, None]
    )
    assert batched == [h1, h2]


# Bytes of jaxkv.hashing._BLOCK_SEPARATOR, as token arguments: they must not split a block.
_SEPARATOR_LIKE = [0xFF, 0xFEFD, 0xFFFEFDFC, 0xFBFAF9F8, 0xF9F8FFFE]
_TOKEN_EDGES = [
    *(0, 23, 24, 255, 256, 65535, 65536, 2**18 - 1, 2**18, 2**32 - 1, 2**32, 2**63 - 1),
    *_SEPARATOR_LIKE,
]


def _ref_raw(parent: bytes, tokens, extra) -> bytes:
    """jaxkv's documented raw encoding of one block, built field by field."""
    tag = b"\x00" if extra is None else b"\x01" + cbor2.dumps(extra, canonical=True)
    count = len(tokens).to_bytes(4, "little")
    return _sha(parent + count + np.asarray(tokens, "<i8").tobytes() + tag)


_RUN_REFERENCES = {"sha256_cbor": functools.partial(_ref_cbor, _sha), "sha256": _ref_raw}


@pytest.mark.parametrize("name", sorted(_RUN_REFERENCES))
@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 40),
    blocks=st.lists(
        st.tuples(
            st.lists(
                st.one_of(st.sampled_from(_TOKEN_EDGES), st.integers(0, 300_000)),
                min_size=40,
                max_size=40,
            ),
            st.sampled_from(
                [None, (("lora", "a", "p"),), (("mm", "img", -3), ("cache_salt", "s"))]
            ),
        ),
        min_size=1,
        max_size=2 * SHA_CBOR.per_block_run_limit + 3,
    ),
    as_array=st.booleans(),
)
def test_runs_match_per_block_reference(name, block_size, blocks, as_array):
    """Runs on both sides of per_block_run_limit, any token width or extra keys."""
    fn, reference = get_hash_fn_by_name(name), _RUN_REFERENCES[name]
    tokens = [t for block, _ in blocks for t in block[:block_size]]
    extra = [e for _, e in blocks]
    parent = expected_parent = b"p" * 32
    expected = []
    for i, e in enumerate(extra):
        expected_parent = reference(
            expected_parent, tokens[i * block_size : (i + 1) * block_size], e
        )
        expected.append(expected_parent)
    given_tokens = np.asarray(tokens, dtype=np.uint64) if as_array else tokens
    assert fn.hash_blocks(parent, given_tokens, block_size, extra) == expected


@pytest.mark.parametrize("block_size", [0xFF, 0xFEFF])
def test_separator_like_bytes_stay_inside_their_block(block_size):
    """Tokens and array heads made of the run separator's bytes hash as cbor2 encodes them."""
    num_blocks = SHA_CBOR.per_block_run_limit + 2
    tokens = (_SEPARATOR_LIKE * num_blocks * block_size)[: num_blocks * block_size]
    expected, parent = [], b"p" * 32
    for i in range(num_blocks):
        parent = _ref_cbor(_sha, parent, tokens[i * block_size : (i + 1) * block_size], None)
        expected.append(parent)
    assert SHA_CBOR.hash_blocks(b"p" * 32, tokens, block_size, [None] * num_blocks) == expected


@pytest.mark.parametrize("name", sorted(_RUN_REFERENCES))
def test_extra_keys_python_calls_equal_hash_apart(name):
    """True == 1 == 1.0 in Python (and hash alike), but they encode differently."""
    fn, reference = get_hash_fn_by_name(name), _RUN_REFERENCES[name]
    parent, tokens = b"p" * 32, [1, 2]
    variants = [(("x", 1),), (("x", True),), (("x", 1.0),), [["x", 1]]]
    for extra in variants * 2:  # the second pass reads the encodings back from the cache
        assert hash_block_tokens(fn, parent, tokens, extra) == reference(parent, tokens, extra)
    run = fn.hash_blocks(parent, tokens * 8, 2, variants * 2)
    expected, chain = [], parent
    for i, extra in enumerate(variants * 2):
        chain = reference(chain, (tokens * 8)[2 * i : 2 * i + 2], extra)
        expected.append(chain)
    assert run == expected
    assert len({hash_block_tokens(fn, parent, tokens, e) for e in variants[:3]}) == 3


def test_request_hasher_large_token_ids_match_reference():
    nh = init_none_hash(SHA_CBOR, "w")
    tokens = [2**32 + 5, 3, 2**33, 70000, 2**63 - 1, 200, 24, 23]
    req = _request(tokens, 4, SHA_CBOR)
    h0 = _ref_cbor(_sha, nh, tokens[:4], None)
    assert req.block_hashes == [h0, _ref_cbor(_sha, h0, tokens[4:], None)]


@pytest.mark.parametrize("fn,digest", [(SHA_CBOR, _sha), (XX_CBOR, xxhash.xxh3_128_digest)])
def test_cbor_parent_of_other_length(fn, digest):
    """Parents of any length (e.g. a NONE_HASH made by another function) encode as cbor2 does."""
    other = XX_CBOR if fn is SHA_CBOR else SHA_CBOR
    nh = init_none_hash(other, "seed")
    assert len(nh) != fn.digest_size
    h = hash_block_tokens(fn, None, [1, 2, 3])
    assert h == _ref_cbor(digest, nh, [1, 2, 3], None)
    assert hash_block_tokens(fn, b"abc", [1, 2, 3]) == _ref_cbor(digest, b"abc", [1, 2, 3], None)
    chain = fn.hash_blocks(nh, np.arange(1, 7, dtype=np.int64), 3, [None, None])
    assert chain[0] == h
    assert chain[1] == _ref_cbor(digest, h, [4, 5, 6], None)


@pytest.mark.parametrize("fn", [SHA, SHA_CBOR, XX, XX_CBOR], ids=lambda f: f.name)
def test_chaining_strategies_agree(fn):
    """Seeded-hasher copies and one-shot digests chain to the same hashes, from parents
    of the usual length and of another, and an empty run hashes to nothing."""
    seeded = hashing.BlockHashFunction(fn.name, fn.new_hasher, fn.cbor, fn.cryptographic)
    oneshot = hashing.BlockHashFunction(
        fn.name,
        fn.new_hasher,
        fn.cbor,
        fn.cryptographic,
        oneshot_digest=lambda data: fn.new_hasher(data).digest(),
    )
    tokens = list(range(100, 100 + 4 * 5))
    for parent in (b"p" * fn.digest_size, b"short"):
        chains = [f.hash_blocks(parent, tokens, 4, [None] * 5) for f in (seeded, oneshot, fn)]
        assert chains[0] == chains[1] == chains[2]
        assert len(set(chains[0])) == 5
        assert all(f.hash_blocks(parent, [], 4, []) == [] for f in (seeded, oneshot))


def test_callable_hashes_like_vllm():
    nh = init_none_hash(SHA_CBOR, "seed")
    assert SHA_CBOR((nh, (1, 2), None)) == _ref_cbor(_sha, nh, [1, 2], None)
    assert SHA_CBOR({"a": 1}) == _sha(cbor2.dumps({"a": 1}, canonical=True))
    assert XX_CBOR("s") == xxhash.xxh3_128_digest(cbor2.dumps("s", canonical=True))


@pytest.mark.parametrize("fn", [SHA, SHA_CBOR], ids=lambda f: f.name)
@pytest.mark.parametrize("num_blocks", [1, 3, 12])
def test_negative_token_rejected(fn, num_blocks):
    """On the one-block, per-block and numpy paths alike, for list and array input."""
    tokens = [1, 2] * num_blocks
    tokens[-1] = -1
    for token_ids in (tokens, np.asarray(tokens, dtype=np.int64)):
        with pytest.raises(ValueError, match="non-negative, got -1"):
            fn.hash_blocks(b"p" * 32, token_ids, 2, [None] * num_blocks)


@pytest.mark.parametrize(
    ("tokens", "block_size", "num_blocks"), [([], 0, 1), ([1, 2], 2, 2), ([1, 2, 3], 2, 1)]
)
def test_hash_blocks_rejects_mismatched_counts(tokens, block_size, num_blocks):
    with pytest.raises(ValueError, match="block_size must be >= 1|positive block size and"):
        SHA_CBOR.hash_blocks(b"p" * 32, tokens, block_size, [None] * num_blocks)


# ---------------------------------------------------------------------------
# Incremental hashing


class CountingHasher(hashing.BlockHashFunction):
    """A hash function that counts the tokens it is asked to hash."""

    def __init__(self, fn: hashing.BlockHashFunction) -> None:
        super().__init__(fn.name, fn.new_hasher, fn.cbor, fn.cryptographic)
        self.tokens_hashed = 0
        self.calls = 0

    def hash_checked_blocks(self, parent, tokens, block_size, extra_keys):
        self.calls += 1
        self.tokens_hashed += len(tokens)
        return super().hash_checked_blocks(parent, tokens, block_size, extra_keys)


def test_incremental_hashing_never_recomputes():
    init_none_hash(SHA_CBOR, "seed")
    counter = CountingHasher(SHA_CBOR)
    req = Request("r", list(range(10)), block_hasher=get_request_block_hasher(4, counter))
    assert (counter.calls, counter.tokens_hashed, len(req.block_hashes)) == (1, 8, 2)
    req.append_output_token_ids(10)  # 11 tokens: no new full block
    assert counter.tokens_hashed == 8
    req.append_output_token_ids(11)  # block 2 full
    assert (counter.calls, counter.tokens_hashed, len(req.block_hashes)) == (2, 12, 3)
    req.append_output_token_ids(list(range(12, 25)))  # 25 tokens: blocks 3..5
    assert (counter.calls, counter.tokens_hashed, len(req.block_hashes)) == (3, 24, 6)
    expected = _request(list(range(25)), 4, SHA_CBOR).block_hashes
    assert req.block_hashes == expected


@pytest.mark.parametrize("fn", [SHA, SHA_CBOR], ids=lambda f: f.name)
def test_memoized_hasher_matches_plain(fn):
    """Requests sharing a prefix through one (memoizing) hasher get the plain hashes."""
    init_none_hash(fn, "seed")
    memo = get_request_block_hasher(4, fn)
    plain = get_request_block_hasher(4, fn, memo_capacity=0)
    system = list(range(40))
    variants = [
        ({}, system + [1, 2, 3, 4, 5, 6, 7, 8]),
        ({}, system + [9, 9, 9, 9]),
        ({"cache_salt": "t"}, system + [9, 9, 9, 9]),
        ({"lora_request": LoRARequest("l", 1, "/l")}, system),
        ({"mm_features": [MultiModalFeatureSpec("img", 30, 4)]}, system),
        ({"mm_features": [MultiModalFeatureSpec("img2", 30, 4)]}, system),
        ({}, [*system[:20], 7, *system[21:]]),
        ({}, system),
    ]
    got = []
    for kwargs, tokens in variants:
        a = Request("m", tokens, block_hasher=memo, **kwargs)
        b = Request("p", tokens, block_hasher=plain, **kwargs)
        assert a.block_hashes == b.block_hashes
        assert len(a.block_hashes) == len(tokens) // 4
        got.append(a.block_hashes)
    assert len({h[-1] for h in got}) == len(got)
    assert got[1][:10] == got[0][:10] == got[7]
    assert got[6][:5] == got[0][:5] and got[6][5] != got[0][5]
    assert got[4][:7] == got[5][:7] == got[0][:7] and got[4][7] != got[5][7]
    assert got[2][0] != got[1][0] and got[3][0] != got[1][0]
    # A hasher keeps the NONE_HASH it was made with: a later init_none_hash cannot mix
    # two chains in its requests; a hasher made after it chains from the new one.
    old = Request("o", system, block_hasher=memo).block_hashes
    init_none_hash(fn, "other-seed")
    assert Request("n", system, block_hasher=memo).block_hashes == old
    assert memo.none_hash != get_none_hash()
    new_memo = get_request_block_hasher(4, fn)
    new = Request("n", system, block_hasher=new_memo).block_hashes
    fresh_plain = get_request_block_hasher(4, fn, memo_capacity=0)
    assert new == Request("q", system, block_hasher=fresh_plain).block_hashes
    assert all(x != y for x, y in zip(old, new, strict=True))


def test_hashes_only_full_blocks():
    init_none_hash(SHA_CBOR, "seed")
    req = _request(range(7), 4)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7])
    assert len(req.block_hashes) == 2
    assert _request(range(3), 4).block_hashes == []


def test_numpy_prompt_same_as_list():
    init_none_hash(SHA_CBOR, "seed")
    a = _request(np.arange(12, dtype=np.int32), 4).block_hashes
    assert a == _request(list(range(12)), 4).block_hashes
    assert len(a) == 3


def test_request_hasher_rejects_bad_args():
    with pytest.raises(ValueError, match="block_size"):
        get_request_block_hasher(0, SHA_CBOR)
    with pytest.raises(TypeError, match="hash_fn"):
        get_request_block_hasher(4, "sha256")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_size"):
        get_request_block_hasher(4.0, SHA_CBOR)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Extra keys (SPEC §2)


def test_no_extra_keys_is_none():
    req = Request("r", list(range(8)))
    assert generate_block_hash_extra_keys(req, 0, 4)[0] is None
    assert generate_block_hash_extra_keys(req, 4, 8)[0] is None


def test_lora_on_every_block_with_path():
    nh = init_none_hash(SHA_CBOR, "seed")
    lora = LoRARequest("ad", 7, "/p/ad")
    req = _request(range(12), 4, lora_request=lora, cache_salt=None)
    key = (("lora", "ad", "/p/ad"),)
    for s in (0, 4, 8):
        assert generate_block_hash_extra_keys(req, s, s + 4)[0] == key
    h0 = _ref_cbor(_sha, nh, range(4), key)
    h1 = _ref_cbor(_sha, h0, range(4, 8), key)
    assert req.block_hashes[:2] == [h0, h1]
    # Re-pointing the same name at another path never reuses KV.
    other = _request(range(12), 4, lora_request=LoRARequest("ad", 7, "/p/other"))
    assert all(a != b for a, b in zip(req.block_hashes, other.block_hashes, strict=True))
    # The int id does not enter the hash.
    same = _request(range(12), 4, lora_request=LoRARequest("ad", 99, "/p/ad"))
    assert same.block_hashes == req.block_hashes


def test_mm_overlapping_ranges_negative_offsets():
    feats = [
        MultiModalFeatureSpec("b", 6, 3),  # [6, 9): given out of order, sorted by offset
        MultiModalFeatureSpec("a", 1, 6),  # [1, 7)
        MultiModalFeatureSpec("c", 12, 4),  # [12, 16)
    ]
    req = Request("r", list(range(20)), mm_features=feats)
    assert [f.identifier for f in req.mm_features] == ["a", "b", "c"]
    keys = [generate_block_hash_extra_keys(req, s, s + 4)[0] for s in range(0, 20, 4)]
    assert keys == [
        (("mm", "a", 1),),
        (("mm", "a", -3), ("mm", "b", 2)),
        (("mm", "b", -2),),
        (("mm", "c", 0),),
        None,
    ]
    # Item ending exactly at a block boundary does not touch the next block.
    req2 = Request("r", list(range(12)), mm_features=[MultiModalFeatureSpec("x", 2, 6)])
    keys = [generate_block_hash_extra_keys(req2, s, s + 4)[0] for s in range(0, 12, 4)]
    assert keys == [(("mm", "x", 2),), (("mm", "x", -2),), None]


def test_mm_long_item_and_nested_item():
    feats = [MultiModalFeatureSpec("long", 0, 16), MultiModalFeatureSpec("in", 9, 2)]
    req = Request("r", list(range(16)), mm_features=feats)
    keys = [generate_block_hash_extra_keys(req, s, s + 4)[0] for s in range(0, 16, 4)]
    assert keys == [
        (("mm", "long", 0),),
        (("mm", "long", -4),),
        (("mm", "long", -8), ("mm", "in", 1)),
        (("mm", "long", -12),),
    ]


def test_extra_key_order_and_salt_only_on_block_zero():
    emb = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    req = Request(
        "r",
        list(range(8)),
        lora_request=LoRARequest("l", 1, "/l"),
        mm_features=[MultiModalFeatureSpec("img", 2, 4)],
        cache_salt="salt",
        prompt_embeds=emb,
    )
    k0 = generate_block_hash_extra_keys(req, 0, 4)[0]
    k1 = generate_block_hash_extra_keys(req, 4, 8)[0]
    assert k0 == (
        ("lora", "l", "/l"),
        ("mm", "img", 2),
        ("cache_salt", "salt"),
        ("prompt_embeds", _sha(emb[0:4].tobytes())),
    )
    assert k1 == (
        ("lora", "l", "/l"),
        ("mm", "img", -2),
        ("prompt_embeds", _sha(emb[4:8].tobytes())),
    )


def test_salt_chains_to_later_blocks():
    init_none_hash(SHA_CBOR, "seed")
    a = _request(range(12), 4, cache_salt="s1").block_hashes
    b = _request(range(12), 4, cache_salt="s2").block_hashes
    c = _request(range(12), 4).block_hashes
    assert len({*a, *b, *c}) == 9


def test_prompt_embeds_digest_computed_once_per_range(monkeypatch):
    init_none_hash(SHA_CBOR, "seed")
    emb = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    calls = []
    real_sha256 = hashlib.sha256

    def counting_sha256(data=b""):
        calls.append(len(data))
        return real_sha256(data)

    req = _request(range(10), 4, XX_CBOR, prompt_embeds=emb)  # xxhash: no hashlib calls
    assert set(req.prompt_embeds_digests) == {(0, 4), (4, 8)}
    assert req.prompt_embeds_digests[(4, 8)] == _sha(emb[4:8].tobytes())
    monkeypatch.setattr(hashing.hashlib, "sha256", counting_sha256)
    # Recomputing extra keys reuses the remembered digest: no hashing of embedding rows.
    generate_block_hash_extra_keys(req, 0, 4)
    generate_block_hash_extra_keys(req, 4, 8)
    assert calls == []
    # Output tokens past the prompt: block [8, 12) covers prompt rows [8, 10) only.
    req.append_output_token_ids([10, 11])
    assert calls == [2 * 4 * 4]
    assert req.prompt_embeds_digests[(8, 10)] == real_sha256(emb[8:10].tobytes()).digest()
    # Blocks wholly past the prompt carry no prompt-embeds key.
    req.append_output_token_ids([12, 13, 14, 15])
    assert generate_block_hash_extra_keys(req, 12, 16)[0] is None
    assert len(calls) == 1


def test_prompt_embeds_isolation():
    init_none_hash(SHA_CBOR, "seed")
    emb = np.zeros((8, 2), dtype=np.float32)
    emb2 = emb.copy()
    emb2[5, 1] = 1.0
    a = _request(range(8), 4, prompt_embeds=emb).block_hashes
    b = _request(range(8), 4, prompt_embeds=emb2).block_hashes
    c = _request(range(8), 4).block_hashes
    assert a[0] == b[0] and a[1] != b[1]
    assert a[0] != c[0]


@pytest.mark.parametrize("fn", [SHA, SHA_CBOR], ids=lambda f: f.name)
def test_isolation_same_tokens(fn):
    init_none_hash(fn, "seed")
    tokens = list(range(8))
    variants = {
        "plain": _request(tokens, 4, fn),
        "salt": _request(tokens, 4, fn, cache_salt="a"),
        "salt2": _request(tokens, 4, fn, cache_salt="b"),
        "lora": _request(tokens, 4, fn, lora_request=LoRARequest("x", 1, "/x")),
        "lora2": _request(tokens, 4, fn, lora_request=LoRARequest("y", 1, "/x")),
        "mm": _request(tokens, 4, fn, mm_features=[MultiModalFeatureSpec("i1", 1, 2)]),
        "mm2": _request(tokens, 4, fn, mm_features=[MultiModalFeatureSpec("i2", 1, 2)]),
        "mm_off": _request(tokens, 4, fn, mm_features=[MultiModalFeatureSpec("i1", 2, 2)]),
    }
    firsts = {k: r.block_hashes[0] for k, r in variants.items()}
    assert len(set(firsts.values())) == len(variants)
    seconds = {k: r.block_hashes[1] for k, r in variants.items()}
    assert len(set(seconds.values())) == len(variants)
    again = _request(tokens, 4, fn, cache_salt="a")
    assert again.block_hashes == variants["salt"].block_hashes


def test_mm_feature_validation():
    with pytest.raises(ValueError, match="offset"):
        MultiModalFeatureSpec("x", -1, 2)
    with pytest.raises(ValueError, match="spans"):
        Request("r", [1, 2, 3], mm_features=[MultiModalFeatureSpec("x", 2, 2)])


# ---------------------------------------------------------------------------
# BlockHashListWithBlockSize and group keys


def test_block_hash_list_with_block_size():
    fine = [bytes([i]) * 4 for i in range(10)]
    view = BlockHashListWithBlockSize(fine, 2, 6)  # k = 3
    assert len(view) == 3
    assert [view[j] for j in range(3)] == [fine[2], fine[5], fine[8]]
    assert view[-1] == fine[8]
    assert view[1:] == [fine[5], fine[8]]
    assert view[:2] == [fine[2], fine[5]]
    assert view[::2] == [fine[2], fine[8]]
    assert list(view) == [fine[2], fine[5], fine[8]]
    with pytest.raises(IndexError):
        view[3]
    # Lazy: sees hashes appended later.
    fine.extend([b"x" * 4, b"y" * 4])
    assert len(view) == 4 and view[3] == fine[11]
    # Identity at k = 1.
    assert list(BlockHashListWithBlockSize(fine, 4, 4)) == fine


@pytest.mark.parametrize("hash_bs,target", [(4, 6), (4, 2), (3, 0), (0, 4), (4, -4)])
def test_block_hash_list_non_multiple_rejected(hash_bs, target):
    with pytest.raises(ValueError, match="multiple|block_size must be >= 1"):
        BlockHashListWithBlockSize([], hash_bs, target)


def test_coarse_view_equals_coarse_chain_tail():
    """Fine hash (j+1)*k-1 chains over the whole prefix: equal iff the whole coarse prefix is."""
    init_none_hash(SHA_CBOR, "seed")
    a = _request(range(16), 2)
    b = _request([*range(7), 99, *range(8, 16)], 2)
    va = BlockHashListWithBlockSize(a.block_hashes, 2, 8)
    vb = BlockHashListWithBlockSize(b.block_hashes, 2, 8)
    assert len(va) == 2
    assert va[0] == a.block_hashes[3] and va[1] == a.block_hashes[7]
    assert va[0] != vb[0] and va[1] != vb[1]
    c = _request([*range(8), 0, *range(9, 16)], 2)
    vc = BlockHashListWithBlockSize(c.block_hashes, 2, 8)
    assert va[0] == vc[0] and va[1] != vc[1]


@pytest.mark.parametrize("group_id", [0, 1, 255, 256, 2**31, 2**32 - 1])
def test_group_id_keys_round_trip(group_id):
    h = hashlib.sha256(b"x").digest()
    key = make_block_hash_with_group_id(h, group_id)
    assert key == h + group_id.to_bytes(4, "big")
    assert get_block_hash(key) == h
    assert get_group_id(key) == group_id
    h16 = h[:16]
    key16 = make_block_hash_with_group_id(h16, group_id)
    assert (get_block_hash(key16), get_group_id(key16)) == (h16, group_id)
    assert make_block_hash_with_group_id(h, group_id) != make_block_hash_with_group_id(
        h, (group_id + 1) % 2**32
    )
