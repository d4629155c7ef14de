"""Pallas GPU paged decode kernel, run in Pallas interpret mode on CPU.

Compared against the dense float64 NumPy reference of `test_device_attention`
on random contexts written into a NaN-poisoned cache (null block, free pages and
page tails are NaN). Interpret mode checks the kernel's semantics, not its Triton
lowering: nothing here runs on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_device_attention import (
    Case,
    random_case,
    reference_attention,
    rel_error,
    run_attention,
)

from jaxkv.device import (
    AttentionOptions,
    gpu_attention,
    paged_decode_attention,
    pallas_gpu,
    ragged_paged_attention,
)
from jaxkv.device.attention import token_intervals
from jaxkv.device.pallas_gpu import paged_attention_rows_pallas, paged_decode_attention_pallas

UNIT = AttentionOptions(sm_scale=1.0)
PALLAS = AttentionOptions(sm_scale=1.0, impl="pallas")
HEAD_SIZE = 16
WIDTH = 5  # block-table width; one request per case fills it


def decode_case(
    rng: np.random.Generator,
    seq_lens: list[int],
    *,
    group: int,
    block_size: int,
    dtype: str = "float32",
) -> Case:
    """One query per request plus one padded request (seq_len 0, NaN query)."""
    pages = sum(-(-s // block_size) for s in seq_lens)
    return random_case(
        rng, seq_lens, [1] * len(seq_lens), group=group, head_size=HEAD_SIZE,
        block_size=block_size, width=WIDTH, num_blocks=pages + 6, dtype=dtype,
        pad_reqs=1, pad_tokens=1,
    )  # fmt: skip


def poison_table_tails(rng: np.random.Generator, case: Case) -> np.ndarray:
    """Entries past each request's used pages become stale ids (some out of range)."""
    tables = case.block_tables.copy()
    block_size = case.cache.block_size
    used = -(-case.seq_lens // block_size)
    tail = np.arange(tables.shape[1])[None, :] >= used[:, None]
    stale = rng.integers(0, 2 * case.cache.num_blocks, tables.shape, dtype=np.int32)
    return np.where(tail, stale, tables)


def run_kernel(case: Case, tables: np.ndarray, **kw) -> np.ndarray:
    fn = jax.jit(
        functools.partial(
            paged_decode_attention_pallas, kv_dtype=case.cache.dtype, interpret=True, **kw
        )
    )
    return np.asarray(
        fn(jnp.asarray(case.q), case.kv, jnp.asarray(tables), jnp.asarray(case.seq_lens))
    )


@pytest.mark.parametrize(
    ("group", "block_size", "pages_per_block", "window", "soft_cap"),
    [
        (1, 4, 4, None, None),
        (2, 8, 2, 5, None),
        (3, 4, 8, None, 3.0),  # group padded to 16 rows; table padded to 8 pages
        (4, 4, 4, 6, 2.0),
        (8, 16, 1, 6, 2.0),  # window starts the loop past the first compute blocks
    ],
)
def test_matches_dense_float64_reference(
    group, block_size, pages_per_block, window, soft_cap
) -> None:
    rng = np.random.default_rng()
    seq_lens = [1, 7, WIDTH * block_size, 2 * block_size + 3]
    case = decode_case(rng, seq_lens, group=group, block_size=block_size)
    opts = {"sm_scale": 0.35, "sliding_window": window, "soft_cap": soft_cap}
    got = run_kernel(
        case, poison_table_tails(rng, case), pages_per_compute_block=pages_per_block, **opts
    )
    want = reference_attention(case, **opts)
    n = case.num_seqs
    assert np.isfinite(got).all(), "NaN leaked from the null block, free pages or page tails"
    assert rel_error(got[:n], want[:n]) < 1e-5
    assert not got[n:].any(), "seq_len 0 rows must be exactly 0"
    if window or soft_cap:  # the options must matter here, or the check above proves little
        assert np.abs(want - reference_attention(case, sm_scale=0.35)).max() > 1e-3


def test_bf16_stored_as_uint16() -> None:
    rng = np.random.default_rng()
    case = decode_case(rng, [1, 9, 20], group=2, block_size=4, dtype="bfloat16")
    assert case.kv.dtype == np.uint16
    got = run_kernel(case, case.block_tables, sm_scale=0.35, pages_per_compute_block=4)
    want = reference_attention(case, sm_scale=0.35)
    n = case.num_seqs
    assert got.dtype == ml_dtypes.bfloat16 and np.isfinite(got.astype(np.float32)).all()
    assert rel_error(got[:n], want[:n]) < 2e-2
    assert not got[n:].astype(np.float32).any()


def test_dispatch_matches_reference_and_zeroes_rows_past_num_seqs() -> None:
    rng = np.random.default_rng()
    case = decode_case(rng, [3, 20, 1, 11], group=2, block_size=4)
    num_seqs = 3  # the 4th request is live in the arrays but past num_seqs
    args = (
        jnp.asarray(case.q), case.kv, jnp.asarray(case.block_tables),
        jnp.asarray(case.seq_lens), jnp.asarray(num_seqs, jnp.int32),
    )  # fmt: skip

    def run(**kw) -> np.ndarray:
        options = AttentionOptions(sm_scale=0.5, soft_cap=4.0, impl=kw.pop("impl", "auto"))
        fn = functools.partial(paged_decode_attention, options=options, **kw)
        return np.asarray(jax.jit(fn)(*args))

    auto = run(platform="cpu")
    kernel = run(impl="pallas", interpret=True, platform="cpu")
    ragged = ragged_paged_attention(
        args[0], case.kv, args[2], args[3], jnp.arange(len(case.q) + 1, dtype=jnp.int32),
        args[4], AttentionOptions(sm_scale=0.5, soft_cap=4.0, impl="reference"),
    )  # fmt: skip
    np.testing.assert_allclose(auto, np.asarray(ragged), rtol=1e-6, atol=1e-6)
    want = reference_attention(case, sm_scale=0.5, soft_cap=4.0)
    for got in (auto, kernel):
        assert rel_error(got[:num_seqs], want[:num_seqs]) < 1e-5
        assert not got[num_seqs:].any()


def _args(num_q_heads=4, head_size=16, block_size=4, kv_heads=2, dtype=jnp.float32):
    q = jnp.zeros((2, num_q_heads, head_size))
    kv = jnp.zeros((8, block_size, 2 * kv_heads, head_size), dtype)
    return q, kv, jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32)


