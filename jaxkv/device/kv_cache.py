"""Preallocated, sharded paged KV caches and their jitted in-place updates.

Layout of one layer's cache: `[dp * num_blocks, block_size, 2 * kv_heads, head_size]`
with K and V interleaved per head (combined head `2h` is K of head `h`, `2h+1`
its V), so any contiguous slice of heads carries its own K and V — a model-axis
shard is self-contained, and the layout is the one JAX's TPU ragged paged
attention kernel reads. The leading axis is split over the data ranks
(`KVLayout.rank_axis`: the mesh's data axis, or data x model under attention
data parallelism, the default when the model axis does not divide the KV heads):
data rank `d` owns blocks `[d * num_blocks, (d+1) * num_blocks)` and addresses
them with local ids `[0, num_blocks)`; block 0 of each rank is its null block.

All updates are jitted with the cache donated, so XLA updates the buffer in
place: the cost follows the tokens (or blocks) touched, not the cache size.
Every host input is validated before anything is sent: a bad slot, block id,
shape or dtype raises `ValueError` naming the value and the allowed range.

A quantised cache (`kv_quant="int8"` / `"fp8"`) stores 1-byte values plus a
float32 scale per token and head inline (`jaxkv.device.storage`), about half of
bf16's bytes; `bytes_per_block` counts the scales.

Serving: `warmup` compiles every program a serving loop runs, `layer_step` puts
all layers' updates and attention in the caller's one jitted forward, and
`zero_blocks_all` zeroes freed blocks in every layer with one call. Every step entry
point takes how the layer attends as one `AttentionOptions` (`jaxkv.device.attention`).

Stacked caches: `allocate_stacked(L)` holds every layer in one `[L, ...]` array, so a
model can run one layer body under `jax.lax.scan` (compile time independent of
depth): `stacked_layer_step` writes and reads layer `layer` of the stack in place,
`layer` and the sliding window being traced scalars; `zero_blocks_stacked` and
`copy_blocks_stacked` update every layer of the stack in one call;
`gather_blocks_stacked` reads blocks of every layer out (for a host-memory tier) and
`scatter_blocks_stacked` writes such blocks back, in place.

Token-indexed inputs of a data-parallel cache are rank-major: with `dp` ranks
and `T` tokens per rank, rows `[d*T, (d+1)*T)` belong to rank `d` and their
slots are local to that rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._checks import check_int
from jaxkv.device.attention import _DEFAULT_OPTIONS, AttentionOptions, ragged_paged_attention
from jaxkv.device.host_inputs import check_ids, pad_to_bucket, place
from jaxkv.device.mesh import MODEL_AXIS, KVLayout, make_mesh
from jaxkv.device.step_metadata import (
    StepMetadataPacker,
    StepShape,
    padding_buckets,
    pick_bucket,
    unpack_step,
)
from jaxkv.device.storage import (
    KV_QUANT,
    SCALE_BYTES,
    DTypeLike,
    check_kv_quant,
    dequantize,
    from_storage,
    quantize,
    resolve_dtype,
    resolve_storage_dtype,
    to_storage,
)
from jaxkv.device.tpu_writes import write_rows_tpu
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

# Specs whose layers attend to keys no `[lo, hi)` interval of one block table describes.
_UNSERVED_MASKS = {
    RSWASpec: "the prompt plus the last rswa_window generated tokens (two key intervals)",
    SinkFullAttentionSpec: "static sink tokens ahead of the request's own keys",
    CircularBufferSpec: "a per-request ring written by position modulo its size",
}


def _write_local(
    kv: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, compute, storage, kv_quant=None,
    layer: jax.Array | None = None, dma: bool | str = False,
):  # fmt: skip
    """Write the step's K/V rows into `kv`, addressed in the cache's own 4-D shape.

    Every program that touches the cache indexes it as `[blocks, block_size, 2H, D]`:
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


class _StepKey(NamedTuple):
    """A step program's cache key: the options resolved against the cache's spec
    (`sm_scale` set, the spec's masks applied; a stacked step's window is data)."""

    shape: StepShape
    num_q_heads: int
    q_dtype: np.dtype
    options: AttentionOptions
    spans: bool
    stacked: bool


# A traced sliding window this large is none: `pos - window + 1` stays below 0.
_NO_WINDOW = np.iinfo(np.int32).max // 2

# Block transfers to and from host memory move at most this many blocks per rank per
# call, and block copies and zeroing scatter this many at a time, so a call's
# temporaries are one chunk of blocks however many ids it takes (a bucket may hold as
# many ids as the pool has blocks: one scatter would materialise a cache-sized update).
_IDS_PER_CHUNK = 64


def _in_chunks(update, kv: jax.Array, ids: Sequence[jax.Array], fills: Sequence[int]):
    """`update(kv, *ids)` over `_IDS_PER_CHUNK` ids at a time (padding with `fills`)."""
    n = ids[0].shape[0]
    if n <= _IDS_PER_CHUNK:
        return update(kv, *ids)
    chunks = -(-n // _IDS_PER_CHUNK)
    padded = [
        jnp.pad(x, (0, chunks * _IDS_PER_CHUNK - n), constant_values=fill).reshape(chunks, -1)
        for x, fill in zip(ids, fills, strict=True)
    ]
    return jax.lax.fori_loop(0, chunks, lambda i, kv: update(kv, *(x[i] for x in padded)), kv)


def _row_major(sharding: NamedSharding, ndim: int, platform: str):
    """`sharding` with a row-major layout on a TPU (see `PagedKVCache.cache_format`)."""
    if platform != "tpu":
        return sharding
    return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)


