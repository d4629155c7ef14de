"""The query-tiled Pallas Triton prefill kernel (`jaxkv.device.pallas_gpu_prefill`), on CPU.

Interpret mode against the dense float64 reference of `test_device_attention` on random
contexts written into a NaN-poisoned cache (null block, free pages and page tails are
NaN, padded query rows NaN), and cross-lowered for CUDA to a Triton call. Nothing here
runs on a GPU. Small tiles (`query_tile=16`, 16-key chunks over 4-token pages) so that
tiles start mid-page, cross page boundaries and walk several chunks with a few tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_device_attention import (
    BATCHES,
    LONG_BATCH,
    Case,
    random_case,
    random_spans,
    reference_attention,
    rel_error,
)

from jaxkv.device.attention import token_intervals
from jaxkv.device.pallas_gpu import SmemLimit, paged_attention_rows_pallas
from jaxkv.device.pallas_gpu_prefill import (
    ROW_ELEMENTS,
    build_tiles,
    num_tiles,
    paged_prefill_gpu,
    prefill_plan,
    prefill_smem_bytes,
)

H100 = SmemLimit(232448, "H100/H200: 227 KiB per block")
TILE = 16
PAGES = 4  # 4 pages of 4 tokens: 16-key chunks
SCALE = 0.3


def intervals(case: Case, *, span_ends=None, window=None, chunk=None):
    """Each query token's `[lo, hi)`, as the dispatch computes them."""
    width_keys = case.block_tables.shape[1] * case.cache.block_size
    return token_intervals(
        case.q.shape[0], jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc),
        jnp.asarray(case.num_seqs, jnp.int32), width_keys, sliding_window=window,
        attention_chunk=chunk, span_ends=None if span_ends is None else jnp.asarray(span_ends),
    )  # fmt: skip


def run_prefill(
    case: Case,
    *,
    span_ends=None,
    window=None,
    chunk=None,
    tables=None,
    kv=None,
    layer=None,
    **kw,
) -> np.ndarray:
    """`paged_prefill_gpu` in interpret mode over `case`, jitted (`layer` traced)."""
    iv = intervals(case, span_ends=span_ends, window=window, chunk=chunk)
    kw = {"query_tile": TILE, "pages_per_chunk": PAGES, "sm_scale": SCALE, **kw}
    fn = functools.partial(paged_prefill_gpu, kv_dtype=case.cache.dtype, interpret=True, **kw)
    args = (
        jnp.asarray(case.q), case.kv if kv is None else kv,
        jnp.asarray(case.block_tables if tables is None else tables),
        jnp.asarray(case.query_start_loc), jnp.asarray(case.num_seqs, jnp.int32), iv.lo, iv.hi,
    )  # fmt: skip
    if layer is None:
        return np.asarray(jax.jit(fn)(*args))
    stacked = jax.jit(lambda layer, *a: fn(*a, layer=layer))
    return np.asarray(stacked(jnp.asarray(layer, jnp.int32), *args))


def as_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def tolerance(case: Case) -> float:
    # bf16: the dots take bf16 operands (p rounded to bf16), as on tensor cores.
    return 2e-2 if case.cache.dtype == ml_dtypes.bfloat16 else 1e-5


