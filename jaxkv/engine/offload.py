"""The engine's host-memory KV tier: a `HostKVTier` plus the host buffer of its slots.

Host only (numpy, no JAX): the scheduler asks it for the blocks that follow a request's
device prefix hit and reports the blocks of requests it frees; the engine moves the
bytes with the model runner's block gather and in-place scatter. vLLM's offloading
connector, reduced to one process, a synchronous load and a store at request end:

* **Store** (`request_freed`, `take_stores`, `complete_stores`): when a request finishes
  or is preempted, its full, cached blocks the tier does not hold yet are queued with a
  digest of what they claim to hold (their token ids and block-hash extra keys). The
  engine gathers them off the device before any later step can reuse the blocks, and
  once the copy lands the tier keeps each block with the checksum of digest and bytes.
* **Load** (`lookup`, `admitted`, `cancel`, `take_loads`): on admission, after the
  device prefix hit, the following blocks found in the tier are pinned, read out of the
  host buffer and verified (digest of the request's own tokens plus the bytes read,
  against the stored checksum) before anything else happens; a mismatch ends the hit
  there (the block is dropped from the tier, counted, never served), the rest is
  recomputed. The read blocks are unpinned at once: the load owns a copy. The
  scheduler allocates them as connector tokens
  (`allocate_slots(num_external_computed_tokens=...)`), and the engine scatters the
  copy into those device blocks ahead of the step, so the step that computes the rest
  of the request reads them. A load is thus all or nothing inside one step: aborting
  or preempting the request afterwards frees device blocks as for any request and
  leaves no pin in the tier.

Invariants: no key of the tier is pinned between scheduler calls; every queued store
names a block whose bytes are final (full and computed by steps already dispatched);
`pending_stores` is empty after `complete_stores()`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHashWithGroupId, make_block_hash_with_group_id
from jaxkv.host_tier import HostKVTier
from jaxkv.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind
from jaxkv.request import Request
from jaxkv.request_hashing import generate_block_hash_extra_keys

__all__ = ["STAT_NAMES", "Gathered", "HostOffload", "PendingStore", "block_digest", "host_offload"]


def block_digest(request: Request, block_index: int, block_size: int) -> bytes:
    """What block `block_index` of `request` claims to hold: a digest of its token ids and
    its block-hash extra keys (cache salt, images, LoRA), which its block hash commits to
    as well; two blocks with equal hashes but different contents (a collision) differ
    here."""
    start = block_index * block_size
    tokens = np.asarray(request.all_token_ids[start : start + block_size], np.int64)
    extra, _ = generate_block_hash_extra_keys(request, start, start + block_size)
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=16)
    digest.update(repr(extra).encode())
    return digest.digest()


def _checksum(digest: bytes, block: np.ndarray) -> bytes:
    """The stored block's checksum: its content digest and its KV bytes."""
    return hashlib.blake2b(digest + np.ascontiguousarray(block).tobytes(), digest_size=16).digest()


# The counters `HostOffload.take_stats` returns (the engine's `StepStats.host_*`): tokens
# looked up in the tier after a device prefix hit and found there (verified), bytes
# moved each way, loads cut short by a verification mismatch.
STAT_NAMES = ("queried_tokens", "hit_tokens", "loaded_bytes", "stored_bytes", "failed_loads")


