"""The engine's side of the host-memory KV tiers (`jaxkv.engine.offload`), one per data
rank: when their stores are dispatched and completed, what routing and the stats read
from them, and their reset.

Invariants: a block queued for a tier is gathered (one device gather for all ranks)
before any later step can write into it: `store_freed_blocks` runs right after each
`schedule()` and again after each step's token update; a tier's store of step `s`
completes once the device has finished step `s`. Without tiers every call is a no-op.
"""

from __future__ import annotations

import time
from collections import Counter

from jaxkv.engine.model_runner import ModelRunner
from jaxkv.engine.offload import HostOffload, PendingStore, wait_for_a_staging
from jaxkv.host_tier import combined_stats
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.request import Request

__all__ = ["EngineTiers"]


class EngineTiers:
    """The data ranks' host tiers (`offloads[k]`: rank `k`'s; none: off)."""

    def __init__(
        self, offloads: list[HostOffload], runner: ModelRunner, managers: list[KVCacheManager]
    ) -> None:
        self.offloads, self.runner, self.managers = offloads, runner, managers
        for rank, offload in enumerate(offloads):
            if offload.store_at == "evicted":  # stores at the pool's evictions
                managers[rank].block_pool.on_evict = offload.blocks_evicted

    def complete_stores(self, before_step: int | None) -> None:
        """Complete the stores gathered before step `before_step` (None: all of them)."""
        for offload in self.offloads:
            offload.complete_stores(before_step=before_step)

    def store_freed_blocks(self, step: int) -> None:
        """Start copying the blocks queued for each rank's tier (freed requests' or, with
        `kv_offloading_store="evicted"`, those `schedule()` just evicted; one gather for
        all ranks, dispatched now, so it reads them before this or any later step writes
        there); see `HostOffload.take_stores`."""
        if not self.offloads:
            return
        stores = [offload.take_stores() for offload in self.offloads]
        if not any(store.block_ids for store in stores):
            return
        gathered = self.runner.gather_blocks(
            [store.block_ids for store in stores], [store.layers for store in stores]
        )
        for offload, store, blocks in zip(self.offloads, stores, gathered, strict=True):
            if store.block_ids:
                offload.pending_stores.append(
                    PendingStore(store.keys, store.slots, store.digests, blocks, step)
                )

    def wait_for_a_staging(self) -> float:
        """With nothing running and nothing in flight, wait until a pending load is staged
        (the next step takes it) rather than step empty meanwhile; the seconds waited."""
        if not self.offloads:
            return 0.0
        start = time.perf_counter()
        wait_for_a_staging(self.offloads)
        return time.perf_counter() - start

    def num_cached_tokens(self, rank: int, request: Request) -> int:
        """Tokens of `request`'s prefix data rank `rank` holds, in its device pool or its
        host tier (the more of the two): what routing a new request weighs."""
        device = self.managers[rank].get_num_cached_prefix_tokens(request)
        if not self.offloads:
            return device
        return max(device, self.offloads[rank].num_cached_tokens(request))

    def take_stats(self) -> Counter:
        """The tiers' counters since the last call, summed over the ranks."""
        host: Counter = Counter()
        for offload in self.offloads:
            host.update(offload.take_stats())
        return host

    def snapshot(self):
        """Device cached blocks per salt (all ranks; None: not counted), the device caps
        (None: off) and the host tiers' stats summed over the ranks (None: off), for
        `EngineStats.tenants()`."""
        pools = [manager.block_pool for manager in self.managers]
        caps = pools[0].tenant_block_quotas
        device: dict[str, int] | None = None
        if caps is not None:
            device = {}
            for pool in pools:
                for salt, n in pool.tenant_cached_blocks().items():
                    device[salt] = device.get(salt, 0) + n
        host = combined_stats([o.tier.stats() for o in self.offloads]) if self.offloads else None
        return device, caps, host

    def reset(self) -> bool:
        """Clear every tier (after the device pools were reset); False where one holds
        blocks a request still loads."""
        return all([offload.reset() for offload in self.offloads])

    def warm_up(self) -> None:
        """Compile the tiers' transfer programs (nothing without tiers)."""
        if self.offloads:
            self.runner.warm_up_transfers(self.offloads[0].layers_per_block)
