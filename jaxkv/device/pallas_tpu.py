"""Pallas TPU (Mosaic) ragged paged attention over the interleaved `[blocks, bs, 2*H, D]` cache.

`paged_attention_tiles_tpu` serves decode, prefill and mixed steps with every
mask of `jaxkv.device.attention`: each query token brings its request and its
key interval `[lo, hi)` (`attention.token_intervals`), so causal, sliding window,
chunked-local and bidirectional spans are one code path.

Grid `(head_block, query_tile)`, both parallel. A head block is `head_block(H)` KV
heads whose `2 * Hb` combined rows are one tile of the cache's tiled `(2H, D)` axes
(`(8 * packing, 128)`, packing 32-bit words: 8 rows of f32, 16 of bf16, 32 of int8) or,
where `2H` is not a multiple of that tile, all `H` heads: the TPU's DMAs may slice a
tiled axis only at a tile boundary. A query tile is `tokens_per_tile` consecutive
tokens; for each KV head of the block it holds the `G = Hq / H` query heads as
`G * tokens_per_tile` rows (row `g * tokens_per_tile + i` is head `g` of token `i`), so
one MXU matmul per page chunk serves the whole GQA group. A tile may hold tokens of
several requests: the wrapper splits it into *segments* (a maximal run of one request's
tokens with non-empty intervals) and prefetches, as SMEM scalars
(`pltpu.PrefetchScalarGridSpec`), every segment's request and key range `[seg_lo,
seg_hi)` (the union of its rows' intervals, which is contiguous: each row's interval
contains its own position and the positions are consecutive) together with the
flattened block tables. For each segment the kernel walks the page chunks covering
`[seg_lo, seg_hi)` only (`pages_per_chunk` pages each), copying each page's rows of the
head block from the cache left in HBM (`memory_space=pl.ANY`, a stacked cache's layer
read in place) into VMEM with manual DMAs, one per page and 128-lane column
(`lane_columns`: Mosaic's strided loads want a buffer at most one vreg wide), double
buffered: chunk `j + 1` is in flight while chunk `j` is computed. Each head's K and V
are read from the buffer with strided loads of 32-bit words (`_head_words`: K and V of
one head share a word in 16- and 8-bit storage; bf16 halves become float32 by shifts,
int8 / fp8 bytes are decoded in-kernel by `_dequantize_bytes`). The online softmax
state (running max, denominator, accumulator) lives in VMEM scratch and is written to
the output once per tile. Each row carries its segment's index and is masked for every
other segment's keys, so a row's state sees its own request's keys, each once.

NaN safety: the null block, freed pages, stale table tails and the unused tail
of a last page may hold anything. Page ids are clipped into `[0, num_blocks)`
(a DMA must stay in bounds). Masked logits are replaced with `jnp.where` and V
rows outside `[seg_lo, seg_hi)` are zeroed with `jnp.where` before `p @ v` (zero
probability times NaN is still NaN); every key inside `[seg_lo, seg_hi)` is
visible to some row of the segment, hence a written (finite) key. Rows with no
visible key return 0.

Precision: the score and value matmuls accumulate in float32; with a float32
compute dtype they run at `Precision.HIGHEST`, with a 16-bit one in that dtype (the
MXU's native input) with float32 accumulation and probabilities rounded to it.

Quantised caches (int8 / fp8 e4m3, `[..., D + 4]` bytes per row with the float32
scale inline, `jaxkv.device.storage`): the DMAs copy the stored bytes (half of bf16's
traffic; the scale lands in the last lane column) and the kernel rebuilds values and
scale from the bytes with integer ops (no width-changing bitcasts, no lane slice past
the values; fp8 decoded from its fields, as TPUs before v6 have no fp8). `kv_head`
(every query head reads one KV head, a replicated cache's head slice) is supported: the
block holding it is copied and only its head computed. Not supported (`tpu_kernel_error`
says why; `attention.py` then runs the blockwise path and logs one line): a storage dtype
of another width than the compute dtype, a 16-bit cache computing in another dtype than
bfloat16, and an odd number of KV heads per device in 8-bit storage (its K/V rows are
read four to a word).

Verification: the tests run this kernel in Pallas TPU interpret mode
(`pltpu.InterpretParams`, which raises on out-of-bounds reads and fills uninitialised
memory with NaN; DMAs executed eagerly and on wait agree) against a float64 reference.
Interpret mode has neither ref reshapes nor bitcasts, so there `_head_words` packs the
same 32-bit words from the rows it indexes (the lowest row in the lowest bits, as TPU
memory packs sublanes) and the decoding that follows is shared. The real TPU compiler
(libtpu, through deviceless ahead-of-time compilation for v5e / v6e / v5p topologies)
compiles the kernel for f32, bf16, int8 and fp8 caches, head sizes 64-256, block sizes
16-128, 1-8 query heads per KV head and 1-16 KV heads per device, with every mask
(`tests/test_tpu_aot.py`, in its own `jax[tpu]` environment). Not run on a TPU: its
speed is unmeasured, and tile sizes are untuned.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.storage import (
    SCALE_BYTES,
    DTypeLike,
    check_kv_quant,
    from_storage,
    resolve_dtype,
)

_MASKED = -1e30
# The engine's block size on a TPU (`attention.default_block_size`), chosen with
# `benchmarks/tpu_block_size.py`: the kernel prefetches the block tables into SMEM, where
# 256 requests of 32,768 tokens fit only from 64-token pages on, and one DMA per page
# makes 128-token pages the cheapest in its estimate (a third of 64's DMAs' issue cost).
TPU_BLOCK_SIZE = 128
TOKENS_PER_TILE = 8  # untuned; a multiple of 8 keeps tile rows sublane-aligned
PAGES_PER_CHUNK = 4  # untuned


class _Segments(NamedTuple):
    """Per query tile, its runs of one request's tokens (flattened `[tiles * tokens_per_tile]`)."""

    req: jax.Array  # request of segment `s` of tile `t` at `t * tokens_per_tile + s`
    lo: jax.Array  # first key any row of the segment sees
    hi: jax.Array  # one past the last key any row of the segment sees
    count: jax.Array  # [tiles] segments per tile
    of_token: jax.Array  # [T_pad] each token's flat segment index; -1: in none


