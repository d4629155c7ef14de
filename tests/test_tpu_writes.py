"""`jaxkv.device.tpu_writes`: the TPU's DMA row writes, in Pallas TPU interpret mode, equal
the scatter every other backend runs (`kv_blocks.write_local`), padding slots skipped."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.device.kv_blocks import write_local as _write_local
from jaxkv.device.tpu_writes import write_rows_tpu


@pytest.mark.parametrize("stacked", [False, True])
def test_dma_rows_equal_the_scatter_and_skip_padding(stacked) -> None:
    rng = np.random.default_rng()
    num_blocks, bs, heads, d, tokens = 6, 4, 2, 8, 7
    shape = ((3,) if stacked else ()) + (num_blocks, bs, 2 * heads, d)
    kv = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((tokens, heads, d)), jnp.float32) for _ in "kv")
    slots = rng.choice(num_blocks * bs, tokens, replace=False)
    slots[[2, 5]] = num_blocks * bs  # padding: dropped by the scatter, skipped by the DMAs
    slots = jnp.asarray(slots, jnp.int32)
    layer = jnp.int32(1) if stacked else None
    args = (kv, k, v, slots, jnp.float32, jnp.float32, None, layer)
    want = np.asarray(_write_local(*args))
    got = np.asarray(_write_local(*args, dma="interpret"))
    np.testing.assert_array_equal(got, want)
    untouched = np.asarray(kv)
    assert (got != untouched).any()  # the rows landed


def test_rows_must_be_whole_cache_rows() -> None:
    kv = jnp.zeros((4, 4, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"must be \[T, 4, 8\] float32"):
        write_rows_tpu(kv, jnp.zeros((3, 2, 8), jnp.float32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="a stacked cache needs `layer`"):
        write_rows_tpu(kv[None], jnp.zeros((3, 4, 8), jnp.float32), jnp.zeros(3, jnp.int32))
