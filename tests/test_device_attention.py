"""Ragged paged attention vs a dense float64 NumPy reference; NaN-poisoned pages.

Also home of the helpers the other device tests import (`random_case`,
`reference_attention`): a random batch written into a NaN-poisoned cache.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.block_table import BlockTable
from jaxkv.device import AttentionOptions, PagedKVCache, ragged_paged_attention
from jaxkv.kv_cache_interface import FullAttentionSpec


@dataclass
class Case:
    cache: PagedKVCache
    kv: jax.Array
    q: np.ndarray  # [T_pad, Hq, D], NaN in padded rows
    block_tables: np.ndarray  # [R_pad, W]
    seq_lens: np.ndarray  # [R_pad]
    query_start_loc: np.ndarray  # [R_pad + 1]
    num_seqs: int
    keys: list[np.ndarray]  # per request [seq, H, D], as stored
    values: list[np.ndarray]
    q_lens: np.ndarray  # [num_seqs]
    slots: np.ndarray  # this step's query-token slots


def poisoned_cache(cache: PagedKVCache) -> jax.Array:
    """A one-layer stacked cache filled with NaN (as stored bits when the storage dtype
    is an integer).

    A quantised cache is filled with 0xFF bytes: every scale reads as NaN.
    """
    shape = (1, *cache.shape)
    if cache.kv_quant:
        bits = np.full(shape, 0xFF, np.uint8).view(cache.storage_dtype)
    else:
        bits = np.full(shape, np.nan, cache.dtype).view(cache.storage_dtype)
    return jax.device_put(bits, cache.stacked_sharding)


def random_case(
    rng: np.random.Generator,
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 8,
    block_size: int = 4,
    width: int = 5,
    num_blocks: int = 40,
    dtype: str = "float32",
    pad_reqs: int = 1,
    pad_tokens: int = 3,
    cache: PagedKVCache | None = None,
) -> Case:
    """Random contexts written through `write_kv` into a NaN-poisoned cache; `kv` is its
    one layer.

    Blocks are a random permutation (never block 0); free blocks, the null
    block and the unused tail of each last block stay NaN.
    """
    spec = FullAttentionSpec(block_size, num_kv_heads, head_size, dtype)
    cache = cache or PagedKVCache(spec, num_blocks)
    n = len(seq_lens)
    table = BlockTable(block_size, n + pad_reqs, width, num_blocks=cache.num_blocks)
    ids = rng.permutation(np.arange(1, cache.num_blocks))
    used = 0
    for r, s in enumerate(seq_lens):
        k = -(-s // block_size)
        table.add_row(ids[used : used + k], r)
        used += k
    np_dtype = cache.dtype
    keys = [rng.standard_normal((s, num_kv_heads, head_size)).astype(np_dtype) for s in seq_lens]
    values = [rng.standard_normal((s, num_kv_heads, head_size)).astype(np_dtype) for s in seq_lens]
    req = np.repeat(np.arange(n), seq_lens)
    pos = np.concatenate([np.arange(s) for s in seq_lens])
    all_slots = table.compute_slot_mapping(req, pos)
    kv = cache.write_kv(
        poisoned_cache(cache),
        jnp.asarray(np.concatenate(keys)),
        jnp.asarray(np.concatenate(values)),
        all_slots,
    )[0]
    q_lens_arr = np.asarray(q_lens)
    num_q = int(q_lens_arr.sum())
    q = np.full((num_q + pad_tokens, num_kv_heads * group, head_size), np.nan, np_dtype)
    q[:num_q] = rng.standard_normal((num_q, num_kv_heads * group, head_size))
    qsl = np.full(n + pad_reqs + 1, num_q, np.int32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(q_lens_arr)
    seq = np.zeros(n + pad_reqs, np.int32)
    seq[:n] = seq_lens
    q_req = np.repeat(np.arange(n), q_lens_arr)
    q_pos = np.concatenate([np.arange(s - ql, s) for s, ql in zip(seq_lens, q_lens, strict=True)])
    return Case(
        cache=cache,
        kv=kv,
        q=q,
        block_tables=table.get_numpy_array().copy(),
        seq_lens=seq,
        query_start_loc=qsl,
        num_seqs=n,
        keys=keys,
        values=values,
        q_lens=q_lens_arr,
        slots=table.compute_slot_mapping(q_req, q_pos),
    )


def query_kv(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """The stored K/V at each request's query positions, in token order."""
    spans = list(zip(case.seq_lens[: case.num_seqs], case.q_lens, strict=True))
    k = [kk[s - ql :] for kk, (s, ql) in zip(case.keys, spans, strict=True)]
    v = [vv[s - ql :] for vv, (s, ql) in zip(case.values, spans, strict=True)]
    return np.concatenate(k), np.concatenate(v)


