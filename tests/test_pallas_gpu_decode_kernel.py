"""The split (flash-decoding) Triton kernel `jaxkv.device.pallas_gpu_decode`, on CPU.

Pallas interpret mode against the dense float64 reference of `test_device_attention`
on random contexts written into a NaN-poisoned cache (null block, free pages and page
tails are NaN; stale table entries past each request's pages point anywhere, some out
of range), plus the CUDA cross-lowering (the Pallas Triton lowering, not PTX). Nothing
here runs on a GPU: speed and Triton's own compilation are unchecked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_device_attention import Case, random_case, random_spans, reference_attention, rel_error

from jaxkv.device import pallas_gpu_decode
from jaxkv.device.attention import token_intervals
from jaxkv.device.pallas_gpu import SmemLimit, smem_limit_for
from jaxkv.device.pallas_gpu_decode import (
    MAX_SPLITS,
    TILE_ELEMENTS,
    decode_compute_block_pages,
    decode_kernel_error,
    decode_smem_bytes,
    default_num_splits,
    merge_splits,
    paged_decode_rows_gpu,
)

H200 = SmemLimit(232448, "H100/H200: 227 KiB per block")
BLOCK_SIZE = 4
WIDTH = 48  # table pages: 192 keys, 6 compute blocks of 32 keys -> 2 default splits
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def decode_case(rng, seq_lens, *, group, head_size, dtype="float32", q_lens=None) -> Case:
    """Requests with one query each (or `q_lens`), one padded request and 2 padded rows."""
    pages = sum(-(-s // BLOCK_SIZE) for s in seq_lens)
    return random_case(
        rng, seq_lens, q_lens or [1] * len(seq_lens), num_kv_heads=2, group=group,
        head_size=head_size, block_size=BLOCK_SIZE, width=WIDTH, num_blocks=pages + 4,
        dtype=dtype, pad_reqs=1, pad_tokens=2,
    )  # fmt: skip


def stale_tails(rng: np.random.Generator, case: Case) -> np.ndarray:
    """Table entries past each request's pages become stale ids, some out of range."""
    used = -(-case.seq_lens // BLOCK_SIZE)
    tail = np.arange(WIDTH)[None, :] >= used[:, None]
    stale = rng.integers(-3, 2 * case.cache.num_blocks, case.block_tables.shape, dtype=np.int32)
    return np.where(tail, stale, case.block_tables)


def rows(case: Case, tables: np.ndarray, span_ends=None, **masks):
    """Token-major kernel inputs: q, each token's table row and key interval."""
    iv = token_intervals(
        case.q.shape[0], jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc),
        jnp.asarray(case.num_seqs, jnp.int32), WIDTH * BLOCK_SIZE,
        span_ends=None if span_ends is None else jnp.asarray(span_ends), **masks,
    )  # fmt: skip
    return jnp.asarray(case.q), jnp.asarray(tables)[iv.req], iv.lo, iv.hi


def run(case: Case, q, tables, lo, hi, *, kv=None, layer=None, **kw) -> np.ndarray:
    fn = functools.partial(paged_decode_rows_gpu, kv_dtype=case.cache.dtype, interpret=True, **kw)
    out = jax.jit(fn)(q, case.kv if kv is None else kv, tables, lo, hi, layer=layer)
    return np.asarray(out).astype(np.float64)


