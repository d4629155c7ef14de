"""Host-memory KV tier: the bookkeeping of blocks offloaded from the device pool.

Host-only (no JAX): this module decides which blocks live in host memory, in
which host slot, and which are safe to read or evict. Copying the bytes
between device pages and host slots is the device side's job; the manager
only hands out slot numbers and is told when a copy has finished.

The API follows vLLM's offloading manager (`vllm/v1/kv_offload`):
`lookup`, `prepare_load`/`complete_load`, `touch`, `prepare_store`/
`complete_store`, `take_events`, plus `reset` and `stats`. Keys are the
device pool's keys, `make_block_hash_with_group_id(block_hash, group_id)`.

How the engine uses it (`jaxkv.engine.offload.HostOffload`, one tier per data
rank, called by the scheduler and the engine's step):

1. On admission, after the device prefix hit, each group's block keys that follow
   it are looked up (`lookup`, `block_state`); the longest hit every group can
   serve (full attention: every block after the device hit; sliding window: the
   blocks of the window before the hit's end, `storable_block_range`); its tokens go
   to `allocate_slots(num_external_computed_tokens=...)` and its keys are pinned
   with `prepare_load` while a worker thread reads their slots out of the host
   buffer (the request waits meanwhile). `complete_load(keys, checksums)` verifies
   what was read: a rejected key (a verified-hit mismatch) is dropped, never used,
   and that request recomputes; otherwise the copy is scattered into the request's
   device blocks before a step. A load abandoned (its request aborted) ends with
   `complete_load(keys)`, unverified.
2. When a request finishes or is preempted (or, with the engine's
   `kv_offloading_store="evicted"`, when the device pool evicts them), each group's
   cached blocks that a hit ending at its last full block needs
   (`storable_block_range`) and the tier does not hold are offered to
   `prepare_store` (one batch per tenant, at most its quota); the device blocks
   are gathered at once, and `complete_store(keys, success, checksums)` is called
   when the copy has landed.
3. `take_events` is drained with the rank's device pool's events, so routers see
   `medium="CPU"` entries next to the `"GPU"` ones.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

from jaxkv._checks import DEFAULT_TENANT_QUOTA_KEY, check_int, check_str, check_tenant_quota_key
from jaxkv.hashing import BlockHashWithGroupId, get_block_hash, get_group_id
from jaxkv.kv_cache_interface import (
    KVCacheSpec,
    KVCacheSpecKind,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# vLLM's name for the host-memory tier in KV events.
MEDIUM_CPU = "CPU"

HostTierPolicy = Literal["lru", "arc"]
POLICIES: tuple[str, ...] = ("lru", "arc")

# Group kinds whose blocks the tier stores: full attention (blocks of the whole
# prefix) and sliding window (only blocks inside the window are worth storing).
STORABLE_KINDS = frozenset(
    {
        KVCacheSpecKind.FULL_ATTENTION,
        KVCacheSpecKind.MLA_ATTENTION,
        KVCacheSpecKind.SLIDING_WINDOW,
        KVCacheSpecKind.SLIDING_WINDOW_MLA,
    }
)

_GROUP_ID_BYTES = 4


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What `prepare_store` decided: the keys to copy out, in the order given, the
    host slot of each (same order), and the keys evicted to make room."""

    keys_to_store: list[BlockHashWithGroupId]
    slots: list[int]
    evicted_keys: list[BlockHashWithGroupId]


@dataclass
class TenantStats:
    """One tenant's (`cache_salt`'s) use of the tier; quota None: no per-tenant cap."""

    quota_bytes: int | None
    bytes_used: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    verify_mismatches: int = 0


@dataclass
class HostTierStats:
    """Counters since construction (kept across `reset`) and the current byte use."""

    capacity_bytes: int
    bytes_used: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    store_refusals: int = 0
    verify_mismatches: int = 0
    tenants: dict[str | None, TenantStats] = field(default_factory=dict)