def _segments(req: jax.Array, lo: jax.Array, hi: jax.Array, tokens_per_tile: int) -> _Segments:
    """Split each tile of `[T_pad]` tokens into segments; rows with `lo >= hi` belong to none."""
    tiles = req.shape[0] // tokens_per_tile
    live = hi > lo
    prev_req = jnp.concatenate([jnp.full((1,), -1, req.dtype), req[:-1]])
    prev_live = jnp.concatenate([jnp.zeros((1,), bool), live[:-1]])
    first_of_tile = jnp.arange(req.shape[0]) % tokens_per_tile == 0
    starts = live & (first_of_tile | ~prev_live | (req != prev_req))
    index = jnp.cumsum(starts.reshape(tiles, tokens_per_tile), axis=1).reshape(-1) - 1
    tile = jnp.arange(req.shape[0]) // tokens_per_tile
    flat = tile * tokens_per_tile + index
    # Rows in no segment scatter out of range (dropped); a positive index, never -1.
    scatter_at = jnp.where(live, flat, req.shape[0])
    size = req.shape[0]
    return _Segments(
        req=jnp.zeros(size, jnp.int32).at[scatter_at].set(req, mode="drop"),
        lo=jnp.full(size, jnp.iinfo(jnp.int32).max, jnp.int32).at[scatter_at].min(lo, mode="drop"),
        hi=jnp.zeros(size, jnp.int32).at[scatter_at].max(hi, mode="drop"),
        count=starts.reshape(tiles, tokens_per_tile).sum(axis=1, dtype=jnp.int32),
        of_token=jnp.where(live, flat, -1).astype(jnp.int32),
    )