def reference_attention(
    case: Case,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk: int | None = None,
    span_ends: np.ndarray | None = None,
) -> np.ndarray:
    """Dense float64 attention per request; padded rows are 0.

    A query at position `p` sees keys `k <= p`, or `k < span_ends[token]` (a
    bidirectional span), within the window `k > p - sliding_window` and its own
    chunk `k >= p // attention_chunk * attention_chunk`.
    """
    out = np.zeros(case.q.shape, np.float64)
    start = 0
    for r in range(case.num_seqs):
        ql, s = int(case.q_lens[r]), int(case.seq_lens[r])
        q = case.q[start : start + ql].astype(np.float64)
        heads = case.keys[r].shape[1]
        group = q.shape[1] // heads
        k = np.repeat(case.keys[r].astype(np.float64), group, axis=1)
        v = np.repeat(case.values[r].astype(np.float64), group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q, k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        q_pos = (s - ql + np.arange(ql))[:, None]
        k_pos = np.arange(s)[None, :]
        visible = k_pos <= q_pos
        if span_ends is not None:
            visible |= k_pos < span_ends[start : start + ql, None]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        if attention_chunk is not None:
            visible &= k_pos >= q_pos // attention_chunk * attention_chunk
        logits = np.where(visible[None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start : start + ql] = np.einsum("hqk,khd->qhd", p, v)
        start += ql
    return out


OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(AttentionOptions))


def split_options(kw: dict) -> tuple[AttentionOptions, dict]:
    """`kw`'s `AttentionOptions` fields as options, and the other keywords."""
    options = AttentionOptions(**{k: v for k, v in kw.items() if k in OPTION_FIELDS})
    return options, {k: v for k, v in kw.items() if k not in OPTION_FIELDS}


def run_attention(
    case: Case, span_ends: np.ndarray | None = None, tables: np.ndarray | None = None, **kw
) -> np.ndarray:
    """`ragged_paged_attention` over `case`, jitted; `kw` holds `AttentionOptions` fields
    and the function's other keywords."""
    options, kw = split_options(kw)
    fn = jax.jit(
        functools.partial(ragged_paged_attention, options=options, kv_dtype=case.cache.dtype, **kw)
    )
    return np.asarray(
        fn(
            jnp.asarray(case.q),
            case.kv,
            jnp.asarray(case.block_tables if tables is None else tables),
            jnp.asarray(case.seq_lens),
            jnp.asarray(case.query_start_loc),
            jnp.asarray(case.num_seqs, jnp.int32),
            span_ends=None if span_ends is None else jnp.asarray(span_ends),
        )
    )


def random_spans(rng: np.random.Generator, case: Case) -> np.ndarray:
    """Per query token, the end of a random bidirectional span it lies in (0: none).

    Each request with at least two queries gets one span inside its queries.
    """
    ends = np.zeros(case.q.shape[0], np.int32)
    start = 0
    for r in range(case.num_seqs):
        ql, s = int(case.q_lens[r]), int(case.seq_lens[r])
        if ql >= 2:
            a = int(rng.integers(0, ql - 1))
            b = int(rng.integers(a + 2, ql + 1))
            ends[start + a : start + b] = s - ql + b
        start += ql
    return ends


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


BATCHES = {
    "prefill": ([5, 9, 3], [5, 9, 3]),
    "decode": ([7, 13, 1, 20], [1, 1, 1, 1]),
    "mixed": ([12, 7, 9, 1, 17], [4, 1, 9, 1, 2]),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(
    ("group", "window", "soft_cap"),
    [(1, None, None), (2, 3, None), (4, None, 5.0), (3, 6, 2.0)],
)
def test_matches_dense_float64_reference(batch, group, window, soft_cap) -> None:
    rng = np.random.default_rng()
    seq_lens, q_lens = BATCHES[batch]
    case = random_case(rng, seq_lens, q_lens, group=group)
    scale = 0.35
    got = run_attention(case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
    want = reference_attention(case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
    assert np.isfinite(got).all(), "NaN/inf leaked from padded rows or poisoned pages"
    num_q = int(case.q_lens.sum())
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any(), "padded query rows must be exactly 0"


def test_window_and_cap_change_the_result() -> None:
    """Guards the test above against options that are silently ignored."""
    rng = np.random.default_rng()
    case = random_case(rng, [12, 9], [6, 1])
    plain = run_attention(case, sm_scale=1.0)
    assert np.abs(plain - run_attention(case, sm_scale=1.0, sliding_window=3)).max() > 1e-3
    assert np.abs(plain - run_attention(case, sm_scale=1.0, soft_cap=0.5)).max() > 1e-3


def test_query_chunking_does_not_change_result() -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [12, 7, 9], [4, 1, 9], pad_tokens=2)
    a = run_attention(case, sm_scale=0.5, query_chunk=1)
    b = run_attention(case, sm_scale=0.5, query_chunk=5)  # 16 tokens: padded last chunk
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_stored_as_uint16() -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [12, 7, 9], [4, 1, 9], dtype="bfloat16")
    assert case.cache.storage_dtype == np.uint16 and case.kv.dtype == np.uint16
    got = run_attention(case, sm_scale=0.35)
    want = reference_attention(case, sm_scale=0.35)
    num_q = int(case.q_lens.sum())
    assert got.dtype == ml_dtypes.bfloat16 and np.isfinite(got.astype(np.float32)).all()
    assert rel_error(got[:num_q], want[:num_q]) < 2e-2


def test_empty_batch_and_unused_rows_are_zero() -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [6], [2])
    case.num_seqs = 0
    case.query_start_loc[:] = 0
    got = run_attention(case, sm_scale=1.0)
    assert not got.any()


def test_bad_arguments() -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [6], [2], num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match=r"num_q_heads=3 must be a multiple of num_kv_heads=2"):
        ragged_paged_attention(
            jnp.zeros((2, 3, 8)), case.kv, case.block_tables, case.seq_lens,
            case.query_start_loc, case.num_seqs, AttentionOptions(sm_scale=1.0),
        )  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        run_attention(case, sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU"):
        run_attention(case, sm_scale=1.0, impl="pallas", platform="cpu")


LONG_BATCH = ([40, 7, 33, 1, 26, 19], [40, 1, 12, 1, 3, 19])  # prefill, decode, chunks


@pytest.mark.parametrize(
    ("group", "window", "chunk", "soft_cap", "spans"),
    [
        (1, None, None, None, True),
        (2, 9, None, 3.0, True),
        (4, None, 8, None, False),
        (8, 5, 12, 2.0, True),
        (3, None, None, None, False),
    ],
)
def test_blockwise_masks_match_float64_reference(group, window, chunk, soft_cap, spans) -> None:
    """Long prefills (request-major tiles) and decodes (token-major) in one batch."""
    rng = np.random.default_rng()
    seq_lens, q_lens = LONG_BATCH
    case = random_case(rng, seq_lens, q_lens, group=group, num_kv_heads=1, width=12)
    ends = random_spans(rng, case) if spans else None
    masks = {"sliding_window": window, "attention_chunk": chunk, "soft_cap": soft_cap}
    want = reference_attention(case, sm_scale=0.3, span_ends=ends, **masks)
    got = run_attention(
        case, ends, sm_scale=0.3, query_chunk=16, token_chunk=4, keys_per_chunk=8, **masks
    )
    num_q = int(case.q_lens.sum())
    assert np.isfinite(got).all()
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()


def test_span_and_chunk_masks_change_the_result() -> None:
    """Guards the test above against masks that are silently ignored."""
    rng = np.random.default_rng()
    case = random_case(rng, [20, 9], [20, 9], width=6)
    ends = random_spans(rng, case)
    plain = run_attention(case, sm_scale=1.0)
    assert np.abs(plain - run_attention(case, ends, sm_scale=1.0)).max() > 1e-3
    assert np.abs(plain - run_attention(case, sm_scale=1.0, attention_chunk=4)).max() > 1e-3


def test_tiling_never_changes_the_result() -> None:
    rng = np.random.default_rng()
    seq_lens, q_lens = LONG_BATCH
    case = random_case(rng, seq_lens, q_lens, width=12, pad_tokens=5)
    ends = random_spans(rng, case)
    base = run_attention(case, ends, sm_scale=0.5, sliding_window=11)
    for tiles in (
        {"query_chunk": 1, "token_chunk": 1, "keys_per_chunk": 1},
        {"query_chunk": 7, "token_chunk": 3, "keys_per_chunk": 12},
        {"query_chunk": 256, "token_chunk": 64, "keys_per_chunk": 1024},
    ):
        got = run_attention(case, ends, sm_scale=0.5, sliding_window=11, **tiles)
        np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-6, err_msg=str(tiles))