def combined_stats(stats: Sequence[HostTierStats]) -> HostTierStats:
    """Several tiers' stats (one per data rank) as one: every count and byte figure
    summed, per tenant too (a tenant's quota: the sum of its per-tier quotas)."""
    total = HostTierStats(capacity_bytes=0)
    for one in stats:
        _add_counts(total, one)
        for tenant, t in one.tenants.items():
            mine = total.tenants.get(tenant)
            if mine is None:
                total.tenants[tenant] = dataclasses.replace(t)
                continue
            if t.quota_bytes is not None:
                mine.quota_bytes = (mine.quota_bytes or 0) + t.quota_bytes
            _add_counts(mine, t)
    return total


def _add_counts(total: HostTierStats | TenantStats, one: HostTierStats | TenantStats) -> None:
    """Add `one`'s int figures (not a tenant's quota) to `total`'s."""
    for f in dataclasses.fields(one):
        value = getattr(one, f.name)
        if f.name != "quota_bytes" and isinstance(value, int):
            setattr(total, f.name, getattr(total, f.name) + value)


@dataclass
class _Entry:
    slot: int
    tenant: str | None
    ready: bool = False
    ref_cnt: int = 0
    # A verified-hit mismatch: never served again, dropped when its last load ends.
    dropped: bool = False
    checksum: bytes | None = None


