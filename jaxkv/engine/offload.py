"""The engine's host-memory KV tier: per data rank, a `HostKVTier` plus the host buffer
of its slots.

Host only (numpy, no JAX): the scheduler asks it for the blocks that follow a request's
device prefix hit and reports the blocks of requests it frees; the engine moves the
bytes with the model runner's block gather and in-place scatter. vLLM's offloading
connector, reduced to one process: a load staged off the scheduling path (a worker
thread) while the request waits, and a store at request end or at device-pool eviction
(`store_at`, `EngineConfig.kv_offloading_store`).

Every KV-cache group is served that is full attention or sliding window (a hybrid model
such as Gemma 3 has both); other kinds (chunked local, Mamba, ...) are refused by
`host_offloads`. A block of group `g` is keyed as the device pool keys it,
`make_block_hash_with_group_id(block_hash, g)`, and holds the layers of group `g` only
(`HostOffload.group_layers[g]`) at its device block id: the runner stacks every layer
in one array over one pool of block ids, each id owned by one group at a time, so the
other layers at that id are bytes no request reads: the device transfers move only
the group's layers (`layer_table`, `layers_of`), so what crosses the host link is what
the tier keeps.

* **Store** (`request_freed`, `blocks_evicted`, `take_stores`, `complete_stores`): when
  a request finishes or is preempted, it offers each group's blocks that a later hit
  ending where its cached blocks end needs (`HostKVTier.storable_block_range`: every
  cached block for full attention, the blocks of the window before that end for a
  sliding window), each with a digest of what it claims to hold (its token ids and
  block-hash extra keys). A window block the request already released (it went on
  computing past that end) is taken from the device prefix cache while it is still
  there; one already evicted is not offered, and then no host hit reaches that end.
  `store_at="finished"`: the offered blocks the tier does not hold yet are queued at
  once. `store_at="evicted"`: they are remembered (device block id -> key, digest,
  tenant; the digest is taken while the request still exists, and an entry whose
  block holds another key by the time it is evicted is stale, ignored) and queued
  only when the device pool evicts them for reuse (`BlockPool.on_evict`, called from
  inside `schedule()` while the blocks still hold their keys and bytes), if the tier
  does not hold them by then; blocks no freed request offered under the key they hold
  (a sliding window's outside every offered window, an entry re-keyed to another
  block since, as a partial-hit copy's) are not stored.
  Either way the engine gathers the queued blocks off the device right after
  `schedule()`, before that step (which may write into a block evicted for it) or
  any later one can reuse them, and once the copy lands the tier keeps each block
  with the checksum of digest and bytes.
* **Load** (`lookup`, `admitted`, `cancel`, `take_loads`, `discard`), as vLLM's
  offloading connector loads asynchronously: on admission, after the device prefix hit
  of `h` tokens, the tier serves a hit ending at `e` (blocks) when every group has what
  the device pool allocates for the prefix `e`: full attention, blocks `[h, e)`; a
  sliding window, blocks `[max(h, s), e)` with `s` the first block the window before
  token `e` reaches (the device hit holds those before `h`; those before `s` are the
  null block) -- as `allocate_slots(num_external_computed_tokens=...)` assigns them.
  `lookup` finds the longest such `e` (reading nothing); the scheduler allocates the
  blocks as connector tokens and, in `admitted`, the hit's blocks are pinned and their
  staging handed to a worker thread: a copy out of the host buffer and its checksums
  (digest of the request's own tokens plus the bytes read). The request waits
  (`RequestStatus.WAITING_FOR_REMOTE_KVS`) while other requests run. A later
  `take_loads` (the scheduler's next `schedule()` at the earliest) takes the finished
  stagings only: each is verified against the stored checksums and unpinned; a
  verified one goes with that step (the engine scatters it into the request's device
  blocks before the step's forward, so every later program reads them) and its request
  runs from the next step; one with a mismatch (the block is dropped from the tier:
  counted, never served) or a staging error is reported failed, and its request is
  recomputed from its device prefix hit. `discard` (a request freed while loading)
  cancels its staging, or waits for one already running, and releases its pins. A
  step with nothing to run but loads pending waits for one (`wait_for_a_staging`)
  instead of stepping empty.

Data ranks: each rank has its own scheduler, device pool and block ids, so it has its
own `HostOffload` (its own tier of `kv_offloading_size` bytes, its own tenant quotas,
its KV events published with the rank's); the engine batches the ranks' gathers and
scatters into one device program each, and routes a new request by the prefix a rank
holds in its device pool or its tier (`num_cached_tokens`).

Invariants: a key of the tier is pinned between scheduler calls only by the loads of
requests waiting for them (`loading`: one pin per block of each); a staged block goes
only to device blocks of its own request, taken once; between scheduler calls no
lookup is pending (`admitted` or `cancel` follows each within the call); every queued store
names a block whose bytes are final (full and computed by steps already dispatched)
and that no program writes before its gather is dispatched (the engine dispatches the
gathers before the next step, its zeroing, copies and loads; a block evicted for reuse
is queued in the `schedule()` that reuses it, so its gather precedes that step); the
queue is empty after `take_stores()` and `pending_stores` after `complete_stores()`;
with `store_at="finished"` nothing is remembered between calls (`_candidates` empty),
with "evicted" at most one entry per device block.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from jaxkv._checks import check_host_memory
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHashWithGroupId, get_group_id, make_block_hash_with_group_id
from jaxkv.host_tier import HostKVTier
from jaxkv.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind
from jaxkv.request import Request
from jaxkv.request_hashing import generate_block_hash_extra_keys

__all__ = [
    "SERVED_KINDS",
    "STAT_NAMES",
    "Gathered",
    "STORE_MOMENTS",
    "HostOffload",
    "LoadBatch",
    "PendingStore",
    "StoreBatch",
    "block_digest",
    "host_offloads",
    "wait_for_a_staging",
]

# The KV-cache group kinds the engine's host tier serves.
SERVED_KINDS = (KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW)
# When a block is copied to the host tier (`EngineConfig.kv_offloading_store`): when the
# device pool evicts it, or when a request holding it finishes or is preempted.
STORE_MOMENTS = ("evicted", "finished")


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


@dataclass
class _Found:
    """A request's host hit, as `lookup` found it: blocks `[first, end)` of its prefix,
    each group's `(group, block index)` pairs `targets`."""

    first: int
    end: int
    targets: list[tuple[int, int]]


