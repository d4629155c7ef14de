"""Pallas (Triton) paged attention over the interleaved `[blocks, bs, 2*H, D]` cache
(one layer's, or layer `layer` of a stack `[L, blocks, bs, 2*H, D]`, read in place).

`paged_attention_rows_pallas`: each query row (a decode token or any token of a
prefill chunk) attends to its own key interval `[lo, hi)` through its own table
row, so one kernel serves decode and mixed steps with every mask of
`jaxkv.device.attention` (causal, window, chunked-local, bidirectional spans are
all intervals). `paged_decode_attention_pallas` is the decode special case. The
kernel reads the cache in place: K of KV head `h` is combined head `2h`, V is
`2h+1`, so two block specs over the same array select the K and V lanes of one
head without any copy or relayout.

Stacked caches: the engine keeps every layer in one `[L, NB, bs, 2H, D]` array and
scans its layers with a traced `layer`. The kernel takes the whole stack viewed as
`[L * NB, bs, 2H, D]` (merging the leading axes of a row-major array is a free
reshape) and page ids offset by `layer * NB`, so it reads that layer's pages where they
lie. Slicing `kv_cache[layer]` instead would make XLA materialise the slice for the
custom call: a copy of one layer's whole cache per layer per step, i.e. of the whole
KV pool per step.

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
`[0, num_blocks)` first (and a stack's `layer` into `[0, L)`): Triton loads have no
bounds check, and the last compute block may read stale table entries past a request's
pages (their keys are masked).

Block-shape constraints (Triton tensors must have power-of-two sizes and `plgpu.dot`
needs every dimension >= 16): `block_size`, `head_size` and
`pages_per_compute_block` are powers of two, `head_size >= 16` and
`pages_per_compute_block * block_size >= 16`. Violations raise `ValueError`
(`block_shape_error` says why without raising).

Shared memory: Triton sizes a program's shared memory at compile time and the launch
fails (`RESOURCE_EXHAUSTED: Shared memory size limit exceeded`) when it passes the
device's per-block limit, so the compute block is chosen per shape and device
(`compute_block_pages`). `smem_bytes` models the need, for `keys =
pages_per_compute_block * block_size`, `rows = G_pad`, `D = head_size`:

    keys * D * (2 * itemsize + 4)    K and V tiles in the stored dtype, one buffer each,
                                     and one float32 [keys, D] layout-conversion buffer
    + 4 * rows * (D + keys)          the float32 dot operands q [rows, D] and p [rows, keys]
    + 96                             the residual (barriers, small scratch)

Calibration: the two figures Triton reported on an H200 for D = 256, 128 keys (8 pages
of 16), 16 rows, JAX's default Triton settings on CUDA (num_warps 4, num_stages 3):
286,816 bytes (bf16) and 417,888 bytes (f32); the model reproduces both exactly, and so
does XLA's compiler for an H200 without one (`tests/test_gpu_aot.py`, every slow run). Two
points at one shape fix only two things: the dtype-dependent part (65,536 bytes per
byte of itemsize: two [128, 256] tiles, so K and V get one buffer each; two buffers
of f32 K and V alone would be 524,288 bytes) and the total of the rest (155,744
bytes at that shape). How that rest splits into the terms above, and so how it scales
with keys, D and rows, is the assumption, read off the kernel's tensors, not a
measurement. Consistent with it: D = 128, 128 keys, f32 and bf16 compiled and ran on
the H200 (`benchmarks/RESULTS.md`), modelled 213,088 and 147,552 bytes. The plan keeps
the modelled need within the limit less `1/SMEM_MARGIN_DIVISOR` of it (alignment, the
assumed split); the margin still admits the measured D = 128 f32 configuration.

The limit comes from the device's compute capability (`gpu_smem_limit`; JAX exposes
no shared-memory attribute): `SMEM_PER_BLOCK` holds the CUDA C++ Programming Guide's
"maximum shared memory per thread block" (opt-in) per capability, which for 9.0 is the
232,448 bytes the H200 reported. A capability outside the table (or none: ROCm) gets
`UNKNOWN_GPU_SMEM`. Compiling ahead of time for a part this process does not have (a
deviceless `jaxkv.device.gpu_targets` topology), trace inside `with gpu_target("8.0"):`
(an A100) so the plan takes that part's limit; jax's caches do not key on it, so trace
new jitted functions per target. With neither a target nor a GPU the plan assumes 9.0,
the capability JAX's Triton lowering assumes then too. Interpret
mode has no shared memory: it takes `PAGES_PER_COMPUTE_BLOCK` pages. An explicit
`pages_per_compute_block` is used as given (block shapes checked, not memory).

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

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.storage import DTypeLike, from_storage, resolve_dtype

_MASKED = -1e30
MIN_DOT = 16  # smallest M, N and K Triton's `tl.dot` accepts
PAGES_PER_COMPUTE_BLOCK = 8  # the most pages per compute block the plan takes; untuned
SMEM_MARGIN_DIVISOR = 16  # the plan leaves limit // 16 of the limit unused (docstring)
_SMEM_RESIDUAL = 96  # bytes the calibration leaves beyond the modelled tensors

# Maximum shared memory per thread block (opt-in), bytes, by compute capability: CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability". 9.0 matches the
# "available: 232448" Triton reported on an H200.
SMEM_PER_BLOCK: dict[tuple[int, int], int] = {
    (7, 0): 96 * 1024,  # V100
    (7, 5): 64 * 1024,  # T4 and other Turing parts
    (8, 0): 163 * 1024,  # A100, A30
    (8, 6): 99 * 1024,  # A10, A40, RTX 30xx
    (8, 7): 163 * 1024,  # Jetson Orin
    (8, 9): 99 * 1024,  # L4, L40, RTX 40xx
    (9, 0): 227 * 1024,  # H100, H200, GH200
    (10, 0): 227 * 1024,  # B200, GB200
    (12, 0): 99 * 1024,  # RTX 50xx
}
# Unknown parts: the smallest limit above (Turing; also AMD CDNA's 64 KiB of LDS).
UNKNOWN_GPU_SMEM = 64 * 1024
# The capability planned for with no target named and no GPU visible.
_LOWERING_DEFAULT_CAPABILITY = "9.0"
# The part being compiled for ahead of time (`gpu_target`), if any.
_TARGET_CAPABILITY: ContextVar[str | None] = ContextVar("jaxkv_gpu_target", default=None)


class SmemLimit(NamedTuple):
    """Shared memory per block a kernel may use on a device, and where the figure comes from."""

    bytes: int
    source: str


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= `n` (n >= 1)."""
    return 1 << (n - 1).bit_length()


