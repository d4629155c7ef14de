"""Where host values enter the device side: validation, bucket padding, placement.

Every public device entry point (`PagedKVCache`, `StepMetadataPacker`,
`EncoderCacheStore`) checks its host arguments here before anything is sent, so a
bad value raises `ValueError`/`TypeError` naming the argument, the value and
what is allowed, and changes nothing. Sizes must be real integers: `8.5`,
`"4"` and `True` are errors, never coerced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Sharding


def check_ids(
    name: str,
    ids: np.ndarray | Sequence[int],
    lo: int,
    hi: int,
    *,
    pad: int | None = None,
    ndim: int | None = 1,
    where: str = "",
) -> np.ndarray:
    """`ids` as int32 with every entry in `[lo, hi)` (or equal to `pad`).

    `ndim=None` accepts any shape. Booleans and floats are rejected even when
    their values would be in range.
    """
    arr = np.asarray(ids)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape}{where}")
    if arr.size and arr.dtype.kind not in "iu":  # signed or unsigned integers (not bool)
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}{where}")
    if not arr.size or (pad is None and arr.min() >= lo and arr.max() < hi):
        return arr.astype(np.int32)
    bad = (arr < lo) | (arr >= hi)
    if pad is not None:
        bad &= arr != pad
    if bad.any():
        flat = bad.reshape(-1)
        value = int(arr.reshape(-1)[np.argmax(flat)])
        extra = f" or the padding value {pad}" if pad is not None else ""
        raise ValueError(f"{name} value {value} is out of range [{lo}, {hi}){extra}{where}")
    return arr.astype(np.int32)


def pad_to_bucket(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`values` (1-D, or `[rows, n]` padded per row) filled with `fill` up to `size` columns.

    Padding to a few fixed sizes bounds the number of compiled programs; `fill`
    must be a positive out-of-range index where the consumer scatters with
    `mode="drop"` (a negative index wraps around in JAX, even then).
    """
    rows = np.atleast_2d(values)
    if rows.shape[1] > size:
        raise ValueError(f"{rows.shape[1]} entries do not fit a bucket of {size}")
    out = np.full((rows.shape[0], size), fill, np.int32)
    out[:, : rows.shape[1]] = rows
    return out.reshape(-1) if np.ndim(values) == 1 else out


def place(arr: np.ndarray, sharding: Sharding | None = None) -> jax.Array:
    """The one host-to-device transfer of `arr` (the same on every process).

    Multi-process: each process supplies its addressable shards from its own copy.
    """
    if sharding is None:
        return jax.device_put(arr)  # jnp.asarray would compile a copy per new shape
    if jax.process_count() == 1:
        return jax.device_put(arr, sharding)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


@functools.cache
def placer(sharding: Sharding) -> Callable[[np.ndarray], jax.Array]:
    """`place(arr, sharding)` for arrays placed again and again with `sharding` (a step's
    buffer, every step): in one process a jitted identity whose input takes `sharding`,
    since a jitted call places its numpy arguments on JAX's C++ path: on the CPU
    backend 10 us against `jax.device_put`'s ~80 us for a small buffer, 37 us for a
    256-request step's. One per sharding, so engines alike share it; it compiles once
    per shape and dtype, like the program the array feeds."""
    if jax.process_count() > 1:
        return functools.partial(place, sharding=sharding)
    return jax.jit(_identity, in_shardings=sharding, out_shardings=sharding)


def _identity(arr: jax.Array) -> jax.Array:
    return arr
