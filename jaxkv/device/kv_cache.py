"""Preallocated, sharded paged KV caches and the jitted, in-place programs over them.

A cache holds every layer of a KV-cache group in one stacked array
`[L, dp * num_blocks, block_size, 2 * kv_heads, head_size]` (`allocate_stacked`), so
a model runs one layer body under `jax.lax.scan` (compile time independent of depth).
Within a layer, K and V are interleaved per head (combined head `2h` is K of head `h`,
`2h+1` its V), so any contiguous slice of heads carries its own K and V — a model-axis
shard is self-contained, and the layout is the one JAX's TPU ragged paged attention
kernel reads. The block axis is split over the data ranks (`KVLayout.rank_axis`: the
mesh's data axis, or data x model under attention data parallelism, the default when
the model axis does not divide the KV heads): data rank `d` owns blocks
`[d * num_blocks, (d+1) * num_blocks)` and addresses them with local ids
`[0, num_blocks)`; block 0 of each rank is its null block.

What the engine runs (`jaxkv.engine`): `stacked_layer_step` writes a step's K/V into
layer `layer` of the stack and attends over it inside the model's one jitted forward
(`layer` and the sliding window being traced scalars); `zero_blocks_stacked` and
`copy_blocks_stacked` zero freed blocks and run copy-on-write page copies in every
layer with one call; `gather_blocks_stacked` reads blocks out for a host-memory tier
and `scatter_blocks_stacked` writes them back; `warmup_transfers` and
`lower_blocks_stacked` compile and lower those. Every step entry point takes how the
layer attends as one `AttentionOptions` (`jaxkv.device.attention`). Outside a model's
jit, `step` runs one layer's step as its own program, `write_kv` / `read_kv` write and
read one layer's rows, and `warmup` compiles a serving loop's programs. Every program
lives in one cache (`_programs`), keyed by what it does and its static arguments.

All updates are jitted with the cache donated, so XLA updates the buffer in
place: the cost follows the tokens (or blocks) touched, not the cache size; the
shard-local bodies are `jaxkv.device.kv_blocks`. Every host input is validated before
anything is sent: a bad slot, block id, layer, shape or dtype raises `ValueError`
naming the value and the allowed range.

A quantised cache (`kv_quant="int8"` / `"fp8"`) stores 1-byte values plus a
float32 scale per token and head inline (`jaxkv.device.storage`), about half of
bf16's bytes; `bytes_per_block` counts the scales.

Token-indexed inputs of a data-parallel cache are rank-major: with `dp` ranks
and `T` tokens per rank, rows `[d*T, (d+1)*T)` belong to rank `d` and their
slots are local to that rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._checks import check_int
from jaxkv.device.attention import _DEFAULT_OPTIONS, AttentionOptions, ragged_paged_attention
from jaxkv.device.block_ids import RankIds
from jaxkv.device.host_inputs import place
from jaxkv.device.kv_blocks import (
    IDS_PER_CHUNK,
    copy_local,
    gather_local,
    read_local,
    row_major,
    scatter_local,
    write_local,
    zero_local,
)
from jaxkv.device.mesh import MODEL_AXIS
from jaxkv.device.page_geometry import page_geometry
from jaxkv.device.step_metadata import (
    StepMetadataPacker,
    StepShape,
    padding_buckets,
    pick_bucket,
    unpack_step,
)
from jaxkv.device.storage import (
    DTypeLike,
    check_kv_quant,
    resolve_dtype,
)
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
)

# A traced sliding window this large is none: `pos - window + 1` stays below 0.
_NO_WINDOW = np.iinfo(np.int32).max // 2


class _StepKey(NamedTuple):
    """A step program's cache key: the options resolved against the cache's spec
    (`sm_scale` set, the chunk applied; the window is data, `sliding_window` None);
    `jitted`: `step`'s own program, else `stacked_layer_step`'s body."""

    shape: StepShape
    num_q_heads: int
    q_dtype: np.dtype
    options: AttentionOptions
    spans: bool
    jitted: bool


def _check_num_blocks(spec: AttentionSpec, num_blocks: int) -> int:
    """`num_blocks`, checked: at least 2, and every slot an int32."""
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
    return num_blocks


class PagedKVCache:
    """Allocator and jitted updates for stacked paged KV caches of one attention spec.

    Invariants: every array it allocates has shape `[L, *shape]`, `storage_dtype` and
    `stacked_sharding`; every update keeps them (donated, in place). `num_blocks` is the
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
        self.geometry = page_geometry(
            spec, mesh, head_policy=head_policy, storage_dtype=storage_dtype, kv_quant=kv_quant
        )
        num_blocks = _check_num_blocks(spec, num_blocks)
        self.layout = self.geometry.layout
        self.mesh = self.layout.mesh
        self.platform = self.geometry.platform
        self.spec = spec
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.num_blocks = num_blocks
        self.dp_size = self.layout.dp_size
        self.dtype = resolve_dtype(spec.dtype)
        self.kv_quant = check_kv_quant(kv_quant)
        self.storage_dtype = self.geometry.storage_dtype
        self.padding_slot = num_blocks * spec.block_size
        # One layer's shape; a cache is `[L, *shape]`.
        self.shape = (self.dp_size * num_blocks, *self.geometry.page_shape)
        self._stacked_spec = P(None, *self.layout.cache_spec)
        self.stacked_sharding = NamedSharding(self.mesh, self._stacked_spec)
        # On a TPU every program keeps the cache row-major (`stacked_format`): the Mosaic
        # kernel and the DMA writes read it so, and XLA's default TPU layout for a narrow
        # row (head size 64, a quantised row's D + 4 bytes) puts another axis minor, which
        # would copy the whole cache around each kernel call. Every program returns caches
        # with this one format object: a cache is then the same jit-cache key whichever
        # update produced it (no recompilation).
        self.stacked_format = row_major(self.stacked_sharding, 5, self.platform)
        self.id_buckets = padding_buckets(num_blocks)
        self.transfer_buckets = padding_buckets(min(num_blocks, IDS_PER_CHUNK))
        self.ids = RankIds(self.dp_size, num_blocks, self.id_buckets, self.transfer_buckets)
        # The spec's own mask: a step applies it without being told again.
        self.sliding_window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        self.attention_chunk = (
            spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None
        )
        self._token_spec = P(self.layout.rank_axis, self.layout.head_axis, None)
        self._rank_spec = P(self.layout.rank_axis)
        # Every program this cache runs, keyed by `_StepKey` or `(op, *static args)`.
        self._programs: dict[Hashable, Callable] = {}

    # --------------------------------------------------------------- sizing
    @property
    def cache_bytes(self) -> int:
        """Bytes of one layer's cache across all devices (without replication)."""
        return int(np.prod(self.shape)) * self.storage_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer on each device (`PageGeometry.bytes_per_block`).

        Capacity planning: `device_budget // (num_layers * bytes_per_block)` blocks fit.
        """
        return self.geometry.bytes_per_block

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

    # ----------------------------------------------------------- programs
    def _program(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """The program cached under `key`, built by `build()` the first time."""
        fn = self._programs.get(key)
        if fn is None:
            fn = self._programs[key] = build()
        return fn

    def _sharded(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _update(self, fn: Callable, in_specs: tuple) -> Callable:
        """`fn(kv, *args)` shard-mapped and jitted with the stacked cache donated."""
        spec = self._stacked_spec
        return jax.jit(
            self._sharded(fn, (spec, *in_specs), spec),
            donate_argnums=0,
            out_shardings=self.stacked_format,
        )

    def _blocks_fn(self, op: str) -> Callable:
        """The jitted block program `op`: "zero" (ids), "copy" (src, dst), "gather"
        (ids, layers; not donated) or "scatter" (ids, layers, blocks). Per block on a
        TPU (`jaxkv.device.kv_blocks`)."""

        def build():
            rank, per_block = self._rank_spec, self.platform == "tpu"
            if op == "gather":
                spec = self._stacked_spec
                fn = self._sharded(gather_local, (spec, rank, rank), spec)
                return jax.jit(fn, out_shardings=self.stacked_sharding)
            local, in_specs = {
                "zero": (zero_local, (rank,)),
                "copy": (copy_local, (rank, rank)),
                "scatter": (scatter_local, (rank, rank, self._stacked_spec)),
            }[op]
            return self._update(functools.partial(local, per_block=per_block), in_specs)

        return self._program(op, build)

    # ----------------------------------------------------------- allocation
    def allocate_stacked(self, num_layers: int) -> jax.Array:
        """One zeroed `[num_layers, *shape]` array holding every layer's cache, created on
        device by one jitted call."""
        struct = self.stacked_struct(check_int("num_layers", num_layers, min_value=1))
        alloc = self._program(
            ("allocate", struct.shape),
            lambda: jax.jit(
                lambda: jnp.zeros(struct.shape, struct.dtype), out_shardings=self.stacked_format
            ),
        )
        return alloc()

    def stacked_struct(self, num_layers: int) -> jax.ShapeDtypeStruct:
        """A stacked cache of `num_layers` layers as an abstract value."""
        return jax.ShapeDtypeStruct(
            (num_layers, *self.shape), self.storage_dtype, sharding=self.stacked_format
        )

    # ------------------------------------------------------------ validation
    def _check_cache(self, kv: jax.Array, layer: jax.Array | int | None = None) -> None:
        """`kv` a stacked cache of this one; `layer`, when a Python or NumPy int, one of
        its layers (a traced or device scalar is the caller's to keep in range)."""
        if (
            kv.ndim != len(self.shape) + 1
            or kv.shape[1:] != self.shape
            or (kv.dtype != self.storage_dtype)
        ):
            raise ValueError(
                f"cache has shape {kv.shape} dtype {kv.dtype}; this PagedKVCache expects "
                f"[num_layers, *shape] with shape {self.shape} dtype {self.storage_dtype}"
            )
        if isinstance(layer, (int, np.integer)):
            check_int("layer", layer, min_value=0, max_value=kv.shape[0] - 1)

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

    # ---------------------------------------------------------- token rows
    def _write_fn(self) -> Callable:
        """The jitted, donating `write_kv` program (K/V rows by DMA on a TPU)."""

        def local(kv, k, v, slots, layer):
            return write_local(
                kv, k, v, slots, self.dtype, self.storage_dtype, self.kv_quant, layer,
                dma=self.platform == "tpu",
            )  # fmt: skip

        in_specs = (self._token_spec, self._token_spec, self._rank_spec, P())
        return self._program("write", lambda: self._update(local, in_specs))

    def write_kv(
        self,
        kv: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        slots: np.ndarray,
        layer: jax.Array | int = 0,
    ) -> jax.Array:
        """Write `new_k/new_v [dp*T, kv_heads, head_size]` at `slots [dp*T]` of layer
        `layer` (donates `kv`; the write a step runs, without the attention).

        Slots are local to their data rank, outside the null block:
        `[block_size, padding_slot)`, or `padding_slot` for a padding token.
        K/V come in the compute dtype, or as its bits in the storage dtype
        (`jaxkv.device.storage.to_storage`), which spares the update a temporary
        of the step's K/V size when the storage dtype differs.
        """
        self._check_cache(kv, layer)
        slots = self.ids.check(
            "slot", slots, self.block_size, self.padding_slot, pad=self.padding_slot
        )
        self.ids.distinct("slot", slots, skip=self.padding_slot)
        self._check_tokens("new_k", new_k, slots.size)
        self._check_tokens("new_v", new_v, slots.size)
        return self._write_fn()(kv, new_k, new_v, self.put(slots), jnp.int32(layer))

    def lower_write_kv(
        self, num_tokens: int, token_dtype: DTypeLike | None = None, num_layers: int = 1
    ) -> jax.stages.Lowered:
        """The lowered `write_kv` program for `num_tokens` tokens per data rank into a
        cache of `num_layers` layers.

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
        slots = jax.ShapeDtypeStruct(
            (self.dp_size * num_tokens,),
            np.int32,
            sharding=NamedSharding(self.mesh, self._rank_spec),
        )
        layer = jax.ShapeDtypeStruct((), np.int32)
        return self._write_fn().lower(self.stacked_struct(num_layers), tokens, tokens, slots, layer)

    def read_kv(
        self, kv: jax.Array, slots: np.ndarray, layer: jax.Array | int = 0
    ) -> tuple[jax.Array, jax.Array]:
        """Gather `(k, v)` of layer `layer` at `slots` (rank-major, local ids) in the
        compute dtype."""
        self._check_cache(kv, layer)
        slots = self.ids.check("slot", slots, 0, self.padding_slot)
        read = self._program(
            "read",
            lambda: jax.jit(
                self._sharded(
                    functools.partial(read_local, compute=self.dtype, kv_quant=self.kv_quant),
                    (self._stacked_spec, self._rank_spec, P()),
                    (self._token_spec, self._token_spec),
                )
            ),
        )
        return read(kv, self.put(slots), jnp.int32(layer))

    # --------------------------------------------------------------- blocks
    def zero_blocks_stacked(self, kv: jax.Array, ids: np.ndarray | Sequence[int]) -> jax.Array:
        """Zero blocks `ids` (e.g. the pool's freed blocks) in every layer, one jitted
        call (donates `kv`)."""
        self._check_cache(kv)
        arr = self.ids.check("block id", ids, 0, self.num_blocks)
        if arr.size == 0:
            return kv
        return self._blocks_fn("zero")(kv, self.put(self.ids.pad(arr, self.num_blocks)))

    def copy_blocks_stacked(
        self,
        kv: jax.Array,
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
        *,
        allow_padding: bool = False,
    ) -> jax.Array:
        """Copy block `src[i]` onto block `dst[i]` in every layer, one jitted call
        (donates `kv`): the page copies of a partial prefix hit's copy-on-write
        (`KVCacheBlockCopy`), run before the step that writes into the copies.

        Sources and destinations must be disjoint. Bits are copied as stored (bf16 kept
        as uint16 on CPU, quantised values with their scales). `allow_padding`: entries
        with `src` 0 and `dst` `num_blocks` pad a data rank with fewer copies (dropped,
        like the bucket padding).
        """
        self._check_cache(kv)
        padded = self.ids.copies(src, dst, allow_padding)
        if padded is None:
            return kv
        return self._blocks_fn("copy")(kv, *(self.put(ids) for ids in padded))

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
        self._check_cache(kv)
        arr = self.ids.check("block id", ids, 1, self.num_blocks, pad=self.num_blocks)
        padded = self.ids.transfer(arr)
        table = self.ids.layer_table(layers, arr.size, kv.shape[0], padded.size)
        return self._blocks_fn("gather")(kv, self.put(padded), self.put(table))

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
        self._check_cache(kv)
        arr = self.ids.check("block id", ids, 1, self.num_blocks, pad=self.num_blocks)
        padded_ids = self.ids.transfer(arr)
        table = self.ids.layer_table(layers, arr.size, kv.shape[0], padded_ids.size)
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
        return self._blocks_fn("scatter")(kv, self.put(padded_ids), self.put(table), placed)

    def warmup_transfers(self, kv: jax.Array, layers_per_block: int | None = None) -> jax.Array:
        """Compile `gather_blocks_stacked` and `scatter_blocks_stacked` for every transfer
        bucket, `layers_per_block` layers a block (None: every layer), run on padding ids
        only (no block changes). Donates and returns `kv`."""
        self._check_cache(kv)
        m = kv.shape[0] if layers_per_block is None else layers_per_block
        for size in self.transfer_buckets:
            n = self.dp_size * size
            ids = self.put(np.full(n, self.num_blocks, np.int32))
            table = self.put(np.full((n, m), kv.shape[0], np.int32))
            blocks = np.zeros((m, n, *self.shape[1:]), self.storage_dtype)
            self._blocks_fn("gather")(kv, ids, table)
            kv = self._blocks_fn("scatter")(kv, ids, table, self.put(blocks, self._stacked_spec))
        return kv

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
        by_rank = NamedSharding(self.mesh, self._rank_spec)
        ids = jax.ShapeDtypeStruct((self.dp_size * size,), np.int32, sharding=by_rank)
        m = num_layers if layers_per_block is None else layers_per_block
        table = jax.ShapeDtypeStruct((self.dp_size * size, m), np.int32, sharding=by_rank)
        blocks = jax.ShapeDtypeStruct(
            (m, self.dp_size * size, *self.shape[1:]), self.storage_dtype,
            sharding=self.stacked_sharding,
        )  # fmt: skip
        args = {"zero": (ids,), "copy": (ids, ids), "gather": (ids, table)}.get(
            op, (ids, table, blocks)
        )
        return self._blocks_fn(op).lower(self.stacked_struct(num_layers), *args)

    # ------------------------------------------------------------ the step
    def warmup(
        self,
        kv: jax.Array,
        packer: StepMetadataPacker,
        *,
        num_q_heads: int,
        q_dtype: DTypeLike | None = None,
        options: AttentionOptions = _DEFAULT_OPTIONS,
    ) -> jax.Array:
        """Compile, before serving, every program a serving loop of `step` and
        `zero_blocks_stacked` over the stacked cache `kv` can run.

        `step` for each of `packer.all_shapes()` (with `options`, as serving will
        pass them) and `zero_blocks_stacked` for every id bucket. Each runs once on an
        all-padding input, which changes no cache entry. Donates and returns `kv`.
        """
        self._check_cache(kv)
        q_dtype = self.dtype if q_dtype is None else resolve_dtype(q_dtype)
        num_q_heads = check_int("num_q_heads", num_q_heads, min_value=1)
        for shape in packer.all_shapes():
            tokens = self.dp_size * shape.num_tokens
            q = jnp.zeros((tokens, num_q_heads, self.head_size), q_dtype)
            k = jnp.zeros((tokens, self.num_kv_heads, self.head_size), self.dtype)
            buf = packer.put(
                packer.empty(shape, self.dp_size), NamedSharding(self.mesh, self._rank_spec)
            )
            kv, _ = self.step(kv, q, k, k, buf, shape, options)
        for size in self.id_buckets:
            ids = np.full(self.dp_size * size, self.num_blocks, np.int32)
            kv = self._blocks_fn("zero")(kv, self.put(ids))
        return kv

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
        layer: jax.Array | int = 0,
        window: jax.Array | int | None = None,
        span_ends: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`stacked_layer_step` as its own jitted program (donates `kv`): one layer's step
        outside a model's jit; returns the updated stack and the attention output."""
        key, args = self._step_args(
            kv, layer, q, new_k, new_v, metadata, shape, options, window, span_ends, jitted=True
        )

        def build():
            q_sharding = NamedSharding(self.mesh, self._q_spec(key.num_q_heads))
            return jax.jit(
                self._layer_fn(key), donate_argnums=0,
                out_shardings=(self.stacked_format, q_sharding),
            )  # fmt: skip

        # Inputs committed to the specs the program expects: however the caller placed
        # them, one program per key (a differently placed input would compile another).
        q, new_k, new_v, metadata, layer, window, *spans = args
        q = self._on_mesh(q, self._q_spec(key.num_q_heads))
        new_k, new_v = (self._on_mesh(x, self._token_spec) for x in (new_k, new_v))
        metadata, *spans = (self._on_mesh(x, self._rank_spec) for x in (metadata, *spans))
        fn = self._program(key, build)
        return fn(kv, q, new_k, new_v, metadata, layer, window, *spans)

    def _q_spec(self, num_q_heads: int) -> P:
        return P(self.layout.rank_axis, self.layout.q_head_axis(num_q_heads), None)

    def _on_mesh(self, x: jax.Array, spec: P) -> jax.Array:
        if isinstance(x, jax.core.Tracer):  # `step` called inside the caller's jit
            return x
        want = NamedSharding(self.mesh, spec)
        if isinstance(x, jax.Array) and x.committed and x.sharding == want:
            return x
        return jax.device_put(x, want)

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
        """One layer's step inside the caller's jitted forward: write this step's K/V into
        layer `layer` of the stacked cache `kv`, then ragged paged attention over it;
        returns the updated stack and the attention output `[dp*T, Hq, D]`.

        The whole model (every layer's cache update and attention) then compiles to one
        program, dispatched once per step; donate the cache to that program
        (`donate_argnums`) so the updates stay in place. `metadata` is the packed
        `[dp, shape.length]` buffer already on device (`StepMetadataPacker.pack` + `put`,
        one transfer); `q [dp*T, Hq, D]`, `new_k/new_v [dp*T, kv_heads, D]` with
        `T = shape.num_tokens`.

        `layer` and `window` (the layer's sliding window) are int32 scalars and may be
        traced (the index of a `jax.lax.scan` over the layers and that layer's window),
        so one layer body serves layers of every window. `window` None: the spec's (a
        `SlidingWindowSpec`'s) or `options.sliding_window`; giving both is a
        `ValueError`. A `ChunkedLocalAttentionSpec` applies its chunk by itself
        (`options` naming a different value is a `ValueError`); `span_ends [dp*T]` int32
        (rank-major, positions local to each request) makes bidirectional spans
        (`jaxkv.device.attention`).
        """
        key, args = self._step_args(
            kv, layer, q, new_k, new_v, metadata, shape, options, window, span_ends, jitted=False
        )
        return self._program(key, lambda: self._layer_fn(key))(kv, *args)

    def _step_args(
        self,
        kv: jax.Array,
        layer: jax.Array | int,
        q: jax.Array,
        new_k: jax.Array,
        new_v: jax.Array,
        metadata: jax.Array,
        shape: StepShape,
        options: AttentionOptions,
        window: jax.Array | int | None,
        span_ends: jax.Array | None,
        *,
        jitted: bool,
    ) -> tuple[_StepKey, tuple]:
        """Validate a step's inputs; the program's cache key (the options resolved against
        this cache's spec) and its arguments after the cache: `(q, new_k, new_v, metadata,
        layer, window)`, then `span_ends` with spans."""
        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        self._check_cache(kv, layer)
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
        if window is not None and options.sliding_window is not None:
            raise ValueError(
                f"window (data) and options.sliding_window={options.sliding_window} both "
                "given; pass one"
            )
        if window is None:
            window = self._spec_mask("sliding_window", self.sliding_window, options.sliding_window)
        resolved = dataclasses.replace(
            options,
            sm_scale=self.head_size**-0.5 if options.sm_scale is None else options.sm_scale,
            sliding_window=None,
            attention_chunk=self._spec_mask(
                "attention_chunk", self.attention_chunk, options.attention_chunk
            ),
        )
        key = _StepKey(shape, q.shape[1], q.dtype, resolved, span_ends is not None, jitted)
        layer, window = (
            jnp.asarray(x, jnp.int32) for x in (layer, _NO_WINDOW if window is None else window)
        )
        spans = () if span_ends is None else (span_ends,)
        return key, (q, new_k, new_v, metadata, layer, window, *spans)

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

    def _dma_writes(self, options: AttentionOptions) -> bool | str:
        """How a step writes its rows: by DMA on a TPU (or in TPU interpret mode, with the
        TPU kernel's interpret impl), else by scatter (`kv_blocks.write_local`)."""
        if options.impl == "pallas_tpu_interpret":
            return "interpret"
        return self.platform == "tpu"

    def _layer_fn(self, key: _StepKey) -> Callable:
        """The shard-mapped (not jitted) write-then-attend function for a `_StepKey`."""
        shape, num_q_heads, options = key.shape, key.num_q_heads, key.options
        q_axis = self.layout.q_head_axis(num_q_heads)
        replicated_kv_split_q = q_axis is not None and not self.layout.heads_sharded
        group = num_q_heads // self.num_kv_heads
        per_rank = num_q_heads // self.layout.model_size

        def local(kv, q, k, v, buf, layer, window, *spans):
            md = unpack_step(buf[0], shape)
            kv = write_local(
                kv, k, v, md.slot_mapping, self.dtype, self.storage_dtype, self.kv_quant, layer,
                dma=self._dma_writes(options),
            )  # fmt: skip
            kv_head = None
            if replicated_kv_split_q:
                kv_head = jax.lax.axis_index(MODEL_AXIS) * per_rank // group
            out = ragged_paged_attention(
                q, kv, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs, options,
                window=window, span_ends=spans[0] if spans else None, kv_dtype=self.dtype,
                platform=self.platform, kv_head=kv_head, kv_quant=self.kv_quant, layer=layer,
            )  # fmt: skip
            return kv, out

        spec, q_spec, rank = self._stacked_spec, self._q_spec(num_q_heads), self._rank_spec
        in_specs = (spec, q_spec, self._token_spec, self._token_spec, rank, P(), P())
        return self._sharded(local, in_specs + ((rank,) if key.spans else ()), (spec, q_spec))
