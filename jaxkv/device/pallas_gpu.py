"""Pallas (Triton) paged attention over the interleaved `[blocks, bs, 2*H, D]` cache.

`paged_attention_rows_pallas`: each query row (a decode token or any token of a
prefill chunk) attends to its own key interval `[lo, hi)` through its own table
row, so one kernel serves decode and mixed steps with every mask of
`jaxkv.device.attention` (causal, window, chunked-local, bidirectional spans are
all intervals). `paged_decode_attention_pallas` is the decode special case. The
kernel reads the cache in place: K of KV head `h` is combined head `2h`, V is
`2h+1`, so two block specs over the same array select the K and V lanes of one
head without any copy or relayout.

Grid `(row, kv_head)`. Program `(n, h)` takes the `G = Hq / H` query heads of KV
head `h` (zero-padded to `G_pad = max(16, next_pow2(G))` rows, the smallest
`plgpu.dot` operand Triton accepts), then walks the row's pages in compute blocks
of `pages_per_compute_block` pages with an online softmax, over compute blocks
`[lo // keys_per_block, cdiv(hi, keys_per_block))` only: pages outside the row's
interval are never read. Accumulation is float32 and both dots ask for
`Precision.HIGHEST` (IEEE fp32 on Triton, not TF32). Token-major: a prefill chunk
re-reads its request's pages once per query token (correct, not fast; see the
README's "Attention dispatch" for measured figures).

Semantics match `jaxkv.device.attention`'s blockwise path: keys outside `[lo, hi)`
are masked; logits are scaled, then soft-capped (`cap * tanh(s / cap)`). Rows with
`lo >= hi` return 0.

NaN safety: the null block, free pages and the unused tail of a last page may hold
anything. Masked logits are replaced with `jnp.where`, their probabilities and V
rows are zeroed with `jnp.where` (0 * NaN is NaN). Page ids are clipped into
`[0, num_blocks)` first: Triton loads have no bounds check, and the last compute
block may read stale table entries past a request's pages (their keys are masked).

Block-shape constraints (Triton tensors must have power-of-two sizes and `plgpu.dot`
needs every dimension >= 16): `block_size`, `head_size` and
`pages_per_compute_block` are powers of two, `head_size >= 16` and
`pages_per_compute_block * block_size >= 16`. Violations raise `ValueError`
(`block_shape_error` says why without raising).

Storage dtypes: a cache that stores another dtype's bits (bf16 as uint16, see
`storage.py`) is loaded as stored and bitcast in the kernel; `kv_dtype` names the
compute dtype and must have the storage dtype's width.

Only constructs the Pallas Triton lowering documents are used (vector-indexed
ref loads, `pl.ds` slices, `plgpu.dot` with dims >= 16, `lax.fori_loop`, grid
indices i.e. `pl.program_id`), and `plgpu.CompilerParams` selects Triton: without
it JAX lowers a CUDA `pallas_call` with Mosaic GPU. The tests run the kernel in
Pallas interpret mode on CPU and cross-lower it for CUDA (jaxpr -> Triton IR);
`benchmarks/gpu_check.py` compiled and ran it on an H200 against the float64
reference (README, "Attention dispatch"); CI has no GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.storage import DTypeLike, from_storage, resolve_dtype

_MASKED = -1e30
_MIN_DOT = 16  # smallest M, N and K Triton's `tl.dot` accepts
PAGES_PER_COMPUTE_BLOCK = 8  # default; untuned


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def block_shape_error(head_size: int, block_size: int, pages_per_compute_block: int) -> str | None:
    """Why the kernel cannot take these block shapes (module docstring), or None if it can."""
    for name, value in (
        ("block_size", block_size),
        ("head_size", head_size),
        ("pages_per_compute_block", pages_per_compute_block),
    ):
        if not _is_pow2(value):
            return f"{name}={value} must be a power of two (Triton block shapes)"
    if head_size < _MIN_DOT:
        return f"head_size={head_size} must be >= {_MIN_DOT} (plgpu.dot on Triton)"
    keys_per_block = pages_per_compute_block * block_size
    if keys_per_block < _MIN_DOT:
        return (
            f"pages_per_compute_block={pages_per_compute_block} * block_size={block_size} "
            f"= {keys_per_block} keys per compute block must be >= {_MIN_DOT} (plgpu.dot on Triton)"
        )
    return None


def _rows_kernel(
    lo_ref,  # [] int32: first visible key position of this row
    hi_ref,  # [] int32: one past the last visible key position
    table_ref,  # [W_pad] int32: this row's page ids, clipped to valid blocks
    q_ref,  # [G_pad, D]
    k_ref,  # [num_blocks, block_size, D]: K lane of this KV head
    v_ref,  # [num_blocks, block_size, D]: V lane of this KV head
    o_ref,  # [G_pad, D]
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    compute: np.dtype,
) -> None:
    _, block_size, head_size = k_ref.shape
    rows = q_ref.shape[0]
    keys_per_block = pages_per_block * block_size
    hp = jax.lax.Precision.HIGHEST
    first, kv_len = lo_ref[()], hi_ref[()]
    q = q_ref[...].astype(jnp.float32)
    offsets = jnp.arange(keys_per_block, dtype=jnp.int32)

    def load(ref, pages: jax.Array) -> jax.Array:
        x = from_storage(ref[pages], compute)  # [P, block_size, D]
        return x.astype(jnp.float32).reshape(keys_per_block, head_size)

    def body(i, carry):
        o, m, denom = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        pos = i * keys_per_block + offsets
        visible = (pos < kv_len) & (pos >= first)
        s = plgpu.dot(q, load(k_ref, pages), trans_b=True, precision=hp) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        v = jnp.where(visible[:, None], load(v_ref, pages), 0.0)
        alpha = jnp.exp(m - m_new)
        o = alpha[:, None] * o + plgpu.dot(p, v, precision=hp)
        return o, m_new, alpha * denom + p.sum(axis=1)

    init = (
        jnp.zeros((rows, head_size), jnp.float32),
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    lo = jax.lax.div(first, keys_per_block)
    hi = pl.cdiv(kv_len, keys_per_block)
    o, _, denom = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (o / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def paged_decode_attention_pallas(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    pages_per_compute_block: int = PAGES_PER_COMPUTE_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of `q [R, Hq, D]` (one query per request); returns `[R, Hq, D]`.

    `kv_cache [num_blocks, block_size, 2 * H, D]` (K/V interleaved per head),
    `block_tables [R, W]` int page ids, `seq_lens [R]` context lengths including
    this step's token. Precondition: the first `cdiv(seq_lens[r], block_size)`
    entries of row `r` are valid block ids (out-of-range ids are clipped, not
    reported). As in the reference, only the table's `W * block_size` keys exist (a
    longer `seq_lens[r]` only moves the query position) and `Hq % H == 0` is
    required. Rows with `seq_lens[r] == 0` return 0 (use it for padding).
    `kv_dtype` is the compute dtype when the cache stores its bits in another
    dtype. `interpret=True` runs the kernel in Pallas interpret mode (any backend).
    See the module docstring for the block-shape constraints (checked here).
    """
    if seq_lens.ndim != 1 or block_tables.ndim != 2:
        raise ValueError(
            f"need block_tables [R, W] and seq_lens [R]; got {block_tables.shape}, {seq_lens.shape}"
        )
    check_attention_args(q.shape, kv_cache.shape, sliding_window, soft_cap)
    seq = seq_lens.astype(jnp.int32)
    hi = jnp.clip(seq, 0, block_tables.shape[1] * kv_cache.shape[1])
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.clip(seq - sliding_window, 0, hi)
    return paged_attention_rows_pallas(
        q, kv_cache, block_tables, lo, hi, sm_scale=sm_scale, soft_cap=soft_cap,
        kv_dtype=kv_dtype, pages_per_compute_block=pages_per_compute_block, interpret=interpret,
    )  # fmt: skip