@pytest.mark.parametrize(
    ("group", "kv_heads", "head_size", "dtype", "window", "chunk", "soft_cap", "spans", "heads"),
    [
        (1, 2, 64, "float32", None, None, None, False, None),
        (4, 2, 128, "float32", 9, None, 3.0, True, 2),  # two head slots per KV head
        (8, 1, 64, "bfloat16", None, 8, None, True, None),
        (8, 2, 64, "float32", 5, 12, 2.0, True, 1),  # eight slots per KV head
        (3, 2, 64, "bfloat16", 7, None, None, False, None),  # group padded to 4 heads
        (4, 1, 128, "bfloat16", None, None, 2.0, True, 4),
    ],
)
def test_mixed_batch_matches_float64_reference(
    group, kv_heads, head_size, dtype, window, chunk, soft_cap, spans, heads
) -> None:
    """`min_query_len=0`: every token of a prefill + decode + chunk batch is served."""
    rng = np.random.default_rng()
    seq_lens, q_lens = LONG_BATCH
    case = random_case(
        rng, seq_lens, q_lens, group=group, num_kv_heads=kv_heads, head_size=head_size,
        width=12, dtype=dtype, pad_tokens=5,
    )  # fmt: skip
    ends = random_spans(rng, case) if spans else None
    masks = {"window": window, "chunk": chunk}
    got = run_prefill(case, span_ends=ends, soft_cap=soft_cap, heads_per_program=heads, **masks)
    want = reference_attention(
        case, sm_scale=SCALE, span_ends=ends, sliding_window=window, attention_chunk=chunk,
        soft_cap=soft_cap,
    )  # fmt: skip
    num_q = int(case.q_lens.sum())
    assert np.isfinite(as_f32(got)).all(), "NaN leaked from poisoned pages or padded rows"
    assert rel_error(as_f32(got[:num_q]), want[:num_q]) < tolerance(case)
    assert not as_f32(got[num_q:]).any(), "padded tokens must be exactly 0"
    if window or chunk or soft_cap or spans:  # the masks must matter, or the check proves little
        assert np.abs(want - reference_attention(case, sm_scale=SCALE)).max() > 1e-3


@pytest.mark.parametrize("batch", ["prefill", "long prefill"])
def test_prefill_only_batches(batch) -> None:
    """Short prefills (one partial tile each) and long ones (several tiles, several chunks),
    with the plan's own chunk size."""
    seq_lens, q_lens = BATCHES["prefill"] if batch == "prefill" else ([45, 64], [45, 64])
    rng = np.random.default_rng()
    case = random_case(rng, seq_lens, q_lens, group=2, head_size=64, width=16, num_blocks=40)
    got = run_prefill(case, pages_per_chunk=None)
    want = reference_attention(case, sm_scale=SCALE)
    num_q = int(case.q_lens.sum())
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()


def test_min_query_len_leaves_short_requests_to_the_decode_kernel() -> None:
    """With `min_query_len`, requests of at most that many tokens return exactly 0 and the
    others match; the row kernel over the short requests plus this one is the whole batch
    (what the dispatch adds)."""
    rng = np.random.default_rng()
    seq_lens, q_lens = LONG_BATCH  # q_lens 40, 1, 12, 1, 3, 19
    case = random_case(rng, seq_lens, q_lens, group=4, head_size=64, width=12, pad_tokens=5)
    want = reference_attention(case, sm_scale=SCALE, soft_cap=2.0, sliding_window=10)
    tok_len = np.repeat(case.q_lens, case.q_lens)  # each token's request's query count
    num_q = tok_len.size
    for min_query_len in (1, 3):
        got = run_prefill(case, soft_cap=2.0, window=10, min_query_len=min_query_len)
        long = tok_len > min_query_len
        assert rel_error(got[:num_q][long], want[:num_q][long]) < 1e-5
        assert not got[:num_q][~long].any(), "short requests' tokens must be exactly 0"
        assert not got[num_q:].any()

    iv = intervals(case, window=10)
    short = jnp.asarray(np.pad(tok_len <= 3, (0, case.q.shape[0] - num_q)))
    tok_req = np.minimum(np.searchsorted(case.query_start_loc[1:], np.arange(len(case.q)), "right"),
                         len(case.seq_lens) - 1)  # fmt: skip
    decode = paged_attention_rows_pallas(
        jnp.asarray(case.q), case.kv, jnp.asarray(case.block_tables[tok_req]),
        jnp.where(short, iv.lo, 0), jnp.where(short, iv.hi, 0), sm_scale=SCALE, soft_cap=2.0,
        pages_per_compute_block=4, interpret=True,
    )  # fmt: skip
    total = np.asarray(decode) + got  # got: min_query_len=3
    assert rel_error(total[:num_q], want[:num_q]) < 1e-5
    assert not total[num_q:].any()


