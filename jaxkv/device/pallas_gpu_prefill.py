"""Pallas (Triton) prefill attention over pages: query tiles share each page chunk.

`paged_prefill_gpu` is the GPU counterpart of the request-major half of
`jaxkv.device.attention`'s blockwise path. `pallas_gpu.paged_attention_rows_pallas`
runs one program per query token, so a prefill chunk re-reads its request's pages once
per token (on an H200, 4,096 prefill tokens took 182 ms against 2.7 ms for cuDNN's dense
attention). Here one program takes `query_tile` consecutive query tokens of one request
and reads each page chunk once for all of them (flash attention over pages).

Tiles. Each request's query tokens are contiguous (`query_start_loc`), so its tokens
are cut into `cdiv(q_len, query_tile)` tiles that never cross requests. The wrapper
builds the tile list with `jnp` from `query_start_loc` and `num_seqs`, statically sized
`cdiv(T, query_tile) + min(R, T // (min_query_len + 1))` (each served request adds at
most one partial tile, and at most `T // (min_query_len + 1)` requests have more than
`min_query_len` tokens); per tile: request, first token, token count. Padding tiles
(count 0) read no page and write nothing. Only requests with more than `min_query_len`
query tokens get tiles: the other tokens' outputs are 0, so a dispatch can run a decode
kernel over the short requests, this kernel over the long ones, and add the two.

Grid `(tile, head_slot)`. A KV head's `G = Hq / H` query heads, zero-padded to
`G_pad = next_pow2(G)`, are split into `G_pad / heads_per_program` slots; a program
computes `rows = query_tile * heads_per_program` rows (token-major, head-minor) of one
slot against K/V of that slot's KV head. It walks the tile's request's pages in chunks
of `pages_per_chunk` pages over the chunks covering the union `[min lo, max hi)` of its
rows' key intervals: causal attention stops at the tile's last position, a window or
chunked-local mask starts at the tile's first visible key. Online softmax in float32;
QK^T and PV are `plgpu.dot`s with float32 accumulation, operands in the cache's dtype
when it is 16-bit (bf16/f16 tensor cores; `p` is rounded to that dtype before PV, as
flash attention does) and float32 with `Precision.HIGHEST` (IEEE, not TF32) otherwise.
Query and output stay `[T, Hq, D]` in HBM: a program loads its rows with a dynamic
slice of the token axis and stores them with a row mask (`count`), so rows of the next
request or past the tile are never written; the output buffer starts as zeros (aliased
input), which is what unserved and padded tokens return.

Masks and semantics match `jaxkv.device.attention`: per-token key intervals `[lo, hi)`
(`token_intervals`: causal, window, chunked-local, bidirectional spans), logits scaled
then soft-capped (`cap * tanh(s / cap)`), rows with `lo >= hi` return 0.

NaN safety: the null block, free pages (behind a sliding window) and the unused tail of
a last page may hold anything. Page ids are clipped into the layer's `[0, NB)` before
the stacked offset is added (Triton loads are unchecked; a chunk may read stale table
entries past the request's pages). Queries of rows outside the tile are replaced by 0,
masked logits by `jnp.where`, their probabilities are zeroed by `jnp.where`, and V rows
outside the tile's union interval are zeroed by `jnp.where` before `p @ v` (0 * NaN is
NaN). Inside the union every key is a written key: `hi <= seq_len` and freed pages lie
before every query's window.

Stacked caches `[L, NB, bs, 2H, D]` are read in place: viewed as `[L * NB, bs, 2H, D]`
(a free reshape), with `layer * NB` added to the page ids; `layer` may be traced.

Block shapes (Triton tensors are powers of two, `plgpu.dot` wants every dimension
>= 16): `query_tile` a power of two >= 16, `block_size`, `head_size` and
`pages_per_chunk` powers of two, `head_size >= 16`, `pages_per_chunk * block_size >=
16`; violations raise `ValueError`.

Shared memory and registers (`prefill_plan`). The plan asks for `KEYS_PER_CHUNK` keys
per chunk and at most `ROW_ELEMENTS // D` rows (the float32 accumulator `[rows, D]`
lives in registers: 64 KiB, 128 registers per thread at 4 warps), then halves heads per
program, then pages per chunk, until `prefill_smem_bytes` is within the device's limit
less 1/16 (`pallas_gpu.SMEM_MARGIN_DIVISOR`):

    (4 * keys * D + rows * D + rows * keys) * itemsize + keys

(K and V chunks double-buffered, the query rows, the probabilities `p`, in the operand
dtype). Measured, not assumed: XLA's Triton pipeline (jaxlib 0.10.2) compiled the
kernel deviceless for sm_90 and sm_80 (`tests/gpu_aot_matrix.py`) at D 64/128/256,
16-64 keys, 64-256 rows, bf16 and f32, and each request was 58-97% of the formula
(bf16) or 81-97% (f32), the largest shares at 16 keys. On an H100/H200 (232,448 bytes,
budget 217,920) with `query_tile=64` and 16-token pages that gives, for GQA groups >= 4:
D=64, 4 heads (256 rows), 64 keys; D=128 bf16, 2 heads, 64 keys; D=128 f32, 2 heads, 32
keys; D=256 bf16, 1 head, 64 keys; D=256 f32, 1 head, 32 keys. A chunk is at least one
page, so 128-token pages with D=256 at 64 rows fit nowhere: `prefill_plan` raises (a
smaller `query_tile` fits).

Verified: Pallas interpret mode on CPU against the float64 reference, and cross-lowered
for CUDA on CPU to one Triton custom call (`tests/test_pallas_gpu_prefill_kernel.py`);
compiled by the real compiler, deviceless, for an H100, H200 and A100 in the slow suite
(`tests/test_gpu_aot.py`). Not run on a GPU: its speed is unmeasured;
`KEYS_PER_CHUNK`, `ROW_ELEMENTS` and Triton's warps/stages are untuned.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.pallas_gpu import (
    MIN_DOT,
    SMEM_MARGIN_DIVISOR,
    SmemLimit,
    block_shape_error,
    gpu_smem_limit,
    is_pow2,
    layer_pages,
    next_pow2,
)
from jaxkv.device.storage import DTypeLike, from_storage, resolve_dtype

_MASKED = -1e30
_INT_MAX = np.iinfo(np.int32).max
KEYS_PER_CHUNK = 64  # keys per page chunk the plan asks for (flash attention's BLOCK_N); untuned
ROW_ELEMENTS = 128 * 128  # most `rows * head_size` float32 accumulator elements; untuned


class PrefillPlan(NamedTuple):
    """How a program is sized: pages per key chunk and query heads per program."""

    pages_per_chunk: int
    heads_per_program: int


def prefill_shape_error(
    head_size: int, block_size: int, query_tile: int, pages_per_chunk: int
) -> str | None:
    """Why the kernel cannot take these block shapes (module docstring), or None."""
    if not isinstance(query_tile, int) or not is_pow2(query_tile) or query_tile < MIN_DOT:
        return f"query_tile={query_tile} must be a power of two >= {MIN_DOT} (Triton dots)"
    error = block_shape_error(head_size, block_size, pages_per_chunk)
    # The row kernel's constraints on its compute block are this kernel's on its chunk.
    return None if error is None else error.replace("pages_per_compute_block", "pages_per_chunk")


def prefill_smem_bytes(head_size: int, keys: int, rows: int, itemsize: int) -> int:
    """Shared memory (bytes) of one program of `rows` query rows and `keys` keys per chunk:
    a bound on what Triton allocates, measured by the real compiler (module docstring)."""
    return (4 * keys * head_size + rows * head_size + rows * keys) * itemsize + keys


def prefill_plan(
    head_size: int,
    block_size: int,
    group: int,
    dtype: DTypeLike,
    query_tile: int,
    smem: SmemLimit | None,
) -> PrefillPlan:
    """Pages per chunk and heads per program for this shape (module docstring, "Shared
    memory"); `smem=None` (interpret mode) takes the largest of each.

    Raises `ValueError` saying why when no configuration qualifies.
    """
    # The fewest pages making a 16-key dot (a non-power-of-two block size fails the check).
    min_pages = max(1, MIN_DOT // block_size) if is_pow2(block_size) else 1
    error = prefill_shape_error(head_size, block_size, query_tile, min_pages)
    if error is not None:
        raise ValueError(error)
    itemsize = np.dtype(resolve_dtype(dtype)).itemsize
    max_pages = max(min_pages, KEYS_PER_CHUNK // block_size)
    max_heads = min(next_pow2(group), max(1, ROW_ELEMENTS // head_size // query_tile))
    if smem is None:
        return PrefillPlan(max_pages, max_heads)
    budget = smem.bytes - smem.bytes // SMEM_MARGIN_DIVISOR
    heads = max_heads
    while heads >= 1:
        pages = max_pages
        while pages >= min_pages:
            need = prefill_smem_bytes(head_size, pages * block_size, query_tile * heads, itemsize)
            if need <= budget:
                return PrefillPlan(pages, heads)
            pages //= 2
        heads //= 2
    rows, keys = query_tile, min_pages * block_size
    raise ValueError(
        f"no prefill tile fits shared memory: head_size={head_size}, "
        f"{np.dtype(resolve_dtype(dtype)).name}, block_size={block_size}; the smallest, "
        f"{rows} rows x {keys} keys, needs {prefill_smem_bytes(head_size, keys, rows, itemsize)} "
        f"bytes, over the budget of {budget}: {smem.bytes} bytes per block "
        f"({smem.source}) less 1/{SMEM_MARGIN_DIVISOR}; use a smaller query_tile"
    )


class Tiles(NamedTuple):
    """The static-size tile list: per tile its request, first token and token count."""

    req: jax.Array  # [NT] int32, clipped into [0, R)
    start: jax.Array  # [NT] int32, 0 for padding tiles
    count: jax.Array  # [NT] int32, 0 for padding tiles


def num_tiles(num_tokens: int, num_reqs: int, query_tile: int, min_query_len: int) -> int:
    """Static tile count bound (module docstring, "Tiles")."""
    served = min(num_reqs, num_tokens // (min_query_len + 1))
    return -(-num_tokens // query_tile) + served


def build_tiles(
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    num_tokens: int,
    *,
    query_tile: int,
    min_query_len: int,
) -> Tiles:
    """Cut every request with more than `min_query_len` query tokens into tiles."""
    qsl = query_start_loc.astype(jnp.int32)
    num_reqs = qsl.shape[0] - 1
    q_lens = qsl[1:] - qsl[:-1]
    served = (jnp.arange(num_reqs) < num_seqs) & (q_lens > min_query_len)
    per_req = jnp.where(served, -(-q_lens // query_tile), 0)
    ends = jnp.cumsum(per_req)  # tiles of requests [0, r]
    tile = jnp.arange(num_tiles(num_tokens, num_reqs, query_tile, min_query_len), dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_reqs - 1).astype(jnp.int32)
    k = tile - (ends[req] - per_req[req])  # the tile's index within its request
    live = tile < ends[-1]
    start = jnp.where(live, qsl[req] + k * query_tile, 0)
    count = jnp.where(live, jnp.clip(q_lens[req] - k * query_tile, 0, query_tile), 0)
    return Tiles(req, start, count)


def _prefill_kernel(
    start_ref,  # [] int32: the tile's first token
    count_ref,  # [] int32: its token count (0: padding tile)
    table_ref,  # [W_pad] int32: its request's page ids, clipped, layer offset added
    lo_ref,  # [T_pad] int32: every token's first visible key
    hi_ref,  # [T_pad] int32: one past its last visible key
    q_ref,  # [T_pad, heads, D]: this head slot's queries, every token
    k_ref,  # [L * NB, block_size, D]: K lane of the slot's KV head
    v_ref,  # [L * NB, block_size, D]: V lane
    _zeros_ref,  # aliased to o_ref (its initial zeros); never read
    o_ref,  # [T_pad, heads, D]
    *,
    sm_scale: float,
    soft_cap: float | None,
    query_tile: int,
    pages_per_chunk: int,
    compute: np.dtype,
) -> None:
    _, block_size, head_size = k_ref.shape
    _, heads, _ = q_ref.shape
    rows = query_tile * heads
    keys = pages_per_chunk * block_size
    dot_dtype = compute if compute.itemsize == 2 else np.dtype(np.float32)
    precision = None if dot_dtype.itemsize == 2 else jax.lax.Precision.HIGHEST
    start, count = start_ref[()], count_ref[()]
    tokens = pl.ds(start, query_tile)

    mine = jnp.arange(query_tile, dtype=jnp.int32) < count  # rows of this tile's request
    lo = jnp.where(mine, lo_ref[tokens], 0)
    hi = jnp.where(mine, hi_ref[tokens], 0)
    live = hi > lo
    first = jnp.min(jnp.where(live, lo, _INT_MAX))  # the union [first, last) of intervals
    last = jnp.max(jnp.where(live, hi, 0))
    # Row n of the program is token n // heads, head n % heads.
    row_lo = _per_row(lo, heads)
    row_hi = _per_row(hi, heads)
    q = q_ref[tokens, :, :].reshape(rows, head_size)
    q = jnp.where(_per_row(mine, heads)[:, None], q.astype(jnp.float32), 0.0).astype(dot_dtype)
    offsets = jnp.arange(keys, dtype=jnp.int32)

    def load(ref, pages: jax.Array) -> jax.Array:
        x = from_storage(ref[pages], compute)  # [P, block_size, D]
        return x.reshape(keys, head_size).astype(dot_dtype)

    def body(i, carry):
        o, m, denom = carry
        pages = table_ref[pl.ds(i * pages_per_chunk, pages_per_chunk)]
        pos = i * keys + offsets
        visible = (pos[None, :] >= row_lo[:, None]) & (pos[None, :] < row_hi[:, None])
        s = plgpu.dot(q, load(k_ref, pages), trans_b=True, precision=precision) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        # Keys outside every row's interval may be free pages or page tails (NaN).
        in_union = (pos >= first) & (pos < last)
        v = jnp.where(in_union[:, None], load(v_ref, pages), 0.0).astype(dot_dtype)
        alpha = jnp.exp(m - m_new)
        o = alpha[:, None] * o + plgpu.dot(p.astype(dot_dtype), v, precision=precision)
        return o, m_new, alpha * denom + p.sum(axis=1)

    init = (
        jnp.zeros((rows, head_size), jnp.float32),
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    chunk_lo = jnp.where(last > 0, first // keys, 0)
    chunk_hi = pl.cdiv(last, keys)
    o, _, denom = jax.lax.fori_loop(chunk_lo, chunk_hi, body, init)
    o = (o / jnp.where(denom > 0, denom, 1.0)[:, None]).reshape(query_tile, heads, head_size)
    mask = jnp.broadcast_to(mine[:, None, None], o.shape)
    plgpu.store(o_ref.at[tokens, :, :], o.astype(o_ref.dtype), mask=mask)


def _per_row(x: jax.Array, heads: int) -> jax.Array:
    """A per-token `[query_tile]` vector repeated for each head: `[query_tile * heads]`."""
    if heads == 1:
        return x
    return jnp.broadcast_to(x[:, None], (x.shape[0], heads)).reshape(x.shape[0] * heads)


def paged_prefill_gpu(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    layer: jax.Array | None = None,
    min_query_len: int = 0,
    query_tile: int = 64,
    pages_per_chunk: int | None = None,
    heads_per_program: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of the query tokens of requests with more than `min_query_len` of them;
    returns `[T, Hq, D]` in q's dtype, 0 for every other token.

    `q [T, Hq, D]`; `kv_cache [NB, bs, 2H, D]`, or `[L, NB, bs, 2H, D]` with `layer` (an
    int32 scalar, may be traced); `block_tables [R, W]`, `query_start_loc [R + 1]` and
    the scalar `num_seqs` as in `ragged_paged_attention`; `lo`/`hi [T]` each token's key
    interval (`attention.token_intervals`; only served tokens' are read). Precondition:
    `hi <= W * bs` and the pages covering `[lo, hi)` are valid. `kv_dtype` is the
    compute dtype when the cache stores its bits in another dtype of the same width.
    `pages_per_chunk` and `heads_per_program` default to `prefill_plan` for this
    process's GPU (interpret mode: the largest); explicit values are used as given
    (block shapes checked, not memory). `interpret=True` runs the kernel in Pallas
    interpret mode on any backend.
    """
    if (kv_cache.ndim == 5) != (layer is not None) or kv_cache.ndim not in (4, 5):
        raise ValueError(
            f"kv_cache has shape {kv_cache.shape}: need [blocks, bs, 2H, D], or a stacked "
            "[L, blocks, bs, 2H, D] with `layer`"
        )
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs, width = block_tables.shape
    if (
        query_start_loc.shape != (num_reqs + 1,)
        or lo.shape != (num_tokens,)
        or lo.shape != hi.shape
    ):
        raise ValueError(
            f"need query_start_loc [R + 1] and lo/hi [T] for block_tables {block_tables.shape} "
            f"and q {q.shape}; got {query_start_loc.shape}, {lo.shape}, {hi.shape}"
        )
    num_kv_heads = check_attention_args(q.shape, kv_cache.shape, None, soft_cap)
    if not isinstance(min_query_len, int) or min_query_len < 0:
        raise ValueError(f"min_query_len must be an int >= 0, got {min_query_len!r}")
    compute = resolve_dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)
    if compute.itemsize != kv_cache.dtype.itemsize:
        raise ValueError(
            f"kv_dtype={compute} must have the width of the cache's storage dtype "
            f"{kv_cache.dtype} (its bits are reinterpreted)"
        )
    block_size = kv_cache.shape[-3]
    group = num_q_heads // num_kv_heads
    plan = prefill_plan(
        head_size, block_size, group, compute, query_tile, None if interpret else gpu_smem_limit()
    )
    pages_per_chunk = pages_per_chunk or plan.pages_per_chunk
    heads = heads_per_program or plan.heads_per_program
    error = prefill_shape_error(head_size, block_size, query_tile, pages_per_chunk)
    if error is None and (not is_pow2(heads) or heads > next_pow2(group)):
        error = f"heads_per_program={heads} must be a power of two <= {next_pow2(group)}"
    if error is not None:
        raise ValueError(error)

    cache, offset, num_blocks = layer_pages(kv_cache, layer)  # the stack read in place
    tiles = build_tiles(
        query_start_loc, num_seqs, num_tokens, query_tile=query_tile, min_query_len=min_query_len
    )
    padded_width = pl.cdiv(width, pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    tables = jnp.clip(tables[tiles.req], 0, num_blocks - 1) + offset  # loads are unchecked

    # Tokens padded by one tile: a tile's dynamic slice never runs past the arrays (interpret
    # mode would clamp its start and shift the rows).
    g_pad = next_pow2(group)
    slots = num_kv_heads * g_pad // heads
    tok_pad = num_tokens + query_tile
    qg = q.reshape(num_tokens, num_kv_heads, group, head_size)
    qg = jnp.pad(qg, ((0, query_tile), (0, 0), (0, g_pad - group), (0, 0)))
    qg = qg.reshape(tok_pad, slots, heads, head_size)
    lo_p = jnp.pad(lo.astype(jnp.int32), (0, query_tile))
    hi_p = jnp.pad(hi.astype(jnp.int32), (0, query_tile))

    kernel = functools.partial(
        _prefill_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        query_tile=query_tile,
        pages_per_chunk=pages_per_chunk,
        compute=compute,
    )
    per_kv_head = g_pad // heads  # head slots of one KV head
    lane = (cache.shape[0], block_size, None, head_size)
    scalar = pl.BlockSpec((None,), lambda t, j: (t,))
    tokens = pl.BlockSpec((tok_pad,), lambda t, j: (0,))
    rows = pl.BlockSpec((tok_pad, None, heads, head_size), lambda t, j: (0, j, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(tiles.req.shape[0], slots),
        in_specs=[
            scalar,
            scalar,
            pl.BlockSpec((None, padded_width), lambda t, j: (t, 0)),
            tokens,
            tokens,
            rows,
            pl.BlockSpec(lane, lambda t, j: (0, 0, 2 * (j // per_kv_head), 0)),  # K
            pl.BlockSpec(lane, lambda t, j: (0, 0, 2 * (j // per_kv_head) + 1, 0)),  # V
            rows,
        ],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # Zeros in, aliased: tokens no tile writes (short requests, padding) return 0.
        input_output_aliases={8: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(),  # Triton; without it CUDA picks Mosaic GPU
        name="jaxkv_paged_prefill",
    )(tiles.start, tiles.count, tables, lo_p, hi_p, qg, cache, cache, jnp.zeros_like(qg))
    out = out[:num_tokens].reshape(num_tokens, num_kv_heads, g_pad, head_size)
    return out[:, :, :group].reshape(num_tokens, num_q_heads, head_size)