def paged_attention_rows_pallas(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    pages_per_compute_block: int = PAGES_PER_COMPUTE_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """Row `n` of `q [N, Hq, D]` attends to key positions `[lo[n], hi[n])` of its own table row.

    `block_tables [N, W]` holds each row's page ids (a query token's request row:
    ragged prefill and decode alike). Rows with `lo >= hi` return 0. Every mask
    of `jaxkv.device.attention` (causal, window, chunked-local, spans) is such an
    interval, so this one kernel serves decode and mixed steps. Precondition:
    `hi[n] <= W * block_size` and the pages covering `[lo[n], hi[n])` are valid.
    """
    if q.ndim != 3 or kv_cache.ndim != 4 or block_tables.ndim != 2 or lo.ndim != 1:
        raise ValueError(
            f"need q [N, Hq, D], kv_cache [blocks, block_size, 2 * H, D], block_tables "
            f"[N, W], lo/hi [N]; got {q.shape}, {kv_cache.shape}, {block_tables.shape}, "
            f"{lo.shape}"
        )
    num_kv_heads = check_attention_args(q.shape, kv_cache.shape, None, soft_cap)
    num_rows, num_q_heads, head_size = q.shape
    num_blocks, block_size = kv_cache.shape[:2]
    if block_tables.shape[0] != num_rows or lo.shape != (num_rows,) or hi.shape != (num_rows,):
        raise ValueError(
            f"block_tables {block_tables.shape} and lo/hi {lo.shape}/{hi.shape} must have "
            f"one row per query ({num_rows})"
        )
    error = block_shape_error(head_size, block_size, pages_per_compute_block)
    if error is not None:
        raise ValueError(error)
    compute = resolve_dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)
    if compute.itemsize != kv_cache.dtype.itemsize:
        raise ValueError(
            f"kv_dtype={compute} must have the width of the cache's storage dtype "
            f"{kv_cache.dtype} (its bits are reinterpreted)"
        )

    group = num_q_heads // num_kv_heads
    rows = max(_MIN_DOT, 1 << (group - 1).bit_length())
    width = block_tables.shape[1]
    padded_width = pl.cdiv(width, pages_per_compute_block) * pages_per_compute_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    tables = jnp.clip(tables, 0, num_blocks - 1)  # Triton loads are unchecked
    qg = q.reshape(num_rows, num_kv_heads, group, head_size)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    kernel = functools.partial(
        _rows_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        pages_per_block=pages_per_compute_block,
        compute=compute,
    )
    lane = (num_blocks, block_size, None, head_size)
    scalar = pl.BlockSpec((None,), lambda r, h: (r,))
    out = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads),
        in_specs=[
            scalar,
            scalar,
            pl.BlockSpec((None, padded_width), lambda r, h: (r, 0)),
            pl.BlockSpec((None, None, rows, head_size), lambda r, h: (r, h, 0, 0)),
            pl.BlockSpec(lane, lambda r, h: (0, 0, 2 * h, 0)),  # K of head h
            pl.BlockSpec(lane, lambda r, h: (0, 0, 2 * h + 1, 0)),  # V of head h
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_size), lambda r, h: (r, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(),  # Triton; without it CUDA picks Mosaic GPU
        name="jaxkv_paged_attention_rows",
    )(lo.astype(jnp.int32), hi.astype(jnp.int32), tables, qg, kv_cache, kv_cache)
    return out[:, :, :group].reshape(num_rows, num_q_heads, head_size)