def _tpu_tiled(rows: int, lanes: int, itemsize: int) -> tuple[int, int]:
    """`(rows, lanes)` a row-major TPU layout gives a `[rows, lanes]` slab: lanes in whole
    128s; rows in whole tiles of `8 * packing` unless they are 1, 2, 4 or 8 packed
    32-bit words, which XLA tiles exactly."""
    packing = 4 // itemsize
    lanes = -(-lanes // 128) * 128
    if rows % packing or rows // packing not in (1, 2, 4) and (rows // packing) % 8:
        rows = -(-rows // (8 * packing)) * 8 * packing
    return rows, lanes


def _each_block(update, kv: jax.Array, ids: Sequence[jax.Array]) -> jax.Array:
    """`update(kv, *(x[i] for x in ids))` for each `i` whose `ids[-1][i]` is a block id
    (`< num_blocks`; larger ids pad and are skipped), one block at a time.

    The TPU's form of a block update (`per_block=True` below): each is a
    dynamic-update-slice of one block, in place, where XLA's TPU scatter of many blocks
    writes a fresh buffer. Elsewhere one scatter per chunk of ids is in place and cheaper.
    """
    num_blocks = kv.shape[-4]

    def body(i, kv):
        row = tuple(x[i] for x in ids)
        return jax.lax.cond(row[-1] < num_blocks, lambda kv: update(kv, *row), lambda kv: kv, kv)

    return jax.lax.fori_loop(0, ids[0].shape[0], body, kv)


def _every_layer(kv: jax.Array) -> tuple[slice, ...]:
    """The index prefix that reaches the block axis of a cache, stacked (`[L, ...]`) or not."""
    return (slice(None),) * (kv.ndim - 4)


def _block_start(kv: jax.Array, block: jax.Array) -> tuple:
    """The start index of block `block` (in every layer of a stack)."""
    return (0,) * (kv.ndim - 4) + (block, 0, 0, 0)


def _copy_local(
    kv: jax.Array, src: jax.Array, dst: jax.Array, *, per_block: bool = False
) -> jax.Array:
    """Block `src[i]` onto `dst[i]` (in every layer of a stack); sources and destinations
    are disjoint (checked on the host), so the order cannot matter. Destination
    `num_blocks` pads (dropped). `per_block`: the TPU's form (`_each_block`)."""
    if per_block:
        size = kv.shape[:-4] + (1,) + kv.shape[-3:]

        def copy_one(kv, src, dst):
            block = jax.lax.dynamic_slice(kv, _block_start(kv, src), size)
            return jax.lax.dynamic_update_slice(kv, block, _block_start(kv, dst))

        return _each_block(copy_one, kv, (src, dst))
    layers = _every_layer(kv)

    def copy(kv, src, dst):
        return kv.at[(*layers, dst)].set(kv[(*layers, src)], mode="drop")

    return _in_chunks(copy, kv, (src, dst), (0, kv.shape[-4]))


def _zero_local(kv: jax.Array, ids: jax.Array, *, per_block: bool = False) -> jax.Array:
    if per_block:
        zeros = jnp.zeros(kv.shape[:-4] + (1,) + kv.shape[-3:], kv.dtype)

        def zero_one(kv, block):
            return jax.lax.dynamic_update_slice(kv, zeros, _block_start(kv, block))

        return _each_block(zero_one, kv, (ids,))
    layers = _every_layer(kv)

    def zero(kv, ids):
        return kv.at[(*layers, ids)].set(jnp.zeros((), kv.dtype), mode="drop")

    return _in_chunks(zero, kv, (ids,), (kv.shape[-4],))


def _gather_local(kv: jax.Array, ids: jax.Array, layers: jax.Array) -> jax.Array:
    """Layers `layers[i]` of block `ids[i]` of a stacked cache, `[m, n, bs, 2H, D]` for
    `layers [n, m]`, as stored (bits, quantisation scales); a padding id `num_blocks` or
    layer `L` reads zeros."""
    return kv.at[layers.T, ids[None, :]].get(mode="fill", fill_value=0)


def _scatter_local(
    kv: jax.Array, ids: jax.Array, layers: jax.Array, blocks: jax.Array, *, per_block=False
) -> jax.Array:
    """`blocks [m, n, bs, 2H, D]` (as stored) onto layers `layers[i]` of block `ids[i]` of
    a stacked cache; a padding id `num_blocks` or layer `L` is dropped (ids are distinct,
    checked on the host, and so are a block's layers). `per_block`: the TPU's form."""
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


def _read_local(
    kv: jax.Array, slots: jax.Array, compute, kv_quant=None
) -> tuple[jax.Array, jax.Array]:
    nb, bs, combined, d = kv.shape
    rows = kv.reshape(nb * bs, combined, d)[slots]
    rows = dequantize(rows, kv_quant, compute) if kv_quant else from_storage(rows, compute)
    return rows[:, 0::2], rows[:, 1::2]


class PagedKVCache:
    """Allocator and jitted updates for paged KV caches of one attention spec.

    Invariants: every array it allocates has `shape`, `storage_dtype` and
    `sharding`; every update keeps them (donated, in place). `num_blocks` is the
    per-data-rank block count and `padding_slot = num_blocks * block_size` the
    one out-of-range slot the scatter drops.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        num_blocks: int,
        *,
        mesh: Mesh | None = None,
        head_policy: str = "auto",
        storage_dtype: DTypeLike | None = "auto",
        kv_quant: str | None = None,
    ) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        for unserved, keys in _UNSERVED_MASKS.items():
            if isinstance(spec, unserved):
                raise ValueError(
                    f"PagedKVCache cannot serve {type(spec).__name__}: its layers attend to "
                    f"{keys}, which the device attention does not implement (host-side "
                    "block management only; docs/vllm-differences.md)"
                )
        num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}"
            )
        if num_blocks * spec.block_size >= np.iinfo(np.int32).max:
            raise ValueError(
                f"num_blocks * block_size = {num_blocks * spec.block_size} exceeds the "
                f"int32 slot range [0, {np.iinfo(np.int32).max})"
            )
        mesh = mesh if mesh is not None else make_mesh(1, 1, jax.local_devices()[:1])
        self.layout = KVLayout.plan(mesh, spec.num_kv_heads, head_policy)
        self.mesh = self.layout.mesh
        self.platform = self.mesh.devices.flat[0].platform
        self.spec = spec
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.num_blocks = num_blocks
        self.dp_size = self.layout.dp_size
        self.dtype = resolve_dtype(spec.dtype)
        self.kv_quant = check_kv_quant(kv_quant)
        if kv_quant is not None:
            if storage_dtype not in (None, "auto"):
                raise ValueError(
                    f"storage_dtype={storage_dtype!r} conflicts with kv_quant={kv_quant!r}, "
                    f"which stores {KV_QUANT[kv_quant][0]}; leave storage_dtype at 'auto'"
                )
            self.storage_dtype = KV_QUANT[kv_quant][0]
        else:
            self.storage_dtype = resolve_storage_dtype(self.dtype, storage_dtype, self.platform)
        self.padding_slot = num_blocks * spec.block_size
        self.shape = (
            self.dp_size * num_blocks,
            spec.block_size,
            2 * spec.num_kv_heads,
            spec.head_size + (SCALE_BYTES if kv_quant else 0),
        )
        self.sharding = self.layout.cache_sharding()
        self._stacked_spec = P(None, *self.layout.cache_spec)
        self.stacked_sharding = NamedSharding(self.mesh, self._stacked_spec)
        # On a TPU every program keeps the cache row-major (`cache_format`): the Mosaic
        # kernel and the DMA writes read it so, and XLA's default TPU layout for a narrow
        # row (head size 64, a quantised row's D + 4 bytes) puts another axis minor, which
        # would copy the whole cache around each kernel call.
        self.cache_format = _row_major(self.sharding, 4, self.platform)
        self.stacked_format = _row_major(self.stacked_sharding, 5, self.platform)
        self.id_buckets = padding_buckets(num_blocks)
        self.transfer_buckets = padding_buckets(min(num_blocks, _IDS_PER_CHUNK))
        # The spec's own mask: a step applies it without being told again.
        self.sliding_window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        self.attention_chunk = (
            spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None
        )
        rank = self.layout.rank_axis
        self._token_spec = P(rank, self.layout.head_axis, None)
        self._rank_spec = P(rank)
        cache_spec = self.layout.cache_spec

        def sharded(fn, in_specs, out_specs):
            return jax.shard_map(
                fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )

        # Block copies, zeroing and host-tier loads: per block on a TPU (`_each_block`).
        per_block = self.platform == "tpu"
        self._copy_blocks = functools.partial(_copy_local, per_block=per_block)
        self._zero_blocks = functools.partial(_zero_local, per_block=per_block)
        self._scatter_blocks = functools.partial(_scatter_local, per_block=per_block)
        c, s = self.dtype, self.storage_dtype
        self._write = jax.jit(
            sharded(
                functools.partial(
                    _write_local,
                    compute=c,
                    storage=s,
                    kv_quant=kv_quant,
                    dma=self.platform == "tpu",
                ),  # fmt: skip
                (cache_spec, self._token_spec, self._token_spec, self._rank_spec),
                cache_spec,
            ),
            donate_argnums=0,
            out_shardings=self.cache_format,
        )
        # Every program returns caches with this one sharding object: a cache is then
        # the same jit-cache key whichever update produced it (no recompilation).
        self._copy = jax.jit(
            sharded(self._copy_blocks, (cache_spec, self._rank_spec, self._rank_spec), cache_spec),
            donate_argnums=0,
            out_shardings=self.cache_format,
        )
        self._zero = jax.jit(
            sharded(self._zero_blocks, (cache_spec, self._rank_spec), cache_spec),
            donate_argnums=0,
            out_shardings=self.cache_format,
        )
        self._read = jax.jit(
            sharded(
                functools.partial(_read_local, compute=c, kv_quant=kv_quant),
                (cache_spec, self._rank_spec),
                (self._token_spec, self._token_spec),
            )
        )
        self._step_fns: dict[_StepKey, object] = {}
        self._layer_fns: dict[_StepKey, object] = {}
        self._alloc_fns: dict[int | tuple[int, ...], object] = {}  # layers or stack shape
        self._all_layer_fns: dict[tuple, object] = {}
        self._stacked_fns: dict[object, object] = {}

    # --------------------------------------------------------------- sizing
    @property
    def cache_bytes(self) -> int:
        """Bytes of one layer's cache across all devices (without replication)."""
        return int(np.prod(self.shape)) * self.storage_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer on each device (quantisation scales included;
        on a TPU the padding of its row-major tiles too: head size 64 takes 128 lanes).

        Capacity planning: `device_budget // (num_layers * bytes_per_block)` blocks fit.
        """
        rows, lanes = 2 * self.layout.kv_heads_per_device, self.shape[-1]
        if self.platform == "tpu":
            rows, lanes = _tpu_tiled(rows, lanes, self.storage_dtype.itemsize)
        return self.block_size * rows * lanes * self.storage_dtype.itemsize

    @property
    def bytes_per_device(self) -> int:
        """Bytes of one layer's cache on each device, replication and scales included.

        Equals `replication * cache_bytes / num_devices` (`KVLayout.device_share`):
        the unreplicated share times the replication factor, so what replication
        costs shows here. The default layout keeps `replication == 1`.
        """
        return self.num_blocks * self.bytes_per_block

    @property
    def replication(self) -> int:
        """How many devices hold each KV head of a block (1: no KV is stored twice)."""
        return self.layout.replication

    # ----------------------------------------------------------- allocation
    def allocate(self, num_layers: int = 1) -> list[jax.Array]:
        """Zeroed caches for `num_layers` layers, created on device by one jitted call."""
        num_layers = check_int("num_layers", num_layers, min_value=1)
        alloc = self._alloc_fns.get(num_layers)
        if alloc is None:
            shape, dtype = self.shape, self.storage_dtype
            alloc = self._alloc_fns[num_layers] = jax.jit(
                lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                out_shardings=tuple(self.cache_format for _ in range(num_layers)),
            )
        return list(alloc())

    def allocate_stacked(self, num_layers: int) -> jax.Array:
        """One zeroed `[num_layers, *shape]` array holding every layer's cache, created on
        device (for a model that scans its layers: `stacked_layer_step`)."""
        struct = self.stacked_struct(check_int("num_layers", num_layers, min_value=1))
        alloc = self._alloc_fns.get(struct.shape)
        if alloc is None:
            alloc = self._alloc_fns[struct.shape] = jax.jit(
                lambda: jnp.zeros(struct.shape, struct.dtype), out_shardings=self.stacked_format
            )
        return alloc()

    def stacked_struct(self, num_layers: int) -> jax.ShapeDtypeStruct:
        """A stacked cache of `num_layers` layers as an abstract value."""
        return jax.ShapeDtypeStruct(
            (num_layers, *self.shape), self.storage_dtype, sharding=self.stacked_format
        )

    # ------------------------------------------------------------ validation
    def _check_cache(self, kv: jax.Array, *, stacked: bool = False) -> None:
        layer_shape = kv.shape[1:] if stacked else kv.shape
        if (
            kv.ndim != len(self.shape) + stacked
            or layer_shape != self.shape
            or (kv.dtype != self.storage_dtype)
        ):
            want = ("[num_layers, *shape] with shape " if stacked else "shape ") + str(self.shape)
            raise ValueError(
                f"cache has shape {kv.shape} dtype {kv.dtype}; this PagedKVCache expects "
                f"{want} dtype {self.storage_dtype}"
            )

    def _check_ids(
        self, name: str, ids: np.ndarray | Sequence[int], lo: int, hi: int, pad: int | None = None
    ) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D integer array, got {arr.dtype}{arr.shape}")
        if arr.size % self.dp_size:
            raise ValueError(
                f"{name} has {arr.size} entries, not a multiple of the {self.dp_size} data ranks"
            )
        return check_ids(name, arr, lo, hi, pad=pad)

    def _check_unique(self, name: str, ids: np.ndarray, skip: int | None = None) -> None:
        """Each data rank's ids (other than `skip`) distinct: a scatter's order is undefined."""
        for rank, row in enumerate(ids.reshape(self.dp_size, -1)):
            uniq, counts = np.unique(
                row[row != skip] if skip is not None else row, return_counts=True
            )
            if (counts > 1).any():
                raise ValueError(
                    f"{name} {int(uniq[np.argmax(counts > 1)])} appears more than once "
                    f"(data rank {rank}); each destination may be written once per call"
                )

    def _check_tokens(self, name: str, x: jax.Array, num_tokens: int) -> None:
        want = (num_tokens, self.num_kv_heads, self.head_size)
        accepted = (self.dtype,) if self.kv_quant else (self.dtype, self.storage_dtype)
        if tuple(x.shape) != want or x.dtype not in accepted:
            allowed = sorted({str(d) for d in accepted})
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} dtype {x.dtype}; expected shape {want} "
                f"dtype {' or '.join(allowed)} (compute dtype, or its bits in the storage dtype)"
            )

    def put(self, arr: np.ndarray, spec: P | None = None) -> jax.Array:
        """Place a host array (the same on every process) on this cache's mesh."""
        return place(arr, NamedSharding(self.mesh, self._rank_spec if spec is None else spec))

    def _pad_ids(self, arr: np.ndarray, fill: int) -> np.ndarray:
        """Pad each rank's ids to a bucket so few programs are compiled."""
        per_rank = arr.reshape(self.dp_size, -1)
        size = pick_bucket(max(per_rank.shape[1], 1), self.id_buckets)
        return pad_to_bucket(per_rank, size, fill).reshape(-1)

    # --------------------------------------------------------------- updates
    def write_kv(
        self, kv: jax.Array, new_k: jax.Array, new_v: jax.Array, slots: np.ndarray
    ) -> jax.Array:
        """Write `new_k/new_v [dp*T, kv_heads, head_size]` at `slots [dp*T]` (donates `kv`).

        Slots are local to their data rank, outside the null block:
        `[block_size, padding_slot)`, or `padding_slot` for a padding token.
        K/V come in the compute dtype, or as its bits in the storage dtype
        (`jaxkv.device.storage.to_storage`), which spares the update a temporary
        of the step's K/V size when the storage dtype differs.
        """
        self._check_cache(kv)
        slots = self._check_ids(
            "slot", slots, self.block_size, self.padding_slot, pad=self.padding_slot
        )
        self._check_unique("slot", slots, skip=self.padding_slot)
        self._check_tokens("new_k", new_k, slots.size)
        self._check_tokens("new_v", new_v, slots.size)
        return self._write(kv, new_k, new_v, self.put(slots, self._rank_spec))

    def copy_blocks(
        self, kv: jax.Array, src: np.ndarray | Sequence[int], dst: np.ndarray | Sequence[int]
    ) -> jax.Array:
        """Copy block `src[i]` onto block `dst[i]` (sources and destinations disjoint;
        donates `kv`)."""
        self._check_cache(kv)
        padded = self._copy_ids(src, dst)
        if padded is None:
            return kv
        return self._copy(kv, *(self.put(ids, self._rank_spec) for ids in padded))

    def copy_blocks_all(
        self,
        kvs: Sequence[jax.Array],
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
        *,
        allow_padding: bool = False,
    ) -> list[jax.Array]:
        """`copy_blocks` in every layer's cache with one jitted call (donates all `kvs`):
        the page copies of a partial prefix hit's copy-on-write (`KVCacheBlockCopy`),
        run before the step that writes into the copies.

        Bits are copied as stored (bf16 kept as uint16 on CPU, quantised values with
        their scales). `allow_padding`: entries with `src` 0 and `dst` `num_blocks`
        pad a data rank with fewer copies (dropped, like the bucket padding).
        """
        kvs = list(kvs)
        for kv in kvs:
            self._check_cache(kv)
        padded = self._copy_ids(src, dst, allow_padding)
        if padded is None or not kvs:
            return kvs
        return self._all_layers(self._copy_blocks, kvs, padded)

    def _copy_ids(
        self,
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
        allow_padding: bool = False,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Checked, bucket-padded (src, dst) ids; None when there is nothing to copy."""
        src_pad, dst_pad = (0, self.num_blocks) if allow_padding else (None, None)
        src_ids = self._check_ids("src block id", src, 1, self.num_blocks, pad=src_pad)
        dst_ids = self._check_ids("dst block id", dst, 1, self.num_blocks, pad=dst_pad)
        if src_ids.shape != dst_ids.shape:
            raise ValueError(f"src has {src_ids.size} ids but dst has {dst_ids.size}")
        self._check_unique("dst block id", dst_ids, skip=dst_pad)
        for rank, (s_row, d_row) in enumerate(
            zip(src_ids.reshape(self.dp_size, -1), dst_ids.reshape(self.dp_size, -1), strict=True)
        ):
            both = np.intersect1d(s_row[d_row != dst_pad], d_row[d_row != dst_pad])
            if both.size:
                raise ValueError(
                    f"block {int(both[0])} is both a copy source and a destination (data rank "
                    f"{rank}); sources and destinations of one call must be disjoint"
                )
        if src_ids.size == 0:
            return None
        # A positive out-of-range destination pads (a negative index would wrap).
        return self._pad_ids(src_ids, 0), self._pad_ids(dst_ids, self.num_blocks)

    def zero_blocks(self, kv: jax.Array, ids: np.ndarray | Sequence[int]) -> jax.Array:
        """Zero blocks `ids` (e.g. the pool's freed blocks; donates `kv`)."""
        self._check_cache(kv)
        arr = self._check_ids("block id", ids, 0, self.num_blocks)
        if arr.size == 0:
            return kv
        return self._zero(kv, self.put(self._pad_ids(arr, self.num_blocks), self._rank_spec))

    def zero_blocks_all(
        self, kvs: Sequence[jax.Array], ids: np.ndarray | Sequence[int]
    ) -> list[jax.Array]:
        """Zero blocks `ids` in every layer's cache with one jitted call (donates all `kvs`).

        Same ids for every layer (the pool's freed blocks); one dispatch and one id
        transfer per step instead of one per layer.
        """
        kvs = list(kvs)
        for kv in kvs:
            self._check_cache(kv)
        arr = self._check_ids("block id", ids, 0, self.num_blocks)
        if arr.size == 0 or not kvs:
            return kvs
        return self._all_layers(self._zero_blocks, kvs, (self._pad_ids(arr, self.num_blocks),))

    def zero_blocks_stacked(self, kv: jax.Array, ids: np.ndarray | Sequence[int]) -> jax.Array:
        """`zero_blocks` in every layer of a stacked cache, one jitted call (donates `kv`)."""
        self._check_cache(kv, stacked=True)
        arr = self._check_ids("block id", ids, 0, self.num_blocks)
        if arr.size == 0:
            return kv
        ids = self.put(self._pad_ids(arr, self.num_blocks), self._rank_spec)
        return self._stacked_fn(self._zero_blocks, 1)(kv, ids)

    def copy_blocks_stacked(
        self,
        kv: jax.Array,
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
        *,
        allow_padding: bool = False,
    ) -> jax.Array:
        """`copy_blocks_all`'s copies in every layer of a stacked cache, one jitted call
        (donates `kv`; same ids, checks and padding)."""
        self._check_cache(kv, stacked=True)
        padded = self._copy_ids(src, dst, allow_padding)
        if padded is None:
            return kv
        src_ids, dst_ids = (self.put(ids, self._rank_spec) for ids in padded)
        return self._stacked_fn(self._copy_blocks, 2)(kv, src_ids, dst_ids)

    def gather_blocks_stacked(
        self, kv: jax.Array, ids: np.ndarray | Sequence[int], layers: np.ndarray | None = None
    ) -> jax.Array:
        """Blocks `ids` (rank-major, local ids, `[1, num_blocks)`, or `num_blocks`: padding,
        read as zeros) of a stacked cache, the layers `layers[i]` of block `ids[i]`
        (`[n, m]`, each in `[0, L]`, `L`: padding, read as zeros; None: every layer), read
        by one jitted program per id bucket and `m`: `[m, dp * size, *shape[1:]]` as
        stored, rank `d`'s blocks at `[d * size, d * size + n)` (`size`: the bucket; the
        rest pads with zeros). Not donated, not waited for: the caller copies the result
        to host memory (`copy_to_host_async`, then `np.asarray`) while the device goes
        on, and the blocks read are those of the cache at this call, whatever later
        programs write."""
        self._check_cache(kv, stacked=True)
        arr = self._check_ids("block id", ids, 1, self.num_blocks, pad=self.num_blocks)
        padded = self._pad_transfer_ids(arr)
        table = self._layer_table(layers, arr.size, kv.shape[0], padded.size)
        return self._transfer_fn("gather")(
            kv, self.put(padded, self._rank_spec), self.put(table, self._rank_spec)
        )

    def scatter_blocks_stacked(
        self,
        kv: jax.Array,
        ids: np.ndarray | Sequence[int],
        blocks: np.ndarray,
        layers: np.ndarray | None = None,
    ) -> jax.Array:
        """Write host `blocks [m, dp * n, *shape[1:]]` (as stored, rank-major like
        `gather_blocks_stacked`'s result without its padding) onto layers `layers[i]` of
        blocks `ids[i]` (ids distinct per rank, `[1, num_blocks)`, or `num_blocks`:
        padding, its block dropped; `layers` as for `gather_blocks_stacked`, None: every
        layer) of a stacked cache: one donated, in-place program per id bucket and `m`
        (donates `kv`). Bad ids or layers, or a block array of the wrong shape or dtype
        raise `ValueError` before anything is sent."""
        self._check_cache(kv, stacked=True)
        arr = self._check_ids("block id", ids, 1, self.num_blocks, pad=self.num_blocks)
        padded_ids = self._pad_transfer_ids(arr)
        table = self._layer_table(layers, arr.size, kv.shape[0], padded_ids.size)
        want = (table.shape[1], arr.size, *self.shape[1:])
        if tuple(np.shape(blocks)) != want or np.asarray(blocks).dtype != self.storage_dtype:
            raise ValueError(
                f"blocks has shape {tuple(np.shape(blocks))} dtype {np.asarray(blocks).dtype}; "
                f"expected shape {want} dtype {self.storage_dtype} (one block per id, as stored)"
            )
        if arr.size == 0:
            return kv
        size = padded_ids.size // self.dp_size
        per_rank = np.asarray(blocks).reshape(want[0], self.dp_size, -1, *want[2:])
        padded = np.zeros((want[0], self.dp_size, size, *want[2:]), self.storage_dtype)
        padded[:, :, : per_rank.shape[2]] = per_rank
        placed = self.put(padded.reshape(want[0], -1, *want[2:]), self._stacked_spec)
        return self._transfer_fn("scatter")(
            kv, self.put(padded_ids, self._rank_spec), self.put(table, self._rank_spec), placed
        )

    def warmup_transfers(self, kv: jax.Array, layers_per_block: int | None = None) -> jax.Array:
        """Compile `gather_blocks_stacked` and `scatter_blocks_stacked` for every transfer
        bucket, `layers_per_block` layers a block (None: every layer), run on padding ids
        only (no block changes). Donates and returns `kv`."""
        self._check_cache(kv, stacked=True)
        m = kv.shape[0] if layers_per_block is None else layers_per_block
        for size in self.transfer_buckets:
            n = self.dp_size * size
            ids = self.put(np.full(n, self.num_blocks, np.int32), self._rank_spec)
            table = self.put(np.full((n, m), kv.shape[0], np.int32), self._rank_spec)
            blocks = np.zeros((m, n, *self.shape[1:]), self.storage_dtype)
            self._transfer_fn("gather")(kv, ids, table)
            kv = self._transfer_fn("scatter")(kv, ids, table, self.put(blocks, self._stacked_spec))
        return kv

    def _layer_table(
        self, layers: np.ndarray | None, num_ids: int, num_layers: int, padded_size: int
    ) -> np.ndarray:
        """The checked layers of each transferred block, `[padded_size, m]` int32 (rank-
        major as the padded ids; the padding rows, and padding entries given, `num_layers`)."""
        if layers is None:
            table = np.broadcast_to(np.arange(num_layers, dtype=np.int32), (num_ids, num_layers))
        else:
            table = np.asarray(layers)
            if (
                table.ndim != 2
                or table.shape[0] != num_ids
                or table.dtype.kind not in "iu"
                or (table.size and (table.min() < 0 or table.max() > num_layers))
            ):
                raise ValueError(
                    f"layers must be [{num_ids}, m] ints in [0, {num_layers}] (one row of layer "
                    f"indices per block id; {num_layers}: padding), got shape {table.shape} "
                    f"dtype {table.dtype}"
                )
        per_rank = table.reshape(self.dp_size, -1, table.shape[1])
        out = np.full(
            (self.dp_size, padded_size // self.dp_size, table.shape[1]), num_layers, np.int32
        )
        out[:, : per_rank.shape[1]] = per_rank
        return out.reshape(padded_size, -1)

    def _pad_transfer_ids(self, arr: np.ndarray) -> np.ndarray:
        """Checked transfer ids (distinct per rank, at most `transfer_buckets[-1]` per
        rank) padded to their bucket with `num_blocks` (a negative pad would wrap)."""
        self._check_unique("block id", arr, skip=self.num_blocks)
        per_rank = arr.size // self.dp_size
        if per_rank > self.transfer_buckets[-1]:
            raise ValueError(
                f"{per_rank} block ids per data rank; a transfer moves at most "
                f"{self.transfer_buckets[-1]} (split the batch)"
            )
        size = pick_bucket(max(per_rank, 1), self.transfer_buckets)
        return pad_to_bucket(arr.reshape(self.dp_size, -1), size, self.num_blocks).reshape(-1)

    def _transfer_fn(self, op: str):
        """The jitted block gather (`op="gather"`) or donated scatter (`"scatter"`)."""
        fn = self._stacked_fns.get(op)
        if fn is None:
            spec, rank = self._stacked_spec, self._rank_spec
            if op == "gather":
                local = jax.shard_map(
                    _gather_local, mesh=self.mesh, in_specs=(spec, rank, rank), out_specs=spec,
                    check_vma=False,
                )  # fmt: skip
                fn = jax.jit(local, out_shardings=self.stacked_sharding)
            else:
                local = jax.shard_map(
                    self._scatter_blocks, mesh=self.mesh, in_specs=(spec, rank, rank, spec),
                    out_specs=spec, check_vma=False,
                )  # fmt: skip
                fn = jax.jit(local, donate_argnums=0, out_shardings=self.stacked_format)
            self._stacked_fns[op] = fn
        return fn

    def _stacked_fn(self, local_fn, num_id_args: int):
        fn = self._stacked_fns.get(local_fn)
        if fn is None:
            spec = self._stacked_spec
            local = jax.shard_map(
                local_fn, mesh=self.mesh, in_specs=(spec,) + (self._rank_spec,) * num_id_args,
                out_specs=spec, check_vma=False,
            )  # fmt: skip
            fn = self._stacked_fns[local_fn] = jax.jit(
                local, donate_argnums=0, out_shardings=self.stacked_format
            )
        return fn

    def lower_blocks_stacked(
        self,
        op: str,
        num_layers: int,
        num_ids: int | None = None,
        layers_per_block: int | None = None,
    ) -> jax.stages.Lowered:
        """The lowered `zero_blocks_stacked` (`op="zero"`), `copy_blocks_stacked`
        (`op="copy"`), `gather_blocks_stacked` (`op="gather"`) or `scatter_blocks_stacked`
        (`op="scatter"`) program, for the id bucket holding `num_ids` ids per data rank
        (default: the largest bucket; `transfer_buckets` for the last two), the last two
        moving `layers_per_block` layers a block (None: every layer)."""
        buckets = self.transfer_buckets if op in ("gather", "scatter") else self.id_buckets
        size = pick_bucket(num_ids or buckets[-1], buckets)
        ids = jax.ShapeDtypeStruct(
            (self.dp_size * size,), np.int32, sharding=NamedSharding(self.mesh, self._rank_spec)
        )
        if op in ("gather", "scatter"):
            m = num_layers if layers_per_block is None else layers_per_block
            table = jax.ShapeDtypeStruct(
                (self.dp_size * size, m), np.int32,
                sharding=NamedSharding(self.mesh, self._rank_spec),
            )  # fmt: skip
            blocks = jax.ShapeDtypeStruct(
                (m, self.dp_size * size, *self.shape[1:]), self.storage_dtype,
                sharding=self.stacked_sharding,
            )  # fmt: skip
            args = (ids, table) if op == "gather" else (ids, table, blocks)
            return self._transfer_fn(op).lower(self.stacked_struct(num_layers), *args)
        local_fn, num_id_args = {"zero": (self._zero_blocks, 1), "copy": (self._copy_blocks, 2)}[op]
        fn = self._stacked_fn(local_fn, num_id_args)
        return fn.lower(self.stacked_struct(num_layers), *(ids,) * num_id_args)

    def _all_layers(
        self, local_fn, kvs: list[jax.Array], padded_ids: Sequence[np.ndarray]
    ) -> list[jax.Array]:
        """`local_fn(kv, *ids)` on every layer's cache in one jitted, donating call."""
        fn = self._all_layers_fn(local_fn, len(kvs), len(padded_ids))
        return list(fn(tuple(kvs), *(self.put(ids, self._rank_spec) for ids in padded_ids)))

    def _all_layers_fn(self, local_fn, num_layers: int, num_id_args: int):
        key = (local_fn, num_layers)
        fn = self._all_layer_fns.get(key)
        if fn is None:
            spec = self.layout.cache_spec
            per_layer = jax.shard_map(
                local_fn, mesh=self.mesh, in_specs=(spec,) + (self._rank_spec,) * num_id_args,
                out_specs=spec, check_vma=False,
            )  # fmt: skip
            fn = self._all_layer_fns[key] = jax.jit(
                lambda kvs, *ids: tuple(per_layer(kv, *ids) for kv in kvs),
                donate_argnums=0,
                out_shardings=(self.cache_format,) * num_layers,
            )
        return fn

    def cache_struct(self) -> jax.ShapeDtypeStruct:
        """One layer's cache as an abstract value (shape, storage dtype, sharding)."""
        return jax.ShapeDtypeStruct(self.shape, self.storage_dtype, sharding=self.cache_format)

    def lower_blocks_all(
        self, op: str, num_layers: int, num_ids: int | None = None
    ) -> jax.stages.Lowered:
        """The lowered `zero_blocks_all` (`op="zero"`) or `copy_blocks_all` (`op="copy"`)
        program over `num_layers` caches, for the id bucket holding `num_ids` ids per data
        rank (default: the largest bucket)."""
        local_fn, num_id_args = {"zero": (self._zero_blocks, 1), "copy": (self._copy_blocks, 2)}[op]
        size = pick_bucket(num_ids or self.id_buckets[-1], self.id_buckets)
        ids = jax.ShapeDtypeStruct(
            (self.dp_size * size,), np.int32, sharding=NamedSharding(self.mesh, self._rank_spec)
        )
        fn = self._all_layers_fn(local_fn, num_layers, num_id_args)
        return fn.lower((self.cache_struct(),) * num_layers, *(ids,) * num_id_args)

    def warmup(
        self,
        kvs: Sequence[jax.Array],
        packer: StepMetadataPacker,
        *,
        num_q_heads: int,
        q_dtype: DTypeLike | None = None,
        options: AttentionOptions = _DEFAULT_OPTIONS,
    ) -> list[jax.Array]:
        """Compile, before serving, every program a serving loop over `kvs` can run.

        `step` for each of `packer.all_shapes()` (with `options`, as serving will
        pass them) and `zero_blocks_all` for every id bucket. Each runs once on an
        all-padding input, which changes no cache entry. Donates and returns `kvs`.
        """
        kvs = list(kvs)
        if not kvs:
            raise ValueError("warmup needs at least one layer's cache")
        q_dtype = self.dtype if q_dtype is None else resolve_dtype(q_dtype)
        num_q_heads = check_int("num_q_heads", num_q_heads, min_value=1)
        for shape in packer.all_shapes():
            tokens = self.dp_size * shape.num_tokens
            q = jnp.zeros((tokens, num_q_heads, self.head_size), q_dtype)
            k = jnp.zeros((tokens, self.num_kv_heads, self.head_size), self.dtype)
            buf = packer.put(
                packer.empty(shape, self.dp_size), NamedSharding(self.mesh, self._rank_spec)
            )
            kvs[0], _ = self.step(kvs[0], q, k, k, buf, shape, options)
        for size in self.id_buckets:
            ids = np.full(self.dp_size * size, self.num_blocks, np.int32)
            kvs = self._all_layers(self._zero_blocks, kvs, (ids,))
        return kvs

    def lower_write_kv(
        self, num_tokens: int, token_dtype: DTypeLike | None = None
    ) -> jax.stages.Lowered:
        """The lowered `write_kv` program for `num_tokens` tokens per data rank.

        `token_dtype` is the K/V input dtype (default: the compute dtype; the
        storage dtype lowers the path that takes stored bits).
        `.compile().memory_analysis()` shows the donation at work: the cache is
        aliased to the output and the temporaries follow the tokens written.
        """
        tokens = jax.ShapeDtypeStruct(
            (self.dp_size * num_tokens, self.num_kv_heads, self.head_size),
            self.dtype if token_dtype is None else resolve_dtype(token_dtype),
            sharding=NamedSharding(self.mesh, self._token_spec),
        )
        return self._write.lower(
            self.cache_struct(),
            tokens,
            tokens,
            jax.ShapeDtypeStruct(
                (self.dp_size * num_tokens,),
                np.int32,
                sharding=NamedSharding(self.mesh, self._rank_spec),
            ),
        )

    def read_kv(self, kv: jax.Array, slots: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Gather `(k, v)` at `slots` (rank-major, local ids) in the compute dtype."""
        self._check_cache(kv)
        slots = self._check_ids("slot", slots, 0, self.padding_slot)
        return self._read(kv, self.put(slots, self._rank_spec))

    # ------------------------------------------------------------ the step
    def step(
        self,
        kv: jax.Array,
        q: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        metadata: jax.Array,
        shape: StepShape,
        options: AttentionOptions = _DEFAULT_OPTIONS,
        *,
        span_ends: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """One layer's step (one jitted call): write this step's K/V, then ragged paged attention.

        `metadata` is the packed `[dp, shape.length]` buffer already on device
        (`StepMetadataPacker.pack` + `put`, one transfer); `q [dp*T, Hq, D]`,
        `new_k/new_v [dp*T, kv_heads, D]` with `T = shape.num_tokens`. Donates
        `kv`; returns the updated cache and the attention output `[dp*T, Hq, D]`.

        Masks: a cache built from a `SlidingWindowSpec` / `ChunkedLocalAttentionSpec`
        applies its window / chunk by itself (`options` naming a different value is a
        `ValueError`); `span_ends [dp*T]` int32 (rank-major, positions local to
        each request) makes bidirectional spans (`jaxkv.device.attention`).
        """
        key, extra = self._step_key(kv, q, new_k, new_v, metadata, shape, options, span_ends)
        fn = self._step_fns.get(key)
        if fn is None:
            q_sharding = NamedSharding(self.mesh, self._q_spec(key.num_q_heads))
            fn = self._step_fns[key] = jax.jit(
                self._layer_fn(key), donate_argnums=0, out_shardings=(self.cache_format, q_sharding)
            )
        # Inputs committed to the specs the program expects: however the caller placed
        # them, one program per key (a differently placed input would compile another).
        q = self._on_mesh(q, self._q_spec(q.shape[1]))
        new_k, new_v = (self._on_mesh(x, self._token_spec) for x in (new_k, new_v))
        metadata = self._on_mesh(metadata, self._rank_spec)
        extra = tuple(self._on_mesh(x, self._rank_spec) for x in extra)
        return fn(kv, q, new_k, new_v, metadata, *extra)

    def _q_spec(self, num_q_heads: int) -> P:
        return P(self.layout.rank_axis, self.layout.q_head_axis(num_q_heads), None)

    def _on_mesh(self, x: jax.Array, spec: P) -> jax.Array:
        if isinstance(x, jax.core.Tracer):  # `step` called inside the caller's jit
            return x
        want = NamedSharding(self.mesh, spec)
        if isinstance(x, jax.Array) and x.committed and x.sharding == want:
            return x
        return jax.device_put(x, want)

    def layer_step(
        self,
        kv: jax.Array,
        q: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        metadata: jax.Array,
        shape: StepShape,
        options: AttentionOptions = _DEFAULT_OPTIONS,
        *,
        span_ends: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`step` without its own jit: call it inside your jitted forward, once per layer.

        The whole model (every layer's cache update and attention) then compiles to
        one program, dispatched once per step; donate the caches to that program
        (`donate_argnums`) so the updates stay in place. Same arguments, checks
        and result as `step`.
        """
        key, extra = self._step_key(kv, q, new_k, new_v, metadata, shape, options, span_ends)
        return self._cached_layer_fn(key)(kv, q, new_k, new_v, metadata, *extra)

    def stacked_layer_step(
        self,
        kv: jax.Array,
        layer: jax.Array | int,
        q: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        metadata: jax.Array,
        shape: StepShape,
        options: AttentionOptions = _DEFAULT_OPTIONS,
        *,
        window: jax.Array | int | None = None,
        span_ends: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`layer_step` on layer `layer` of a stacked cache (`allocate_stacked`), inside
        the caller's jit; returns the updated stack and the attention output.

        `layer` and `window` (the layer's sliding window) are int32 scalars and may be
        traced (the index of a `jax.lax.scan` over the layers and that layer's window),
        so one layer body serves layers of every window; None is no window. The window
        is data here, so `options.sliding_window` must be None, and the spec's own
        window is not applied: the caller passes each layer's.
        """
        if options.sliding_window is not None:
            raise ValueError(
                f"a stacked step takes each layer's window as `window` (data, may be traced); "
                f"options.sliding_window must be None, got {options.sliding_window}"
            )
        key, extra = self._step_key(
            kv, q, new_k, new_v, metadata, shape, options, span_ends, stacked=True
        )
        fn = self._cached_layer_fn(key)
        window = _NO_WINDOW if window is None else window
        layer, window = (jnp.asarray(x, jnp.int32) for x in (layer, window))
        return fn(kv, q, new_k, new_v, metadata, layer, window, *extra)

    def _step_key(
        self,
        kv: jax.Array,
        q: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        metadata: jax.Array,
        shape: StepShape,
        options: AttentionOptions,
        span_ends: jax.Array | None,
        *,
        stacked: bool = False,
    ) -> tuple[_StepKey, tuple]:
        """Validate a step's inputs; the program's cache key (the options resolved against
        this cache's spec) and its extra arguments (`(span_ends,)` with spans, else ())."""
        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        self._check_cache(kv, stacked=stacked)
        tokens = self.dp_size * shape.num_tokens
        self._check_tokens("new_k", new_k, tokens)
        self._check_tokens("new_v", new_v, tokens)
        if q.ndim != 3 or q.shape[0] != tokens or q.shape[2] != self.head_size:
            raise ValueError(
                f"q has shape {tuple(q.shape)}; expected [{tokens}, num_q_heads, {self.head_size}]"
            )
        if metadata.shape != (self.dp_size, shape.length) or metadata.dtype != jnp.int32:
            raise ValueError(
                f"metadata has shape {metadata.shape} dtype {metadata.dtype}; expected "
                f"({self.dp_size}, {shape.length}) int32"
            )
        if span_ends is not None and (span_ends.shape != (tokens,) or span_ends.dtype != jnp.int32):
            raise ValueError(
                f"span_ends has shape {span_ends.shape} dtype {span_ends.dtype}; expected "
                f"({tokens},) int32"
            )
        window = self._spec_mask("sliding_window", self.sliding_window, options.sliding_window)
        resolved = dataclasses.replace(
            options,
            sm_scale=self.head_size**-0.5 if options.sm_scale is None else options.sm_scale,
            sliding_window=None if stacked else window,
            attention_chunk=self._spec_mask(
                "attention_chunk", self.attention_chunk, options.attention_chunk
            ),
        )
        spans = span_ends is not None
        key = _StepKey(shape, q.shape[1], q.dtype, resolved, spans, stacked)
        return key, ((span_ends,) if spans else ())

    def _spec_mask(self, name: str, from_spec: int | None, given: int | None) -> int | None:
        """The mask the step applies: the spec's, or `given` on a cache without one."""
        if given is None or given == from_spec:
            return from_spec
        if from_spec is not None:
            raise ValueError(
                f"{name}={given!r} conflicts with this cache's spec {type(self.spec).__name__} "
                f"({name}={from_spec}); allowed: None or {from_spec}"
            )
        return given

    def _cached_layer_fn(self, key: _StepKey):
        fn = self._layer_fns.get(key)
        if fn is None:
            fn = self._layer_fns[key] = self._layer_fn(key)
        return fn

    def _dma_writes(self, options: AttentionOptions) -> bool | str:
        """How a step writes its rows: by DMA on a TPU (or in TPU interpret mode, with the
        TPU kernel's interpret impl), else by scatter (`_write_local`)."""
        if options.impl == "pallas_tpu_interpret":
            return "interpret"
        return self.platform == "tpu"

    def _layer_fn(self, key: _StepKey):
        """The shard-mapped (not jitted) write-then-attend function for a `_step_key`."""
        shape, num_q_heads, options, stacked = key.shape, key.num_q_heads, key.options, key.stacked
        q_axis = self.layout.q_head_axis(num_q_heads)
        replicated_kv_split_q = q_axis is not None and not self.layout.heads_sharded
        group = num_q_heads // self.num_kv_heads
        per_rank = num_q_heads // self.layout.model_size

        def local(kv, q, k, v, buf, *extra):
            # extra: (layer, window) of a stacked cache, then (span_ends,) with spans.
            layer, window = extra[:2] if stacked else (None, None)
            md = unpack_step(buf[0], shape)
            kv = _write_local(
                kv, k, v, md.slot_mapping, self.dtype, self.storage_dtype, self.kv_quant, layer,
                dma=self._dma_writes(options),
            )  # fmt: skip
            kv_head = None
            if replicated_kv_split_q:
                kv_head = jax.lax.axis_index(MODEL_AXIS) * per_rank // group
            out = ragged_paged_attention(
                q, kv, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs, options,
                window=window, span_ends=extra[-1] if key.spans else None, kv_dtype=self.dtype,
                platform=self.platform, kv_head=kv_head, kv_quant=self.kv_quant, layer=layer,
            )  # fmt: skip
            return kv, out

        cache_spec = self._stacked_spec if stacked else self.layout.cache_spec
        q_spec = self._q_spec(num_q_heads)
        extra_specs = ((P(), P()) if stacked else ()) + ((self._rank_spec,) if key.spans else ())
        fn = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(cache_spec, q_spec, self._token_spec, self._token_spec, self._rank_spec)
            + extra_specs,
            out_specs=(cache_spec, q_spec),
            check_vma=False,
        )
        return fn