@dataclass
class _Store:
    """Blocks of freed requests to copy out: device block ids, keys, digests, tenants."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockHashWithGroupId] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)


class Gathered(Protocol):
    """Blocks being copied off the device (`ModelRunner.gather_blocks`)."""

    def ready(self) -> bool:
        """Whether `read` would return without waiting."""

    def read(self) -> np.ndarray:
        """The blocks `[n, *block_shape]` as stored (waits for the copy)."""


@dataclass
class PendingStore:
    """A gather in flight since engine step `step`: `keys[i]` goes to host slot
    `slots[i]` with `digests[i]`."""

    keys: list[BlockHashWithGroupId]
    slots: list[int]
    digests: list[bytes]
    blocks: Gathered
    step: int


class HostOffload:
    """Host tier of one data rank: which blocks (`tier`) and their bytes (`buffer`,
    `[num_slots, *block_shape]`, as the device stores them). See the module docstring.

    `block_size`: tokens per block of the one full-attention KV-cache group served.
    """

    def __init__(
        self, tier: HostKVTier, block_shape: tuple[int, ...], dtype: np.dtype, block_size: int
    ) -> None:
        self.tier = tier
        self.block_size = block_size
        self.buffer = np.empty((tier.num_slots, *block_shape), dtype)
        self.block_bytes = int(np.prod(block_shape)) * np.dtype(dtype).itemsize
        self.stats: Counter[str] = Counter()
        self._queued = _Store()
        self._queued_keys: set[BlockHashWithGroupId] = set()
        # request id -> (first block index, its verified blocks), kept until it is admitted
        # or freed: a request retried step after step is read and verified once
        self._staged: dict[str, tuple[int, np.ndarray]] = {}
        self._queried: dict[str, int] = {}  # request id -> tokens its lookup asked for
        self._loads: list[tuple[list[int], np.ndarray]] = []
        self.pending_stores: list[PendingStore] = []

    # -- loads (scheduler) -------------------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (a whole number of blocks) that the
        tier serves verified, whole blocks only, leaving at least the request's last
        token to compute. The verified blocks are staged for `admitted` (a copy, reused
        when the request is looked up again from the same block); a mismatch drops
        that block from the tier and ends the hit before it."""
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if num_computed_tokens % bs or first >= last:
            return 0
        keys = [
            make_block_hash_with_group_id(request.block_hashes[i], 0) for i in range(first, last)
        ]
        self._queried[request.request_id] = len(keys) * bs
        staged = self._staged.get(request.request_id)
        if staged is not None and staged[0] == first:
            return staged[1].shape[0] * bs
        num_hits = self.tier.lookup(keys)
        if not num_hits:
            return 0
        keys = keys[:num_hits]
        blocks = self.buffer[self.tier.prepare_load(keys)]  # a copy: the pins end below
        checksums = [
            _checksum(block_digest(request, first + i, bs), block) for i, block in enumerate(blocks)
        ]
        rejected = set(self.tier.complete_load(keys, checksums))
        if rejected:
            self.stats["failed_loads"] += 1
            num_hits = next(i for i, key in enumerate(keys) if key in rejected)
        if num_hits:
            self._staged[request.request_id] = (first, blocks[:num_hits])
        return num_hits * bs

    def admitted(self, request: Request, block_ids: Sequence[int]) -> None:
        """`request`, looked up last, is admitted: its staged blocks (if any) go to device
        blocks `block_ids` (the ones `allocate_slots` gave its connector tokens) with
        the next step. Its lookup counts in the stats from here."""
        self.stats["queried_tokens"] += self._queried.pop(request.request_id, 0)
        staged = self._staged.pop(request.request_id, None)
        if staged is None:
            return
        blocks = staged[1]
        self._loads.append((list(block_ids), blocks))
        self.stats["hit_tokens"] += blocks.shape[0] * self.block_size
        self.stats["loaded_bytes"] += blocks.shape[0] * self.block_bytes

    def cancel(self, request: Request) -> None:
        """`request`, looked up last, was not admitted (its staged blocks are kept for its
        next attempt)."""
        self._queried.pop(request.request_id, None)

    def take_loads(self) -> tuple[list[int], np.ndarray | None]:
        """The device block ids and blocks `[n, *block_shape]` to scatter before the next
        step (None: nothing)."""
        loads, self._loads = self._loads, []
        if not loads:
            return [], None
        ids = [i for block_ids, _ in loads for i in block_ids]
        return ids, np.concatenate([blocks for _, blocks in loads])

    # -- stores (scheduler, then engine) ---------------------------------------------

    def request_freed(self, request: Request, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue the full, cached blocks of `request` (its group-0 block list, read before
        the pool frees them) that the tier does not hold yet; drop what was staged for it."""
        self._staged.pop(request.request_id, None)
        q = self._queued
        for i, block in enumerate(blocks):
            key = block.block_hash
            if key is None or block.is_null:
                continue
            if key in self._queued_keys or self.tier.block_state(key) is not None:
                continue
            self._queued_keys.add(key)
            q.block_ids.append(block.block_id)
            q.keys.append(key)
            q.digests.append(block_digest(request, i, self.block_size))
            q.tenants.append(request.cache_salt)

    def take_stores(self) -> tuple[list[int], list[BlockHashWithGroupId], list[bytes], list]:
        """The queued stores (device block ids, keys, digests, tenants), emptied."""
        q, self._queued = self._queued, _Store()
        self._queued_keys.clear()
        return q.block_ids, q.keys, q.digests, q.tenants

    def prepare_store(
        self, keys: list[BlockHashWithGroupId], tenant: str | None
    ) -> tuple[list[int], list[int]] | None:
        """Slots for the `keys` (of one tenant, in order) the tier takes: (their indices in
        `keys`, their slots); at most the tenant's quota (the first ones: the leading
        blocks of a prefix serve the most requests); None when the tier has no room
        (nothing stored, nothing changed)."""
        new = [k for k in dict.fromkeys(keys) if self.tier.block_state(k) is None]
        out = self.tier.prepare_store(new[: self.tier.max_store_blocks(tenant)], tenant)
        if out is None:
            return None
        index = {key: i for i, key in enumerate(keys)}
        return [index[key] for key in out.keys_to_store], out.slots

    def complete_stores(self, before_step: int | None = None) -> None:
        """Land pending gathers in the host buffer and make their blocks readable with
        their checksums: those done, and (waiting for them) those dispatched before step
        `before_step` (None: all)."""
        pending, self.pending_stores = self.pending_stores, []
        for store in pending:
            if before_step is not None and store.step >= before_step and not store.blocks.ready():
                self.pending_stores.append(store)
                continue
            blocks = store.blocks.read()
            self.buffer[store.slots] = blocks
            self.tier.complete_store(
                store.keys,
                True,
                [_checksum(d, b) for d, b in zip(store.digests, blocks, strict=True)],
            )
            self.stats["stored_bytes"] += len(store.keys) * self.block_bytes

    def take_stats(self) -> dict[str, int]:
        """The `STAT_NAMES` counters since the last call; they restart."""
        stats, self.stats = self.stats, Counter()
        return {name: stats[name] for name in STAT_NAMES}

    def reset(self) -> bool:
        """Land the pending stores, drop the queued ones and what lookups staged, and clear
        the tier (`AllBlocksCleared`); False, changing nothing, while loads are taken
        for a step not yet dispatched."""
        if self._loads:
            return False
        self.complete_stores()
        self.take_stores()
        self._staged.clear()
        return self.tier.reset()


def host_offload(config, runner) -> HostOffload | None:
    """The host tier an `EngineConfig`'s `kv_offloading_size` asks for (None: off), its
    blocks shaped as the `ModelRunner`'s stacked KV cache stores them (every layer of
    one block). ValueError/TypeError naming the
    setting and what is allowed when the budget, policy or quotas are bad, or the model
    or mesh is one the tier does not serve."""
    size = config.kv_offloading_size
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        raise TypeError(
            f"EngineConfig.kv_offloading_size must be an int (bytes) or None, got {size!r}"
        )
    groups = runner.kv_cache_config.kv_cache_groups
    if (
        len(groups) != 1
        or get_kv_cache_spec_kind(groups[0].kv_cache_spec) != KVCacheSpecKind.FULL_ATTENTION
    ):
        kinds = [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in groups]
        raise ValueError(
            f"EngineConfig.kv_offloading_size: the host tier serves models with one "
            f"full-attention KV-cache group; this model has {kinds}"
        )
    if runner.dp_size != 1:
        raise ValueError(
            f"EngineConfig.kv_offloading_size: the host tier serves one data rank; the mesh "
            f"has {runner.dp_size}"
        )
    kv = runner.kv_cache
    block_shape = (kv.shape[0], *kv.shape[2:])
    block_bytes = int(np.prod(block_shape)) * np.dtype(kv.dtype).itemsize
    if size < block_bytes:
        raise ValueError(
            f"EngineConfig.kv_offloading_size must hold at least one block ({block_bytes} "
            f"bytes: {kv.shape[0]} layers of {groups[0].kv_cache_spec.block_size} tokens), "
            f"got {size}"
        )
    quotas = config.kv_offloading_tenant_quotas
    if quotas is not None and not isinstance(quotas, Mapping):
        raise TypeError(
            "EngineConfig.kv_offloading_tenant_quotas must map cache_salt to bytes, or be "
            f"None; got {quotas!r}"
        )
    try:
        tier = HostKVTier(
            block_bytes, int(size), config.kv_offloading_policy, quotas,
            group_specs=[groups[0].kv_cache_spec],
        )  # fmt: skip
    except (TypeError, ValueError) as error:
        raise type(error)(f"EngineConfig kv_offloading_*: {error}") from None
    return HostOffload(tier, block_shape, np.dtype(kv.dtype), groups[0].kv_cache_spec.block_size)