def _stage(
    buffer: np.ndarray, slots: list[int], digests: list[bytes]
) -> tuple[np.ndarray, list[bytes]]:
    """A load's staging (on the worker thread): the host blocks of `slots`, copied, and
    the checksum of each with its digest."""
    blocks = buffer[slots]
    return blocks, [_checksum(d, b) for d, b in zip(digests, blocks, strict=True)]


@dataclass
class _Load:
    """An admitted request's load: the pinned `keys` (one per target), and the staged
    blocks' rows `rows` going to device blocks `block_ids` of groups `groups` (the
    targets the pool did not leave null); `num_tokens` it serves; `staging` the worker's
    copy and checksums."""

    keys: list[BlockHashWithGroupId]
    block_ids: list[int]
    groups: list[int]
    rows: list[int]
    num_tokens: int
    staging: Future[tuple[np.ndarray, list[bytes]]]


class LoadBatch(NamedTuple):
    """What `take_loads` hands out: the requests whose loads go with the next step
    (`loaded`, their host blocks `blocks`, `[n, *block_shape]`, onto the layers `layers`,
    `[n, layers_per_block]`, of device blocks `block_ids`; None, None: nothing), and
    those whose load failed (`failed`: a verification mismatch or a staging error; their
    pins are released, their device blocks hold nothing loaded)."""

    loaded: list[str]
    failed: list[str]
    block_ids: list[int]
    blocks: np.ndarray | None
    layers: np.ndarray | None


class Gathered(Protocol):
    """Blocks being copied off the device (`ModelRunner.gather_blocks`)."""

    def ready(self) -> bool:
        """Whether `read` would return without waiting."""

    def read(self) -> np.ndarray:
        """The blocks `[n, layers_per_block, *page_shape]` (each its group's layers) as the
        device stores them (waits for the copy)."""


