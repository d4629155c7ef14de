"""Block-size resolution for KV-cache groups (SPEC §5, hybrid models).

Where vLLM reads a `VllmConfig`, these functions take plain arguments. The
rules are vLLM's:

- scheduler block size: one group: its block size (times the decode context
  parallel degree for DCP-sharded specs); several: the LCM of the groups'
  (DCP-scaled) block sizes;
- hash block size: one group: the scheduler block size; several: an explicit
  `prefix_match_unit`, else the GCD of the prefix-cacheable groups' sizes; the
  scheduler size when caching and connectors are off or a Mamba group is not
  in "align" mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol

from jaxkv._checks import as_int
from jaxkv.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)


class FineGrainedLookupSupport(Protocol):
    """What `partial_hash_hits_enabled` reads of a manager class."""

    supports_fine_grained_hash_lookup: bool


class KVCacheBlockCopy(NamedTuple):
    """One page copy the device runs before a step (as vLLM does): block `src_block_id`'s
    contents into block `dst_block_id`, in every layer (a partial hit's copy-on-write)."""

    src_block_id: int
    dst_block_id: int


def resolve_dcp_kv_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Tokens one block of `spec` spans under decode context parallelism."""
    return spec.block_size * (dcp_world_size if spec.dcp_sharded else 1)


def resolve_dcp_kv_cache_spec(spec: KVCacheSpec, dcp_world_size: int) -> KVCacheSpec:
    """`spec` with its block size scaled for DCP (itself when unchanged)."""
    block_size = resolve_dcp_kv_block_size(spec, dcp_world_size)
    if block_size == spec.block_size:
        return spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return replace(
            spec,
            block_size=block_size,
            kv_cache_specs={
                name: resolve_dcp_kv_cache_spec(layer, dcp_world_size)
                for name, layer in spec.kv_cache_specs.items()
            },
        )
    return replace(spec, block_size=block_size)


def partial_hash_hits_enabled(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    hash_block_size: int,
    dcp_world_size: int = 1,
    manager_classes: Sequence[FineGrainedLookupSupport] | None = None,
) -> bool:
    """Whether aligned Mamba states allow prefix hits finer than a Mamba block.

    Needs a Mamba "align" group whose block is coarser than the hash unit
    (or equal under DCP); with `manager_classes` (one per group) every other
    prefix-cacheable group must also support fine-grained lookups or hash at
    its own block size.
    """
    if not any(
        isinstance(spec, MambaSpec)
        and spec.mamba_cache_mode == "align"
        and (
            spec.block_size > hash_block_size
            if dcp_world_size == 1
            else spec.block_size >= hash_block_size
        )
        for group in kv_cache_groups
        for spec in iter_layer_specs(group.kv_cache_spec)
    ):
        return False
    if manager_classes is None:
        return True
    return all(
        not group.kv_cache_spec.prefix_cacheable
        or manager_cls.supports_fine_grained_hash_lookup
        or resolve_dcp_kv_block_size(group.kv_cache_spec, dcp_world_size) == hash_block_size
        for group, manager_cls in zip(kv_cache_groups, manager_classes, strict=True)
    )


def eagle_proof_margin(block_size: int, hash_block_size: int, fine_grained_lookup: bool) -> int:
    """Tokens an EAGLE group matches past a hit before dropping them.

    One hash unit for fine-grained lookups, else one cache block.
    """
    if fine_grained_lookup and block_size > hash_block_size:
        return hash_block_size
    return block_size


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig,
    enable_prefix_caching: bool = True,
    prefix_match_unit: int | None = None,
    dcp_world_size: int = 1,
    kv_connector_enabled: bool = False,
    block_size: int | None = None,
) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) for `kv_cache_config`.

    `block_size` stands in for vLLM's `cache_config.block_size` when the config
    has no group (attention-free models); otherwise the groups' sizes are used.
    Every `prefix_match_unit` that cannot apply is a `ValueError` naming the
    rule and the numbers; it may be a numpy integer (not a bool).
    """
    if prefix_match_unit is not None:
        unit = as_int(prefix_match_unit)
        if unit is None or unit <= 0:
            raise ValueError(
                f"Invalid prefix_match_unit={prefix_match_unit!r}; it must be a positive integer"
            )
        prefix_match_unit = unit
    if dcp_world_size <= 0:
        raise ValueError(f"dcp_world_size must be positive, got {dcp_world_size}")
    groups = kv_cache_config.kv_cache_groups
    hashing_active = enable_prefix_caching or kv_connector_enabled
    if len(groups) <= 1:
        if groups:
            bs = resolve_dcp_kv_block_size(groups[0].kv_cache_spec, dcp_world_size)
        elif block_size is not None:
            bs = block_size * dcp_world_size
        else:
            raise ValueError("a KV cache config without groups needs block_size")
        if prefix_match_unit not in (None, bs) and groups and hashing_active:
            raise ValueError(
                f"Invalid prefix_match_unit={prefix_match_unit}; with a single KV cache group, "
                f"prefix-cache hits land on the block size ({bs}). Unset it or set it to {bs}."
            )
        return bs, bs

    group_block_sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp_world_size) for g in groups]
    scheduler_block_size = math.lcm(*group_block_sizes)
    if not hashing_active:
        return scheduler_block_size, scheduler_block_size
    if any(
        isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align"
        for group in groups
        for spec in iter_layer_specs(group.kv_cache_spec)
    ):
        return scheduler_block_size, scheduler_block_size
    hashing_sizes = [
        bs
        for group, bs in zip(groups, group_block_sizes, strict=True)
        if group.kv_cache_spec.prefix_cacheable
    ] or group_block_sizes
    hash_block_size = (
        prefix_match_unit if prefix_match_unit is not None else math.gcd(*hashing_sizes)
    )
    if any(bs % hash_block_size for bs in hashing_sizes):
        raise ValueError(
            f"Invalid prefix_match_unit={hash_block_size}; prefix-cacheable KV cache group "
            f"block sizes must be divisible by prefix_match_unit. Got group block sizes="
            f"{group_block_sizes}, prefix-cacheable={hashing_sizes}."
        )
    return scheduler_block_size, hash_block_size
