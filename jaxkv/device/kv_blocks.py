"""The shard-local bodies of `PagedKVCache`'s programs, and the cache's TPU layout.

Each function takes one device's shard of a stacked cache `[L, blocks, bs, 2H, D]`
(`jaxkv.device.kv_cache`) and returns the updated shard; `PagedKVCache` shard-maps and
jits them with the cache donated, so every update is in place. Bits are moved as
stored (quantisation scales included). Block updates come in two forms: one scatter
per chunk of ids (in place, and the cheaper form off a TPU), or, on a TPU
(`per_block=True`), one dynamic-update-slice per block, as XLA's TPU scatter of many
blocks writes a fresh buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding

from jaxkv.device.storage import dequantize, from_storage, quantize, to_storage
from jaxkv.device.tpu_writes import write_rows_tpu

# Block transfers to and from host memory move at most this many blocks per rank per
# call, and block copies and zeroing scatter this many at a time, so a call's
# temporaries are one chunk of blocks however many ids it takes (a bucket may hold as
# many ids as the pool has blocks: one scatter would materialise a cache-sized update).
IDS_PER_CHUNK = 64


def row_major(sharding: NamedSharding, ndim: int, platform: str) -> NamedSharding | Format:
    """`sharding` with a row-major layout on a TPU (see `PagedKVCache.stacked_format`)."""
    if platform != "tpu":
        return sharding
    return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)


def tpu_tiled(rows: int, lanes: int, itemsize: int) -> tuple[int, int]:
    """`(rows, lanes)` a row-major TPU layout gives a `[rows, lanes]` slab: lanes in whole
    128s; rows in whole tiles of `8 * packing` unless they are 1, 2, 4 or 8 packed
    32-bit words, which XLA tiles exactly."""
    packing = 4 // itemsize
    lanes = -(-lanes // 128) * 128
    if rows % packing or rows // packing not in (1, 2, 4) and (rows // packing) % 8:
        rows = -(-rows // (8 * packing)) * 8 * packing
    return rows, lanes


def write_local(
    kv: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, compute, storage, kv_quant=None,
    layer: jax.Array | None = None, dma: bool | str = False,
) -> jax.Array:  # fmt: skip
    """Write the step's K/V rows into `kv`, addressed in the cache's own shape.

    Every program that touches the cache indexes it as `[(L,) blocks, block_size, 2H, D]`:
    an update written through one reshape of the buffer and read through another makes
    XLA materialise the buffer in both shapes, a copy of the whole cache per step.
    The scatter puts K and V straight into their lanes (combined heads `2h` and `2h+1`):
    no interleaved temporary of the step's K/V. `dma` (the TPU: True, or "interpret"
    for Pallas TPU interpret mode) writes whole interleaved rows by DMA instead
    (`tpu_writes`): XLA's TPU scatter of more than a few rows is not in place.
    `layer`: the layer of a stacked `[L, ...]` cache.
    """
    bs, combined = kv.shape[-3:-1]
    stack = () if layer is None else (layer,)

    def stored(x):
        return quantize(x, kv_quant) if kv_quant else to_storage(x, compute, storage)

    if dma:
        rows = jnp.stack([stored(k), stored(v)], axis=2).reshape(k.shape[0], *kv.shape[-2:])
        return write_rows_tpu(kv, rows, slots, layer, interpret=dma == "interpret")
    # The padding slot `nb * bs` lands on block `nb`: out of range, dropped.
    blocks, offsets = (slots // bs)[:, None], (slots % bs)[:, None]
    k_lanes = 2 * jnp.arange(combined // 2, dtype=slots.dtype)[None, :]
    kv = kv.at[(*stack, blocks, offsets, k_lanes)].set(stored(k), mode="drop")
    return kv.at[(*stack, blocks, offsets, k_lanes + 1)].set(stored(v), mode="drop")


def read_local(
    kv: jax.Array, slots: jax.Array, layer: jax.Array, compute, kv_quant=None
) -> tuple[jax.Array, jax.Array]:
    """`(k, v)` of layer `layer` at `slots`, in the compute dtype."""
    _, nb, bs, combined, d = kv.shape
    rows = kv.at[layer, slots // bs, slots % bs].get(mode="fill", fill_value=0)
    rows = dequantize(rows, kv_quant, compute) if kv_quant else from_storage(rows, compute)
    return rows[:, 0::2], rows[:, 1::2]


def _in_chunks(update: Callable, kv: jax.Array, ids: Sequence[jax.Array], fills: Sequence[int]):
    """`update(kv, *ids)` over `IDS_PER_CHUNK` ids at a time (padding with `fills`)."""
    n = ids[0].shape[0]
    if n <= IDS_PER_CHUNK:
        return update(kv, *ids)
    chunks = -(-n // IDS_PER_CHUNK)
    padded = [
        jnp.pad(x, (0, chunks * IDS_PER_CHUNK - n), constant_values=fill).reshape(chunks, -1)
        for x, fill in zip(ids, fills, strict=True)
    ]
    return jax.lax.fori_loop(0, chunks, lambda i, kv: update(kv, *(x[i] for x in padded)), kv)


def _each_block(update: Callable, kv: jax.Array, ids: Sequence[jax.Array]) -> jax.Array:
    """`update(kv, *(x[i] for x in ids))` for each `i` whose `ids[-1][i]` is a block id
    (`< num_blocks`; larger ids pad and are skipped), one block at a time: the TPU's
    form of a block update (`per_block=True`)."""
    num_blocks = kv.shape[1]

    def body(i, kv):
        row = tuple(x[i] for x in ids)
        return jax.lax.cond(row[-1] < num_blocks, lambda kv: update(kv, *row), lambda kv: kv, kv)

    return jax.lax.fori_loop(0, ids[0].shape[0], body, kv)


def copy_local(
    kv: jax.Array, src: jax.Array, dst: jax.Array, *, per_block: bool = False
) -> jax.Array:
    """Block `src[i]` onto `dst[i]` in every layer; sources and destinations are disjoint
    (checked on the host), so the order cannot matter. Destination `num_blocks` pads
    (dropped)."""
    if per_block:
        size = (kv.shape[0], 1, *kv.shape[2:])

        def copy_one(kv, src, dst):
            block = jax.lax.dynamic_slice(kv, (0, src, 0, 0, 0), size)
            return jax.lax.dynamic_update_slice(kv, block, (0, dst, 0, 0, 0))

        return _each_block(copy_one, kv, (src, dst))

    def copy(kv, src, dst):
        return kv.at[:, dst].set(kv[:, src], mode="drop")

    return _in_chunks(copy, kv, (src, dst), (0, kv.shape[1]))


def zero_local(kv: jax.Array, ids: jax.Array, *, per_block: bool = False) -> jax.Array:
    """Blocks `ids` zeroed in every layer; id `num_blocks` pads (dropped)."""
    if per_block:
        zeros = jnp.zeros((kv.shape[0], 1, *kv.shape[2:]), kv.dtype)

        def zero_one(kv, block):
            return jax.lax.dynamic_update_slice(kv, zeros, (0, block, 0, 0, 0))

        return _each_block(zero_one, kv, (ids,))

    def zero(kv, ids):
        return kv.at[:, ids].set(jnp.zeros((), kv.dtype), mode="drop")

    return _in_chunks(zero, kv, (ids,), (kv.shape[1],))


def gather_local(kv: jax.Array, ids: jax.Array, layers: jax.Array) -> jax.Array:
    """Layers `layers[i]` of block `ids[i]`, `[m, n, bs, 2H, D]` for `layers [n, m]`, as
    stored; a padding id `num_blocks` or layer `L` reads zeros."""
    return kv.at[layers.T, ids[None, :]].get(mode="fill", fill_value=0)


def scatter_local(
    kv: jax.Array, ids: jax.Array, layers: jax.Array, blocks: jax.Array, *, per_block=False
) -> jax.Array:
    """`blocks [m, n, bs, 2H, D]` (as stored) onto layers `layers[i]` of block `ids[i]`; a
    padding id `num_blocks` or layer `L` is dropped (ids are distinct, checked on the
    host, and so are a block's layers)."""
    if not per_block:
        return kv.at[layers.T, ids[None, :]].set(blocks, mode="drop")
    num_layers = kv.shape[0]

    def one_block(kv, i, block):
        def one_layer(j, kv):
            layer, update = layers[i, j], blocks[j, i][None, None]

            def write(kv):
                return jax.lax.dynamic_update_slice(kv, update, (layer, block, 0, 0, 0))

            return jax.lax.cond(layer < num_layers, write, lambda kv: kv, kv)

        return jax.lax.fori_loop(0, layers.shape[1], one_layer, kv)

    return _each_block(one_block, kv, (jnp.arange(ids.shape[0]), ids))