def block_shape_error(head_size: int, block_size: int, pages_per_compute_block: int) -> str | None:
    """Why the kernel cannot take these block shapes (module docstring), or None if it can."""
    for name, value in (
        ("block_size", block_size),
        ("head_size", head_size),
        ("pages_per_compute_block", pages_per_compute_block),
    ):
        if not is_pow2(value):
            return f"{name}={value} must be a power of two (Triton block shapes)"
    if head_size < MIN_DOT:
        return f"head_size={head_size} must be >= {MIN_DOT} (plgpu.dot on Triton)"
    keys_per_block = pages_per_compute_block * block_size
    if keys_per_block < MIN_DOT:
        return (
            f"pages_per_compute_block={pages_per_compute_block} * block_size={block_size} "
            f"= {keys_per_block} keys per compute block must be >= {MIN_DOT} (plgpu.dot on Triton)"
        )
    return None


def query_rows(group: int) -> int:
    """Query rows a program computes for a GQA group: `G_pad = max(16, next_pow2(group))`."""
    return max(MIN_DOT, 1 << (group - 1).bit_length())


def smem_bytes(head_size: int, keys_per_block: int, rows: int, itemsize: int) -> int:
    """Modelled shared memory (bytes) of one program; model and calibration: module docstring.

    Exact at the calibration shape (head 256, 128 keys, 16 rows, itemsize 2 and 4);
    elsewhere an estimate whose scaling is assumed, hence the plan's margin.
    """
    tiles = keys_per_block * head_size * (2 * itemsize + 4)
    operands = 4 * rows * (head_size + keys_per_block)
    return tiles + operands + _SMEM_RESIDUAL


def _capability(compute_capability: object) -> tuple[int, int] | None:
    """`(major, minor)` of a capability like "9.0"; None for None, ROCm's gfx names, etc."""
    try:
        major, minor = (int(part) for part in str(compute_capability).split("."))
    except ValueError:
        return None
    return major, minor