class HostKVTier:
    """The host-memory KV tier's manager (see the module docstring for its use).

    Capacity is `capacity_bytes // block_bytes` slots of `block_bytes` each.
    Every key is in exactly one state: absent, *pending* (`prepare_store`
    gave it a slot; not readable until `complete_store`), *ready* (readable),
    or *dropped* (failed verification while loads were in flight; never
    served, freed when its last load completes).

    Invariants, after every call:

    - bytes used (held slots times `block_bytes`) <= the budget;
    - a block with a reference count > 0 (between `prepare_load` and
      `complete_load`) or a pending store is never evicted;
    - a tenant with a quota holds <= its quota: a store over it evicts that
      tenant's own least recently used blocks first, so one tenant's traffic
      never takes more than its quota of the budget from the others;
    - only ready blocks are found by `lookup` or pinned by `prepare_load`;
    - events come out of `take_events` in the order the changes happened:
      `BlockRemoved` for each eviction or dropped block, `BlockStored` when a
      store completes, `AllBlocksCleared` on `reset`, all with `medium="CPU"`.

    Eviction under the global budget follows `policy`: "lru" (least recently
    touched first) or "arc" (adaptive replacement: blocks touched again move to
    a frequent list that a one-pass scan cannot flush). Bad arguments raise a
    `TypeError`/`ValueError` naming the argument, before any state changes.
    """

    def __init__(
        self,
        block_bytes: int,
        capacity_bytes: int,
        policy: HostTierPolicy = "lru",
        tenant_quota_bytes: Mapping[str, int] | None = None,
        *,
        group_specs: Sequence[KVCacheSpec],
    ) -> None:
        block_bytes = check_int("block_bytes", block_bytes, min_value=1)
        capacity_bytes = check_int("capacity_bytes", capacity_bytes, min_value=0)
        if capacity_bytes < block_bytes:
            raise ValueError(
                f"capacity_bytes must hold at least one block (>= block_bytes = "
                f"{block_bytes}), got {capacity_bytes}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        quotas: dict[str, int] = {}
        if tenant_quota_bytes is not None:
            if not isinstance(tenant_quota_bytes, Mapping):
                raise TypeError(
                    f"tenant_quota_bytes must be a mapping of cache_salt to bytes or None, "
                    f"got {tenant_quota_bytes!r}"
                )
            for tenant, quota in tenant_quota_bytes.items():
                check_tenant_quota_key("tenant_quota_bytes", tenant)
                quotas[tenant] = check_int(
                    f"tenant_quota_bytes[{tenant!r}]",
                    quota,
                    min_value=block_bytes,
                    max_value=capacity_bytes,
                )
        self._group_specs = list(group_specs)
        if not self._group_specs:
            raise ValueError("group_specs must name at least one KV cache group, got none")
        for group_id, spec in enumerate(self._group_specs):
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(f"group_specs[{group_id}] must be a KVCacheSpec, got {spec!r}")
            kind = get_kv_cache_spec_kind(spec)
            if kind not in STORABLE_KINDS:
                raise ValueError(
                    f"group_specs[{group_id}] is a {kind.value!r} group; the host tier stores "
                    f"only full-attention and sliding-window groups "
                    f"({sorted(k.value for k in STORABLE_KINDS)})"
                )
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.num_slots = capacity_bytes // block_bytes
        self._quotas = quotas  # bytes; DEFAULT_TENANT_QUOTA_KEY: every salt not listed
        self._entries: dict[BlockHashWithGroupId, _Entry] = {}
        # Least recently touched first: the "lru" order and each tenant's quota order.
        self._recency: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        # ARC: T1 (seen once), T2 (touched again), their ghosts B1/B2, T1's target size.
        self._t1: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._t2: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._b1: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._b2: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._target_t1 = 0.0
        self._next_fresh_slot = 0
        self._free_slots: list[int] = []
        self._tenant_blocks: dict[str | None, int] = {}
        self._events: list[KVCacheEvent] = []
        self._stats = HostTierStats(capacity_bytes=capacity_bytes)
        for tenant, quota in quotas.items():
            if tenant != DEFAULT_TENANT_QUOTA_KEY:
                self._stats.tenants[tenant] = TenantStats(quota_bytes=quota)

    # -- inspection ----------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Bytes of the held slots (pending, ready and dropped blocks)."""
        return len(self._entries) * self.block_bytes

    def tenant_bytes_used(self, tenant: str | None) -> int:
        return self._tenant_blocks.get(tenant, 0) * self.block_bytes

    def _quota_bytes(self, tenant: str | None) -> int | None:
        """`tenant`'s byte quota: its own, else the default key's; None (no cap) for
        unsalted blocks and when neither is given."""
        if tenant is None:
            return None
        return self._quotas.get(tenant, self._quotas.get(DEFAULT_TENANT_QUOTA_KEY))

    def max_store_blocks(self, tenant: str | None = None) -> int:
        """The most new blocks one `prepare_store` of `tenant` can take (its quota in
        blocks, else every slot); a larger batch is refused whole."""
        tenant = check_str("tenant", tenant, allow_none=True)
        quota = self._quota_bytes(tenant)
        return self.num_slots if quota is None else quota // self.block_bytes

    def block_state(self, key: BlockHashWithGroupId) -> str | None:
        """ "pending", "ready" or "dropped"; None for a key the tier does not hold."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return "dropped" if entry.dropped else "ready" if entry.ready else "pending"

    def ref_count(self, key: BlockHashWithGroupId) -> int:
        """Loads in flight for `key` (0 for a key the tier does not hold)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.ref_cnt

    def stats(self) -> HostTierStats:
        """A snapshot of the counters and byte use, overall and per tenant."""
        tenants = {
            tenant: TenantStats(
                quota_bytes=s.quota_bytes,
                bytes_used=self.tenant_bytes_used(tenant),
                blocks_stored=s.blocks_stored,
                blocks_evicted=s.blocks_evicted,
                verify_mismatches=s.verify_mismatches,
            )
            for tenant, s in self._stats.tenants.items()
        }
        s = self._stats
        return HostTierStats(
            capacity_bytes=s.capacity_bytes,
            bytes_used=self.bytes_used,
            blocks_stored=s.blocks_stored,
            blocks_evicted=s.blocks_evicted,
            store_refusals=s.store_refusals,
            verify_mismatches=s.verify_mismatches,
            tenants=tenants,
        )

    def storable_block_range(self, group_id: int, num_tokens: int) -> range:
        """Indices of the blocks worth storing for a request with `num_tokens` computed
        tokens: every full block for full attention; for a sliding window, the full
        blocks the next token can still attend to (those the device manager keeps).
        For `num_tokens` a whole number of blocks: the blocks a prefix hit of
        `num_tokens` tokens needs from this group."""
        group_id = self._check_group_id("group_id", group_id)
        num_tokens = check_int("num_tokens", num_tokens, min_value=0)
        spec = self._group_specs[group_id]
        # None for full attention (and for a group whose layers' windows differ, where
        # storing every block is the safe choice).
        window = get_kv_cache_spec_sliding_window(spec)
        first_token = 0 if window is None else max(0, num_tokens - window + 1)
        return range(first_token // spec.block_size, num_tokens // spec.block_size)

    # -- loads ---------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockHashWithGroupId]) -> int:
        """How many of `keys`, from the first, are ready in the tier (stops at the first
        absent, pending or dropped one). Changes nothing."""
        keys = self._check_keys("keys", keys)
        hits = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready or entry.dropped:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: Sequence[BlockHashWithGroupId]) -> list[int]:
        """Pin `keys` (all ready) for reading: each one's reference count goes up, so it
        is not evicted until `complete_load`. Returns their host slots, in order."""
        keys = self._check_keys("keys", keys)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready or entry.dropped:
                raise ValueError(
                    f"keys must all be ready in the host tier (lookup them first); "
                    f"{key.hex()} is {self.block_state(key) or 'absent'}"
                )
        slots = []
        for key in keys:
            entry = self._entries[key]
            entry.ref_cnt += 1
            slots.append(entry.slot)
        return slots

    def complete_load(
        self,
        keys: Sequence[BlockHashWithGroupId],
        checksums: Sequence[bytes] | None = None,
    ) -> list[BlockHashWithGroupId]:
        """End loads begun by `prepare_load` (one reference each) and verify them.

        `checksums`: the checksum of the KV bytes each load read (same order as
        `keys`), checked against the one its store claimed; a mismatch (or a block
        stored without a checksum) is dropped: counted in the stats, a
        `BlockRemoved` event, never served again, its slot freed when its last load
        ends. Returns the rejected keys, which the caller must not use.
        """
        keys = self._check_keys("keys", keys)
        checksums = self._check_checksums(keys, checksums)
        pins: dict[BlockHashWithGroupId, int] = {}
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        for key, count in pins.items():
            if self.ref_count(key) < count:
                raise ValueError(
                    f"keys must each have been pinned by prepare_load; {key.hex()} has "
                    f"{self.ref_count(key)} load(s) in flight, {count} completed"
                )
        rejected = []
        for i, key in enumerate(keys):
            entry = self._entries[key]
            entry.ref_cnt -= 1
            if checksums is not None and checksums[i] != entry.checksum:
                rejected.append(key)
                if not entry.dropped:
                    entry.dropped = True
                    self._stats.verify_mismatches += 1
                    self._tenant_stats(entry.tenant).verify_mismatches += 1
                    self._events.append(self._removed_event(key))
            if entry.dropped and entry.ref_cnt == 0:
                self._forget(key, ghost=False)
        return rejected

    def touch(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        """Mark held `keys` as just used (absent ones are ignored); the first key ends
        most recent, so a prefix's later blocks go before its earlier ones. Under ARC a
        block touched again moves to the frequent list."""
        keys = self._check_keys("keys", list(keys))
        for key in reversed(keys):
            if key not in self._entries:
                continue
            self._recency.move_to_end(key)
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    # -- stores --------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[BlockHashWithGroupId], tenant: str | None = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the `keys` the tier does not hold yet, as pending stores of
        `tenant` (the request's `cache_salt`; None: no tenant).

        Evicts what it must: first `tenant`'s own least recently used blocks while
        its quota would be exceeded, then blocks by the tier's policy while the
        budget would be. Neither `keys` nor pinned or pending blocks are evicted.
        Returns None, changing nothing, when the room cannot be made.
        """
        keys = self._check_keys("keys", keys)
        tenant = check_str("tenant", tenant, allow_none=True)
        protected = set(keys)
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._entries))
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], slots=[], evicted_keys=[])
        victims: list[BlockHashWithGroupId] = []
        quota = self._quota_bytes(tenant)
        if quota is not None:
            quota //= self.block_bytes
            over = self._tenant_blocks.get(tenant, 0) + len(new_keys) - quota
            if over > 0:
                candidates = (
                    k
                    for k in self._recency
                    if self._entries[k].tenant == tenant and self._evictable(k, protected)
                )
                victims = list(islice(candidates, over))
                if len(victims) < over:
                    self._stats.store_refusals += 1
                    return None
        over = len(self._entries) - len(victims) + len(new_keys) - self.num_slots
        if over > 0:
            more = self._policy_victims(over, protected | set(victims))
            if more is None:
                self._stats.store_refusals += 1
                return None
            victims += more
        for key in victims:
            self._tenant_stats(self._entries[key].tenant).blocks_evicted += 1
            self._forget(key, ghost=True)
            self._events.append(self._removed_event(key))
        self._stats.blocks_evicted += len(victims)
        slots = []
        for key in new_keys:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot, self._next_fresh_slot = self._next_fresh_slot, self._next_fresh_slot + 1
            self._entries[key] = _Entry(slot=slot, tenant=tenant)
            self._tenant_blocks[tenant] = self._tenant_blocks.get(tenant, 0) + 1
            self._recency[key] = None
            self._arc_insert(key)
            slots.append(slot)
        return PrepareStoreOutput(keys_to_store=new_keys, slots=slots, evicted_keys=victims)

    def complete_store(
        self,
        keys: Sequence[BlockHashWithGroupId],
        success: bool = True,
        checksums: Sequence[bytes] | None = None,
    ) -> None:
        """Finish stores begun by `prepare_store`: on success each pending key becomes
        ready (a `BlockStored` event) and keeps its `checksums` entry, the checksum
        of the KV bytes it claims to hold, for `complete_load` to verify; on failure
        the pending keys are forgotten (never announced, so no event). Keys not
        pending are ignored."""
        keys = self._check_keys("keys", keys)
        checksums = self._check_checksums(keys, checksums)
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if not success:
                self._forget(key, ghost=False)
                continue
            entry.ready = True
            entry.checksum = None if checksums is None else checksums[i]
            self._stats.blocks_stored += 1
            self._tenant_stats(entry.tenant).blocks_stored += 1
            self._events.append(self._stored_event(key))

    # -- events and reset ----------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def reset(self) -> bool:
        """Forget every block (an `AllBlocksCleared` event) and ARC's history. Only
        allowed when no load or store is in flight: False, changing nothing, else."""
        if any(e.ref_cnt or not e.ready for e in self._entries.values()):
            return False
        for tracked in (self._entries, self._recency, self._t1, self._t2, self._b1, self._b2):
            tracked.clear()
        self._tenant_blocks.clear()
        self._target_t1 = 0.0
        self._next_fresh_slot = 0
        self._free_slots.clear()
        self._events.append(AllBlocksCleared())
        return True

    # -- internals -----------------------------------------------------------

    def _evictable(self, key: BlockHashWithGroupId, protected: set[BlockHashWithGroupId]) -> bool:
        entry = self._entries[key]
        return entry.ready and entry.ref_cnt == 0 and not entry.dropped and key not in protected

    def _policy_victims(
        self, n: int, protected: set[BlockHashWithGroupId]
    ) -> list[BlockHashWithGroupId] | None:
        """`n` evictable keys in the policy's order (state unchanged), or None."""
        if self.policy == "lru":
            victims = list(islice(self._lru_candidates(self._recency, protected), n))
            return victims if len(victims) == n else None
        # ARC: from T1 while it is at or over its target, else from T2; the other
        # list when the preferred one has nothing evictable.
        t1 = self._lru_candidates(self._t1, protected)
        t2 = self._lru_candidates(self._t2, protected)
        t1_size = len(self._t1)
        victims = []
        for _ in range(n):
            key = next(t1, None) if t1_size >= int(self._target_t1) else None
            if key is None:
                key = next(t2, None)
            if key is None:
                key = next(t1, None)
            if key is None:
                return None
            if key in self._t1:
                t1_size -= 1
            victims.append(key)
        return victims

    def _lru_candidates(
        self, order: Iterable[BlockHashWithGroupId], protected: set[BlockHashWithGroupId]
    ) -> Iterable[BlockHashWithGroupId]:
        return (k for k in order if self._evictable(k, protected))

    def _arc_insert(self, key: BlockHashWithGroupId) -> None:
        """A new block enters T1, or T2 when ARC remembers evicting it (a ghost hit,
        which moves T1's target towards the list it was evicted from)."""
        if key in self._b1:
            self._target_t1 = min(
                self._target_t1 + max(1.0, len(self._b2) / len(self._b1)), self.num_slots
            )
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._target_t1 = max(self._target_t1 - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def _forget(self, key: BlockHashWithGroupId, *, ghost: bool) -> None:
        """Drop `key`'s entry and free its slot; `ghost`: ARC remembers the eviction."""
        entry = self._entries.pop(key)
        self._free_slots.append(entry.slot)
        self._tenant_blocks[entry.tenant] -= 1
        if not self._tenant_blocks[entry.tenant]:
            del self._tenant_blocks[entry.tenant]
        del self._recency[key]
        ghosts = self._b1 if key in self._t1 else self._b2
        self._t1.pop(key, None)
        self._t2.pop(key, None)
        if ghost and self.policy == "arc":
            ghosts[key] = None
            if len(ghosts) > self.num_slots:
                ghosts.popitem(last=False)

    def _tenant_stats(self, tenant: str | None) -> TenantStats:
        stats = self._stats.tenants.get(tenant)
        if stats is None:
            stats = self._stats.tenants[tenant] = TenantStats(quota_bytes=self._quota_bytes(tenant))
        return stats

    def _stored_event(self, key: BlockHashWithGroupId) -> BlockStored:
        # As vLLM's offloading connector emits a host block it has no token metadata
        # for: the bare hash, no tokens, block_size 0, and the group's description.
        spec = self._group_specs[get_group_id(key)]
        return BlockStored(
            block_hashes=[get_block_hash(key)],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=MEDIUM_CPU,
            group_idx=get_group_id(key),
            kv_cache_spec_kind=get_kv_cache_spec_kind(spec).value,
            kv_cache_spec_sliding_window=get_kv_cache_spec_sliding_window(spec),
        )

    @staticmethod
    def _removed_event(key: BlockHashWithGroupId) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[get_block_hash(key)], medium=MEDIUM_CPU, group_idx=get_group_id(key)
        )

    def _check_group_id(self, name: str, group_id: int) -> int:
        return check_int(name, group_id, min_value=0, max_value=len(self._group_specs) - 1)

    def _check_keys(
        self, name: str, keys: Sequence[BlockHashWithGroupId]
    ) -> list[BlockHashWithGroupId]:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise TypeError(f"{name} must be a sequence of block keys, got {keys!r}")
        for key in keys:
            if not isinstance(key, bytes) or len(key) <= _GROUP_ID_BYTES:
                raise TypeError(
                    f"{name} must hold make_block_hash_with_group_id keys (bytes), got {key!r}"
                )
            if get_group_id(key) >= len(self._group_specs):
                raise ValueError(
                    f"{name} must hold keys of groups 0..{len(self._group_specs) - 1}, got "
                    f"group {get_group_id(key)}"
                )
        return list(keys)

    @staticmethod
    def _check_checksums(
        keys: list[BlockHashWithGroupId], checksums: Sequence[bytes] | None
    ) -> list[bytes] | None:
        if checksums is None:
            return None
        if isinstance(checksums, (bytes, str)) or not isinstance(checksums, Sequence):
            raise TypeError(f"checksums must be a sequence of bytes or None, got {checksums!r}")
        if len(checksums) != len(keys):
            raise ValueError(
                f"checksums must have one entry per key ({len(keys)}), got {len(checksums)}"
            )
        if not all(isinstance(c, bytes) for c in checksums):
            raise TypeError(f"checksums must hold bytes, got {checksums!r}")
        return list(checksums)
