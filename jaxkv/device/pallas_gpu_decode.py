"""Flash-decoding paged attention for GPUs (Pallas Triton), split over the context.

`paged_decode_rows_gpu` has the contract of `pallas_gpu.paged_attention_rows_pallas`:
row `n` of `q [N, Hq, D]` (a decode token, or any token-major row) attends to key
positions `[lo[n], hi[n])` through its own table row `block_tables[n]`; rows with
`lo >= hi` return exactly 0. Masks are intervals, so causal, window, chunked-local and
bidirectional spans cost nothing extra. It also reads a stacked cache in place (below).

Design. The cache is `[num_blocks, block_size, 2H, D]` (K of KV head `h` at combined
head `2h`, V at `2h + 1`). Grid `(row, kv_head, split)`:

* Program `(n, h, s)` takes all `G = Hq / H` query heads of KV head `h`, so each page
  of K and V is read once per KV head, not once per query head.
* The row's interval covers compute blocks `[lo // keys, cdiv(hi, keys))` of
  `keys = pages_per_compute_block * block_size` keys; split `s` of `S` walks the
  contiguous range `[b0 + s * c, min(b0 + (s + 1) * c, b1))`, `c = cdiv(b1 - b0, S)`,
  with an online softmax and writes its unnormalised partial `(m, l, acc)` in float32.
  The split is of the row's own interval, not of the table, so a short row in a wide
  table still spreads over all `S` programs. A split with no block writes
  `(_MASKED, 0, 0)`.
* The merge (`merge_splits`, plain jnp ops) is the exact log-sum-exp combination:
  `M = max_s m_s`, `out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s`; a row
  whose denominator is 0 (no key) gives 0.
* Query-head group. With `G < 16` (any `G`, not only powers of two) the program loops
  statically over its `G` heads and computes `q . k` as a float32 broadcast-multiply-
  reduce over `[keys, D]` (exact float32, so no precision flag matters), and `p . v` the
  same way; the K and V tiles are loaded once per compute block and shared by the
  heads. No head is padded: the `plgpu.dot` route would pad the group to 16 rows, 16/G
  times the useful work. With `G >= 16` it uses `plgpu.dot` on `[G_pad, D]`
  (`G_pad = next_pow2(G)`) like the rows kernel, with `Precision.HIGHEST` (IEEE fp32
  on Triton, not TF32). Query blocks are padded to `G_pad` rows in memory only
  (Triton block shapes are powers of two); padded rows are never computed on the
  `G < 16` route and are dropped after the merge.
* `num_splits` (static): `clamp(cdiv(table_blocks, BLOCKS_PER_SPLIT), 1, MAX_SPLITS)`,
  `table_blocks = cdiv(W, pages_per_compute_block)` for a table of `W` pages: a full-
  width row gives each split about `BLOCKS_PER_SPLIT` compute blocks. Untuned (no GPU
  was available to measure); `num_splits=` overrides it.

Tiles and shared memory. `pages_per_compute_block` (`decode_compute_block_pages`): on
the `G < 16` route the largest power of two `<= pallas_gpu.PAGES_PER_COMPUTE_BLOCK`
pages with `keys * D <= TILE_ELEMENTS` (one page if a page alone is larger), which keeps
the float32 K and V tiles in registers (8192 elements: 64 per thread each at 4 warps),
e.g. 64 keys at D = 128 (vLLM's Triton decode kernel uses 64-key tiles too); on the
`G >= 16` route `PAGES_PER_COMPUTE_BLOCK` pages. Either is then halved while
`decode_smem_bytes` exceeds the device's limit less `1/SMEM_MARGIN_DIVISOR` of it:

    G < 16:   16 * D                                    (reduction scratch)
    G >= 16:  2 * keys * D * (itemsize + 4)             K and V tiles, stored dtype and
                                                        their float32 conversion
              + 4 * G_pad * D + keys                    the float32 q operand, scratch

Measured, not assumed: XLA's Triton pipeline (jaxlib 0.10.2, num_warps 4, num_stages 3)
compiled the kernel deviceless for sm_90 and sm_80 (`tests/gpu_aot_matrix.py`) and
reported each program's request at D 64/128/256, 16-128 keys, bf16 and f32, G 1-32: the
vector route asked for 0 or 2,048 bytes, the dot route for the formula above less
`keys * 3 / 4` bytes. The same compiler reproduces the two figures an H200 reported for
the rows kernel exactly (`pallas_gpu`). Interpret mode uses the same tiles without the
limit.

Stacked caches: `kv_cache [L, NB, block_size, 2H, D]` with a (traced) `layer` is
viewed as `[L * NB, ...]` (a free reshape of a contiguous array) and `layer * NB` is
added to the clipped page ids, so no per-layer slice is materialised.

NaN safety (as in the rows kernel): the null block, free pages and page tails may hold
anything. Page ids are clipped into `[0, NB)` (and `layer` into `[0, L)`) before use:
Triton loads have no bounds check, and a compute block may read stale table entries
past a row's pages. Logits outside `[lo, hi)` are replaced with `jnp.where`,
probabilities and V rows are zeroed with `jnp.where` (`0 * NaN` is NaN), so partials
are finite and the merge never sees a NaN. Padding query rows (`G .. G_pad`) get
defined partials (`0`, `_MASKED`, `0`) on the `G < 16` route and are dropped after the
merge on both routes; a padding token (`lo = hi = 0`, its q possibly NaN) walks no block.

Storage dtypes: a cache storing another dtype's bits (bf16 as uint16, `storage.py`) is
loaded as stored and bitcast; `kv_dtype` names the compute dtype (same width).

Verified: `tests/test_pallas_gpu_decode_kernel.py` runs the kernel in Pallas interpret
mode on CPU against the float64 reference (GQA 1/2/3/4/8/16, D 64/128/256, bf16 and
f32, window, soft cap, chunked-local and span masks on prefill rows, contexts over
several splits, NaN-poisoned pages and stale table tails, padded rows exactly 0,
stacked caches, 1 vs 2/5/16 splits), checks with a spy the page ids the kernel gets
(interpret mode's gathers clamp, Triton's loads do not), and cross-lowers it for CUDA
on CPU (one Triton custom call; the Pallas Triton lowering accepts every construct).
Compiled by the real compiler, deviceless, for an H100, H200 and A100 in the slow
suite (`tests/test_gpu_aot.py`: the dispatch's tiles fit each part). Not run on a GPU:
its speed and register use are unmeasured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.device.pallas_gpu import (
    MIN_DOT,
    PAGES_PER_COMPUTE_BLOCK,
    SMEM_MARGIN_DIVISOR,
    SmemLimit,
    block_shape_error,
    check_rows_call,
    gpu_smem_limit,
    is_pow2,
    layer_pages,
    next_pow2,
)
from jaxkv.device.storage import DTypeLike, from_storage

_MASKED = -1e30  # finite: exp(_MASKED - m) is 0, never NaN
TILE_ELEMENTS = 8192  # keys * D per K (and V) tile on the G < 16 route (docstring)
VECTOR_SMEM_PER_LANE = 16  # bytes per head-size lane on the G < 16 route (docstring)
BLOCKS_PER_SPLIT = 4  # compute blocks per split for a full-width row; untuned
MAX_SPLITS = 16  # untuned


def uses_dot(group: int) -> bool:
    """Whether a group of `group` query heads takes the `plgpu.dot` route (>= 16 rows)."""
    return group >= MIN_DOT


def decode_smem_bytes(head_size: int, keys: int, group: int, itemsize: int) -> int:
    """Shared memory (bytes) of one program with `keys` keys per compute block: a bound
    on what Triton allocates, measured by the real compiler (module docstring)."""
    if not uses_dot(group):
        return VECTOR_SMEM_PER_LANE * head_size
    rows = next_pow2(group)
    return 2 * keys * head_size * (itemsize + 4) + 4 * rows * head_size + keys


def decode_compute_block_pages(
    head_size: int, block_size: int, group: int, dtype: DTypeLike, smem: SmemLimit | None
) -> int:
    """Pages per compute block (module docstring, "Tiles"); `smem=None`: interpret mode.

    Raises `ValueError` saying why when the kernel cannot serve these shapes.
    """
    for name, value in (("block_size", block_size), ("head_size", head_size)):
        if not is_pow2(value):
            raise ValueError(f"{name}={value} must be a power of two (Triton block shapes)")
    if group < 1:
        raise ValueError(f"group={group} must be >= 1")
    dot = uses_dot(group)
    pages = PAGES_PER_COMPUTE_BLOCK
    while not dot and pages > 1 and pages * block_size * head_size > TILE_ELEMENTS:
        pages //= 2
    if dot and (error := block_shape_error(head_size, block_size, pages)):
        raise ValueError(error)
    if smem is None:
        return pages
    itemsize = np.dtype(dtype).itemsize
    budget = smem.bytes - smem.bytes // SMEM_MARGIN_DIVISOR
    while (need := decode_smem_bytes(head_size, pages * block_size, group, itemsize)) > budget:
        if pages == 1 or (dot and block_shape_error(head_size, block_size, pages // 2)):
            raise ValueError(
                f"no decode tile fits shared memory: head_size={head_size}, "
                f"{np.dtype(dtype).name}, block_size={block_size}, group {group}: "
                f"{pages * block_size} keys need {need} bytes, over the budget of {budget}: "
                f"{smem.bytes} bytes per block ({smem.source}) less 1/{SMEM_MARGIN_DIVISOR}"
            )
        pages //= 2
    return pages


def decode_kernel_error(
    head_size: int, block_size: int, group: int, dtype: DTypeLike, smem: SmemLimit | None
) -> str | None:
    """Why `paged_decode_rows_gpu` cannot serve these shapes, or None if it can."""
    try:
        decode_compute_block_pages(head_size, block_size, group, dtype, smem)
    except ValueError as exc:
        return str(exc)
    return None


def default_num_splits(table_width: int, pages_per_compute_block: int) -> int:
    """Splits for a table of `table_width` pages (module docstring): static, >= 1."""
    table_blocks = pl.cdiv(table_width, pages_per_compute_block)
    return max(1, min(MAX_SPLITS, pl.cdiv(table_blocks, BLOCKS_PER_SPLIT)))


def _decode_kernel(
    lo_ref,  # [] int32: first visible key position of this row
    hi_ref,  # [] int32: one past the last visible key position
    table_ref,  # [W_pad] int32: this row's page ids, clipped, layer offset added
    q_ref,  # [G_pad, D]
    k_ref,  # [pages, block_size, D]: K lane of this KV head
    v_ref,  # [pages, block_size, D]: V lane of this KV head
    acc_ref,  # [G_pad, D] float32: unnormalised sum of p * v of this split
    m_ref,  # [G_pad] float32: running max logit of this split
    l_ref,  # [G_pad] float32: sum of exp(s - m) of this split
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_block: int,
    num_splits: int,
    group: int,
    compute: np.dtype,
) -> None:
    _, block_size, head_size = k_ref.shape
    keys = pages_per_block * block_size
    first, last = lo_ref[()], hi_ref[()]
    b0 = jax.lax.div(first, keys)
    count = jnp.where(first < last, pl.cdiv(last, keys) - b0, 0)
    per_split = pl.cdiv(count, num_splits)
    start = b0 + pl.program_id(2) * per_split
    stop = jnp.minimum(start + per_split, b0 + count)
    offsets = jnp.arange(keys, dtype=jnp.int32)

    def tiles(i):
        """K and V of compute block `i` as float32 `[keys, D]` (V rows outside `[lo, hi)`
        zeroed) and the mask of the keys in `[lo, hi)`."""
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        pos = i * keys + offsets
        visible = (pos >= first) & (pos < last)

        def load(ref):
            x = from_storage(ref[pages], compute)  # [pages, block_size, D]
            return x.astype(jnp.float32).reshape(keys, head_size)

        # V rows outside the interval may be NaN and 0 * NaN is NaN: zero them.
        return load(k_ref), jnp.where(visible[:, None], load(v_ref), 0.0), visible

    def logits(s, visible):
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return jnp.where(visible, s, _MASKED)

    if uses_dot(group):
        _dot_route(q_ref, acc_ref, m_ref, l_ref, tiles, logits, start, stop)
    else:
        _vector_route(q_ref, acc_ref, m_ref, l_ref, tiles, logits, start, stop, group)


def _dot_route(q_ref, acc_ref, m_ref, l_ref, tiles, logits, start, stop) -> None:
    """`G >= 16`: the group's `[G_pad, D]` queries against each tile with `plgpu.dot`."""
    rows, head_size = q_ref.shape
    hp = jax.lax.Precision.HIGHEST
    q = q_ref[...].astype(jnp.float32)

    def body(i, carry):
        acc, m, denom = carry
        k, v, visible = tiles(i)
        s = logits(plgpu.dot(q, k, trans_b=True, precision=hp), visible[None, :])
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + plgpu.dot(p, v, precision=hp)
        return acc, m_new, alpha * denom + p.sum(axis=1)

    init = (
        jnp.zeros((rows, head_size), jnp.float32),
        jnp.full((rows,), _MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, denom = jax.lax.fori_loop(start, stop, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


def _vector_route(q_ref, acc_ref, m_ref, l_ref, tiles, logits, start, stop, group) -> None:
    """`G < 16`: per head, `q . k` and `p . v` as float32 multiply-reduce over `[keys, D]`.

    The tiles are loaded once per compute block and reused by the `group` heads (a
    static loop); per head the carry is a scalar max, a scalar denominator and `[D]`.
    """
    head_size = q_ref.shape[1]
    qs = [q_ref[g, :].astype(jnp.float32) for g in range(group)]

    def body(i, carry):
        k, v, visible = tiles(i)
        out = []
        for q, (acc, m, denom) in zip(qs, carry, strict=True):
            s = logits(jnp.sum(k * q[None, :], axis=1), visible)  # [keys]
            m_new = jnp.maximum(m, s.max())
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m - m_new)
            acc = alpha * acc + jnp.sum(p[:, None] * v, axis=0)
            out.append((acc, m_new, alpha * denom + p.sum()))
        return tuple(out)

    init = tuple(
        (
            jnp.zeros((head_size,), jnp.float32),
            jnp.full((), _MASKED, jnp.float32),
            jnp.zeros((), jnp.float32),
        )
        for _ in range(group)
    )
    result = jax.lax.fori_loop(start, stop, body, init)
    rows = q_ref.shape[0]
    if rows > group:  # padding rows get defined values (dropped after the merge)
        # Whole-block stores: a scalar store of a constant trips the Pallas Triton
        # lowering (jax 0.10.2, RuntimeError std::bad_cast in `_masked_swap_lowering_rule`).
        acc_ref[...] = jnp.zeros((rows, head_size), jnp.float32)
        m_ref[...] = jnp.full((rows,), _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros((rows,), jnp.float32)
    for g, (acc, m, denom) in enumerate(result):
        acc_ref[g, :] = acc
        m_ref[g] = m
        l_ref[g] = denom


def merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array) -> jax.Array:
    """Exact log-sum-exp merge of split partials over axis 2; rows with no key give 0.

    `acc [N, H, S, G, D]`, `m` and `denom` `[N, H, S, G]` (float32) -> `[N, H, G, D]`.
    An empty split has `m = _MASKED` and weight `exp(_MASKED - M) = 0` next to any
    non-empty one; with every split empty the denominator is 0 and the result 0.
    """
    top = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - top)
    total = (weight * denom).sum(axis=2)
    out = (weight[..., None] * acc).sum(axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def paged_decode_rows_gpu(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    layer: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Row `n` of `q [N, Hq, D]` attends to keys `[lo[n], hi[n])` of table row `n`.

    `kv_cache [NB, bs, 2H, D]`, or `[L, NB, bs, 2H, D]` with `layer` (int32 scalar, may
    be traced); `block_tables [N, W]`. Rows with `lo >= hi` return 0. Precondition:
    `hi[n] <= W * bs` and the pages covering `[lo[n], hi[n])` are valid (ids are
    clipped, not checked). `pages_per_compute_block` / `num_splits` default to
    `decode_compute_block_pages` (this process's GPU; interpret mode: no limit) and
    `default_num_splits` (explicit values are used as given: shapes checked, not
    shared memory). Returns `[N, Hq, D]` in q's dtype. Raises `ValueError` when
    the shapes do not fit (`decode_kernel_error`).
    """
    kv_cache, offset, num_blocks = layer_pages(kv_cache, layer)
    num_kv_heads, compute = check_rows_call(q, kv_cache, block_tables, lo, hi, soft_cap, kv_dtype)
    num_rows, num_q_heads, head_size = q.shape
    block_size = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if pages_per_compute_block is None:
        smem = None if interpret else gpu_smem_limit()
        pages_per_compute_block = decode_compute_block_pages(
            head_size, block_size, group, compute, smem
        )
    elif not is_pow2(pages_per_compute_block):
        raise ValueError(f"pages_per_compute_block={pages_per_compute_block}: a power of two")
    elif uses_dot(group) and (
        error := block_shape_error(head_size, block_size, pages_per_compute_block)
    ):
        raise ValueError(error)  # the dot route's operands must be >= 16 on every side
    width = block_tables.shape[1]
    splits = (
        default_num_splits(width, pages_per_compute_block) if num_splits is None else num_splits
    )
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")

    rows = next_pow2(group)
    padded_width = pl.cdiv(width, pages_per_compute_block) * pages_per_compute_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    tables = jnp.clip(tables, 0, num_blocks - 1) + offset  # Triton loads are unchecked
    qg = q.reshape(num_rows, num_kv_heads, group, head_size)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    acc, m, denom = _call(
        qg, kv_cache, tables, lo.astype(jnp.int32), hi.astype(jnp.int32),
        sm_scale=sm_scale, soft_cap=soft_cap, pages_per_block=pages_per_compute_block,
        num_splits=splits, group=group, compute=compute, interpret=interpret,
    )  # fmt: skip
    out = merge_splits(acc, m, denom)[:, :, :group]
    return out.reshape(num_rows, num_q_heads, head_size).astype(q.dtype)


def _call(qg, kv_cache, tables, lo, hi, *, num_splits, interpret, **params):
    """The split kernel over grid `(row, kv_head, split)`; returns float32 partials."""
    num_rows, num_kv_heads, rows, head_size = qg.shape
    pages, block_size = kv_cache.shape[:2]
    kernel = functools.partial(_decode_kernel, num_splits=num_splits, **params)
    lane = (pages, block_size, None, head_size)
    scalar = pl.BlockSpec((None,), lambda r, h, s: (r,))
    part = (None, None, None, rows)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_splits),
        in_specs=[
            scalar,
            scalar,
            pl.BlockSpec((None, tables.shape[1]), lambda r, h, s: (r, 0)),
            pl.BlockSpec((None, None, rows, head_size), lambda r, h, s: (r, h, 0, 0)),
            pl.BlockSpec(lane, lambda r, h, s: (0, 0, 2 * h, 0)),  # K of head h
            pl.BlockSpec(lane, lambda r, h, s: (0, 0, 2 * h + 1, 0)),  # V of head h
        ],
        out_specs=[
            pl.BlockSpec((*part, head_size), lambda r, h, s: (r, h, s, 0, 0)),
            pl.BlockSpec(part, lambda r, h, s: (r, h, s, 0)),
            pl.BlockSpec(part, lambda r, h, s: (r, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, rows, head_size), f32),
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, rows), f32),
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, rows), f32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(),  # Triton; without it CUDA picks Mosaic GPU
        name="jaxkv_paged_decode_split",
    )(lo, hi, tables, qg, kv_cache, kv_cache)
