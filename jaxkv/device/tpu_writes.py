"""Writes of a step's K/V rows into the paged cache on TPU, by DMA, in place.

XLA's TPU scatter keeps a donated cache in place only for a handful of updates: a
prefill step's few hundred token rows make it write into a fresh cache-sized buffer
(the compiled program holds the whole cache twice). `write_rows_tpu` instead copies
each token's `[2H, D]` row straight into its slot with one DMA, inside a Pallas call
whose cache input is aliased to its output: the compiled program updates the donated
buffer itself, whatever the number of rows.

Every DMA moves whole tiles: a row `[2H, D]` is the cache's two minor (tiled) axes in
full, and the slot picks a block, an offset and (stacked) a layer, all untiled axes.
Rows whose slot is `>= num_blocks * block_size` (padding) are skipped. Slots are
distinct within a step (the host allocates them), so the DMAs' order cannot matter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _write_rows_kernel(slots_ref, layer_ref, rows_hbm, kv_in, kv_out, sem) -> None:
    """DMA row `t` of `rows_hbm` to slot `slots_ref[t]` of `kv_out` (`kv_in`'s buffer)."""
    del kv_in  # aliased to kv_out
    num_blocks, block_size = kv_out.shape[-4], kv_out.shape[-3]
    stack = (layer_ref[0],) if kv_out.ndim == 5 else ()

    def dma(t):
        slot = slots_ref[t]  # non-negative: lax.div/rem (jnp's floor division lowers through
        # `sign`, whose Mosaic rule asks the TPU generation, unknown to a compile-only host)
        block, offset = jax.lax.div(slot, block_size), jax.lax.rem(slot, block_size)
        dst = kv_out.at[(*stack, block, offset)]
        return pltpu.make_async_copy(rows_hbm.at[t], dst, sem)

    def each_row(wait: bool):
        def body(t, carry):
            @pl.when(slots_ref[t] < num_blocks * block_size)
            def _():
                if wait:
                    dma(t).wait()
                else:
                    dma(t).start()

            return carry

        jax.lax.fori_loop(0, slots_ref.shape[0], body, 0)

    each_row(wait=False)  # all in flight at once
    each_row(wait=True)


def write_rows_tpu(
    kv: jax.Array,
    rows: jax.Array,
    slots: jax.Array,
    layer: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """`kv` with row `rows[t]` (`[T, 2H, D]`, as stored) at slot `slots[t]`; in place.

    `kv` is `[num_blocks, block_size, 2H, D]`, or a stacked `[L, ...]` cache whose layer
    `layer` (an int32 scalar, may be traced) is written. `interpret=True` runs the DMAs
    in Pallas TPU interpret mode (any backend).
    """
    if rows.shape[1:] != kv.shape[-2:] or rows.dtype != kv.dtype:
        raise ValueError(
            f"rows {rows.shape} {rows.dtype} must be [T, {kv.shape[-2]}, {kv.shape[-1]}] "
            f"{kv.dtype}: whole cache rows as stored"
        )
    if (kv.ndim == 5) != (layer is not None):
        raise ValueError(f"kv {kv.shape}: a stacked cache needs `layer`, a 4-D one must not")
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _write_rows_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(),
            in_specs=[anywhere, anywhere],
            out_specs=anywhere,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(kv.shape, kv.dtype),
        input_output_aliases={3: 0},  # operands: slots, layer, rows, kv
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxkv_write_rows_tpu",
    )(slots.astype(jnp.int32), layer_arr, rows, kv)