@pytest.mark.parametrize(
    ("group", "head_size", "dtype", "window", "soft_cap", "splits"),
    [
        (1, 64, "float32", None, None, None),
        (2, 128, "bfloat16", 37, None, None),  # the window starts past compute block 0
        (4, 256, "float32", None, 3.0, 3),
        (8, 64, "bfloat16", 50, 2.0, 4),
        (3, 64, "float32", 20, None, 5),  # a group that is no power of two
        (16, 64, "float32", None, 2.0, None),  # the plgpu.dot route
    ],
)
def test_matches_dense_float64_reference(group, head_size, dtype, window, soft_cap, splits):
    rng = np.random.default_rng()
    seq_lens = [1, 7, WIDTH * BLOCK_SIZE, 150, 33]
    case = decode_case(rng, seq_lens, group=group, head_size=head_size, dtype=dtype)
    opts = {"sm_scale": 0.3, "soft_cap": soft_cap}
    args = rows(case, stale_tails(rng, case), sliding_window=window)
    got = run(case, *args, num_splits=splits, **opts)
    want = reference_attention(case, sliding_window=window, **opts)
    n = case.num_seqs
    assert np.isfinite(got).all(), "NaN leaked from the null block, free pages or page tails"
    assert rel_error(got[:n], want[:n]) < TOL[dtype]
    assert not got[n:].any(), "padded rows must be exactly 0"
    if window or soft_cap:  # the options must matter here, or the check above proves little
        assert np.abs(want - reference_attention(case, sm_scale=0.3)).max() > 1e-2


def test_bf16_stored_as_uint16_returns_q_dtype() -> None:
    rng = np.random.default_rng()
    case = decode_case(rng, [9, 130], group=2, head_size=64, dtype="bfloat16")
    assert case.kv.dtype == np.uint16
    q, tables, lo, hi = rows(case, case.block_tables)
    fn = functools.partial(paged_decode_rows_gpu, sm_scale=0.3, kv_dtype="bfloat16")
    out = jax.jit(functools.partial(fn, interpret=True))(q, case.kv, tables, lo, hi)
    assert out.dtype == ml_dtypes.bfloat16
    want = reference_attention(case, sm_scale=0.3)
    assert rel_error(np.asarray(out)[:2], want[:2]) < TOL["bfloat16"]


def test_merge_of_splits_equals_one_split() -> None:
    """Splitting only regroups the same exact sums: 1, 2, 5 and 16 splits (more splits
    than compute blocks: empty splits) agree to float rounding."""
    rng = np.random.default_rng()
    case = decode_case(rng, [WIDTH * BLOCK_SIZE, 101, 5], group=4, head_size=64)
    args = rows(case, case.block_tables, sliding_window=70)
    one = run(case, *args, sm_scale=0.3, num_splits=1)
    for splits in (2, 5, 16):
        np.testing.assert_allclose(
            run(case, *args, sm_scale=0.3, num_splits=splits), one, rtol=2e-6, atol=2e-7
        )
    want = reference_attention(case, sm_scale=0.3, sliding_window=70)
    assert rel_error(one[:3], want[:3]) < 1e-5


def test_merge_splits_weights_and_empty_rows() -> None:
    """The merge by hand: two splits of known partials, an empty split beside them
    changes nothing, and a row whose splits are all empty gives 0 (not NaN)."""
    empty = (np.zeros(3), -1e30, 0.0)
    a = (np.array([2.0, 4.0, 6.0]), 1.0, 2.0)  # acc, m, l
    b = (np.array([1.0, 0.0, 1.0]), 3.0, 1.0)
    parts = [[a, b, empty], [empty, empty, empty]]  # [rows=2][splits=3]
    acc = jnp.asarray([[[[p[0]] for p in row]] for row in parts], jnp.float32)
    m = jnp.asarray([[[[p[1]] for p in row]] for row in parts], jnp.float32)
    denom = jnp.asarray([[[[p[2]] for p in row]] for row in parts], jnp.float32)
    out = np.asarray(merge_splits(acc, m, denom))  # [2, 1, 1, 3]
    wa, wb = np.exp(1.0 - 3.0), 1.0
    want = (wa * a[0] + wb * b[0]) / (wa * a[2] + wb * b[2])
    np.testing.assert_allclose(out[0, 0, 0], want, rtol=1e-6)
    assert not out[1].any() and np.isfinite(out).all()


