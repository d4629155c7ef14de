"""Device store for encoder outputs (SPEC §8, last item).

A preallocated `[num_pages, page_size, hidden]` array holds the embeddings of
every multimodal item the host `EncoderCacheManager` keeps cached. A host page
allocator, keyed by mm_hash, hands each item `ceil(num_embeds / page_size)`
pages. The host manager drives it: an item it allocates is `allocate`d here
and written once the encoder has run; the hashes from
`EncoderCacheManager.get_freed_mm_hashes()` are passed to `free`, which
returns their pages.

All device updates are jitted and donate the buffer they update, so their cost
grows with the rows written, never with the store. Index arrays are padded to
power-of-two lengths; padding indices are positive and out of range, so the
scatter (`mode="drop"`) ignores them. A negative index would wrap around in JAX
even with `mode="drop"`.

Item sizes are bucketed: a write and a gather each compile one program per page
bucket (a power of two) and input dtype, whatever the item sizes, for NumPy and
JAX inputs alike. An item whose rows do not fill its bucket is padded on the
host (a JAX array is fetched first: one item-sized copy, never a program per
size); `gather`'s exact-size result is cut on the host and placed back. Inside
a caller's `jit` (traced inputs) padding is part of the caller's program.

bf16 is stored as its uint16 bits on CPU by default (`storage_dtype="auto"`, as
the KV cache does, `jaxkv.device.storage`): XLA's CPU scatter into a donated bf16
buffer copies the whole buffer, a uint16 one is updated in place. `get`,
`gather` and `merge` return the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv._checks import check_int
from jaxkv.device.host_inputs import check_ids, pad_to_bucket, place
from jaxkv.device.storage import from_storage, resolve_storage_dtype, to_storage

__all__ = ["EmbedPlacement", "EncoderCacheStore"]


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


def _merge_rows(
    inputs_embeds: jax.Array, cache: jax.Array, src: jax.Array, dst: jax.Array, compute: np.dtype
) -> jax.Array:
    flat = cache.reshape(-1, cache.shape[-1])
    rows = from_storage(flat.at[src].get(mode="fill", fill_value=0), compute)
    return inputs_embeds.at[dst].set(rows.astype(inputs_embeds.dtype), mode="drop")


@dataclass(frozen=True)
class EmbedPlacement:
    """Where one multimodal item's embeddings go in one step's flattened token batch.

    The step computes the request's prompt positions `[num_computed_tokens,
    num_computed_tokens + num_scheduled_tokens)`, which sit at rows
    `[batch_offset, batch_offset + num_scheduled_tokens)` of the step's input
    embeddings. `feature` needs `offset`, `length` and `is_embed` (None: every
    placeholder position takes an embedding), as `MultiModalFeatureSpec` has.
    """

    mm_hash: str
    feature: Any
    num_computed_tokens: int
    num_scheduled_tokens: int
    batch_offset: int


class EncoderCacheStore:
    """Paged device storage of encoder embeddings, keyed by mm_hash.

    Invariants: each stored mm_hash owns `ceil(num_embeds / page_size)`
    distinct pages; the free pages and the pages of all stored hashes
    partition `range(num_pages)`; `cache` always has shape `[num_pages,
    page_size, hidden_size]`, dtype `dtype` and sharding `sharding`, and is
    replaced (its old buffer donated) by every write. `cache` holds
    `storage_dtype` (bf16 bits as uint16 on CPU by default; `dtype` itself with
    `storage_dtype=dtype`).

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
        self.cache: jax.Array = jax.jit(lambda: jnp.zeros(shape, self.storage_dtype), **placed)()
        compute = {"compute": self.dtype}
        self._write = jax.jit(
            functools.partial(_write_pages, **compute), donate_argnums=0, **placed
        )
        self._gather = jax.jit(functools.partial(_gather_pages, **compute))
        self._merge = jax.jit(functools.partial(_merge_rows, **compute), donate_argnums=0)
        # Popped from the end: pages are handed out lowest first, freed pages reused first.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._entries: dict[str, tuple[np.ndarray, int]] = {}

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

    @staticmethod
    def pages_needed(cache_size: int, page_size: int, min_item_embeds: int = 1) -> int:
        """Pages that hold any set of items the host manager can keep in `cache_size` embeddings.

        Items of at least `min_item_embeds` embeddings each: at most
        `k = cache_size // min_item_embeds` of them fit, each wastes at most
        `page_size - 1` slots to rounding, and none takes more pages than it has
        embeddings.
        """
        if cache_size < 0 or page_size <= 0 or min_item_embeds <= 0:
            raise ValueError(
                "need cache_size >= 0, page_size > 0 and min_item_embeds > 0, got "
                f"{cache_size}, {page_size}, {min_item_embeds}"
            )
        max_items = cache_size // min_item_embeds
        return min(cache_size, (cache_size + max_items * (page_size - 1)) // page_size)

    @property
    def nbytes(self) -> int:
        """Device bytes the store takes (over all shards)."""
        return self.num_pages * self.bytes_per_page(self.page_size, self.hidden_size, self.dtype)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    # ---- host page allocator -------------------------------------------------------------

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        """Number of stored items."""
        return len(self._entries)

    def pages_of(self, mm_hash: str) -> np.ndarray:
        """The pages (int32, in embedding order) holding `mm_hash`."""
        return self._entry(mm_hash)[0]

    def num_embeds_of(self, mm_hash: str) -> int:
        return self._entry(mm_hash)[1]

    def _entry(self, mm_hash: str) -> tuple[np.ndarray, int]:
        try:
            return self._entries[mm_hash]
        except KeyError:
            raise KeyError(f"mm_hash {mm_hash!r} is not in the encoder store") from None

    def allocate(self, mm_hash: str, num_embeds: int) -> np.ndarray:
        """Give `mm_hash` pages for `num_embeds` embeddings; return them (int32).

        ValueError, changing nothing, if the hash is already stored or too few
        pages are free.
        """
        if check_int("num_embeds", num_embeds) < 0:
            raise ValueError(f"num_embeds must be >= 0, got {num_embeds}")
        if not isinstance(mm_hash, str):
            raise TypeError(f"mm_hash must be a str, got {type(mm_hash).__name__}")
        if mm_hash in self._entries:
            raise ValueError(f"mm_hash {mm_hash!r} is already in the encoder store")
        count = -(-num_embeds // self.page_size)
        if count > len(self._free_pages):
            raise ValueError(
                f"mm_hash {mm_hash!r} needs {count} pages of {self.page_size} embeddings but only "
                f"{len(self._free_pages)} of {self.num_pages} are free; size the store with "
                "pages_needed() and free the hashes from get_freed_mm_hashes() first"
            )
        pages = np.array(self._free_pages[len(self._free_pages) - count :][::-1], dtype=np.int32)
        del self._free_pages[len(self._free_pages) - count :]
        self._entries[mm_hash] = (pages, num_embeds)
        return pages

    def free(self, mm_hashes: Iterable[str]) -> None:
        """Return the pages of `mm_hashes` (KeyError, changing nothing, for an unknown hash).

        `mm_hashes` is a collection of hashes; a bare string is a TypeError (iterating
        it would free one "hash" per character).
        """
        if isinstance(mm_hashes, str | bytes):
            raise TypeError(
                f"mm_hashes must be a collection of hashes, got the bare string {mm_hashes!r}; "
                f"pass [{mm_hashes!r}]"
            )
        mm_hashes = list(mm_hashes)
        unknown = [h for h in mm_hashes if h not in self._entries]
        if unknown or len(set(mm_hashes)) != len(mm_hashes):
            raise KeyError(
                f"cannot free mm hashes {mm_hashes!r}: unknown {unknown!r} or listed twice"
            )
        for mm_hash in mm_hashes:
            pages, _ = self._entries.pop(mm_hash)
            self._free_pages.extend(reversed(pages.tolist()))

    # ---- device updates ------------------------------------------------------------------

    def write(self, embeds: jax.Array | np.ndarray, pages: np.ndarray | Sequence[int]) -> None:
        """Write `embeds` `[n, hidden]` into `pages` (`len(pages) == ceil(n / page_size)`).

        `pages` must be free or one stored item's own pages (as `allocate` returned
        them); pages of another item are a ValueError. Jitted, donating the store's
        buffer: the update is in place.
        """
        self.cache = self.scatter(self.cache, embeds, pages)

    def scatter(
        self, cache: jax.Array, embeds: jax.Array | np.ndarray, pages: np.ndarray | Sequence[int]
    ) -> jax.Array:
        """`write` as a function: returns the updated store array (donates `cache`).

        For callers that hold the store array themselves, as `PagedKVCache` callers
        hold their caches; `self.cache` is not touched. Programs are keyed by the page
        bucket (a power of two) and the input dtype: rows are padded to the bucket on
        the host (a JAX array that does not fill its bucket is fetched first), so any
        item size reuses its bucket's program. Traced `embeds` (inside a caller's
        `jit`) are padded in the caller's program.
        """
        if cache.shape != self.shape or cache.dtype != self.storage_dtype:
            raise ValueError(
                f"store array has shape {cache.shape} dtype {cache.dtype}; expected "
                f"{self.shape} {self.storage_dtype}"
            )
        pages = check_ids("pages", pages, 0, self.num_pages)
        self._check_owner(pages)
        num_rows = embeds.shape[0] if embeds.ndim == 2 else -1
        if (
            embeds.ndim != 2
            or embeds.shape[1] != self.hidden_size
            or pages.ndim != 1
            or len(pages) != -(-num_rows // self.page_size)
        ):
            raise ValueError(
                f"write needs embeds [n, {self.hidden_size}] and ceil(n / {self.page_size}) "
                f"pages, got embeds {tuple(embeds.shape)} and {pages.shape[0]} pages"
            )
        bucket = _bucket(len(pages))
        padded_pages = pad_to_bucket(pages, bucket, self.num_pages)
        return self._write(cache, padded_pages, self._pad_rows(embeds, bucket * self.page_size))

    def lower_write(self, num_pages: int = 1) -> tuple[jax.stages.Lowered, jax.ShapeDtypeStruct]:
        """The lowered `write` program for an item of `num_pages` pages, and the store
        buffer it donates (as an abstract value)."""
        bucket = _bucket(check_int("num_pages", num_pages))
        store = jax.ShapeDtypeStruct(self.shape, self.storage_dtype, sharding=self.sharding)
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

    def _check_owner(self, pages: np.ndarray) -> None:
        """`pages` are all free, or exactly one stored item's pages (a rewrite of it)."""
        if not len(pages):
            return
        owners = sorted(h for h, (own, _) in self._entries.items() if np.isin(own, pages).any())
        if not owners:
            return
        if len(owners) == 1 and set(self._entries[owners[0]][0].tolist()) == set(pages.tolist()):
            return
        raise ValueError(
            f"pages {pages.tolist()} include pages of stored item(s) {owners!r}; write only "
            f"free pages or exactly one item's own pages"
        )

    def put(self, mm_hash: str, embeds: jax.Array | np.ndarray) -> np.ndarray:
        """`allocate` pages for `mm_hash` and `write` its embeddings there; return the pages."""
        if embeds.ndim != 2 or embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"embeds must have shape [n, {self.hidden_size}], got {tuple(embeds.shape)}"
            )
        pages = self.allocate(mm_hash, embeds.shape[0])
        self.write(embeds, pages)
        return pages

    def gather(self, pages: np.ndarray | Sequence[int], num_embeds: int) -> jax.Array:
        """The first `num_embeds` embeddings in `pages`, contiguous: `[num_embeds, hidden]`.

        The bucket's rows are gathered on device (one program per bucket) and cut to
        `num_embeds` on the host, then placed back (one item-sized copy each way
        off CPU): an exact-size result costs no program per size.
        """
        pages = check_ids("pages", pages, 0, self.num_pages)
        if check_int("num_embeds", num_embeds) < 0 or num_embeds > len(pages) * self.page_size:
            raise ValueError(
                f"num_embeds must lie in [0, {len(pages) * self.page_size}] for {len(pages)} "
                f"pages, got {num_embeds}"
            )
        padded = self.gather_padded(pages)
        if padded.shape[0] == num_embeds:
            return padded
        if not padded.is_fully_addressable:  # other processes hold parts: cut on device
            return padded[:num_embeds]
        return place(np.asarray(padded)[:num_embeds], padded.sharding)

    def gather_padded(self, pages: np.ndarray | Sequence[int]) -> jax.Array:
        """The rows of `pages`, padded with zero rows to the page bucket: one program per
        bucket, the result left on device as it is."""
        pages = check_ids("pages", pages, 0, self.num_pages)
        padded = pad_to_bucket(pages, _bucket(len(pages)), self.num_pages)
        return self._gather(self.cache, padded)

    def get(self, mm_hash: str) -> jax.Array:
        """The stored embeddings of `mm_hash`, `[num_embeds, hidden]`."""
        pages, num_embeds = self._entry(mm_hash)
        return self.gather(pages, num_embeds)

    def merge_indices(
        self, placements: Sequence[EmbedPlacement], num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host part of `merge`: (source row in the flattened store, destination token row).

        Both int32, padded to a power of two; padding sources read row 0 and
        padding destinations are `num_tokens` (out of range, dropped).
        """
        sources: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        for p in placements:
            pages, _ = self._entry(p.mm_hash)
            feature = p.feature
            start = max(p.num_computed_tokens, feature.offset)
            end = min(
                p.num_computed_tokens + p.num_scheduled_tokens, feature.offset + feature.length
            )
            if start >= end:
                continue
            rel = np.arange(start - feature.offset, end - feature.offset)
            if feature.is_embed is None:
                embed_index = rel
            else:
                is_embed = np.asarray(feature.is_embed, dtype=bool)
                rank = np.cumsum(is_embed) - 1
                rel = rel[is_embed[rel]]
                embed_index = rank[rel]
            dst = p.batch_offset + feature.offset + rel - p.num_computed_tokens
            if len(dst) and (dst.min() < 0 or dst.max() >= num_tokens):
                raise ValueError(
                    f"placement of {p.mm_hash!r} writes token rows [{dst.min()}, {dst.max()}], "
                    f"outside the step's {num_tokens} rows"
                )
            page = pages[embed_index // self.page_size].astype(np.int64)
            sources.append(page * self.page_size + embed_index % self.page_size)
            targets.append(dst)
        count = sum(len(s) for s in sources)
        bucket = _bucket(count)
        src = np.zeros(bucket, dtype=np.int32)
        dst = np.full(bucket, num_tokens, dtype=np.int32)
        if count:
            src[:count] = np.concatenate(sources)
            dst[:count] = np.concatenate(targets)
        return src, dst

    def merge(self, inputs_embeds: jax.Array, placements: Sequence[EmbedPlacement]) -> jax.Array:
        """Write the stored embeddings of `placements` into `inputs_embeds` `[tokens, hidden]`.

        Only the placeholder positions the step computes and that take an
        embedding (`is_embed`) are overwritten; text and break tokens keep their
        token embeddings. `inputs_embeds` is donated; use the returned array.
        """
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"inputs_embeds must have shape [tokens, {self.hidden_size}], got "
                f"{tuple(inputs_embeds.shape)}"
            )
        src, dst = self.merge_indices(placements, inputs_embeds.shape[0])
        return self._merge(inputs_embeds, self.cache, src, dst)
