"""Ragged paged attention over a `[num_blocks, block_size, 2 * kv_heads, head_size]` cache.

One call serves a mixed batch: prefill chunks and decode tokens of many
requests, concatenated along the token axis (`query_start_loc` delimits them,
vLLM style). Request `r` has `seq_lens[r]` tokens of context after this step, of
which its last `q_len = query_start_loc[r+1] - query_start_loc[r]` are the
queries, so query `i` of `r` sits at position `seq_lens[r] - q_len + i` and sees
keys at positions `<=` its own (causal), and `> pos - sliding_window` when a
window is set. Logits are scaled, then soft-capped (`cap * tanh(s / cap)`).

The pure-JAX reference runs on every backend. Dispatch (`impl="auto"`):

| function                 | TPU                         | GPU (cuda/rocm)            | CPU       |
|--------------------------|-----------------------------|----------------------------|-----------|
| `ragged_paged_attention` | JAX's Pallas ragged kernel  | reference                  | reference |
| `paged_decode_attention` | JAX's Pallas ragged kernel  | `pallas_gpu` Triton kernel | reference |

Where the kernel does not apply (TPU: a cache stored in another dtype; GPU: block
shapes outside `pallas_gpu`'s constraints) `"auto"` falls back to the reference.
`impl="reference"` always runs the reference. `impl="pallas"` forces the table's
kernel and raises `ValueError` where the table has none, except that
`paged_decode_attention(..., interpret=True)` runs the GPU kernel in Pallas
interpret mode on any backend (for tests). The TPU ragged kernel reads this cache
layout directly; so does the GPU decode kernel (`jaxkv.device.pallas_gpu`), which
is untested on GPU hardware in this repo (interpret mode and CUDA cross-lowering only).

NaN safety: padded query rows, the null block and free pages may hold anything
(including NaN). Masked logits are replaced with `jnp.where` and the values of
masked keys are zeroed with `jnp.where` before `p @ v` (a zero probability times
a NaN value is still NaN); rows with no visible key return 0.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.device.attention_checks import check_attention_args
from jaxkv.device.pallas_gpu import (
    PAGES_PER_COMPUTE_BLOCK,
    block_shape_error,
    paged_decode_attention_pallas,
)
from jaxkv.device.storage import DTypeLike, from_storage, resolve_dtype

_MASKED = -1e30
AttentionImpl = Literal["auto", "reference", "pallas"]


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    impl: AttentionImpl = "auto",
    platform: str | None = None,
    query_chunk: int = 64,
    kv_head: jax.Array | None = None,
) -> jax.Array:
    """Attention of `q [T, Hq, D]` over the paged cache; returns `[T, Hq, D]` in q's dtype.

    `block_tables [R, W]`, `seq_lens [R]`, `query_start_loc [R+1]` and the scalar
    `num_seqs` describe the requests (rows at or beyond `num_seqs` are padding).
    `kv_dtype` is the compute dtype when the cache stores its bits in another
    dtype. `kv_head`, when given, makes every query head attend to that single
    KV head (a query-head slice of a replicated cache); otherwise query heads
    are grouped over the cache's KV heads (GQA).
    """
    num_tokens = q.shape[0]
    check_attention_args(q.shape, kv_cache.shape, sliding_window, soft_cap, kv_head is None)
    compute = resolve_dtype(kv_cache.dtype if kv_dtype is None else kv_dtype)
    platform = platform or jax.default_backend()
    use_pallas = impl == "pallas" or (
        impl == "auto" and platform == "tpu" and kv_head is None and kv_cache.dtype == compute
    )
    if use_pallas:
        if platform != "tpu" or kv_head is not None or kv_cache.dtype != compute:
            raise ValueError(
                f"impl='pallas' needs a TPU and a cache stored in its compute dtype with "
                f"grouped heads; got platform={platform!r}, storage {kv_cache.dtype}, "
                f"compute {compute}"
            )
        out = _pallas_tpu(
            q, kv_cache, block_tables, seq_lens, query_start_loc, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )  # fmt: skip
        valid = jnp.arange(num_tokens) < query_start_loc[num_seqs]
        return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    return _reference(
        q, kv_cache, block_tables, seq_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        compute=compute, query_chunk=min(query_chunk, num_tokens), kv_head=kv_head,
    )  # fmt: skip


def paged_decode_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_dtype: DTypeLike | None = None,
    impl: AttentionImpl = "auto",
    platform: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode-only attention: query `r` of `q [R, Hq, D]` is request `r`'s newest token.

    Same semantics as `ragged_paged_attention` with `query_start_loc = arange(R + 1)`:
    the query sits at position `seq_lens[r] - 1`; rows at or beyond `num_seqs` return
    0. Returns `[R, Hq, D]` in q's dtype. Dispatch follows the module docstring's
    table; `interpret=True` (only with `impl="pallas"`) runs the GPU kernel in
    Pallas interpret mode on any platform.
    """
    if impl not in ("auto", "reference", "pallas"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'pallas', got {impl!r}")
    if interpret and impl != "pallas":
        raise ValueError(f"interpret=True needs impl='pallas', got impl={impl!r}")
    num_reqs = q.shape[0]
    platform = platform or jax.default_backend()
    if impl == "pallas" and platform not in ("gpu", "tpu") and not interpret:
        raise ValueError(
            f"impl='pallas' needs a GPU (Triton kernel) or a TPU (ragged kernel); got "
            f"platform={platform!r}. Pass interpret=True to run the GPU kernel in Pallas "
            f"interpret mode, or use impl='auto'/'reference'"
        )
    fits = block_shape_error(q.shape[-1], kv_cache.shape[1], PAGES_PER_COMPUTE_BLOCK) is None
    if interpret or (platform == "gpu" and (impl == "pallas" or (impl == "auto" and fits))):
        live = jnp.arange(num_reqs) < num_seqs
        return paged_decode_attention_pallas(
            q, kv_cache, block_tables, jnp.where(live, seq_lens, 0),
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            kv_dtype=kv_dtype, interpret=interpret,
        )  # fmt: skip
    return ragged_paged_attention(
        q, kv_cache, block_tables, seq_lens, jnp.arange(num_reqs + 1, dtype=jnp.int32),
        num_seqs, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        kv_dtype=kv_dtype, impl=impl, platform=platform,
    )  # fmt: skip


def _pallas_tpu(q, kv_cache, block_tables, seq_lens, query_start_loc, num_seqs, **kw):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention as tpu_rpa,
    )

    return tpu_rpa(
        q, kv_cache, seq_lens, block_tables, query_start_loc,
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32), **kw,
    )  # fmt: skip


