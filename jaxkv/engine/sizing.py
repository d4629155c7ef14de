"""Sizing the engine's KV cache from a memory budget (vLLM's `gpu_memory_utilization` /
`kv_cache_memory_bytes`): how many blocks fit, and the longest `max_model_len` they hold.

Every layer keeps its own cache of `num_blocks` blocks, all KV-cache groups draw from
one pool, and block 0 is the null block. So a budget of `B` bytes per device holds
`B // bytes_per_block` blocks, `bytes_per_block` summed over the layers as stored on one
device (storage dtype, quantisation scales and the mesh's head split included), and one
request of `L` tokens takes its peak blocks from every group, which must fit in the
`num_blocks - 1` usable blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from jaxkv.device import PagedKVCache

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxkv.engine.config import EngineConfig
    from jaxkv.kv_cache_interface import KVCacheConfig

__all__ = ["KVCacheSizing", "device_kv_budget", "size_kv_cache"]

DEFAULT_NUM_BLOCKS = 128  # without a memory budget or an explicit num_blocks


@dataclasses.dataclass(frozen=True)
class KVCacheSizing:
    """What `size_kv_cache` chose, and from what."""

    num_blocks: int
    max_model_len: int
    bytes_per_block: int  # one block of every layer, on one device
    budget_bytes: int | None  # None: num_blocks was given

    def describe(self) -> str:
        """One line saying what was chosen, for the command to print."""
        budget = "" if self.budget_bytes is None else f" in {self.budget_bytes:,} bytes"
        return (
            f"KV cache: {self.num_blocks} blocks of {self.bytes_per_block:,} bytes per "
            f"device{budget}; max_model_len {self.max_model_len}"
        )


def device_kv_budget(memory_utilization: float, devices) -> int:
    """Bytes per device for the KV cache: `memory_utilization` of the device's memory
    less what is in use (the weights), as `memory_stats()` reports; ValueError where the
    device reports none (CPU): give `kv_cache_memory` instead."""
    budgets = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            raise ValueError(
                f"memory_utilization needs the device's memory size, which {device} does not "
                "report; give kv_cache_memory (bytes per device) instead"
            )
        budgets.append(
            int(stats["bytes_limit"] * memory_utilization) - int(stats.get("bytes_in_use", 0))
        )
    return min(budgets)


def longest_model_len(
    blocks_per_request: Callable[[int], int], usable_blocks: int, limit: int
) -> int:
    """The longest length `L <= limit` with `blocks_per_request(L) <= usable_blocks`
    (0 if none); `blocks_per_request` never falls as `L` grows."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_per_request(mid) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_kv_cache(
    config: EngineConfig,
    kv_cache_config: KVCacheConfig,
    layer_to_group: tuple[int, ...],
    model_max_len: int | None,
    mesh: Mesh | None,
    kv_quant: str | None,
) -> KVCacheSizing:
    """`num_blocks` and `max_model_len` for `config`: given ones are checked, missing ones
    derived (module docstring). ValueError, naming the budget, the bytes per block and the
    longest `max_model_len` that fits, when one request of `max_model_len` cannot fit."""
    groups = kv_cache_config.kv_cache_groups
    block_bytes = [
        PagedKVCache(g.kv_cache_spec, 2, mesh=mesh, kv_quant=kv_quant).bytes_per_block
        for g in groups
    ]
    bytes_per_block = sum(block_bytes[g] for g in layer_to_group)
    budget = config.kv_cache_memory
    if budget is None and config.memory_utilization is not None:
        devices = mesh.devices.flat if mesh is not None else jax.local_devices()[:1]
        budget = device_kv_budget(config.memory_utilization, devices)
    if config.num_blocks is not None:
        num_blocks, budget = config.num_blocks, None
    elif budget is not None:
        num_blocks = budget // bytes_per_block
    else:
        num_blocks = DEFAULT_NUM_BLOCKS
    unit = (
        f"kv_cache_memory={budget:,} bytes hold {num_blocks} blocks of {bytes_per_block:,} "
        "bytes per device"
        if budget is not None
        else f"num_blocks={num_blocks}"
    )
    if num_blocks < 2:
        raise ValueError(f"{unit}; at least 2 are needed (block 0 is the null block)")

    def blocks_per_request(length: int) -> int:
        batch = min(config.max_num_batched_tokens, max(length, 1))
        return sum(g.kv_cache_spec.max_num_blocks_per_req(length, batch) for g in groups)

    # A model that states no length limit is capped where full attention would be.
    limit = (
        config.max_model_len
        or model_max_len
        or num_blocks * max(g.kv_cache_spec.block_size for g in groups)
    )
    longest = longest_model_len(blocks_per_request, num_blocks - 1, limit)
    if config.max_model_len is None:
        if longest < 2:
            raise ValueError(f"{unit}: too few for a request of 2 tokens")
        return KVCacheSizing(num_blocks, longest, bytes_per_block, budget)
    if longest < config.max_model_len:
        need = blocks_per_request(config.max_model_len)
        raise ValueError(
            f"{unit}; one request of max_model_len={config.max_model_len} tokens takes "
            f"{need} blocks over the model's {len(groups)} KV-cache groups (block 0 is the "
            f"null block: num_blocks >= {need + 1}, or {(need + 1) * bytes_per_block:,} "
            f"bytes); the longest max_model_len that fits is {longest}"
        )
    return KVCacheSizing(num_blocks, config.max_model_len, bytes_per_block, budget)