class StoreBatch(NamedTuple):
    """The stores `take_stores` hands out: device block `block_ids[i]`'s layers
    `layers[i]` (`layers_of`) go to host slot `slots[i]` as `keys[i]`, with `digests[i]`."""

    block_ids: list[int]
    layers: np.ndarray
    keys: list[BlockHashWithGroupId]
    slots: list[int]
    digests: list[bytes]


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
    `[num_slots, *block_shape]`). See the module docstring.

    `group_layers[g]`: the indices, in the runner's stacked KV cache, of KV-cache group
    `g`'s layers; a host block of group `g` holds those layers in that order, padded
    with zeros to `block_shape[0]` (the most layers of a group). `block_size`: tokens
    per block, every group's. `loading`: the admitted requests' loads not taken yet,
    by request id (one each), their blocks pinned in the tier; it owns the worker
    thread that stages them (it ends with this object).
    """

    def __init__(
        self,
        tier: HostKVTier,
        group_layers: Sequence[Sequence[int]],
        page_shape: tuple[int, ...],
        dtype: np.dtype,
        block_size: int,
        *,
        store_at: str = "finished",
    ) -> None:
        if store_at not in STORE_MOMENTS:
            raise ValueError(f"store_at must be one of {STORE_MOMENTS}, got {store_at!r}")
        self.tier = tier
        self.block_size = block_size
        self.store_at = store_at
        self.group_layers = [np.asarray(layers, np.intp) for layers in group_layers]
        self.num_layers = sum(len(layers) for layers in group_layers)
        self.layers_per_block = max(len(layers) for layers in group_layers)
        # Row g: the stacked cache's layers a block of group g moves, padded with
        # `num_layers` (the transfers read zeros there and write nothing).
        self.layer_table = np.full(
            (len(group_layers), self.layers_per_block), self.num_layers, np.int32
        )
        for g, layers in enumerate(group_layers):
            self.layer_table[g, : len(layers)] = layers
        block_shape = (self.layers_per_block, *page_shape)
        self.buffer = np.empty((tier.num_slots, *block_shape), dtype)
        self.block_bytes = int(np.prod(block_shape)) * np.dtype(dtype).itemsize
        self.stats: Counter[str] = Counter()
        self._queued = _Store()
        self._queued_keys: set[BlockHashWithGroupId] = set()
        # store_at="evicted": device block id -> (its key, digest, tenant) when a freed
        # request offered it; stale (ignored, replaced) once the block holds another key.
        self._candidates: dict[int, tuple[BlockHashWithGroupId, bytes, str | None]] = {}
        # request id -> the hit its lookup found, until it is admitted or not (`cancel`)
        self._found: dict[str, _Found] = {}
        self._queried: dict[str, int] = {}  # request id -> tokens its lookup asked for
        # request id -> its load, admitted, not yet taken or discarded (admission order)
        self.loading: dict[str, _Load] = {}
        # Stages the loads: numpy copies and hashing release the GIL. One thread keeps
        # them in admission order; its thread ends with this object.
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="jaxkv-host-load")
        self.pending_stores: list[PendingStore] = []

    # -- loads (scheduler) -------------------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (a whole number of blocks) that the
        tier holds for `request`, whole blocks only, leaving at least its last token to
        compute. Nothing is read or pinned yet: `admitted` starts the load, `cancel`
        forgets it."""
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        self._found.pop(request.request_id, None)
        if num_computed_tokens % bs or first >= last:
            return 0
        self._queried[request.request_id] = (last - first) * bs
        end, targets = self._find_hit(request, first, last)
        if not targets:
            return 0
        self._found[request.request_id] = _Found(first, end, targets)
        return (end - first) * bs

    def num_cached_tokens(self, request: Request) -> int:
        """Tokens of `request`'s prefix the tier could serve from its first token, as a
        lookup after no device hit would (nothing pinned, read or verified)."""
        last = (request.num_tokens - 1) // self.block_size
        return self._find_hit(request, 0, last)[0] * self.block_size if last > 0 else 0

    def _find_hit(self, request: Request, first: int, last: int) -> tuple[int, list]:
        """The longest hit end `end` in `(first, last]` (blocks) for which every group has
        the blocks the device pool allocates after a device hit of `first` blocks (module
        docstring), and those `(group, block index)` pairs; `(first, [])`: none."""
        hashes, bs = request.block_hashes, self.block_size

        def key(g: int, i: int) -> BlockHashWithGroupId:
            return make_block_hash_with_group_id(hashes[i], g)

        def start(g: int, end: int) -> int:  # the group's first block to load
            return max(first, self.tier.storable_block_range(g, end * bs).start)

        groups = range(len(self.group_layers))
        # Groups needing every block after the hit, whatever the end, bound it at once.
        windowed = [g for g in groups if start(g, last) > first]
        end = last
        for g in groups:
            if g not in windowed:
                end = first + self.tier.lookup([key(g, i) for i in range(first, end)])
        # runs[g][j]: ready blocks of group g in a row ending at block first + j.
        runs = {}
        for g in windowed:
            count, runs[g] = 0, []
            for i in range(first, end):
                count = count + 1 if self.tier.block_state(key(g, i)) == "ready" else 0
                runs[g].append(count)
        for e in range(end, first, -1):
            if all(runs[g][e - 1 - first] >= e - start(g, e) for g in windowed):
                return e, [(g, i) for g in groups for i in range(start(g, e), e)]
        return first, []

    def admitted(self, request: Request, block_lists: Sequence[Sequence[KVCacheBlock]]) -> bool:
        """`request`, looked up last, is admitted with the device blocks `block_lists` (per
        group, as `allocate_slots` left them, its host hit as connector tokens). When its
        lookup found a hit, that hit's blocks are pinned and their staging starts (the
        worker copies and checksums them); they go to the blocks `allocate_slots` gave
        its connector tokens (one the pool left null, outside a window, is not needed)
        once `take_loads` takes them. Returns whether a load started: the request then
        waits for it. Its lookup counts in the stats from here."""
        request_id = request.request_id
        self.stats["queried_tokens"] += self._queried.pop(request_id, 0)
        found = self._found.pop(request_id, None)
        if found is None:
            return False
        if request_id in self.loading:
            raise ValueError(f"request {request_id!r} is already loading from the host tier")
        hashes, bs = request.block_hashes, self.block_size
        keys = [make_block_hash_with_group_id(hashes[i], g) for g, i in found.targets]
        digests = {i: block_digest(request, i, bs) for _, i in found.targets}
        ids, groups, rows = [], [], []
        for row, (g, i) in enumerate(found.targets):
            block = block_lists[g][i]
            if not block.is_null:
                ids.append(block.block_id)
                groups.append(g)
                rows.append(row)
        slots = self.tier.prepare_load(keys)  # pinned until taken or discarded
        staging = self._stager.submit(
            _stage, self.buffer, slots, [digests[i] for _, i in found.targets]
        )
        num_tokens = (found.end - found.first) * bs
        self.loading[request_id] = _Load(keys, ids, groups, rows, num_tokens, staging)
        return True

    def cancel(self, request: Request) -> None:
        """`request`, looked up last, was not admitted: what its lookup found is
        forgotten (nothing was pinned)."""
        self._queried.pop(request.request_id, None)
        self._found.pop(request.request_id, None)

    def take_loads(self) -> LoadBatch:
        """The loads whose staging has finished, in admission order, verified and
        unpinned; the others keep waiting. A verified load's blocks are handed out to be
        scattered before the next step (in `LoadBatch.blocks`), one failing the check (a
        block whose checksum differs is dropped from the tier, counted) or whose staging
        raised is reported in `LoadBatch.failed`; either way the load is over."""
        loaded, failed, parts = [], [], []
        for request_id, load in list(self.loading.items()):
            if not load.staging.done():
                continue
            del self.loading[request_id]
            try:
                blocks, checksums = load.staging.result()
            except Exception:  # a staging error: the request recomputes, as on a mismatch
                blocks, checksums = None, None
            rejected = self.tier.complete_load(load.keys, checksums)  # unpins
            if blocks is None or rejected:
                self.stats["failed_loads"] += 1
                failed.append(request_id)
                continue
            loaded.append(request_id)
            parts.append((load, blocks[load.rows]))
            self.stats["hit_tokens"] += load.num_tokens
            self.stats["loaded_bytes"] += len(load.rows) * self.block_bytes
        if not parts:
            return LoadBatch(loaded, failed, [], None, None)
        ids = [i for load, _ in parts for i in load.block_ids]
        groups = [g for load, _ in parts for g in load.groups]
        blocks = np.concatenate([rows for _, rows in parts])
        return LoadBatch(loaded, failed, ids, blocks, self.layer_table[groups])

    def discard(self, request: Request) -> None:
        """Drop `request`'s load, if it has one not taken yet (it is freed while waiting):
        its staging is cancelled or, already running, waited for (it reads the pinned
        slots, which a store may reuse once unpinned), then its pins are released."""
        load = self.loading.pop(request.request_id, None)
        if load is None:
            return
        if not load.staging.cancel():
            wait([load.staging])
        self.tier.complete_load(load.keys)

    def layers_of(self, keys: Sequence[BlockHashWithGroupId]) -> np.ndarray:
        """The stacked cache's layers each key's block moves, `[n, layers_per_block]`
        (its group's, padded with `num_layers`)."""
        groups = np.fromiter((get_group_id(key) for key in keys), np.intp, len(keys))
        return self.layer_table[groups]

    # -- stores (scheduler, then engine) ---------------------------------------------

    def request_freed(
        self,
        request: Request,
        block_lists: Sequence[Sequence[KVCacheBlock]],
        device_cached: Callable[[BlockHashWithGroupId], KVCacheBlock | None] | None = None,
    ) -> None:
        """Offer the blocks of `request` (its block lists per group, read before the pool
        frees them) that a hit ending where the group's cached blocks end needs
        (`HostKVTier.storable_block_range`). A block the
        request already released (a sliding window's, now the null block in its list)
        is taken from the device prefix cache, `device_cached(key)` (the block pool's
        `get_one_block`), when still there. `store_at="finished"`: those the tier does
        not hold yet are queued; "evicted": each is remembered with its digest (once per
        key a block holds) until the pool evicts it (`blocks_evicted`). A load the
        request still waits for is discarded first (`discard`)."""
        self.discard(request)
        bs, candidates = self.block_size, self._candidates
        for g, blocks in enumerate(block_lists):
            num_cached = next(
                (i + 1 for i in reversed(range(len(blocks))) if blocks[i].block_hash is not None),
                0,
            )
            for i in self.tier.storable_block_range(g, num_cached * bs):
                block = blocks[i]
                if block.block_hash is None:  # released (null) or not cached
                    key = make_block_hash_with_group_id(request.block_hashes[i], g)
                    block = device_cached(key) if device_cached is not None else None
                    if block is None:
                        continue
                key = block.block_hash
                if self.store_at == "evicted":
                    known = candidates.get(block.block_id)
                    if known is None or known[0] != key:
                        digest = block_digest(request, i, bs)
                        candidates[block.block_id] = (key, digest, request.cache_salt)
                    continue
                if key in self._queued_keys or self.tier.block_state(key) is not None:
                    continue
                self._queue(block.block_id, key, block_digest(request, i, bs), request.cache_salt)

    def blocks_evicted(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`store_at="evicted"` (the block pool's `on_evict`): the device pool is about to
        reuse these cached free blocks, still keyed and holding their bytes; those a
        freed request offered under the key they hold, and the tier does not hold yet,
        are queued (the engine gathers them before the step that reuses them)."""
        candidates = self._candidates
        for block in blocks:
            known = candidates.pop(block.block_id, None)
            if known is None:
                continue
            key, digest, tenant = known
            if key != block.block_hash:  # offered under an older key: stale
                continue
            if key in self._queued_keys or self.tier.block_state(key) is not None:
                continue
            self._queue(block.block_id, key, digest, tenant)

    def _queue(
        self, block_id: int, key: BlockHashWithGroupId, digest: bytes, tenant: str | None
    ) -> None:
        q = self._queued
        self._queued_keys.add(key)
        q.block_ids.append(block_id)
        q.keys.append(key)
        q.digests.append(digest)
        q.tenants.append(tenant)

    def take_stores(self) -> StoreBatch:
        """The queued stores the tier takes, emptied: one batch per tenant, at most its
        quota (the first ones: the leading blocks of a prefix serve the most requests);
        a tenant the tier has no room for stores nothing. The caller gathers the blocks
        now and hands the copy back as a `PendingStore`."""
        q, self._queued = self._queued, _Store()
        self._queued_keys.clear()
        ids, keys, slots, digests = [], [], [], []
        for tenant in dict.fromkeys(q.tenants):
            mine = [i for i, t in enumerate(q.tenants) if t == tenant]
            new = [i for i in mine if self.tier.block_state(q.keys[i]) is None]
            new = new[: self.tier.max_store_blocks(tenant)]
            out = self.tier.prepare_store([q.keys[i] for i in new], tenant)
            if out is None:
                continue
            index = {q.keys[i]: i for i in new}
            for key, slot in zip(out.keys_to_store, out.slots, strict=True):
                i = index[key]
                ids.append(q.block_ids[i])
                keys.append(key)
                slots.append(slot)
                digests.append(q.digests[i])
        return StoreBatch(ids, self.layers_of(keys), keys, slots, digests)

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

    # -- the rest ------------------------------------------------------------------------

    def take_stats(self) -> dict[str, int]:
        """The `STAT_NAMES` counters since the last call; they restart."""
        stats, self.stats = self.stats, Counter()
        return {name: stats[name] for name in STAT_NAMES}

    def reset(self) -> bool:
        """Land the pending stores, drop the queued ones, and clear the tier
        (`AllBlocksCleared`); False, changing nothing, while a request waits for a load."""
        if self.loading:
            return False
        self.complete_stores()
        self._queued = _Store()
        self._queued_keys.clear()
        self._candidates.clear()
        return self.tier.reset()


def wait_for_a_staging(offloads: Sequence[HostOffload]) -> None:
    """Block until a load of any of `offloads` has finished staging (`take_loads` then
    takes it); at once when none is pending."""
    stagings = [load.staging for offload in offloads for load in offload.loading.values()]
    if stagings:
        wait(stagings, return_when=FIRST_COMPLETED)


def host_offloads(config, plan, runner) -> list[HostOffload]:
    """The host tiers an `EngineConfig`'s `kv_offloading_size` asks for, one per data rank
    of the `ModelRunner` (none: off), each of that many bytes, its blocks laid out as
    `HostOffload` says: the groups, layers and page shape of the KV-cache `plan` the
    runner allocated (`jaxkv.engine.sizing.KVCachePlan`). ValueError/TypeError naming
    the setting and what is allowed when the budget, policy, store moment or quotas are
    bad, the model has a KV-cache group of a kind the tier does not serve, or the KV
    cache is on other processes' devices too. With `kv_offloading_store="evicted"` the
    caller sets each rank's block pool's `on_evict` to its `HostOffload.blocks_evicted`."""
    store_at = config.kv_offloading_store
    if store_at not in STORE_MOMENTS:
        raise ValueError(
            f"EngineConfig.kv_offloading_store must be one of {STORE_MOMENTS} (copy a block "
            f"to the host tier when the device pool evicts it, or when a request holding it "
            f"finishes or is preempted); got {store_at!r}"
        )
    size = config.kv_offloading_size
    if size is None:
        return []
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        raise TypeError(
            f"EngineConfig.kv_offloading_size must be an int (bytes) or None, got {size!r}"
        )
    check_host_memory(
        f"EngineConfig.kv_offloading_size ({runner.dp_size} data ranks' tiers)",
        int(size) * runner.dp_size,
    )
    groups = plan.groups
    kinds = [get_kv_cache_spec_kind(g.kv_cache_spec) for g in groups]
    if any(kind not in SERVED_KINDS for kind in kinds):
        raise ValueError(
            f"EngineConfig.kv_offloading_size: the host tier serves KV-cache groups of kinds "
            f"{[k.value for k in SERVED_KINDS]}; this model has {[k.value for k in kinds]}"
        )
    kv = runner.kv_cache
    if not getattr(kv, "is_fully_addressable", True):
        raise ValueError(
            "EngineConfig.kv_offloading_size: the host tier copies blocks through this "
            "process's memory; the KV cache spans devices of other processes"
        )
    group_layers = [
        [layer for layer, g in enumerate(runner.layer_to_group) if g == group_id]
        for group_id in range(len(groups))
    ]
    block_size = groups[0].kv_cache_spec.block_size
    num_layers = max(len(layers) for layers in group_layers)
    block_bytes = num_layers * int(np.prod(plan.page_shape)) * plan.storage_dtype.itemsize
    if size < block_bytes:
        raise ValueError(
            f"EngineConfig.kv_offloading_size must hold at least one block ({block_bytes} "
            f"bytes: {num_layers} layers of {block_size} tokens), got {size}"
        )
    quotas = config.kv_offloading_tenant_quotas
    if quotas is not None and not isinstance(quotas, Mapping):
        raise TypeError(
            "EngineConfig.kv_offloading_tenant_quotas must map cache_salt to bytes, or be "
            f"None; got {quotas!r}"
        )
    offloads = []
    for _ in range(runner.dp_size):
        try:
            tier = HostKVTier(
                block_bytes, int(size), config.kv_offloading_policy, quotas,
                group_specs=[g.kv_cache_spec for g in groups],
            )  # fmt: skip
        except (TypeError, ValueError) as error:
            raise type(error)(f"EngineConfig kv_offloading_*: {error}") from None
        offloads.append(
            HostOffload(
                tier,
                group_layers,
                plan.page_shape,
                plan.storage_dtype,
                block_size,
                store_at=store_at,
            )
        )
    return offloads