def _reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    compute: np.dtype,
    query_chunk: int,
    kv_head: jax.Array | None,
) -> jax.Array:
    num_tokens, num_q_heads, head_size = q.shape
    num_reqs, width = block_tables.shape
    num_blocks, block_size, combined, _ = kv_cache.shape
    context = width * block_size
    cache5 = kv_cache.reshape(num_blocks, block_size, combined // 2, 2, head_size)
    num_valid = query_start_loc[num_seqs]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    key_pos = jnp.arange(context, dtype=jnp.int32)
    acc = jnp.promote_types(compute, jnp.float32)
    hp = jax.lax.Precision.HIGHEST

    def chunk(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        qc, tok = args  # [c, Hq, D], [c]
        c = tok.shape[0]
        req = jnp.minimum(
            jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32),
            num_reqs - 1,
        )
        q_pos = seq_lens[req] - q_lens[req] + (tok - query_start_loc[req])
        tables = block_tables[req]  # [c, W]
        # Gather K and V directly (no strided slice of a gathered copy), heads before keys.
        if kv_head is None:
            keys, values = (cache5[tables, :, :, i, :] for i in (0, 1))  # [c, W, bs, H, D]
        else:
            keys, values = (cache5[tables, :, kv_head, i, :][:, :, :, None] for i in (0, 1))
        heads = keys.shape[3]
        keys, values = (
            from_storage(x, compute).reshape(c, context, heads, head_size).transpose(0, 2, 1, 3)
            for x in (keys, values)
        )  # [c, H, C, D]
        visible = (
            (tok < num_valid)[:, None]
            & (key_pos[None, :] <= q_pos[:, None])
            & (key_pos[None, :] < seq_lens[req][:, None])
        )
        if sliding_window is not None:
            visible &= key_pos[None, :] > (q_pos - sliding_window)[:, None]
        qg = qc.reshape(c, heads, num_q_heads // heads, head_size).astype(acc)
        logits = jnp.einsum("chgd,chkd->chgk", qg, keys.astype(acc), precision=hp) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        mask = visible[:, None, None, :]
        logits = jnp.where(mask, logits, _MASKED)
        probs = jnp.where(mask, jnp.exp(logits - logits.max(axis=-1, keepdims=True)), 0.0)
        denom = probs.sum(axis=-1, keepdims=True)
        values = jnp.where(visible[:, None, :, None], values.astype(acc), 0.0)
        out = jnp.einsum("chgk,chkd->chgd", probs, values, precision=hp)
        out = out / jnp.where(denom > 0, denom, 1.0)
        return out.reshape(c, num_q_heads, head_size).astype(q.dtype)

    padded = -(-num_tokens // query_chunk) * query_chunk
    tok = jnp.arange(padded, dtype=jnp.int32)
    qp = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    out = jax.lax.map(
        chunk,
        (
            qp.reshape(-1, query_chunk, num_q_heads, head_size),
            tok.reshape(-1, query_chunk),
        ),
    )
    return out.reshape(padded, num_q_heads, head_size)[:num_tokens]
