"""Comparable snapshots of the host structures' whole state, for "a raised error changes
nothing" checks (imported by several test modules)."""

from __future__ import annotations

from jaxkv import BlockPool, KVCacheManager
from jaxkv.blocks import FreeKVCacheBlockQueue


def queue_state(queue: FreeKVCacheBlockQueue) -> tuple:
    """Order, both link directions and the count of a free queue."""
    forward = [b.block_id for b in queue.get_all_free_blocks()]
    backward = []
    block = queue.tail.prev_free_block
    while block is not None and block is not queue.head:
        backward.append(block.block_id)
        block = block.prev_free_block
    return forward, backward[::-1], queue.num_free_blocks


def pool_state(pool: BlockPool) -> tuple:
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.is_null) for b in pool.blocks],
        queue_state(pool.free_block_queue),
        sorted((k, [b.block_id for b in v]) for k, v in pool.cached_block_hash_to_block.items()),
        list(pool.kv_event_queue),
        sorted(pool._freed_block_ids),
    )


def manager_state(manager: KVCacheManager) -> tuple:
    return (
        pool_state(manager.block_pool),
        [
            (
                {r: [b.block_id for b in bs] for r, bs in m.req_to_blocks.items()},
                dict(m.num_cached_block),
            )
            for m in manager.coordinator.single_type_managers
        ],
        {id(r): s for r, s in manager._slot_states.items()},
        dict(manager._running),
    )


def encoder_state(manager) -> tuple:
    """Everything an encoder cache manager's behaviour depends on, comparable."""
    return (
        manager.num_free_slots,
        getattr(manager, "num_freeable_slots", None),
        {k: set(v) for k, v in getattr(manager, "cached", {}).items()},
        list(getattr(manager, "freeable", {}).items()),
        list(getattr(manager, "freed", [])),
        list(getattr(manager, "allocated", [])),
        {k: dict(v) for k, v in manager._held.items()},
    )