def head_block(num_kv_heads: int, storage_itemsize: int) -> int:
    """KV heads per grid step: their `2 * heads` combined rows fill whole tiles.

    The cache's HBM layout tiles its last two axes `(2H, D)` by `(8 * packing, 128)`,
    `packing = 4 // itemsize` rows per 32-bit sublane; a DMA may only slice the `2H`
    axis at a tile boundary. A block is one tile of combined heads where `2H` is a
    multiple of it, else all `H` heads (the whole axis, always a legal slice).
    """
    tile_rows = 8 * (4 // storage_itemsize)
    return tile_rows // 2 if (2 * num_kv_heads) % tile_rows == 0 else num_kv_heads


def lane_columns(stored_head: int) -> tuple[tuple[int, int], ...]:
    """`(start, width)` of each DMA'd lane column of a stored row: 128 lanes each, the rest last.

    Mosaic's strided loads need a buffer whose last axis is at most one 128-lane vreg
    wide, so a wider row (head size 256, a quantised row's inline scale) is copied
    column by column (each slice of the HBM row starts at a lane-tile boundary).
    """
    return tuple((c, min(128, stored_head - c)) for c in range(0, stored_head, 128))


def _head_words(buf, slot, head: int, combined: int, keys: int, interpret: bool) -> list:
    """The rows holding block head `head`'s K and V in `buf[slot]` (`[P, bs, combined, w]`).

    32-bit storage: `[K rows, V rows]`, each `[keys, w]`. Narrower storage: one `[keys, w]`
    uint32 array whose words each pack `4 // itemsize` consecutive combined rows, the
    lowest row in the lowest bits (TPU memory packs sublanes so), and hence K and V of
    one head side by side. Compiled, Mosaic reads them with strided loads over the buffer
    viewed as `[keys * combined, w]` rows (as words); interpret mode, which has neither ref
    reshapes nor bitcasts, packs the same words from the rows it indexes.
    """
    itemsize = buf.dtype.itemsize
    per_word = 4 // itemsize
    if not interpret:
        flat = buf.at[slot].reshape(keys * combined, buf.shape[-1])
        if per_word == 1:
            return [flat[pl.ds(2 * head + lane, keys, stride=combined), :] for lane in (0, 1)]
        words = flat.bitcast(jnp.uint32)
        return [words[pl.ds(2 * head // per_word, keys, stride=combined // per_word), :]]

    def row(c: int) -> jax.Array:
        return buf[slot, :, :, c, :].reshape(keys, buf.shape[-1])

    if per_word == 1:
        return [row(2 * head), row(2 * head + 1)]
    first = 2 * head // per_word * per_word
    bits = jnp.dtype(f"uint{8 * itemsize}")
    word = jnp.zeros((keys, buf.shape[-1]), jnp.uint32)
    for i in range(per_word):
        part = jax.lax.bitcast_convert_type(row(first + i), bits).astype(jnp.uint32)
        word = word | (part << (8 * itemsize * i))
    return [word]


def _load_head(bufs, slot, head, combined, keys, compute, kv_quant, interpret):
    """K and V of block head `head` in this chunk, float32 `[keys, D]` each."""
    columns = [_head_words(b, slot, head, combined, keys, interpret) for b in bufs]
    if len(columns[0]) == 2:  # 32-bit rows
        k, v = (jnp.concatenate([c[lane] for c in columns], axis=1) for lane in (0, 1))
        return from_storage(k, compute).astype(jnp.float32), from_storage(v, compute).astype(
            jnp.float32
        )
    words = jnp.concatenate([c[0] for c in columns], axis=1)
    if bufs[0].dtype.itemsize == 2:  # bfloat16 bits: a float32 with low mantissa bits zero
        k = pltpu.bitcast(words << 16, jnp.float32)
        v = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32)
        return k, v
    shift = 8 * (2 * head % 4)
    k_bytes = ((words >> shift) & 0xFF).astype(jnp.int32)
    v_bytes = ((words >> (shift + 8)) & 0xFF).astype(jnp.int32)
    return _dequantize_bytes(k_bytes, kv_quant), _dequantize_bytes(v_bytes, kv_quant)


def _dequantize_bytes(b: jax.Array, kv_quant: str) -> jax.Array:
    """`storage.dequantize` of a row's bytes given as int32 `[K, D + SCALE_BYTES]` in [0, 256).

    Written with what Mosaic lowers: no width-changing bitcast and no lane slice past
    the values (the scale's four bytes are summed out of the masked row in two exact
    16-bit halves), and fp8 e4m3 decoded from its fields (TPUs before v6 have no fp8).
    """
    head_size = b.shape[-1] - SCALE_BYTES
    lane = jax.lax.broadcasted_iota(jnp.int32, b.shape, 1) - head_size
    shifted = b << (8 * jnp.clip(lane % 2, 0, 1))

    def half(first: int) -> jax.Array:
        part = jnp.where((lane == first) | (lane == first + 1), shifted, 0)
        return part.astype(jnp.float32).sum(axis=1, keepdims=True).astype(jnp.int32)

    scale = pltpu.bitcast(half(0) | (half(2) << 16), jnp.float32)
    values = b[:, :head_size]
    if kv_quant == "int8":
        x = jnp.where(values >= 128, values - 256, values).astype(jnp.float32)
    else:  # e4m3fn: bias 7, 3 mantissa bits; quantize never writes its NaN
        exponent, mantissa = (values >> 3) & 0xF, values & 7
        normal = pltpu.bitcast(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
        magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 2.0**-9, normal)
        x = jnp.where(values >= 128, -magnitude, magnitude)
    return x * scale


def _tiles_kernel(
    # scalar prefetch (SMEM)
    tables_ref,  # [R * W_pad] int32 page ids, clipped to valid blocks
    seg_req_ref,  # [T_pad] int32
    seg_lo_ref,  # [T_pad] int32
    seg_hi_ref,  # [T_pad] int32
    seg_count_ref,  # [tiles] int32
    head_ref,  # [3] int32: first combined head of grid row 0, selected block head (-1: all),
    # layer of a stacked cache
    # blocks (VMEM)
    q_ref,  # [Hq_blk, N, D], N = G * tokens_per_tile
    lo_ref,  # [N, 1] int32
    hi_ref,  # [N, 1] int32
    seg_ref,  # [N, 1] int32 flat segment index of the row (-1: none)
    kv_hbm,  # [(L,) num_blocks, block_size, 2 * H, D_stored] left in HBM
    o_ref,  # [Hq_blk, N, D]
    # scratch
    *scratch,  # per lane column [2, P, block_size, 2 * Hb, w] double buffer; DMA
    # semaphores [2 slots, P, columns]; [Hq_blk, N, 1] f32 running max and denominator;
    # [Hq_blk, N, D] f32 accumulator
    columns: tuple[tuple[int, int], ...],
    sm_scale: float,
    soft_cap: float | None,
    tokens_per_tile: int,
    table_width: int,
    compute: np.dtype,
    kv_quant: str | None,
    select_head: bool,
    interpret: bool,
) -> None:
    bufs, (sems, m_ref, l_ref, acc_ref) = scratch[: len(columns)], scratch[len(columns) :]
    _, pages_per_chunk, block_size, combined, _ = bufs[0].shape
    keys = pages_per_chunk * block_size
    first_head = pl.multiple_of(head_ref[0] + pl.program_id(0) * combined, combined)
    tile = pl.program_id(1)
    dot_dtype = jnp.float32 if compute == jnp.float32 else compute
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    row_lo, row_hi, row_seg = lo_ref[...], hi_ref[...], seg_ref[...]

    def transfer(req, chunk, slot, wait: bool) -> None:
        """Start (or wait for) the DMAs of page chunk `chunk` of `req` into buffer `slot`."""
        base = req * table_width + chunk * pages_per_chunk
        stack = (head_ref[2],) if len(kv_hbm.shape) == 5 else ()
        for p in range(pages_per_chunk):
            page = tables_ref[base + p]
            for c, (lane, width) in enumerate(columns):
                heads, lanes = pl.ds(first_head, combined), pl.ds(lane, width)
                dma = pltpu.make_async_copy(
                    kv_hbm.at[(*stack, page, slice(None), heads, lanes)],
                    bufs[c].at[slot, p],
                    sems.at[slot, p, c],
                )
                if wait:
                    dma.wait()
                else:
                    dma.start()

    def attend(slot, head: int, q_row: int, visible, values_ok) -> None:
        """Fold block head `head`'s keys of this chunk into query block `q_row`'s state."""
        k, v = _load_head(bufs, slot, head, combined, keys, compute, kv_quant, interpret)
        s = jax.lax.dot_general(
            q_ref[q_row].astype(dot_dtype), k.astype(dot_dtype), (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        ) * sm_scale  # fmt: skip
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, _MASKED)
        m_prev = m_ref[q_row]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        v = jnp.where(values_ok, v, 0.0).astype(dot_dtype)
        pv = jax.lax.dot_general(
            p.astype(dot_dtype), v, (((1,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        alpha = jnp.exp(m_prev - m_new)
        l_ref[q_row] = alpha * l_ref[q_row] + p.sum(axis=1, keepdims=True)
        acc_ref[q_row] = alpha * acc_ref[q_row] + pv
        m_ref[q_row] = m_new

    def segment(s, carry):
        index = tile * tokens_per_tile + s
        req, seg_lo, seg_hi = seg_req_ref[index], seg_lo_ref[index], seg_hi_ref[index]
        # lax.div/rem: the ranges are non-negative, and jnp's floor division lowers
        # through `sign`, whose Mosaic rule queries the TPU generation.
        first = jax.lax.div(seg_lo, keys)
        last = jax.lax.div(seg_hi + keys - 1, keys)
        transfer(req, first, 0, wait=False)

        def chunk(j, carry):
            slot = jax.lax.rem(j - first, 2)

            @pl.when(j + 1 < last)
            def _prefetch_next():
                transfer(req, j + 1, 1 - slot, wait=False)

            transfer(req, j, slot, wait=True)
            key = j * keys + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
            visible = (row_seg == index) & (key >= row_lo) & (key < row_hi)  # [N, K]
            key_col = j * keys + jax.lax.broadcasted_iota(jnp.int32, (keys, 1), 0)
            values_ok = (key_col >= seg_lo) & (key_col < seg_hi)  # [K, 1]
            for head in range(combined // 2):
                if select_head:
                    pl.when(head_ref[1] == head)(
                        functools.partial(attend, slot, head, 0, visible, values_ok)
                    )
                else:
                    attend(slot, head, head, visible, values_ok)
            return carry

        return jax.lax.fori_loop(first, last, chunk, carry)

    jax.lax.fori_loop(0, seg_count_ref[tile], segment, 0)
    denom = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def tpu_kernel_error(
    num_kv_heads: int, storage: np.dtype, compute: np.dtype, kv_quant: str | None
) -> str | None:
    """Why the kernel cannot read this cache, or None if it can (the dispatch's test)."""
    storage, compute = np.dtype(storage), np.dtype(compute)
    if kv_quant is None and compute.itemsize != storage.itemsize:
        return (
            f"kv_dtype={compute} must have the width of the cache's storage dtype "
            f"{storage} (its bits are reinterpreted)"
        )
    if kv_quant is None and compute.itemsize == 2 and compute != jnp.bfloat16:
        return f"a 16-bit cache must compute in bfloat16, got {compute}"
    if kv_quant is None and compute.itemsize not in (2, 4):
        return f"a {compute} cache is not supported (bfloat16, float32 or kv_quant)"
    block = head_block(num_kv_heads, storage.itemsize)
    if (2 * block) % (4 // storage.itemsize):
        return (
            f"num_kv_heads={num_kv_heads} per device: a {storage} cache needs an even number "
            f"of KV heads per device (its K/V rows are read 4 to a 32-bit word)"
        )
    return None


def paged_attention_tiles_tpu(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    req: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    kv_head: jax.Array | None = None,
    kv_quant: str | None = None,
    layer: jax.Array | None = None,
    tokens_per_tile: int = TOKENS_PER_TILE,
    pages_per_chunk: int = PAGES_PER_CHUNK,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Token `n` of `q [T, Hq, D]` attends to keys `[lo[n], hi[n])` of request `req[n]`.

    `block_tables [R, W]` holds each request's page ids; `kv_cache [num_blocks,
    block_size, 2 * H, D]` is read in place. Returns `[T, Hq, D]` in q's dtype;
    tokens with `lo >= hi` return 0. Precondition (as `token_intervals` gives
    it): a request's tokens are contiguous and in position order, each token's
    interval contains its own position, `hi <= W * block_size`, and the pages
    covering each interval are written. `layer` (a traced scalar) reads that layer of a
    stacked `[L, num_blocks, ...]` cache in place. `kv_head` (a traced scalar) makes every
    query head read that one KV head. `kv_quant` ("int8"/"fp8") reads a quantised
    cache `[..., D + SCALE_BYTES]` (`jaxkv.device.storage`), dequantised in VMEM to
    `kv_dtype`'s precision. `interpret=True` (or a `pltpu.InterpretParams`, e.g.
    with race detection) runs the kernel in Pallas TPU interpret mode (any
    backend); otherwise it needs a TPU.
    """
    if q.ndim != 3 or kv_cache.ndim != (4 if layer is None else 5) or block_tables.ndim != 2:
        raise ValueError(
            f"need q [T, Hq, D], kv_cache [blocks, block_size, 2 * H, D] (with `layer`: "
            f"[L, blocks, ...]), block_tables [R, W]; got {q.shape}, {kv_cache.shape}, "
            f"{block_tables.shape}"
        )
    num_tokens, num_q_heads, head_size = q.shape
    for name, x in (("req", req), ("lo", lo), ("hi", hi)):
        if x.shape != (num_tokens,):
            raise ValueError(f"{name} has shape {x.shape}; expected ({num_tokens},)")
    for name, value in (("tokens_per_tile", tokens_per_tile), ("pages_per_chunk", pages_per_chunk)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_kv_quant(kv_quant)
    stored_head = kv_cache.shape[-1]
    value_shape = kv_cache.shape[-4:-1] + (stored_head - (SCALE_BYTES if kv_quant else 0),)
    num_kv_heads = check_attention_args(q.shape, value_shape, None, soft_cap, kv_head is None)
    if kv_quant and kv_dtype is None:
        raise ValueError(f"kv_quant={kv_quant!r} needs kv_dtype, the dtype to dequantise to")
    compute = resolve_dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)
    error = tpu_kernel_error(kv_cache.shape[-2] // 2, kv_cache.dtype, compute, kv_quant)
    if error is not None:
        raise ValueError(error)
    num_blocks, block_size = kv_cache.shape[-4:-2]
    block = head_block(kv_cache.shape[-2] // 2, kv_cache.dtype.itemsize)
    select_head = kv_head is not None
    heads = num_kv_heads if kv_head is None else 1
    group = num_q_heads // heads
    tiles = pl.cdiv(max(num_tokens, 1), tokens_per_tile)
    padded = tiles * tokens_per_tile
    rows = group * tokens_per_tile
    num_reqs, width = block_tables.shape
    table_width = pl.cdiv(width, pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, table_width - width)))
    tables = jnp.clip(tables, 0, num_blocks - 1).reshape(-1)  # DMAs must stay in bounds

    def pad_tokens(x: jax.Array) -> jax.Array:
        return jnp.pad(x.astype(jnp.int32), (0, padded - num_tokens))

    req_p, lo_p, hi_p = pad_tokens(req), pad_tokens(lo), pad_tokens(hi)  # padding: lo == hi
    segs = _segments(req_p, lo_p, hi_p, tokens_per_tile)

    def per_row(x: jax.Array) -> jax.Array:  # [T_pad] -> [tiles, G * tokens_per_tile, 1]
        x = jnp.broadcast_to(x.reshape(tiles, 1, tokens_per_tile), (tiles, group, tokens_per_tile))
        return x.reshape(tiles, rows, 1)

    # [T, H*G, D] -> [H, tiles, G * tokens_per_tile, D], row g * tokens_per_tile + i.
    qt = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(tiles, tokens_per_tile, heads, group, head_size).transpose(2, 0, 3, 1, 4)
    qt = qt.reshape(heads, tiles, rows, head_size)
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if select_head:  # the block holding `kv_head`, and its place in the block
        kv_head = jnp.asarray(kv_head, jnp.int32)
        head_info = jnp.stack([kv_head // block * 2 * block, kv_head % block, layer])
    else:
        head_info = jnp.stack([jnp.int32(0), jnp.int32(-1), layer])
    q_block = 1 if select_head else block
    columns = lane_columns(stored_head)

    kernel = functools.partial(
        _tiles_kernel, sm_scale=sm_scale, soft_cap=soft_cap, tokens_per_tile=tokens_per_tile,
        table_width=table_width, compute=compute, kv_quant=kv_quant, select_head=select_head,
        columns=columns, interpret=bool(interpret),
    )  # fmt: skip
    tile_block = pl.BlockSpec((q_block, None, rows, head_size), lambda h, t, *_: (h, t, 0, 0))
    row_block = pl.BlockSpec((None, rows, 1), lambda h, t, *_: (t, 0, 0))
    cache_in_hbm = pl.BlockSpec(memory_space=pl.ANY)  # pages are copied by the kernel's DMAs
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(heads // q_block, tiles),
            in_specs=[tile_block, row_block, row_block, row_block, cache_in_hbm],
            out_specs=tile_block,
            scratch_shapes=[
                *(
                    pltpu.VMEM((2, pages_per_chunk, block_size, 2 * block, w), kv_cache.dtype)
                    for _, w in columns
                ),
                pltpu.SemaphoreType.DMA((2, pages_per_chunk, len(columns))),
                pltpu.VMEM((q_block, rows, 1), jnp.float32),
                pltpu.VMEM((q_block, rows, 1), jnp.float32),
                pltpu.VMEM((q_block, rows, head_size), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="jaxkv_ragged_paged_attention_tpu",
    )(
        tables, segs.req, segs.lo, segs.hi, segs.count, head_info,
        qt, per_row(lo_p), per_row(hi_p), per_row(segs.of_token), kv_cache,
    )  # fmt: skip
    out = out.reshape(heads, tiles, group, tokens_per_tile, head_size).transpose(1, 3, 0, 2, 4)
    return out.reshape(padded, num_q_heads, head_size)[:num_tokens]
