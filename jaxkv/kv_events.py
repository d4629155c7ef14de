"""KV-cache events for external KV-aware routers, as vLLM emits them (SPEC §5)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# vLLM's name for the accelerator memory tier; routers key on it.
MEDIUM_GPU = "GPU"


def maybe_convert_block_hash(block_hash: bytes) -> bytes:
    """A block hash as jaxkv's in-process events carry it: the bytes, unchanged.

    vLLM's function of this name turns it into a 64-bit int unless
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; jaxkv's events carry the bytes
    (docs/vllm-differences.md) and the publisher converts them on the wire
    (`jaxkv.kv_events_wire.block_hash_to_wire`), so this is the identity.
    """
    return block_hash


@dataclass(slots=True)
class KVCacheEvent:
    """Base of the events drained per step by `take_events()`: plain records (as vLLM's
    are), built once per cached or evicted block, so cheap to make."""


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """Per-block hash extra keys as events publish them: untagged.

    Routers parse the untagged shapes: bare LoRA names and cache salts,
    `(mm_identifier, offset)` pairs, bare prompt-embeds digests (the block hash
    itself uses the tagged keys, e.g. `("lora", name, path)`). None when no
    block has extra keys.
    """
    if not extra_keys:
        return None
    event_keys = [
        None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
        for keys in extra_keys
    ]
    return event_keys if any(k is not None for k in event_keys) else None


@dataclass(slots=True)
class BlockStored(KVCacheEvent):
    """Blocks that became full and findable; hashes are bare block hashes (no group id).

    vLLM's fields: `lora_name` and `extra_keys` (untagged, one entry per
    stored block) let a router recompute the keys; `group_idx` names the KV
    cache group, `kv_cache_spec_kind` ("full_attention", "sliding_window", ...)
    and `kv_cache_spec_sliding_window` describe it (filled in by the KV cache
    manager's `take_events`).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved(KVCacheEvent):
    """Blocks whose hashes were dropped (evicted for reuse or invalidated)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


@dataclass(slots=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class DeferredKVCacheEvent:
    """An event queued as what it is built from, built by `build()` when read.

    What it is built from never changes once it is queued (a request only appends
    tokens and block hashes), so `build()` gives the same event whenever and on whichever
    thread it runs: the engine leaves the building to its publishing thread, which runs
    while the step loop waits for the device.
    """

    __slots__ = ()

    def build(self) -> KVCacheEvent:
        raise NotImplementedError


def build_events(events: Iterable[KVCacheEvent | DeferredKVCacheEvent]) -> list[KVCacheEvent]:
    """`events` with the deferred ones built, in order."""
    return [e.build() if isinstance(e, DeferredKVCacheEvent) else e for e in events]