def smem_limit_for(compute_capability: object) -> SmemLimit:
    """`SMEM_PER_BLOCK`'s limit for a capability like "9.0"; `UNKNOWN_GPU_SMEM` otherwise."""
    key = _capability(compute_capability)
    limit = SMEM_PER_BLOCK.get(key) if key else None
    if limit is None:
        return SmemLimit(
            UNKNOWN_GPU_SMEM,
            f"compute capability {compute_capability}, not in SMEM_PER_BLOCK: the default",
        )
    return SmemLimit(limit, f"compute capability {key[0]}.{key[1]}")


@contextlib.contextmanager
def gpu_target(capability: str) -> Iterator[None]:
    """Plan the GPU kernels traced inside for compute capability `capability` (e.g. "9.0",
    "8.0"): compiling ahead of time for that part (module docstring).

    Raises `ValueError` when `SMEM_PER_BLOCK` does not know the capability.
    """
    if _capability(capability) not in SMEM_PER_BLOCK:
        known = ", ".join(f"{a}.{b}" for a, b in SMEM_PER_BLOCK)
        raise ValueError(f"gpu_target({capability!r}): a compute capability among {known}")
    token = _TARGET_CAPABILITY.set(capability)
    try:
        yield
    finally:
        _TARGET_CAPABILITY.reset(token)


def gpu_smem_limit() -> SmemLimit:
    """The shared memory per block of the part compiled for: the `gpu_target` in force,
    else this process's first GPU, else capability 9.0 assumed (module docstring)."""
    target = _TARGET_CAPABILITY.get()
    if target is not None:
        limit = smem_limit_for(target)
        return limit._replace(source=f"{limit.source}, the target compiled for")
    return _local_gpu_smem_limit()


@functools.cache
def _local_gpu_smem_limit() -> SmemLimit:
    """This process's first GPU's limit; cached: the device set does not change."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend: lowering for CUDA from a CPU host
        limit = smem_limit_for(_LOWERING_DEFAULT_CAPABILITY)
        return limit._replace(source=f"{limit.source}, assumed: no GPU visible")
    return smem_limit_for(getattr(device, "compute_capability", None))


def compute_block_pages(
    head_size: int, block_size: int, group: int, dtype: DTypeLike, smem: SmemLimit | None
) -> int:
    """Pages per compute block for this shape: the largest power of two <= 8 whose block
    shapes are valid and whose modelled shared memory (`smem_bytes`) stays within `smem`
    less its margin; `smem=None` (interpret mode) takes `PAGES_PER_COMPUTE_BLOCK`.

    Raises `ValueError` saying why when no compute block qualifies.
    """
    error = block_shape_error(head_size, block_size, PAGES_PER_COMPUTE_BLOCK)
    if error is not None:
        raise ValueError(error)
    if smem is None:
        return PAGES_PER_COMPUTE_BLOCK
    dtype = np.dtype(dtype)
    rows = query_rows(group)
    budget = smem.bytes - smem.bytes // SMEM_MARGIN_DIVISOR
    pages = PAGES_PER_COMPUTE_BLOCK
    while True:
        need = smem_bytes(head_size, pages * block_size, rows, dtype.itemsize)
        if need <= budget:
            return pages
        if pages == 1 or block_shape_error(head_size, block_size, pages // 2) is not None:
            break  # fewer pages: fewer keys than a Triton dot takes
        pages //= 2
    raise ValueError(
        f"no compute block fits shared memory: head_size={head_size}, {dtype.name}, group "
        f"{group} ({rows} query rows), block_size={block_size}; the smallest, {pages} "
        f"page(s) = {pages * block_size} keys, needs {need} bytes (modelled), over the "
        f"budget of {budget}: {smem.bytes} bytes per block ({smem.source}) less 1/"
        f"{SMEM_MARGIN_DIVISOR}"
    )


def compute_block_error(
    head_size: int, block_size: int, group: int, dtype: DTypeLike, smem: SmemLimit | None
) -> str | None:
    """Why `compute_block_pages` finds no compute block, or None if it finds one."""
    try:
        compute_block_pages(head_size, block_size, group, dtype, smem)
    except ValueError as exc:
        return str(exc)
    return None


def _rows_kernel(
    lo_ref,  # [] int32: first visible key position of this row
    hi_ref,  # [] int32: one past the last visible key position
    table_ref,  # [W_pad] int32: this row's page ids, clipped into the layer, offset added
    q_ref,  # [G_pad, D]
    k_ref,  # [pages, block_size, D]: K lane of this KV head (a layer or the flat stack)
    v_ref,  # [pages, block_size, D]: V lane of this KV head
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
    layer: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of `q [R, Hq, D]` (one query per request); returns `[R, Hq, D]`.

    `kv_cache [num_blocks, block_size, 2 * H, D]` (K/V interleaved per head), or a
    stack `[L, num_blocks, block_size, 2 * H, D]` with `layer` (an int32 scalar, may be
    traced; read in place, see `paged_attention_rows_pallas`), `block_tables [R, W]`
    int page ids, `seq_lens [R]` context lengths including this step's token.
    Precondition: the first `cdiv(seq_lens[r], block_size)` entries of row `r` are
    valid block ids (out-of-range ids are clipped, not reported). As in the reference,
    only the table's `W * block_size` keys exist (a longer `seq_lens[r]` only moves the
    query position) and `Hq % H == 0` is required. Rows with `seq_lens[r] == 0` return
    0 (use it for padding). `kv_dtype` is the compute dtype when the cache stores its
    bits in another dtype. `interpret=True` runs the kernel in Pallas interpret mode
    (any backend). See the module docstring for the block-shape constraints (checked
    here) and for how `pages_per_compute_block=None` is chosen.
    """
    if seq_lens.ndim != 1 or block_tables.ndim != 2:
        raise ValueError(
            f"need block_tables [R, W] and seq_lens [R]; got {block_tables.shape}, {seq_lens.shape}"
        )
    check_attention_args(q.shape, kv_cache.shape, sliding_window, soft_cap)
    seq = seq_lens.astype(jnp.int32)
    hi = jnp.clip(seq, 0, block_tables.shape[1] * kv_cache.shape[-3])
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.clip(seq - sliding_window, 0, hi)
    return paged_attention_rows_pallas(
        q, kv_cache, block_tables, lo, hi, sm_scale=sm_scale, soft_cap=soft_cap,
        kv_dtype=kv_dtype, layer=layer, pages_per_compute_block=pages_per_compute_block,
        interpret=interpret,
    )  # fmt: skip