def test_freed_pages_and_stale_table_tails_are_never_read_into_the_output() -> None:
    """Pages behind every query's window point at the NaN null block; entries past each
    request's pages are stale ids, some out of range."""
    rng = np.random.default_rng()
    block_size, window = 4, 6
    case = random_case(
        rng, [45, 29, 20], [21, 1, 20], head_size=64, width=14, block_size=block_size
    )
    tables = case.block_tables.copy()
    for r in range(case.num_seqs):
        s, ql = int(case.seq_lens[r]), int(case.q_lens[r])
        tables[r, : max(0, (s - ql - window + 1) // block_size)] = 0
        used = -(-s // block_size)
        tables[r, used:] = rng.integers(0, 2 * case.cache.num_blocks, tables.shape[1] - used)
    assert (tables[: case.num_seqs, :2] == 0).any()  # some pages really were freed
    got = run_prefill(case, tables=tables, window=window)
    want = reference_attention(case, sm_scale=SCALE, sliding_window=window)
    num_q = int(case.q_lens.sum())
    assert np.isfinite(got).all()
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5


def test_stacked_cache_reads_its_layer_in_place() -> None:
    """Layer 2 of a `[3, NB, ...]` stack (the others NaN or another context) equals the
    per-layer call; `layer` is traced."""
    rng = np.random.default_rng()
    seq_lens, q_lens = [33, 7, 20], [17, 1, 20]
    case = random_case(rng, seq_lens, q_lens, group=2, head_size=64, width=10)
    other = random_case(rng, seq_lens, q_lens, group=2, head_size=64, width=10)
    poison = jnp.full_like(case.kv, jnp.nan)
    stack = jnp.stack([other.kv, poison, case.kv])
    got = run_prefill(case, kv=stack, layer=2, soft_cap=3.0)
    np.testing.assert_array_equal(got, run_prefill(case, soft_cap=3.0))
    want = reference_attention(case, sm_scale=SCALE, soft_cap=3.0)
    num_q = int(case.q_lens.sum())
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5


def test_tiles_cover_served_tokens_once_and_never_cross_requests() -> None:
    """Random batches of up to 8 requests (some empty, some past `num_seqs`)."""
    rng = np.random.default_rng()
    num_reqs, num_tokens = 8, 8 * 40 + 4
    for min_query_len in range(4):
        tile_list = jax.jit(
            functools.partial(
                build_tiles, num_tokens=num_tokens, query_tile=TILE, min_query_len=min_query_len
            )
        )
        for _ in range(6):
            q_lens = rng.integers(0, 41, num_reqs)
            num_seqs = int(rng.integers(0, num_reqs + 1))
            qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            tiles = tile_list(jnp.asarray(qsl), jnp.int32(num_seqs))
            req, start, count = (np.asarray(x) for x in tiles)
            assert len(req) == num_tiles(num_tokens, num_reqs, TILE, min_query_len)
            covered = np.zeros(num_tokens, int)
            for r, s, c in zip(req, start, count, strict=True):
                assert 0 <= c <= TILE
                if c:
                    assert qsl[r] <= s and s + c <= qsl[r + 1], "a tile crosses its request"
                    covered[s : s + c] += 1
            served = np.zeros(num_tokens, int)
            for r in range(num_seqs):
                if q_lens[r] > min_query_len:
                    served[qsl[r] : qsl[r + 1]] = 1
            np.testing.assert_array_equal(covered, served)


def test_tile_bound_is_tight_for_many_short_prefills() -> None:
    """Every request just over `min_query_len`: one tile each, all of them needed."""
    qsl = jnp.arange(0, 42, 2, dtype=jnp.int32)  # 20 requests of 2 tokens
    tiles = build_tiles(qsl, jnp.int32(20), 40, query_tile=TILE, min_query_len=1)
    assert int((tiles.count > 0).sum()) == 20 and int(tiles.count.sum()) == 40


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_plan_keeps_programs_within_an_h100s_shared_memory(head_size, dtype, group) -> None:
    plan = prefill_plan(head_size, 16, group, dtype, 64, H100)
    rows = 64 * plan.heads_per_program
    need = prefill_smem_bytes(head_size, plan.pages_per_chunk * 16, rows, np.dtype(dtype).itemsize)
    assert need <= H100.bytes - H100.bytes // 16
    assert rows * head_size <= ROW_ELEMENTS or plan.heads_per_program == 1
    assert plan.pages_per_chunk * 16 >= 16


def test_plan_refuses_what_fits_nowhere() -> None:
    with pytest.raises(ValueError, match="no prefill tile fits shared memory.*128 keys"):
        prefill_plan(256, 128, 1, np.float32, 64, H100)
    assert prefill_plan(256, 128, 1, np.float32, 16, None).pages_per_chunk == 1


def _args(q_heads=4, head_size=16, block_size=4, kv_heads=2, dtype=jnp.float32, stacked=False):
    cache = (8, block_size, 2 * kv_heads, head_size)
    q = jnp.zeros((5, q_heads, head_size))
    kv = jnp.zeros(((2,) if stacked else ()) + cache, dtype)
    qsl = jnp.asarray([0, 5, 5], jnp.int32)
    lohi = jnp.zeros(5, jnp.int32)
    return q, kv, jnp.zeros((2, 3), jnp.int32), qsl, jnp.int32(1), lohi, lohi


@pytest.mark.parametrize(
    ("shape", "kw", "match"),
    [
        ({}, {"query_tile": 24}, "query_tile=24 must be a power of two >= 16"),
        ({}, {"query_tile": 8}, "query_tile=8 must be a power of two >= 16"),
        ({"block_size": 6}, {}, "block_size=6 must be a power of two"),
        ({"head_size": 8}, {}, "head_size=8 must be >= 16"),
        ({}, {"pages_per_chunk": 2}, r"pages_per_chunk=2 \* block_size=4"),
        ({}, {"heads_per_program": 4}, "heads_per_program=4 must be a power of two <= 2"),
        ({"q_heads": 3}, {}, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
        ({"dtype": jnp.uint16}, {"kv_dtype": "float32"}, "kv_dtype=float32 must have the width"),
        ({"stacked": True}, {}, "stacked .* with `layer`"),
        ({}, {"layer": 0}, "stacked .* with `layer`"),
        ({}, {"min_query_len": -1}, "min_query_len must be an int >= 0"),
    ],
)
def test_rejects_bad_inputs(shape, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        paged_prefill_gpu(*_args(**shape), sm_scale=1.0, interpret=True, **kw)


@pytest.mark.parametrize(
    ("storage", "kv_dtype", "group", "head_size", "stacked"),
    [(jnp.float32, None, 4, 128, False), (jnp.uint16, "bfloat16", 8, 64, True)],
)
def test_lowers_to_one_triton_call_for_cuda(storage, kv_dtype, group, head_size, stacked) -> None:
    """Cross-lowering on CPU runs the Pallas Triton lowering (not PTX compilation): it
    rejects non-power-of-two tensors, small dots and unsupported ops, and catches a kernel
    routed to Mosaic GPU; the plan is the H100's (no GPU visible)."""
    fn = functools.partial(
        paged_prefill_gpu, sm_scale=0.1, soft_cap=2.0, kv_dtype=kv_dtype, min_query_len=1
    )
    q_dtype = jnp.float32 if kv_dtype is None else jnp.bfloat16
    cache = ((3,) if stacked else ()) + (50, 16, 4, head_size)
    shapes = [
        jax.ShapeDtypeStruct((100, 2 * group, head_size), q_dtype),
        jax.ShapeDtypeStruct(cache, storage),
        jax.ShapeDtypeStruct((5, 7), jnp.int32),
        jax.ShapeDtypeStruct((6,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((100,), jnp.int32),
        jax.ShapeDtypeStruct((100,), jnp.int32),
    ]
    if stacked:
        shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
        call = jax.jit(lambda *a: fn(*a[:-1], layer=a[-1]))
    else:
        call = jax.jit(fn)
    text = call.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    [call_line] = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert "jaxkv_paged_prefill" in call_line
    assert "output_operand_alias" in call_line, "the output must start as the aliased zeros"