def test_stacked_cache_reads_the_layer_in_place() -> None:
    """Layer 0 and the last layer of a stack (a traced index) equal the per-layer call;
    the other layers are NaN, so a page read from the wrong layer would show."""
    rng = np.random.default_rng()
    case = decode_case(rng, [3, 90, 150], group=2, head_size=64)
    args = rows(case, stale_tails(rng, case))
    single = run(case, *args, sm_scale=0.3, soft_cap=5.0)
    nan = jnp.full_like(case.kv, jnp.nan)
    for layer, stack in ((0, [case.kv, nan, nan]), (2, [nan, nan, case.kv])):
        got = run(
            case, *args, kv=jnp.stack(stack), layer=jnp.int32(layer), sm_scale=0.3, soft_cap=5.0
        )
        np.testing.assert_array_equal(got, single)
    assert rel_error(single[:3], reference_attention(case, sm_scale=0.3, soft_cap=5.0)[:3]) < 1e-5


@pytest.mark.parametrize(("layer", "read"), [(1, 1), (7, 2), (-1, 0)])
def test_page_ids_handed_to_the_kernel_lie_in_the_layer(monkeypatch, layer, read) -> None:
    """Triton loads are unchecked (interpret mode's gathers clamp, so only a spy sees
    this): stale and out-of-range ids are clipped into the layer's `[l * NB, (l + 1) *
    NB)`, an out-of-range `layer` into `[0, L)`."""
    seen, kernel = [], pallas_gpu_decode._call

    def spy(qg, kv_cache, tables, *args, **kw):
        seen.append(np.asarray(tables))
        return kernel(qg, kv_cache, tables, *args, **kw)

    rng = np.random.default_rng()
    case = decode_case(rng, [3, 90], group=2, head_size=64)
    tables = stale_tails(rng, case)
    assert (tables < 0).any() and (tables >= case.cache.num_blocks).any()
    monkeypatch.setattr(pallas_gpu_decode, "_call", spy)
    q, rows_tables, lo, hi = rows(case, tables)
    stack = jnp.stack([case.kv] * 3)
    paged_decode_rows_gpu(
        q,
        stack,
        rows_tables,
        lo,
        hi,
        sm_scale=0.3,
        layer=jnp.int32(layer),
        kv_dtype=case.cache.dtype,
        interpret=True,
    )
    [got] = seen
    nb = case.cache.num_blocks
    assert got.min() >= read * nb and got.max() < (read + 1) * nb
    np.testing.assert_array_equal(got[:, :WIDTH] - read * nb, np.clip(rows_tables, 0, nb - 1))


def test_token_major_rows_of_a_mixed_step() -> None:
    """Prefill, chunk and decode tokens as rows, with spans and a chunked-local mask."""
    rng = np.random.default_rng()
    case = decode_case(rng, [40, 6, 75, 1], group=2, head_size=64, q_lens=[9, 1, 5, 1])
    ends = random_spans(rng, case)
    masks = {"attention_chunk": 32, "span_ends": ends}
    got = run(case, *rows(case, stale_tails(rng, case), **masks), sm_scale=0.3)
    want = reference_attention(case, sm_scale=0.3, **masks)
    num_q = int(case.q_lens.sum())
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()