def check_rows_call(q, pages, block_tables, lo, hi, soft_cap, kv_dtype) -> tuple[int, np.dtype]:
    """`(num_kv_heads, compute dtype)` of a token-major GPU kernel call (this module's and
    `pallas_gpu_decode`'s): ValueError naming the argument whose shape or dtype is wrong.
    `pages` is the cache as `layer_pages` views it."""
    if q.ndim != 3 or block_tables.ndim != 2 or lo.ndim != 1:
        raise ValueError(
            f"need q [N, Hq, D], block_tables [N, W], lo/hi [N]; got {q.shape}, "
            f"{block_tables.shape}, {lo.shape}"
        )
    num_kv_heads = check_attention_args(q.shape, pages.shape, None, soft_cap)
    num_rows = q.shape[0]
    if block_tables.shape[0] != num_rows or lo.shape != (num_rows,) or hi.shape != (num_rows,):
        raise ValueError(
            f"block_tables {block_tables.shape} and lo/hi {lo.shape}/{hi.shape} must have "
            f"one row per query ({num_rows})"
        )
    compute = resolve_dtype(pages.dtype if kv_dtype is None else kv_dtype)
    if compute.itemsize != pages.dtype.itemsize:
        raise ValueError(
            f"kv_dtype={compute} must have the width of the cache's storage dtype "
            f"{pages.dtype} (its bits are reinterpreted)"
        )
    return num_kv_heads, compute


