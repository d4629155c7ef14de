"""The engine's one KV-cache plan (`plan_kv_cache`): from the model's KV-cache specs, the
KV quantisation, the mesh and a memory budget (vLLM's `gpu_memory_utilization` /
`kv_cache_memory_bytes`) or an explicit `num_blocks`, the `KVCacheConfig` (groups,
`num_blocks`, one tensor per layer), the longest `max_model_len` and the bytes per block
per device. The engine build, its `ModelRunner`, its host tier and `jaxkv plan` (with or
without `--mesh` / `--topology`) all take this plan; nothing is allocated to make it.

Every layer keeps its own cache of `num_blocks` blocks, all KV-cache groups draw from
one pool, and block 0 is the null block. So a budget of `B` bytes per device holds
`B // bytes_per_block` blocks, `bytes_per_block` summed over the layers as stored on one
device (`jaxkv.device.page_geometry`: storage dtype, quantisation scales, the
mesh's head split and a TPU's tile padding, the arithmetic `PagedKVCache` itself uses),
and one request of `L` tokens takes its peak blocks from every group, which must fit in
the `num_blocks - 1` usable blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxkv.device.page_geometry import page_geometry
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)
from jaxkv.kv_cache_planning import get_kv_cache_groups

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxkv.engine.config import EngineConfig

__all__ = ["KVCachePlan", "device_kv_budget", "kv_cache_groups", "plan_kv_cache"]

DEFAULT_NUM_BLOCKS = 128  # without a memory budget or an explicit num_blocks


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """The KV cache the engine allocates, and what it was sized from.

    Invariants: `kv_cache_config.num_blocks` blocks per data rank, one tensor per layer
    (layer `i`, the `i`-th entry of the specs, in group `layer_to_group[i]`); one request
    of `max_model_len` tokens fits in the `num_blocks - 1` usable blocks;
    `bytes_per_block` is one block of every layer on one device; every group's pages
    have `page_shape` (all heads) and `storage_dtype`.
    """

    kv_cache_config: KVCacheConfig
    layer_to_group: tuple[int, ...]
    max_model_len: int
    bytes_per_block: int
    budget_bytes: int | None  # None: num_blocks was given
    kv_quant: str | None  # None: stored in the model's dtype
    mesh: Mesh | None  # None: this process's first device
    page_shape: tuple[int, int, int]  # (block_size, 2 * kv_heads, head_size [+ scales])
    storage_dtype: np.dtype

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self.kv_cache_config.kv_cache_groups

    def describe(self) -> str:
        """One line saying what was chosen, for the command to print."""
        budget = "" if self.budget_bytes is None else f" in {self.budget_bytes:,} bytes"
        return (
            f"KV cache: {self.num_blocks} blocks of {self.bytes_per_block:,} bytes per "
            f"device{budget}; max_model_len {self.max_model_len}"
        )


def kv_cache_groups(
    specs: Mapping[str, KVCacheSpec],
) -> tuple[tuple[KVCacheGroupSpec, ...], tuple[int, ...]]:
    """vLLM's KV-cache groups of the model's layers (`get_kv_cache_groups`: one group when
    all layers agree; a hybrid model's sliding and full layers in groups of equal size),
    and `layer_to_group` (layer `i` is the `i`-th entry of `specs`). ValueError when there
    are no layers or a group is not attention."""
    if not specs:
        raise ValueError("the model declares no KV-cache layers")
    groups = get_kv_cache_groups(specs)
    for group in groups:
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            raise ValueError(
                f"layers {group.layer_names} have {type(group.kv_cache_spec).__name__}; the "
                "engine serves attention layers of one shape per group"
            )
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    return tuple(groups), tuple(group_of[name] for name in specs)


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


def _pool_size(
    config: EngineConfig, bytes_per_block: int, mesh: Mesh | None
) -> tuple[int, int | None, str]:
    """`(num_blocks, budget bytes or None, how they were chosen)`: `config.num_blocks`,
    else the budget (`kv_cache_memory`, else `memory_utilization` of the devices) over
    `bytes_per_block`, else `DEFAULT_NUM_BLOCKS`. ValueError below 2 blocks."""
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
    return num_blocks, budget, unit


def _max_model_len(
    config: EngineConfig,
    groups: tuple[KVCacheGroupSpec, ...],
    num_blocks: int,
    model_max_len: int | None,
    unit: str,
    bytes_per_block: int,
) -> int:
    """`config.max_model_len`, checked to fit one request in the pool, else the longest
    that fits (capped by `model_max_len`, else where full attention would be). ValueError
    naming the budget, the bytes per block and the longest that fits when it does not."""

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
        return longest
    if longest < config.max_model_len:
        need = blocks_per_request(config.max_model_len)
        raise ValueError(
            f"{unit}; one request of max_model_len={config.max_model_len} tokens takes "
            f"{need} blocks over the model's {len(groups)} KV-cache groups (block 0 is the "
            f"null block: num_blocks >= {need + 1}, or {(need + 1) * bytes_per_block:,} "
            f"bytes); the longest max_model_len that fits is {longest}"
        )
    return config.max_model_len


def plan_kv_cache(
    specs: Mapping[str, KVCacheSpec],
    config: EngineConfig,
    mesh: Mesh | None,
    model_max_len: int | None = None,
) -> KVCachePlan:
    """The one KV-cache plan of a model whose layers have `specs` (`model.kv_cache_specs(
    config.block_size, config.dtype)`) on `mesh` (module docstring): `num_blocks` and
    `max_model_len` of `config` checked when given, derived when missing; the KV
    quantisation is `config.kv_cache_dtype`. Arithmetic only: no device memory is touched.
    ValueError when the layers cannot be served or one request of `max_model_len` does not
    fit, naming the budget, the bytes per block and the longest `max_model_len` that fits.
    """
    groups, layer_to_group = kv_cache_groups(specs)
    kv_quant = None if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    geometries = [page_geometry(g.kv_cache_spec, mesh, kv_quant=kv_quant) for g in groups]
    bytes_per_block = sum(geometries[g].bytes_per_block for g in layer_to_group)
    num_blocks, budget, unit = _pool_size(config, bytes_per_block, mesh)
    max_model_len = _max_model_len(config, groups, num_blocks, model_max_len, unit, bytes_per_block)
    tensors = tuple(
        KVCacheTensor(groups[g].kv_cache_spec.page_size_bytes * num_blocks, (name,))
        for name, g in zip(specs, layer_to_group, strict=True)
    )
    return KVCachePlan(
        kv_cache_config=KVCacheConfig(num_blocks, tensors, groups),
        layer_to_group=layer_to_group, max_model_len=max_model_len,
        bytes_per_block=bytes_per_block, budget_bytes=budget, kv_quant=kv_quant, mesh=mesh,
        page_shape=geometries[0].page_shape, storage_dtype=geometries[0].storage_dtype,
    )  # fmt: skip
