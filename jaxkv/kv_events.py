"""KV-cache events for external KV-aware routers, as vLLM emits them (SPEC §5)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's name for the accelerator memory tier; routers key on it.
MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class KVCacheEvent:
    """Base of the events drained per step by `take_events()`."""


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Blocks that became full and findable; hashes are bare block hashes (no group id)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """Blocks whose hashes were dropped (evicted for reuse or invalidated)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""
