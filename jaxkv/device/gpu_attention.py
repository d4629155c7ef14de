"""The GPU path of `ragged_paged_attention`: two Pallas Triton kernels over one step.

Tokens of requests with at most `PREFILL_MIN_QUERY_LEN` query tokens (decode, short
speculative chunks) run the split decode kernel (`pallas_gpu_decode`: token-major, each
page read once per KV head for its whole GQA group, a long context split across
programs and merged); requests with more run the query-tiled prefill kernel
(`pallas_gpu_prefill`: a tile of one request's queries shares each page chunk). The
threshold is the blockwise path's (`query_chunk // 8` of its default 64). Each kernel
returns exactly 0 for the other's tokens, so a mixed step's output is their sum; a step
whose bucket holds at most `PREFILL_MIN_QUERY_LEN` tokens cannot hold a long request and
runs the decode kernel alone. Where no prefill tiling fits the GPU's shared memory, the
decode kernel serves every token (token-major: correct, prefill slower). Both kernels
read a stacked cache's layer in place.

`paged_attention_rows_pallas` (`pallas_gpu`), the first GPU kernel, is no longer
dispatched: it stays as `benchmarks/gpu_check.py`'s baseline, the kernel the H200 figures
in the README were measured on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.device.pallas_gpu import gpu_smem_limit
from jaxkv.device.pallas_gpu_decode import decode_kernel_error, paged_decode_rows_gpu
from jaxkv.device.pallas_gpu_prefill import paged_prefill_gpu, prefill_plan

PREFILL_MIN_QUERY_LEN = 8
QUERY_TILE = 64


def gpu_kernel_error(
    kv_cache: jax.Array, compute: np.dtype, kv_head, q_shape, *, quantised: bool, interpret: bool
) -> str | None:
    """Why the GPU kernels cannot serve this call, or None if they can (the decode kernel
    serves every token where the prefill kernel cannot)."""
    if quantised:
        return "a quantised cache is not supported"
    if kv_head is not None:
        return "a replicated KV head slice is not supported"
    if compute.itemsize != kv_cache.dtype.itemsize:
        return f"storage {kv_cache.dtype} does not have the width of {compute}"
    group = q_shape[-2] // (kv_cache.shape[-2] // 2)
    smem = None if interpret else gpu_smem_limit()
    return decode_kernel_error(q_shape[-1], kv_cache.shape[-3], group, compute, smem)


def _prefill_fits(head_size, block_size, group, compute, interpret) -> bool:
    try:
        smem = None if interpret else gpu_smem_limit()
        prefill_plan(head_size, block_size, group, compute, QUERY_TILE, smem)
    except ValueError:
        return False
    return True


def gpu_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    iv,
    *,
    sm_scale: float,
    soft_cap: float | None,
    compute: np.dtype,
    layer: jax.Array | None,
    interpret: bool,
) -> jax.Array:
    """`[T, Hq, D]` attention of a step (module docstring); `iv` is its `TokenIntervals`."""
    num_tokens, num_q_heads, head_size = q.shape
    group = num_q_heads // (kv_cache.shape[-2] // 2)
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, kv_dtype=compute, layer=layer)
    split = num_tokens > PREFILL_MIN_QUERY_LEN and _prefill_fits(
        head_size, kv_cache.shape[-3], group, compute, interpret
    )
    lo, hi = iv.lo, iv.hi
    if split:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        short = iv.valid & (q_lens[iv.req] <= PREFILL_MIN_QUERY_LEN)
        lo, hi = jnp.where(short, lo, 0), jnp.where(short, hi, 0)
    out = paged_decode_rows_gpu(
        q, kv_cache, block_tables[iv.req], lo, hi, interpret=interpret, **common
    )
    if split:
        out = out + paged_prefill_gpu(
            q, kv_cache, block_tables, query_start_loc, num_seqs, iv.lo, iv.hi,
            min_query_len=PREFILL_MIN_QUERY_LEN, query_tile=QUERY_TILE, interpret=interpret,
            **common,
        )  # fmt: skip
    return out