def test_table_width_does_not_change_the_result() -> None:
    """Width 8 vs 256 at equal contexts; the wide table's unused tail is stale garbage."""
    rng = np.random.default_rng()
    case = random_case(rng, [30, 17, 5, 32], [10, 1, 5, 1], block_size=4, width=8)
    narrow = run_attention(case, sm_scale=0.4, keys_per_chunk=32)  # 8 pages per tile
    wide = rng.integers(0, case.cache.num_blocks, (case.block_tables.shape[0], 256))
    wide[:, :8] = case.block_tables
    got = run_attention(case, tables=wide.astype(np.int32), sm_scale=0.4, keys_per_chunk=32)
    np.testing.assert_array_equal(got, narrow)


def test_freed_pages_before_the_window_may_hold_nan() -> None:
    """A sliding-window manager frees pages behind the window: their table entries
    point at the (NaN) null block, and attention must not read them into the output."""
    rng = np.random.default_rng()
    case = random_case(rng, [37, 29], [9, 1], block_size=4, width=10)
    window = 6
    tables = case.block_tables.copy()
    for r, (s, ql) in enumerate(zip(case.seq_lens[:2], case.q_lens, strict=True)):
        first_needed = (int(s) - int(ql) - window + 1) // 4
        tables[r, :first_needed] = 0  # the null block, NaN-poisoned by random_case
    want = reference_attention(case, sm_scale=0.4, sliding_window=window)
    for tiles in ({}, {"query_chunk": 4, "token_chunk": 2, "keys_per_chunk": 8}):
        got = run_attention(case, tables=tables, sm_scale=0.4, sliding_window=window, **tiles)
        assert np.isfinite(got).all()
        num_q = int(case.q_lens.sum())
        assert rel_error(got[:num_q], want[:num_q]) < 1e-5
