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
