"""Storage dtypes: keep cache bits in a dtype the backend scatters cheaply.

On XLA's CPU backend a bfloat16 scatter into a donated buffer copies the whole
buffer, while a uint16 scatter is in place; storing the bf16 bits as uint16 and
bitcasting at the edges keeps updates proportional to the tokens written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = str | np.dtype | type


def resolve_dtype(dtype: DTypeLike) -> np.dtype:
    """`"bfloat16"`, `"bf16"`, `jnp.float32`, ... as a numpy dtype."""
    if isinstance(dtype, str) and dtype == "bf16":
        dtype = "bfloat16"
    return np.dtype(jnp.dtype(dtype))


def resolve_storage_dtype(compute: np.dtype, storage: DTypeLike | None, platform: str) -> np.dtype:
    """`None`/"auto": uint16 for bfloat16 on CPU, else the compute dtype.

    An explicit storage dtype must have the compute dtype's width (the bits are
    reinterpreted, never converted).
    """
    if storage is None or (isinstance(storage, str) and storage == "auto"):
        if compute == jnp.bfloat16 and platform == "cpu":
            return np.dtype(np.uint16)
        return compute
    resolved = resolve_dtype(storage)
    if resolved.itemsize != compute.itemsize:
        raise ValueError(
            f"storage dtype {resolved} ({resolved.itemsize} bytes) must have the width of "
            f"the compute dtype {compute} ({compute.itemsize} bytes)"
        )
    return resolved


def to_storage(x: jax.Array, compute: np.dtype, storage: np.dtype) -> jax.Array:
    """`x` as storage bits; already-stored bits pass through untouched.

    A producer that emits its K/V as storage bits (this bitcast at the end of its
    own jitted computation, where it fuses into the output) spares the cache
    update a temporary copy of the step's K/V: XLA's CPU scatter does not fuse the
    bitcast into its updates.
    """
    if x.dtype == storage:
        return x
    x = x.astype(compute)
    return x if storage == compute else jax.lax.bitcast_convert_type(x, storage)


def from_storage(x: jax.Array, compute: np.dtype) -> jax.Array:
    return x if x.dtype == compute else jax.lax.bitcast_convert_type(x, compute)


# Quantised KV: per (token, head) symmetric scale, stored inline after the head's values.
#
# A quantised cache keeps `[blocks, bs, 2 * H, D + SCALE_BYTES]` 1-byte lanes: the
# first `D` bytes of each K or V head row are the quantised values, the last four
# the float32 scale's bits, so one array (one donated buffer, one scatter per
# update, the same K/V interleaving and sharding) carries values and scales. The
# scale is `max|x| / qmax` over the row's `D` values (`qmax` 127 for int8, 448 for
# fp8 e4m3), so each row uses the format's full range; an all-zero row has scale 0.
# Per element: int8 rounds to the nearest step, |error| <= scale / 2; fp8 e4m3
# keeps 3 mantissa bits, |error| <= |x| / 16 + scale * 2**-9 (subnormals).
SCALE_BYTES = 4
KV_QUANT = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(np.uint8), 448.0)}


def check_kv_quant(kv_quant: str | None) -> str | None:
    if kv_quant is not None and kv_quant not in KV_QUANT:
        raise ValueError(f"kv_quant must be None or one of {sorted(KV_QUANT)}, got {kv_quant!r}")
    return kv_quant


def quantize(x: jax.Array, kv_quant: str) -> jax.Array:
    """`x [..., D]` (any float dtype) as `[..., D + SCALE_BYTES]` stored bytes."""
    storage, qmax = KV_QUANT[kv_quant]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    if kv_quant == "int8":
        values = jnp.clip(jnp.round(x / safe), -qmax, qmax).astype(jnp.int8)
    else:
        e4m3 = jnp.clip(x / safe, -qmax, qmax).astype(jnp.float8_e4m3fn)
        values = jax.lax.bitcast_convert_type(e4m3, jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], storage)  # [..., 4]
    return jnp.concatenate([values, scale_bytes], axis=-1)


def dequantize(stored: jax.Array, kv_quant: str, dtype=jnp.float32) -> jax.Array:
    """`[..., D + SCALE_BYTES]` stored bytes back to `[..., D]` values in `dtype`.

    The scale is reassembled from its four bytes with integer shifts (little-endian,
    the byte order `quantize`'s bitcast writes on every XLA backend) rather than a
    width-changing bitcast, which Pallas TPU (Mosaic) cannot lower: the Pallas TPU
    kernel dequantises with this same function.
    """
    values, scale_bytes = stored[..., :-SCALE_BYTES], stored[..., -SCALE_BYTES:]
    b = scale_bytes.astype(jnp.int32) & 0xFF
    bits = b[..., 0:1] | (b[..., 1:2] << 8) | (b[..., 2:3] << 16) | (b[..., 3:4] << 24)
    scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    if kv_quant == "int8":
        values = values.astype(jnp.float32)
    else:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn).astype(jnp.float32)
    return (values * scale).astype(dtype)