def layer_pages(kv_cache: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, jax.Array, int]:
    """`(pages, offset, num_blocks)`: the cache as `[pages, bs, 2H, D]`, the id of the
    layer's first page in it, and the blocks per layer.

    A 4-D cache (`layer` None) is returned as is with offset 0. A stack `[L, NB, bs, 2H,
    D]` (`layer` an int32 scalar, may be traced) is viewed as `[L * NB, bs, 2H, D]`:
    merging the two leading axes of a row-major array is a free reshape (a bitcast in
    XLA), so layer `l`'s block `b` is page `l * NB + b` and no per-layer slice is
    materialised (a slice feeding the custom call would be a copy of the whole layer
    per call). `layer` is clipped into `[0, L)`: Triton loads are unchecked. Raises
    `ValueError` when the rank and `layer` disagree.
    """
    if (kv_cache.ndim == 5) != (layer is not None) or kv_cache.ndim not in (4, 5):
        raise ValueError(
            f"kv_cache {kv_cache.shape}: need [blocks, block_size, 2 * H, D] without `layer`, "
            "or a stack [L, blocks, block_size, 2 * H, D] with `layer`"
        )
    if layer is None:
        return kv_cache, jnp.int32(0), kv_cache.shape[0]
    num_layers, num_blocks = kv_cache.shape[:2]
    pages = kv_cache.reshape(num_layers * num_blocks, *kv_cache.shape[2:])
    offset = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1) * num_blocks
    return pages, offset, num_blocks


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
    layer: jax.Array | None = None,
    pages_per_compute_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Row `n` of `q [N, Hq, D]` attends to key positions `[lo[n], hi[n])` of its own table row.

    `kv_cache [blocks, bs, 2H, D]`, or a stack `[L, blocks, bs, 2H, D]` with `layer`
    (an int32 scalar, may be traced, clipped into `[0, L)`): the kernel then reads that
    layer's pages in place in the whole stack (`layer_pages`), never a sliced copy, so
    a scanned layer body costs no per-layer copy of the cache. `block_tables [N, W]`
    holds each row's page ids within the layer (a query token's request row: ragged
    prefill and decode alike). Rows with `lo >= hi` return 0. Every mask of
    `jaxkv.device.attention` (causal, window, chunked-local, spans) is such an
    interval, so this one kernel serves decode and mixed steps. Precondition:
    `hi[n] <= W * block_size` and the pages covering `[lo[n], hi[n])` are valid (ids
    are clipped into the layer's blocks, not checked).
    `pages_per_compute_block=None` takes `compute_block_pages` for this process's GPU
    (interpret mode: `PAGES_PER_COMPUTE_BLOCK`); raises `ValueError` if none fits.
    """
    kv_cache, offset, num_blocks = layer_pages(kv_cache, layer)
    num_kv_heads, compute = check_rows_call(q, kv_cache, block_tables, lo, hi, soft_cap, kv_dtype)
    num_rows, num_q_heads, head_size = q.shape
    block_size = kv_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if pages_per_compute_block is None:
        smem = None if interpret else gpu_smem_limit()
        pages_per_compute_block = compute_block_pages(head_size, block_size, group, compute, smem)
    error = block_shape_error(head_size, block_size, pages_per_compute_block)
    if error is not None:
        raise ValueError(error)

    rows = query_rows(group)
    width = block_tables.shape[1]
    padded_width = pl.cdiv(width, pages_per_compute_block) * pages_per_compute_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    # Triton loads are unchecked: ids are clipped into the layer before the offset.
    tables = jnp.clip(tables, 0, num_blocks - 1) + offset
    qg = q.reshape(num_rows, num_kv_heads, group, head_size)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    out = _call(
        qg, kv_cache, tables, lo.astype(jnp.int32), hi.astype(jnp.int32),
        sm_scale=sm_scale, soft_cap=soft_cap, pages_per_block=pages_per_compute_block,
        compute=compute, interpret=interpret,
    )  # fmt: skip
    return out[:, :, :group].reshape(num_rows, num_q_heads, head_size)


def _call(qg, kv_cache, tables, lo, hi, *, interpret, **params) -> jax.Array:
    """The rows kernel over grid `(row, kv_head)` on `kv_cache [pages, bs, 2H, D]` (a
    layer, or a whole stack viewed flat with `tables` already offset into the layer)."""
    num_rows, num_kv_heads, rows, head_size = qg.shape
    pages, block_size = kv_cache.shape[:2]
    lane = (pages, block_size, None, head_size)
    scalar = pl.BlockSpec((None,), lambda r, h: (r,))
    return pl.pallas_call(
        functools.partial(_rows_kernel, **params),
        grid=(num_rows, num_kv_heads),
        in_specs=[
            scalar,
            scalar,
            pl.BlockSpec((None, tables.shape[1]), lambda r, h: (r, 0)),
            pl.BlockSpec((None, None, rows, head_size), lambda r, h: (r, h, 0, 0)),
            pl.BlockSpec(lane, lambda r, h: (0, 0, 2 * h, 0)),  # K of head h
            pl.BlockSpec(lane, lambda r, h: (0, 0, 2 * h + 1, 0)),  # V of head h
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_size), lambda r, h: (r, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(),  # Triton; without it CUDA picks Mosaic GPU
        name="jaxkv_paged_attention_rows",
    )(lo, hi, tables, qg, kv_cache, kv_cache)