def test_tile_plan() -> None:
    """Vector route: `keys * D <= TILE_ELEMENTS` (8 pages at most); dot route: the most
    pages whose shared memory fits; splits follow the table width, at most `MAX_SPLITS`."""
    for head_size, pages in ((64, 8), (128, 4), (256, 2)):
        for dtype in ("float32", "bfloat16"):
            assert decode_compute_block_pages(head_size, 16, 4, dtype, H200) == pages
    assert 128 * 128 * decode_compute_block_pages(128, 128, 1, "bfloat16", H200) > TILE_ELEMENTS
    # f32 head 256, dot route: 64 keys asked the compiler for 278,544 bytes (> 232,448)
    assert decode_smem_bytes(256, 64, 16, 4) >= 278544 > H200.bytes
    assert decode_compute_block_pages(256, 16, 16, "float32", H200) == 2
    assert decode_compute_block_pages(128, 16, 16, "bfloat16", H200) == 8  # 204,832 bytes
    assert decode_compute_block_pages(64, 4, 2, "float32", None) == 8  # interpret mode
    assert default_num_splits(64, 4) == 4  # 16 compute blocks, 4 per split
    assert default_num_splits(3, 4) == 1
    assert default_num_splits(4096, 4) == MAX_SPLITS


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((64, 6, 2, "float32", H200), "block_size=6 must be a power of two"),
        ((96, 16, 2, "float32", H200), "head_size=96 must be a power of two"),
        ((8, 16, 16, "float32", H200), "head_size=8 must be >= 16"),  # dot route
        ((256, 128, 16, "float32", smem_limit_for("7.5")), "no decode tile fits shared memory"),
    ],
)
def test_decode_kernel_error(args, match) -> None:
    assert match.split(" must")[0] in decode_kernel_error(*args)
    with pytest.raises(ValueError, match=match):
        decode_compute_block_pages(*args)
    assert decode_kernel_error(64, 16, 2, "float32", H200) is None


def test_rejects_bad_inputs() -> None:
    q = jnp.zeros((2, 4, 64))
    kv = jnp.zeros((8, 4, 4, 64))
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32)
    call = functools.partial(paged_decode_rows_gpu, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"need \[blocks, block_size, 2 \* H, D\] without `layer`"):
        call(q, kv, tables, lens * 0, lens, layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"with `layer`"):
        call(q, kv[None], tables, lens * 0, lens)
    with pytest.raises(ValueError, match="num_q_heads=3 must be a multiple"):
        call(q[:, :3], kv, tables, lens * 0, lens)
    with pytest.raises(ValueError, match="kv_dtype=float32 must have the width"):
        call(q, kv.astype(jnp.uint16), tables, lens * 0, lens, kv_dtype="float32")
    with pytest.raises(ValueError, match="num_splits=0"):
        call(q, kv, tables, lens * 0, lens, num_splits=0)
    with pytest.raises(ValueError, match="pages_per_compute_block=3: a power of two"):
        call(q, kv, tables, lens * 0, lens, pages_per_compute_block=3)
    q16 = jnp.zeros((2, 32, 64))  # group 16: the dot route needs >= 16 keys per block
    with pytest.raises(ValueError, match=r"pages_per_compute_block=2 \* block_size=4"):
        call(q16, kv, tables, lens * 0, lens, pages_per_compute_block=2)


@pytest.mark.parametrize(
    ("group", "storage", "kv_dtype", "stacked"),
    [
        (1, jnp.float32, None, False),
        (4, jnp.uint16, "bfloat16", True),
        (3, jnp.bfloat16, None, False),
        (16, jnp.bfloat16, None, True),  # plgpu.dot route
    ],
)
def test_lowers_to_one_triton_call_for_cuda(group, storage, kv_dtype, stacked) -> None:
    """Cross-lowering on CPU runs the Pallas Triton lowering (not PTX compilation): it
    rejects non-power-of-two tensors and small dots, and without Triton compiler params
    CUDA would take Mosaic GPU. One kernel, one Triton call (the merge is plain XLA)."""
    heads, head_size, num_blocks = 2, 128, 50
    cache = (num_blocks, 16, 2 * heads, head_size)
    q_dtype = jnp.float32 if storage == jnp.float32 else jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct((3, heads * group, head_size), q_dtype),
        jax.ShapeDtypeStruct((4, *cache) if stacked else cache, storage),
        jax.ShapeDtypeStruct((3, 37), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    ]

    def fn(q, kv, tables, lo, hi, layer):
        return paged_decode_rows_gpu(
            q, kv, tables, lo, hi, sm_scale=0.1, soft_cap=2.0, kv_dtype=kv_dtype,
            layer=layer if stacked else None,
        )  # fmt: skip

    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "jaxkv_paged_decode_split" in text
