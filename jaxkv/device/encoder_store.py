"""Device store for encoder outputs (SPEC §8, last item).

A `[num_pages, page_size, hidden]` array holds the embeddings of every multimodal
item the host `EncoderCacheManager` keeps cached. `EncoderCacheStore` holds its
layout and compiled programs; the array itself is the caller's (`allocate()`), and
goes into every update and comes out, donated, as `PagedKVCache` caches do. Which
pages hold which item is decided on the host (`jaxkv.encoder_pages.EncoderPageAllocator`):
the store makes no allocation decisions.

All updates are jitted and donate the array they update, so their cost grows with
the rows written, never with the store. Index arrays are padded to power-of-two
lengths; padding indices are positive and out of range, so the scatter
(`mode="drop"`) ignores them. A negative index would wrap around in JAX even with
`mode="drop"`.

Item sizes are bucketed: a write and a gather each compile one program per page
bucket (a power of two) and input dtype, whatever the item sizes, for NumPy and
JAX inputs alike. An item whose rows do not fill its bucket is padded on the
host (a JAX array is fetched first: one item-sized copy, never a program per
size); `gather`'s exact-size result is cut on the host and placed back. Inside
a caller's `jit` (traced inputs) padding is part of the caller's program.

bf16 is stored as its uint16 bits on CPU by default (`storage_dtype="auto"`, as
the KV cache does, `jaxkv.device.storage`): XLA's CPU scatter into a donated bf16
buffer copies the whole buffer, a uint16 one is updated in place. `gather` and
`merge` return the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._checks import check_int
from jaxkv.device.host_inputs import check_ids, pad_to_bucket, place
from jaxkv.device.storage import from_storage, resolve_storage_dtype, to_storage

__all__ = ["EncoderCacheStore", "merge_rows"]


def _bucket(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _write_pages(
    cache: jax.Array, pages: jax.Array, values: jax.Array, compute: np.dtype
) -> jax.Array:
    """`values [bucket * page_size, hidden]` into `pages [bucket]` (padding pages dropped)."""
    values = values.reshape(pages.shape[0], *cache.shape[1:])
    return cache.at[pages].set(to_storage(values, compute, cache.dtype), mode="drop")


def _gather_pages(cache: jax.Array, pages: jax.Array, compute: np.dtype) -> jax.Array:
    rows = cache.at[pages].get(mode="fill", fill_value=0)
    return from_storage(rows.reshape(-1, cache.shape[-1]), compute)


def merge_rows(
    inputs_embeds: jax.Array, store: jax.Array, src: jax.Array, dst: jax.Array, compute: np.dtype
) -> jax.Array:
    """`inputs_embeds [tokens, hidden]` with row `dst[i]` replaced by row `src[i]` of the
    flattened store (read as `compute`); traceable, for a caller's jit. Destinations
    past the last token row are dropped (`EncoderPageAllocator.merge_indices` pads so)."""
    flat = store.reshape(-1, store.shape[-1])
    rows = from_storage(flat.at[src].get(mode="fill", fill_value=0), compute)
    return inputs_embeds.at[dst].set(rows.astype(inputs_embeds.dtype), mode="drop")


class EncoderCacheStore:
    """Layout and compiled programs of a paged device store of encoder embeddings.

    Invariants: every store array it allocates or returns has shape `shape =
    (num_pages, page_size, hidden_size)`, dtype `storage_dtype` (bf16 bits as uint16
    on CPU by default; `dtype` itself with `storage_dtype=dtype`) and sharding
    `sharding`; `write` donates the array it is given (the update is in place) and
    every call checks the array and its host arguments before anything runs.

    With a `mesh`, the hidden dimension is split over `hidden_axis` (None:
    replicated on every device of the mesh).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        hidden_size: int,
        *,
        dtype: Any = jnp.bfloat16,
        mesh: Mesh | None = None,
        hidden_axis: str | None = None,
        storage_dtype: Any = "auto",
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("hidden_size", hidden_size),
        ):
            if check_int(name, value) <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden_axis is not None:
            if mesh is None:
                raise ValueError(f"hidden_axis={hidden_axis!r} needs a mesh")
            if hidden_axis not in mesh.shape:
                raise ValueError(
                    f"hidden_axis {hidden_axis!r} is not a mesh axis (axes: {tuple(mesh.shape)})"
                )
            if hidden_size % mesh.shape[hidden_axis]:
                raise ValueError(
                    f"hidden_size {hidden_size} is not divisible by the {mesh.shape[hidden_axis]} "
                    f"devices of mesh axis {hidden_axis!r}"
                )
        self.num_pages = num_pages
        self.page_size = page_size
        self.hidden_size = hidden_size
        self.dtype = np.dtype(jnp.dtype(dtype))
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        # "auto" (or None): bf16 bits as uint16 on CPU, where a bf16 scatter copies the
        # whole buffer; else the given dtype of `dtype`'s width (`dtype` itself: no bitcast).
        self.storage_dtype = resolve_storage_dtype(self.dtype, storage_dtype, platform)
        shape = (num_pages, page_size, hidden_size)
        if mesh is None:
            self.sharding: NamedSharding | None = None
            placed: dict[str, Any] = {}
        else:
            self.sharding = NamedSharding(mesh, PartitionSpec(None, None, hidden_axis))
            placed = {"out_shardings": self.sharding}
        self.shape = shape
        self._zeros = jax.jit(lambda: jnp.zeros(shape, self.storage_dtype), **placed)
        compute = {"compute": self.dtype}
        self._write = jax.jit(
            functools.partial(_write_pages, **compute), donate_argnums=0, **placed
        )
        self._gather = jax.jit(functools.partial(_gather_pages, **compute))
        self._merge = jax.jit(functools.partial(merge_rows, **compute), donate_argnums=0)

    # ---- sizing --------------------------------------------------------------------------

    @staticmethod
    def bytes_per_page(page_size: int, hidden_size: int, dtype: Any) -> int:
        """Device bytes one page takes (over all shards of a sharded store)."""
        return page_size * hidden_size * jnp.dtype(dtype).itemsize

    @staticmethod
    def pages_for_bytes(budget_bytes: int, page_size: int, hidden_size: int, dtype: Any) -> int:
        """How many pages fit in `budget_bytes` (the encoder share of a device budget)."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        return budget_bytes // EncoderCacheStore.bytes_per_page(page_size, hidden_size, dtype)

    @property
    def nbytes(self) -> int:
        """Device bytes a store array takes (over all shards)."""
        return self.num_pages * self.bytes_per_page(self.page_size, self.hidden_size, self.dtype)

    # ---- the store array -----------------------------------------------------------------

    def allocate(self) -> jax.Array:
        """A zeroed store array, created on device by one jitted call."""
        return self._zeros()

    def struct(self) -> jax.ShapeDtypeStruct:
        """A store array as an abstract value (shape, storage dtype, sharding)."""
        return jax.ShapeDtypeStruct(self.shape, self.storage_dtype, sharding=self.sharding)

    def _check_store(self, store: jax.Array) -> None:
        if store.shape != self.shape or store.dtype != self.storage_dtype:
            raise ValueError(
                f"store array has shape {store.shape} dtype {store.dtype}; expected "
                f"{self.shape} {self.storage_dtype}"
            )

    def _check_pages(self, pages: np.ndarray | Sequence[int]) -> np.ndarray:
        return check_ids("pages", pages, 0, self.num_pages)

    # ---- device updates ------------------------------------------------------------------

    def write(
        self, store: jax.Array, embeds: jax.Array | np.ndarray, pages: np.ndarray | Sequence[int]
    ) -> jax.Array:
        """`store` with `embeds [n, hidden]` written into `pages` (`len(pages) ==
        ceil(n / page_size)`, in embedding order, as `EncoderPageAllocator.allocate`
        hands them out); donates `store`: the update is in place.

        Programs are keyed by the page bucket (a power of two) and the input dtype:
        rows are padded to the bucket on the host (a JAX array that does not fill its
        bucket is fetched first), so any item size reuses its bucket's program. Traced
        `embeds` (inside a caller's `jit`) are padded in the caller's program.
        """
        self._check_store(store)
        pages = self._check_pages(pages)
        num_rows = embeds.shape[0] if embeds.ndim == 2 else -1
        if (
            embeds.ndim != 2
            or embeds.shape[1] != self.hidden_size
            or len(pages) != -(-num_rows // self.page_size)
        ):
            raise ValueError(
                f"write needs embeds [n, {self.hidden_size}] and ceil(n / {self.page_size}) "
                f"pages, got embeds {tuple(embeds.shape)} and {pages.shape[0]} pages"
            )
        bucket = _bucket(len(pages))
        padded_pages = pad_to_bucket(pages, bucket, self.num_pages)
        return self._write(store, padded_pages, self._pad_rows(embeds, bucket * self.page_size))

    def lower_write(self, num_pages: int = 1) -> tuple[jax.stages.Lowered, jax.ShapeDtypeStruct]:
        """The lowered `write` program for an item of `num_pages` pages, and the store
        array it donates (as an abstract value)."""
        bucket = _bucket(check_int("num_pages", num_pages))
        store = self.struct()
        pages = jax.ShapeDtypeStruct((bucket,), np.int32)
        rows = jax.ShapeDtypeStruct((bucket * self.page_size, self.hidden_size), self.dtype)
        return self._write.lower(store, pages, rows), store

    @staticmethod
    def _pad_rows(embeds: jax.Array | np.ndarray, rows: int) -> jax.Array | np.ndarray:
        """`embeds` with zero rows appended up to `rows`, without a program per item size."""
        pad = ((0, rows - embeds.shape[0]), (0, 0))
        if isinstance(embeds, jax.Array) and embeds.shape[0] == rows:
            return embeds
        if isinstance(embeds, jax.core.Tracer) or (
            isinstance(embeds, jax.Array) and not embeds.is_fully_addressable
        ):
            return jnp.pad(embeds, pad)  # traced: part of the caller's program
        # A JAX array: on CPU a view of its buffer, else one item-sized copy to the host.
        return np.pad(np.asarray(embeds), pad)

    def gather(
        self, store: jax.Array, pages: np.ndarray | Sequence[int], num_embeds: int
    ) -> jax.Array:
        """The first `num_embeds` embeddings in `pages` of `store`, contiguous:
        `[num_embeds, hidden]` in the compute dtype.

        The bucket's rows are gathered on device (one program per bucket) and cut to
        `num_embeds` on the host, then placed back (one item-sized copy each way
        off CPU): an exact-size result costs no program per size.
        """
        pages = self._check_pages(pages)
        if check_int("num_embeds", num_embeds) < 0 or num_embeds > len(pages) * self.page_size:
            raise ValueError(
                f"num_embeds must lie in [0, {len(pages) * self.page_size}] for {len(pages)} "
                f"pages, got {num_embeds}"
            )
        padded = self.gather_padded(store, pages)
        if padded.shape[0] == num_embeds:
            return padded
        if not padded.is_fully_addressable:  # other processes hold parts: cut on device
            return padded[:num_embeds]
        return place(np.asarray(padded)[:num_embeds], padded.sharding)

    def gather_padded(self, store: jax.Array, pages: np.ndarray | Sequence[int]) -> jax.Array:
        """The rows of `pages` of `store`, padded with zero rows to the page bucket: one
        program per bucket, the result left on device as it is."""
        self._check_store(store)
        pages = self._check_pages(pages)
        padded = pad_to_bucket(pages, _bucket(len(pages)), self.num_pages)
        return self._gather(store, padded)

    def merge(
        self,
        store: jax.Array,
        inputs_embeds: jax.Array,
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
    ) -> jax.Array:
        """`inputs_embeds [tokens, hidden]` with row `dst[i]` replaced by the store's
        flattened row `src[i]` (`EncoderPageAllocator.merge_indices`; a destination
        `tokens` pads). `inputs_embeds` is donated; use the returned array.
        """
        self._check_store(store)
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"inputs_embeds must have shape [tokens, {self.hidden_size}], got "
                f"{tuple(inputs_embeds.shape)}"
            )
        tokens = inputs_embeds.shape[0]
        src = check_ids("src", src, 0, self.num_pages * self.page_size)
        dst = check_ids("dst", dst, 0, tokens + 1)
        if src.shape != dst.shape:
            raise ValueError(f"src has {src.size} rows but dst has {dst.size}")
        return self._merge(inputs_embeds, store, src, dst)
