"""Ragged paged attention over a `[num_blocks, block_size, 2 * kv_heads, head_size]` cache
(or layer `layer` of a stack `[L, num_blocks, ...]` of them, read in place).

One call serves a mixed batch: prefill chunks and decode tokens of many
requests, concatenated along the token axis (`query_start_loc` delimits them,
vLLM style). Request `r` has `seq_lens[r]` tokens of context after this step, of
which its last `q_len = query_start_loc[r+1] - query_start_loc[r]` are the
queries, so query `i` of `r` sits at position `pos = seq_lens[r] - q_len + i`.

Masks. Every mask this module knows is one key interval `[lo, hi)` per query
token (`token_intervals`): causal `hi = pos + 1`; a bidirectional span (image
tokens of Gemma-3-style models, prefix-LM) raises it to `hi = span_ends[token]`
so a span's tokens see each other; a sliding window sets
`lo = pos - sliding_window + 1`; chunked-local attention `lo = pos // chunk * chunk`.
`hi` never exceeds `seq_lens[r]` nor the table's `W * block_size` keys. Logits are
scaled, then soft-capped (`cap * tanh(s / cap)`).

The portable path (`impl="reference"`, every backend) is blockwise with an
online softmax (flash style), so time and temporary memory follow the keys each
query actually attends, never the table width:

* requests with more than `query_chunk // 8` queries (prefill chunks) run
  request-major: query chunks of `query_chunk` rows against page chunks of
  about `keys_per_chunk` keys, a loop bounded by the chunk's visible key range;
* the other tokens (decode, short speculative chunks) run token-major: chunks
  of `token_chunk` tokens, each gathering its own request's page chunk.

The working set is one `query_chunk x keys_per_chunk` (or `token_chunk x
keys_per_chunk`) tile per step of the loop.

Dispatch:

| backend | `impl="auto"` (what `PagedKVCache.step` runs) | `impl="pallas"`                  |
|---------|-----------------------------------------------|----------------------------------|
| CPU     | blockwise                                     | ValueError (or `interpret=True`) |
| GPU     | `gpu_attention`: Triton decode + prefill kernels | the same Triton kernels          |
| TPU     | `pallas_tpu` Mosaic kernel (decode and mixed) | the same Mosaic kernel           |

Where a kernel does not apply (on GPU a quantised cache, block shapes outside
`pallas_gpu`'s constraints or a replicated KV head slice; on TPU what
`pallas_tpu.tpu_kernel_error` refuses) `"auto"` runs the blockwise path and logs one
line saying why;
`impl="reference"` always runs it. `interpret=True` (with `impl="pallas"`) runs
the GPU kernel in Pallas interpret mode on any backend, and
`impl="pallas_tpu_interpret"` the TPU kernel in Pallas TPU interpret mode on any
backend (tests; `step` can pass it). JAX's bundled TPU ragged kernel is not used:
in JAX 0.10.2 it fails in Pallas TPU interpret mode and cannot be lowered for TPU
on a CPU host, so it could not be verified. The README's "Attention dispatch"
section says what has been verified how.

NaN safety: padded query rows, the null block and free pages may hold anything
(including NaN). Masked logits are replaced with `jnp.where` and the values of
keys no query of a tile may see are zeroed with `jnp.where` before `p @ v` (a zero
probability times a NaN value is still NaN); rows with no visible key return 0.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._checks import check_int
from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.gpu_attention import gpu_attention, gpu_kernel_error
from jaxkv.device.pallas_tpu import TPU_BLOCK_SIZE, paged_attention_tiles_tpu, tpu_kernel_error
from jaxkv.device.storage import (
    SCALE_BYTES,
    DTypeLike,
    check_kv_quant,
    dequantize,
    from_storage,
    resolve_dtype,
)

logger = logging.getLogger("jaxkv")
_MASKED = -1e30
AttentionImpl = Literal["auto", "reference", "pallas", "pallas_tpu_interpret"]
_IMPLS = ("auto", "reference", "pallas", "pallas_tpu_interpret")


def _positive_number(name: str, value: object) -> float:
    """`value` as a Python float; TypeError unless a real number, ValueError unless > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive, got {value}")
    return float(value)


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends: the one spelling every attention entry point takes
    (`ragged_paged_attention`, `paged_decode_attention`, and `PagedKVCache.step`,
    `layer_step`, `stacked_layer_step`, `warmup`).

    * `sm_scale`: the logit scale (None: `head_size ** -0.5`),
    * `sliding_window`, `attention_chunk`: None or a positive int (module docstring,
      "Masks"); a cache built from a `SlidingWindowSpec` / `ChunkedLocalAttentionSpec`
      applies its own and accepts only None or that value,
    * `soft_cap`: None or a positive number (`cap * tanh(s / cap)`),
    * `impl`: the dispatch table's column.

    Invariants: validated at construction (TypeError / ValueError naming the field);
    numbers are Python ints and floats, so equal options compare and hash equal, and an
    `AttentionOptions` is a static jit argument and part of a compiled program's key.
    What is data is passed beside it: per-token bidirectional spans (`span_ends`) and a
    stacked cache's per-layer window (traced under a scan over the layers).
    """

    sm_scale: float | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    attention_chunk: int | None = None
    impl: AttentionImpl = "auto"

    def __post_init__(self) -> None:
        for name in ("sliding_window", "attention_chunk"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), min_value=1))
        for name in ("sm_scale", "soft_cap"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_number(name, getattr(self, name)))
        if self.impl not in _IMPLS:
            raise ValueError(f"impl must be one of {_IMPLS}, got {self.impl!r}")


_DEFAULT_OPTIONS = AttentionOptions()


class TokenIntervals(NamedTuple):
    """Per query token: its request, position and visible key interval `[lo, hi)`.

    Invariant: tokens at or beyond `query_start_loc[num_seqs]` (padding) have
    `lo == hi == 0`, so they see nothing and return 0.
    """

    req: jax.Array  # [T] int32
    pos: jax.Array  # [T] int32
    lo: jax.Array  # [T] int32
    hi: jax.Array  # [T] int32
    valid: jax.Array  # [T] bool


def token_intervals(
    num_tokens: int,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    max_keys: int,
    *,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    span_ends: jax.Array | None = None,
) -> TokenIntervals:
    """The key interval each query token sees (module docstring, "Masks")."""
    num_reqs = seq_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq = seq_lens[req]
    pos = seq - q_lens[req] + (tok - query_start_loc[req])
    valid = tok < query_start_loc[num_seqs]
    hi = pos + 1
    if span_ends is not None:
        hi = jnp.maximum(hi, span_ends.astype(jnp.int32))
    hi = jnp.minimum(jnp.minimum(hi, seq), max_keys)
    lo = jnp.zeros_like(pos)
    if sliding_window is not None:
        lo = jnp.maximum(lo, pos - sliding_window + 1)
    if attention_chunk is not None:
        lo = jnp.maximum(lo, pos // attention_chunk * attention_chunk)
    hi = jnp.where(valid, jnp.maximum(hi, 0), 0)
    lo = jnp.where(valid, jnp.clip(lo, 0, hi), 0)
    return TokenIntervals(req, pos, lo, hi, valid)


def _check_call(
    q: jax.Array,
    kv_cache: jax.Array,
    options: AttentionOptions,
    window: jax.Array | None,
    span_ends: jax.Array | None,
    kv_dtype: DTypeLike | None,
    kv_head: jax.Array | None,
    kv_quant: str | None,
    layer: jax.Array | None,
    interpret: bool,
    tiling: tuple[int, int, int],
) -> int | jax.Array | None:
    """Checks `ragged_paged_attention`'s arguments; returns the sliding window to apply
    (`window` when given, else `options.sliding_window`)."""
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if window is not None and options.sliding_window is not None:
        raise ValueError(
            f"window (data) and options.sliding_window={options.sliding_window} both given; "
            "pass one"
        )
    sliding_window = options.sliding_window if window is None else window
    impl, soft_cap = options.impl, options.soft_cap
    num_tokens = q.shape[0]
    check_kv_quant(kv_quant)
    if (kv_cache.ndim == 5) != (layer is not None):
        raise ValueError(
            f"kv_cache has shape {kv_cache.shape}: a stacked [L, blocks, bs, 2H, D] cache "
            "needs `layer`, a [blocks, bs, 2H, D] one must not have it"
        )
    value_shape = kv_cache.shape[:-1] + (kv_cache.shape[-1] - (SCALE_BYTES if kv_quant else 0),)
    check_attention_args(q.shape, value_shape, sliding_window, soft_cap, kv_head is None)
    _check_tiling(*tiling)
    if interpret and impl != "pallas":
        raise ValueError(f"interpret=True needs impl='pallas', got impl={impl!r}")
    if span_ends is not None and span_ends.shape != (num_tokens,):
        raise ValueError(f"span_ends has shape {span_ends.shape}; expected ({num_tokens},)")
    if kv_quant and kv_dtype is None:
        raise ValueError(f"kv_quant={kv_quant!r} needs kv_dtype, the dtype to dequantise to")
    return sliding_window


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    options: AttentionOptions = _DEFAULT_OPTIONS,
    *,
    window: jax.Array | None = None,
    span_ends: jax.Array | None = None,
    kv_dtype: DTypeLike | None = None,
    platform: str | None = None,
    query_chunk: int = 64,
    kv_head: jax.Array | None = None,
    token_chunk: int = 8,
    keys_per_chunk: int = 128,
    interpret: bool = False,
    kv_quant: str | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Attention of `q [T, Hq, D]` over the paged cache; returns `[T, Hq, D]` in q's dtype.

    `options` says how (`AttentionOptions`: scale, masks, soft cap, `impl`); `span_ends
    [T]` (bidirectional spans) is the module docstring's per-token mask. `window` is a
    sliding window given as data, an int32 scalar that may be traced (one layer body for
    layers with different windows; a window at least the table's key count is none):
    `options.sliding_window` must then be None.

    `layer` (an int32 scalar, may be traced) reads layer `layer` of a stacked cache
    `[L, blocks, bs, 2H, D]` (`PagedKVCache.allocate_stacked`) in place: the blockwise
    path gathers its pages straight from the stack and both kernels take the whole
    stack plus `layer` (the TPU kernel's DMAs index the layer; the Triton kernel reads
    the stack viewed as `[L * blocks, ...]` with page ids offset by `layer * blocks`).
    No path slices `kv_cache[layer]`: XLA would materialise such a slice before a
    kernel's custom call, a copy of the whole layer per layer per step.

    `block_tables [R, W]`, `seq_lens [R]`, `query_start_loc [R+1]` and the scalar
    `num_seqs` describe the requests (rows at or beyond `num_seqs` are padding).
    `kv_dtype` is the compute dtype when the cache stores its bits in another
    dtype. `kv_head`, when given, makes every query head attend to that single
    KV head (a query-head slice of a replicated cache); otherwise query heads
    are grouped over the cache's KV heads (GQA). `query_chunk`, `token_chunk` and
    `keys_per_chunk` size the blockwise path's tiles (they never change the result
    beyond float rounding; the tiles do not depend on the table width, so neither does
    the result); the TPU kernel takes `token_chunk` tokens per tile and
    `keys_per_chunk // block_size` pages per DMA chunk. `kv_quant` ("int8"/"fp8") reads
    a quantised cache (`jaxkv.device.storage`), dequantised inside the blockwise path or
    the TPU kernel; `kv_dtype` is then the dtype it dequantises to.
    """
    sliding_window = _check_call(
        q, kv_cache, options, window, span_ends, kv_dtype, kv_head, kv_quant, layer, interpret,
        (query_chunk, token_chunk, keys_per_chunk),
    )  # fmt: skip
    impl, soft_cap, attention_chunk = options.impl, options.soft_cap, options.attention_chunk
    sm_scale = q.shape[-1] ** -0.5 if options.sm_scale is None else options.sm_scale
    num_tokens = q.shape[0]
    compute = resolve_dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)
    platform = platform or jax.default_backend()
    block_size = kv_cache.shape[-3]
    masks = {
        "sliding_window": sliding_window,
        "attention_chunk": attention_chunk,
        "span_ends": span_ends,
    }
    kernel = _pick_kernel(impl, platform, interpret, kv_cache, compute, kv_head, q.shape, kv_quant)
    iv = token_intervals(
        num_tokens, seq_lens, query_start_loc, num_seqs,
        block_tables.shape[1] * block_size, **masks,
    )  # fmt: skip
    if kernel == "tpu":
        return paged_attention_tiles_tpu(
            q, kv_cache, block_tables, iv.req, iv.lo, iv.hi,
            sm_scale=sm_scale, soft_cap=soft_cap, kv_dtype=compute, kv_head=kv_head,
            kv_quant=kv_quant, layer=layer, tokens_per_tile=token_chunk,
            pages_per_chunk=max(1, keys_per_chunk // block_size),
            interpret=impl == "pallas_tpu_interpret",
        )  # fmt: skip
    if kernel == "gpu":
        return gpu_attention(
            q, kv_cache, block_tables, query_start_loc, num_seqs, iv, sm_scale=sm_scale,
            soft_cap=soft_cap, compute=compute, layer=layer, interpret=interpret,
        )  # fmt: skip
    return _blockwise(
        q, kv_cache, block_tables, query_start_loc, num_seqs, iv,
        sm_scale=sm_scale, soft_cap=soft_cap, compute=compute, kv_head=kv_head,
        query_chunk=min(query_chunk, num_tokens), token_chunk=min(token_chunk, num_tokens),
        pages_per_chunk=max(1, keys_per_chunk // block_size), kv_quant=kv_quant, layer=layer,
    )  # fmt: skip


def default_block_size(platform: str) -> int:
    """Tokens per KV block when none is given: `pallas_tpu.TPU_BLOCK_SIZE` on a TPU (its
    kernel wants few, large pages), else vLLM's 16."""
    return TPU_BLOCK_SIZE if platform == "tpu" else 16


def _check_tiling(*sizes: int) -> None:
    for name, size in zip(("query_chunk", "token_chunk", "keys_per_chunk"), sizes, strict=True):
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def _pick_kernel(impl, platform, interpret, kv_cache, compute, kv_head, q_shape, kv_quant):
    """`"tpu"`, `"gpu"` or `"blockwise"` for this call (module docstring's dispatch table)."""
    if impl == "reference":
        return "blockwise"
    tpu_error = tpu_kernel_error(kv_cache.shape[-2] // 2, kv_cache.dtype, compute, kv_quant)
    gpu_error = gpu_kernel_error(
        kv_cache, compute, kv_head, q_shape, quantised=bool(kv_quant), interpret=interpret
    )
    if impl == "auto":
        error = {"gpu": gpu_error, "tpu": tpu_error}.get(platform)
        if platform in ("gpu", "tpu") and error is None:
            return platform
        if platform in ("gpu", "tpu"):
            _say_once(
                f"jaxkv: the {platform.upper()} attention kernel cannot serve "
                f"{tuple(kv_cache.shape)} {kv_cache.dtype}: {error}; using the blockwise path"
            )
        return "blockwise"
    if impl == "pallas_tpu_interpret" or (impl == "pallas" and platform == "tpu" and not interpret):
        if tpu_error is not None:
            raise ValueError(f"impl={impl!r} (the TPU kernel) cannot serve this cache: {tpu_error}")
        return "tpu"
    if interpret or platform == "gpu":
        if gpu_error is not None:
            raise ValueError(
                f"impl='pallas' on GPU needs grouped heads and a cache the Triton kernel can "
                f"tile: {gpu_error}; use impl='auto'"
            )
        return "gpu"
    raise ValueError(
        f"impl='pallas' needs a GPU (Triton kernel) or a TPU (Mosaic kernel); got "
        f"platform={platform!r}. Pass interpret=True to run the GPU kernel in Pallas "
        f"interpret mode, impl='pallas_tpu_interpret' for the TPU kernel in Pallas TPU "
        f"interpret mode, or use impl='auto'/'reference'"
    )


@functools.cache
def _say_once(line: str) -> None:
    """Log `line` once per process (a dispatch is traced once per compiled program)."""
    logger.warning(line)


def paged_decode_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    num_seqs: jax.Array,
    options: AttentionOptions = _DEFAULT_OPTIONS,
    *,
    kv_dtype: DTypeLike | None = None,
    platform: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode-only attention: query `r` of `q [R, Hq, D]` is request `r`'s newest token.

    `ragged_paged_attention` with `query_start_loc = arange(R + 1)`: the query
    sits at position `seq_lens[r] - 1`; rows at or beyond `num_seqs` return 0.
    Returns `[R, Hq, D]` in q's dtype. Dispatch follows the module docstring's
    table; `interpret=True` (only with `impl="pallas"`) runs the GPU kernel in
    Pallas interpret mode on any platform.
    """
    num_reqs = q.shape[0]
    return ragged_paged_attention(
        q, kv_cache, block_tables, seq_lens, jnp.arange(num_reqs + 1, dtype=jnp.int32),
        num_seqs, options, kv_dtype=kv_dtype, platform=platform, interpret=interpret,
    )  # fmt: skip


class _Softmax(NamedTuple):
    """Online-softmax state of a tile of rows: running max, denominator, output."""

    m: jax.Array  # [N, H, G]
    denom: jax.Array  # [N, H, G]
    acc: jax.Array  # [N, H, G, D]

    @classmethod
    def init(cls, rows: int, heads: int, group: int, head_size: int, dtype) -> _Softmax:
        return cls(
            jnp.full((rows, heads, group), _MASKED, dtype),
            jnp.zeros((rows, heads, group), dtype),
            jnp.zeros((rows, heads, group, head_size), dtype),
        )

    def update(self, logits: jax.Array, visible: jax.Array, values: jax.Array, eq: str):
        """Fold in one key tile: `logits [N, H, G, K]`, `visible [N, 1, 1, K]`."""
        logits = jnp.where(visible, logits, _MASKED)
        m_new = jnp.maximum(self.m, logits.max(axis=-1))
        p = jnp.where(visible, jnp.exp(logits - m_new[..., None]), 0.0)
        alpha = jnp.exp(self.m - m_new)
        pv = jnp.einsum(eq, p, values, precision=jax.lax.Precision.HIGHEST)
        return _Softmax(m_new, alpha * self.denom + p.sum(-1), alpha[..., None] * self.acc + pv)

    def result(self) -> jax.Array:
        """`[N, H * G, D]`; rows that saw no key are 0."""
        out = self.acc / jnp.where(self.denom > 0, self.denom, 1.0)[..., None]
        n, h, g, d = out.shape
        return out.reshape(n, h * g, d)


def _blockwise(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    iv: TokenIntervals,
    *,
    sm_scale: float,
    soft_cap: float | None,
    compute: np.dtype,
    kv_head: jax.Array | None,
    query_chunk: int,
    token_chunk: int,
    pages_per_chunk: int,
    kv_quant: str | None,
    layer: jax.Array | None,
) -> jax.Array:
    """Flash-style attention (module docstring): request-major long, token-major short."""
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs, width = block_tables.shape
    block_size, combined = kv_cache.shape[-3:-1]
    stack = () if layer is None else (layer,)
    heads = combined // 2 if kv_head is None else 1
    group = num_q_heads // heads
    acc = jnp.promote_types(compute, jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    keys_per_chunk = pages_per_chunk * block_size
    padded_width = -(-width // pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    key_offsets = jnp.arange(keys_per_chunk, dtype=jnp.int32)

    def load(pages: jax.Array, lane: int) -> jax.Array:
        """K (lane 0) or V (lane 1) of `pages [..., P]` as `[..., keys, heads, D]`.

        The gather reads the cache in its own 4-D shape (see `PagedKVCache`'s write):
        only the gathered pages are reshaped.
        """
        if kv_head is None:
            x = kv_cache[(*stack, pages)]  # [..., P, bs, 2H, D]
            x = x.reshape(*x.shape[:-2], combined // 2, 2, x.shape[-1])[..., lane, :]
        else:
            x = kv_cache[(*stack, pages, slice(None), 2 * kv_head + lane)][..., None, :]
        x = dequantize(x, kv_quant, acc) if kv_quant else from_storage(x, compute).astype(acc)
        return x.reshape(*pages.shape[:-1], keys_per_chunk, heads, head_size)

    def capped(logits: jax.Array) -> jax.Array:
        logits = logits * sm_scale
        return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)

    def chunk_range(lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Page-chunk indices `[first, last)` covering every row's `[lo, hi)`."""
        live = hi > lo
        first = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max))
        last = jnp.max(jnp.where(live, hi, 0))
        return jnp.where(last > 0, first // keys_per_chunk, 0), -(-last // keys_per_chunk)

    # Padding lets every dynamic slice start anywhere in [0, num_tokens) unclamped.
    pad = max(query_chunk, token_chunk)
    total = num_tokens + pad

    def padded(x: jax.Array, fill=0) -> jax.Array:
        widths = ((0, pad),) + ((0, 0),) * (x.ndim - 1)
        return jnp.pad(x, widths, constant_values=fill)

    q_p = padded(q).reshape(total, heads, group, head_size)
    lo_p, hi_p, req_p = padded(iv.lo), padded(iv.hi), padded(iv.req)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_long = q_lens > max(1, query_chunk // 8)
    short_tok = iv.valid & ~is_long[iv.req]
    short_p = padded(short_tok, False)
    out0 = jnp.zeros((total, heads, group, head_size), acc)

    def store(out, start, rows_ok, state: _Softmax):
        n = rows_ok.shape[0]
        new = state.result().reshape(n, heads, group, head_size)
        old = jax.lax.dynamic_slice_in_dim(out, start, n)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(rows_ok[:, None, None, None], new, old), start, 0
        )

    # Token-major: decode and short query chunks, each token its own table row.
    def token_tile(c, out):
        start = c * token_chunk
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, token_chunk)  # noqa: E731
        ok = sl(short_p)
        lo, hi = jnp.where(ok, sl(lo_p), 0), jnp.where(ok, sl(hi_p), 0)
        qc = sl(q_p).astype(acc)
        rows = tables[sl(req_p)]  # [n, Wp]

        def page_chunk(j, state: _Softmax) -> _Softmax:
            pages = jax.lax.dynamic_slice_in_dim(rows, j * pages_per_chunk, pages_per_chunk, 1)
            pos = j * keys_per_chunk + key_offsets
            visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
            k, v = load(pages, 0), load(pages, 1)  # [n, K, H, D]
            logits = capped(jnp.einsum("nhgd,nkhd->nhgk", qc, k, precision=hp))
            v = jnp.where(visible[:, :, None, None], v, 0.0)
            return state.update(logits, visible[:, None, None, :], v, "nhgk,nkhd->nhgd")

        first, last = chunk_range(lo, hi)
        init = _Softmax.init(token_chunk, heads, group, head_size, acc)
        return store(out, start, ok, jax.lax.fori_loop(first, last, page_chunk, init))

    num_valid = query_start_loc[num_seqs]
    out = jax.lax.fori_loop(0, -(-num_valid // token_chunk), token_tile, out0)

    # Request-major: prefill chunks share each page chunk across `query_chunk` rows.
    def request(r, out):
        begin, length = query_start_loc[r], q_lens[r]
        num_chunks = jnp.where(is_long[r], -(-length // query_chunk), 0)

        def query_tile(i, out):
            start = begin + i * query_chunk
            sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, query_chunk)  # noqa: E731
            ok = start + jnp.arange(query_chunk) < begin + length
            lo, hi = jnp.where(ok, sl(lo_p), 0), jnp.where(ok, sl(hi_p), 0)
            qc = sl(q_p).astype(acc)
            live = hi > lo
            seen_lo = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max))
            seen_hi = jnp.max(hi)

            def page_chunk(j, state: _Softmax) -> _Softmax:
                pages = jax.lax.dynamic_slice(
                    tables, (r, j * pages_per_chunk), (1, pages_per_chunk)
                )
                pos = j * keys_per_chunk + key_offsets
                visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
                k, v = load(pages[0], 0), load(pages[0], 1)  # [K, H, D]
                logits = capped(jnp.einsum("nhgd,khd->nhgk", qc, k, precision=hp))
                # Keys outside every row's interval may be freed pages (NaN).
                v = jnp.where(((pos >= seen_lo) & (pos < seen_hi))[:, None, None], v, 0.0)
                return state.update(logits, visible[:, None, None, :], v, "nhgk,khd->nhgd")

            first, last = chunk_range(lo, hi)
            init = _Softmax.init(query_chunk, heads, group, head_size, acc)
            return store(out, start, ok, jax.lax.fori_loop(first, last, page_chunk, init))

        return jax.lax.fori_loop(0, num_chunks, query_tile, out)

    out = jax.lax.fori_loop(0, num_seqs, request, out)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_size).astype(q.dtype)
