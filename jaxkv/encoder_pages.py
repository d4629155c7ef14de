"""Host page allocation for the device encoder store (SPEC §8, last item).

The device `jaxkv.device.EncoderCacheStore` holds every cached encoder output in one
`[num_pages, page_size, hidden]` array and makes no allocation decisions: which pages
hold which multimodal item is decided here, on the host, next to the
`EncoderCacheManager` that decides which items are cached. The manager drives it: an
item the scheduler allocates is `allocate`d pages here when the encoder runs (and its
embeddings written there with `EncoderCacheStore.write`); the hashes from
`EncoderCacheManager.get_freed_mm_hashes()` are passed to `free`, which returns their
pages. `merge_indices` turns a step's placements into the store rows to merge into
the step's input embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxkv._checks import check_int

__all__ = ["EmbedPlacement", "EncoderPageAllocator"]


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


class EncoderPageAllocator:
    """The pages of a device encoder store, keyed by mm_hash.

    Invariants: each stored mm_hash owns `ceil(num_embeds / page_size)` distinct
    pages; the free pages and the pages of all stored hashes partition
    `range(num_pages)`; pages are handed out lowest first and freed pages reused
    first. A failed call changes nothing.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = check_int("num_pages", num_pages, min_value=1)
        self.page_size = check_int("page_size", page_size, min_value=1)
        # Popped from the end: pages are handed out lowest first, freed pages reused first.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._entries: dict[str, tuple[np.ndarray, int]] = {}

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
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        """Number of stored items."""
        return len(self._entries)

    def stored_hashes(self) -> list[str]:
        """The stored items' hashes, in storing order."""
        return list(self._entries)

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
        num_embeds = check_int("num_embeds", num_embeds, min_value=0)
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

    def merge_indices(
        self, placements: Sequence[EmbedPlacement], num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows `EncoderCacheStore.merge` merges for `placements` into a step of
        `num_tokens` token rows: (source row in the flattened store, destination token row).

        Only the placeholder positions the step computes and that take an embedding
        (`is_embed`) are listed; text and break tokens keep their token embeddings.
        Both int32, padded to a power of two; padding sources read row 0 and padding
        destinations are `num_tokens` (out of range, dropped). ValueError for a
        placement whose rows fall outside the step, KeyError for an unknown hash.
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
        bucket = 1 << max(count - 1, 0).bit_length()  # a power of two: few programs
        src = np.zeros(bucket, dtype=np.int32)
        dst = np.full(bucket, num_tokens, dtype=np.int32)
        if count:
            src[:count] = np.concatenate(sources)
            dst[:count] = np.concatenate(targets)
        return src, dst