@pytest.mark.parametrize(
    ("shape", "kw", "match"),
    [
        ({"block_size": 6}, {}, "block_size=6 must be a power of two"),
        ({"head_size": 24}, {}, "head_size=24 must be a power of two"),
        ({"head_size": 8}, {}, "head_size=8 must be >= 16"),
        ({}, {"pages_per_compute_block": 3}, "pages_per_compute_block=3 must be a power of two"),
        ({}, {"pages_per_compute_block": 2}, r"pages_per_compute_block=2 \* block_size=4"),
        ({"num_q_heads": 3}, {}, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
        ({}, {"sliding_window": 0}, "sliding_window must be positive, got 0"),
        ({}, {"soft_cap": -1.0}, "soft_cap must be positive"),
        ({"dtype": jnp.uint16}, {"kv_dtype": "float32"}, "kv_dtype=float32 must have the width"),
    ],
)
def test_kernel_rejects_bad_inputs(shape, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_pallas(*_args(**shape), sm_scale=1.0, interpret=True, **kw)


def test_kernel_rejects_a_cache_rank_that_disagrees_with_layer() -> None:
    q, kv, tables, lens = _args()
    call = functools.partial(paged_decode_attention_pallas, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match=r"without `layer`, or a stack .* with `layer`"):
        call(q, kv, tables, lens, layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"without `layer`, or a stack .* with `layer`"):
        call(q, kv[None], tables, lens)


def test_dispatch_rejects_bad_options() -> None:
    q, kv, tables, lens = _args()
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU .* or a TPU"):
        paged_decode_attention(q, kv, tables, lens, 2, PALLAS, platform="cpu")
    with pytest.raises(ValueError, match="interpret=True needs impl='pallas'"):
        paged_decode_attention(q, kv, tables, lens, 2, UNIT, interpret=True)
    with pytest.raises(ValueError, match="impl must be"):
        paged_decode_attention(q, kv, tables, lens, 2, AttentionOptions(impl="triton"))
    with pytest.raises(TypeError, match="options must be an AttentionOptions, got dict"):
        paged_decode_attention(q, kv, tables, lens, 2, {"sm_scale": 1.0})
    with pytest.raises(ValueError, match="window .* and options.sliding_window=3 both given"):
        ragged_paged_attention(
            q, kv, tables, lens, jnp.arange(3, dtype=jnp.int32), 2,
            AttentionOptions(sliding_window=3), window=jnp.int32(3),
        )  # fmt: skip


def test_gpu_dispatch_picks_the_decode_kernel(monkeypatch) -> None:
    """No GPU here: a spy stands in for the decode kernel to check what `auto` picks (a
    decode step holds no long request: the prefill kernel does not run)."""
    calls = []

    def spy(q, kv_cache, block_tables, lo, hi, **kw):
        calls.append((np.asarray(hi), kw))
        return jnp.zeros_like(q)

    def no_prefill(*args, **kw):
        raise AssertionError("a decode step ran the prefill kernel")

    q, kv, tables, lens = _args()  # head_size 16, block_size 4: the kernel applies
    monkeypatch.setattr(gpu_attention, "paged_decode_rows_gpu", spy)
    monkeypatch.setattr(gpu_attention, "paged_prefill_gpu", no_prefill)
    paged_decode_attention(q, kv, tables, lens, 1, UNIT, platform="gpu")
    [(hi, kw)] = calls
    np.testing.assert_array_equal(hi, [1, 0])  # rows past num_seqs see no key
    assert kw["interpret"] is False
    reference = AttentionOptions(sm_scale=1.0, impl="reference")
    paged_decode_attention(q, kv, tables, lens, 2, reference, platform="gpu")
    assert len(calls) == 1


def test_gpu_mixed_step_is_decode_plus_prefill_kernels() -> None:
    """A step with a long prefill and decodes: the decode kernel serves the short
    requests, the prefill kernel the long one, each 0 for the other's tokens; their sum
    is the float64 reference (interpret mode)."""
    rng = np.random.default_rng()
    case = random_case(rng, [40, 9, 23, 5], [24, 1, 1, 1], num_kv_heads=2, group=2, width=12)
    got = run_attention(case, sm_scale=0.3, sliding_window=17, impl="pallas", interpret=True)
    want = reference_attention(case, sm_scale=0.3, sliding_window=17)
    num_q = int(case.q_lens.sum())
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()


@pytest.mark.parametrize(
    ("storage", "kv_dtype", "window", "soft_cap"),
    [(jnp.float32, None, None, None), (jnp.uint16, "bfloat16", 6, 2.0)],
)
def test_lowers_to_a_triton_call_for_cuda(storage, kv_dtype, window, soft_cap) -> None:
    """Cross-lowering on CPU runs the Pallas Triton lowering (not PTX compilation).

    Catches constructs Triton rejects (non power-of-two loads, small dots) and a
    kernel silently routed to Mosaic GPU, which is the default without Triton params.
    """
    fn = functools.partial(
        paged_decode_attention_pallas, sm_scale=0.1, kv_dtype=kv_dtype,
        sliding_window=window, soft_cap=soft_cap, pages_per_compute_block=4,
    )  # fmt: skip
    q_dtype = jnp.float32 if kv_dtype is None else jnp.bfloat16
    lowered = (
        jax.jit(fn)
        .trace(
            jax.ShapeDtypeStruct((3, 6, 128), q_dtype),
            jax.ShapeDtypeStruct((50, 16, 4, 128), storage),
            jax.ShapeDtypeStruct((3, 7), jnp.int32),
            jax.ShapeDtypeStruct((3,), jnp.int32),
        )
        .lower(lowering_platforms=("cuda",))
    )
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize(
    ("group", "window", "chunk", "soft_cap", "spans"),
    [(2, None, None, None, True), (1, 5, None, 2.0, False), (4, None, 6, None, True)],
)
def test_rows_kernel_serves_mixed_steps(group, window, chunk, soft_cap, spans) -> None:
    """`step`'s GPU path: prefill, decode and chunks in one batch, every mask, interpret mode."""
    from test_device_attention import random_spans, run_attention

    rng = np.random.default_rng()
    case = random_case(
        rng, [11, 6, 9, 1], [7, 1, 4, 1], group=group, head_size=HEAD_SIZE, block_size=4,
        width=WIDTH - 2, num_blocks=20, pad_tokens=2,
    )  # fmt: skip
    ends = random_spans(rng, case) if spans else None
    masks = {"sliding_window": window, "attention_chunk": chunk, "soft_cap": soft_cap}
    want = reference_attention(case, sm_scale=0.3, span_ends=ends, **masks)
    got = run_attention(case, ends, sm_scale=0.3, impl="pallas", interpret=True, **masks)
    num_q = int(case.q_lens.sum())
    assert np.isfinite(got).all()
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()


@pytest.mark.slow
def test_decode_matches_jax_paged_attention_in_interpret_mode() -> None:
    """The GPU script's comparison with JAX's own kernels, dry-run on CPU: jaxkv's Triton
    decode kernel and `jax.experimental.pallas.ops.gpu.paged_attention` (both in Pallas
    interpret mode) agree on the same pages; the prefill agrees with XLA's attention over
    the gathered pages (that side in bfloat16, as cuDNN runs it)."""
    from benchmarks.gpu_check import compare_with_jax_kernels

    report = compare_with_jax_kernels(4800.0, small=True)
    assert report["decode_max_abs_diff"] < 1e-5, report
    assert report["prefill_max_abs_diff"] < 5e-2, report


@pytest.mark.slow
def test_attention_targets_dry_run_reports_every_target() -> None:
    """The GPU script's attention targets, dry-run on CPU (small shapes, the blockwise
    path): each case agrees with dense attention in bf16, and each target's verdict is
    its figure against its bound."""
    from benchmarks.gpu_attention_targets import attention_targets

    report = attention_targets(10.0, 4800.0, rounds=1, small=True)
    for name in ("decode 4 x 64", "decode 2 x 256"):
        assert report[name]["max_abs_diff"] < 5e-2, report[name]
        assert report[name]["paged"]["share_nominal"] < report[name]["paged"]["share_measured"]
    assert report["prefill 128"]["max_abs_diff"] < 5e-2
    assert report["prefill 128"]["dense_implementation"] == "xla"
    targets = report["targets"]
    assert len(targets) == 5
    share = targets["decode 4 x 64: share of measured bandwidth >= 0.5"]
    assert share["value"] == report["decode 4 x 64"]["paged"]["share_measured"]
    assert share["met"] == (share["value"] >= 0.5)
    mixed = report["mixed 64 + 3 x 64"]
    parts = mixed["prefill_alone"]["median"] + mixed["decodes_alone"]["median"]
    assert mixed["mixed_vs_sum_of_parts"] == pytest.approx(mixed["mixed"]["median"] / parts)


def _mixed_rows(rng: np.random.Generator, stale: bool):
    """A mixed step (prefill, chunk, decode, padding) as token rows for the rows kernel:
    `(case, q, each token's table row, lo, hi)`; with `stale`, table entries past each
    request's pages are stale ids, some negative or past the layer's blocks."""
    case = random_case(
        rng, [11, 6, 19, 1], [7, 1, 4, 1], group=2, head_size=HEAD_SIZE, block_size=4,
        width=WIDTH + 1, num_blocks=20, pad_tokens=2,
    )  # fmt: skip
    tables = case.block_tables
    if stale:
        used = -(-case.seq_lens // 4)
        tail = np.arange(tables.shape[1])[None, :] >= used[:, None]
        junk = rng.integers(-3, 2 * case.cache.num_blocks, tables.shape, dtype=np.int32)
        junk[:2, -1] = -3, 2 * case.cache.num_blocks - 1  # always both kinds (tails: 3, 4)
        tables = np.where(tail, junk, tables)
    iv = token_intervals(
        case.q.shape[0], jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc),
        jnp.asarray(case.num_seqs, jnp.int32), tables.shape[1] * 4,
    )  # fmt: skip
    return case, jnp.asarray(case.q), jnp.asarray(tables)[iv.req], iv.lo, iv.hi


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_rows_kernel_reads_a_stacked_layer_in_place(layer) -> None:
    """Layer `layer` (traced) of a 3-layer stack gives bit for bit the 4-D call on
    `stack[layer]`, and the float64 reference. The other layers are NaN, so a page read
    from the wrong layer (e.g. an offset of the wrong layer, or none) shows as NaN."""
    rng = np.random.default_rng()
    case, q, tables, lo, hi = _mixed_rows(rng, stale=True)
    nan = jnp.full_like(case.kv, jnp.nan)
    stack = jnp.stack([case.kv if i == layer else nan for i in range(3)])
    fn = jax.jit(
        functools.partial(
            paged_attention_rows_pallas, sm_scale=0.3, soft_cap=5.0,
            kv_dtype=case.cache.dtype, pages_per_compute_block=4, interpret=True,
        )
    )  # fmt: skip
    got = np.asarray(fn(q, stack, tables, lo, hi, layer=jnp.int32(layer)))
    single = np.asarray(fn(q, stack[layer], tables, lo, hi))
    np.testing.assert_array_equal(got, single)
    num_q = int(case.q_lens.sum())
    want = reference_attention(case, sm_scale=0.3, soft_cap=5.0)
    assert np.isfinite(got).all()
    assert rel_error(got[:num_q], want[:num_q]) < 1e-5
    assert not got[num_q:].any()

    from test_device_attention import run_attention  # the dispatch passes `layer` through

    stacked_case = dataclasses.replace(case, kv=stack)
    kw = {"sm_scale": 0.3, "soft_cap": 5.0, "impl": "pallas", "interpret": True}
    via_dispatch = run_attention(stacked_case, layer=jnp.int32(layer), **kw)
    np.testing.assert_array_equal(via_dispatch, run_attention(case, **kw))


@pytest.mark.parametrize(("layer", "read"), [(1, 1), (7, 2), (-1, 0)])
def test_rows_kernel_page_ids_lie_in_the_layer(monkeypatch, layer, read) -> None:
    """Triton loads are unchecked (interpret mode's gathers clamp, so only a spy sees
    this): the kernel gets the stack as `[L * NB, ...]` pages and page ids clipped into
    the layer's `[l * NB, (l + 1) * NB)`, an out-of-range `layer` clipped into `[0, L)`."""
    seen, kernel = [], pallas_gpu._call

    def spy(qg, kv_cache, tables, *args, **kw):
        seen.append((kv_cache.shape, np.asarray(tables)))
        return kernel(qg, kv_cache, tables, *args, **kw)

    rng = np.random.default_rng()
    case, q, tables, lo, hi = _mixed_rows(rng, stale=True)
    nb = case.cache.num_blocks
    assert (tables < 0).any() and (tables >= nb).any()
    monkeypatch.setattr(pallas_gpu, "_call", spy)
    paged_attention_rows_pallas(
        q, jnp.stack([case.kv] * 3), tables, lo, hi, sm_scale=0.3, layer=jnp.int32(layer),
        kv_dtype=case.cache.dtype, pages_per_compute_block=4, interpret=True,
    )  # fmt: skip
    [(shape, got)] = seen
    assert shape == (3 * nb, *case.kv.shape[1:])
    width = tables.shape[1]
    assert got.min() >= read * nb and got.max() < (read + 1) * nb
    np.testing.assert_array_equal(got[:, :width] - read * nb, np.clip(tables, 0, nb - 1))


def test_scanned_layers_hand_the_triton_call_the_whole_stack() -> None:
    """The engine's shape of the step: layers under `lax.scan`, the stacked cache in the
    carry, `layer` traced, `impl="auto"` on a GPU (cross-lowered for CUDA on CPU).

    The Triton call's K and V operands must be the whole stack viewed as `[L * NB, ...]`
    and nothing may slice the stack: a `kv_cache[layer]` slice feeding the custom call
    is materialised by XLA, a copy of the whole KV pool per step."""
    layers, num_blocks, block_size, heads, head_size = 3, 40, 16, 2, 128
    stacked = f"tensor<{layers}x{num_blocks}x{block_size}x{2 * heads}x{head_size}xbf16>"
    flat = f"tensor<{layers * num_blocks}x{block_size}x{2 * heads}x{head_size}xbf16>"
    options = AttentionOptions(sm_scale=0.1)

    def step(q, kv, tables, seq_lens, query_start_loc, num_seqs):
        def body(carry, layer):
            out = ragged_paged_attention(
                q, carry, tables, seq_lens, query_start_loc, num_seqs, options,
                platform="gpu", layer=layer,
            )  # fmt: skip
            return carry, out

        return jax.lax.scan(body, kv, jnp.arange(layers, dtype=jnp.int32))

    shapes = [
        jax.ShapeDtypeStruct((5, 2 * heads, head_size), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, num_blocks, block_size, 2 * heads, head_size), jnp.bfloat16),
        jax.ShapeDtypeStruct((3, 7), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    ]
    text = jax.jit(step).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    [call] = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    operand_types = re.search(r"\} : \((.*)\) -> ", call).group(1).split(", ")
    assert operand_types[-2:] == [flat, flat], operand_types
    # The operand is the stack itself, reshaped (a bitcast), and nothing slices it.
    assert re.search(rf"stablehlo.reshape %\S+ : \({re.escape(stacked)}\) -> {flat}", text)
    assert not re.search(rf"(slice|gather)\b[^\n]*{re.escape(stacked)}", text)
