"""KV-cache capacity planning: from `{layer: spec}` and a memory budget to a `KVCacheConfig`.

vLLM's rules (SPEC §6) with plain arguments where vLLM reads a
`VllmConfig`: `max_model_len`, `max_num_batched_tokens` (vLLM's in-flight
token budget) and a per-device budget in bytes.

Grouping: identical specs share a group; layers of one type with different
shapes share one `UniformTypeKVCacheSpecs` group; a hybrid model's layers are
grouped by spec and split into groups of equal layer count, so that tensor
slot i is shared by layer i of every group (all groups then draw block ids
from one pool and one block id addresses the same bytes in each tensor). That
needs one page size across groups: specs with smaller pages get their block
size scaled up until the pages match, or (Mamba, and attention pages that do
not divide the largest) their page padded (`unify_kv_cache_spec_page_size`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from jaxkv.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)

logger = logging.getLogger("jaxkv")


def _check_args(max_model_len: int, max_num_batched_tokens: int) -> None:
    for name, value in (
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def max_memory_usage_bytes(
    kv_cache_specs: Mapping[str, KVCacheSpec], max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Bytes one request at `max_model_len` needs over all layers."""
    return sum(
        spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        for spec in kv_cache_specs.values()
    )


def estimate_max_model_len(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> int:
    """The longest `max_model_len` (at most the given one) one request fits in; 0 if none.

    Binary search: the memory a request needs never falls as its length grows.
    """

    def fits(length: int) -> bool:
        return (
            max_memory_usage_bytes(kv_cache_specs, length, min(max_num_batched_tokens, length))
            <= available_memory
        )

    if not fits(1):
        return 0
    lo, hi = 1, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_enough_kv_cache_memory(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> None:
    """`ValueError` unless `available_memory` holds one request of `max_model_len` tokens.

    The message names the bytes needed, the bytes available and the longest
    `max_model_len` that fits.
    """
    _check_args(max_model_len, max_num_batched_tokens)
    if not kv_cache_specs:
        return
    if available_memory <= 0:
        raise ValueError(
            f"no memory for the KV cache: available_memory={available_memory} bytes; "
            "give the cache a positive budget"
        )
    needed = max_memory_usage_bytes(kv_cache_specs, max_model_len, max_num_batched_tokens)
    if needed > available_memory:
        longest = estimate_max_model_len(
            kv_cache_specs, available_memory, max_model_len, max_num_batched_tokens
        )
        raise ValueError(
            f"to serve one request of max_model_len={max_model_len} tokens the KV cache needs "
            f"{needed} bytes, more than the {available_memory} bytes available; the longest "
            f"max_model_len that fits is {longest}. Give the cache more memory or lower "
            "max_model_len."
        )


def unify_kv_cache_spec_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Specs whose pages all have the largest page's size (vLLM's rule).

    An attention page that divides the largest grows by scaling its block
    size; a Mamba page (its size does not follow the block size), or a non-MLA
    attention page that does not divide the largest or is padded already, is
    padded to it (`page_size_padded`). `ValueError` for any other page: an MLA page that
    does not divide (its rows cannot be padded), or a spec of another kind.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs.values()}
    if len(page_sizes) <= 1:
        return dict(kv_cache_specs)
    max_page = max(page_sizes)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_specs.items():
        page = spec.page_size_bytes
        is_padded = getattr(spec, "page_size_padded", None) is not None
        if page == max_page:
            unified[name] = spec
        elif isinstance(spec, MambaSpec):
            unified[name] = replace(spec, page_size_padded=max_page)
        elif isinstance(spec, AttentionSpec) and max_page % page == 0 and not is_padded:
            unified[name] = spec.copy_with_new_block_size(spec.block_size * (max_page // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            unified[name] = replace(spec, page_size_padded=max_page)
        else:
            raise ValueError(
                f"cannot give layer {name!r} ({type(spec).__name__}, page {page} bytes) the "
                f"common page size {max_page} bytes: only an attention page that divides it "
                f"grows, and only Mamba and non-MLA attention pages are padded; page sizes "
                f"are {sorted(page_sizes)}"
            )
    return unified


def get_kv_cache_groups(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Split the model's layers into KV-cache groups (see the module docstring)."""
    for name, spec in kv_cache_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"layer {name!r}: {spec!r} is not a KVCacheSpec")
    if not kv_cache_specs:
        return []
    specs = list(kv_cache_specs.values())
    if all(spec == specs[0] for spec in specs[1:]):
        return [KVCacheGroupSpec(tuple(kv_cache_specs), specs[0])]
    uniform = UniformTypeKVCacheSpecs.from_specs(kv_cache_specs)
    if uniform is not None:
        return [KVCacheGroupSpec(tuple(kv_cache_specs), uniform)]
    unified = unify_kv_cache_spec_page_size(kv_cache_specs)
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in unified.items():
        by_spec.setdefault(spec, []).append(name)
    sizes = [len(names) for names in by_spec.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)  # pad a few layers rather than double the groups
    groups = []
    for spec, names in by_spec.items():
        num_groups = cdiv(len(names), group_size)
        # layers[i::n]: with pipeline stages each stage keeps whole group slots.
        groups.extend(
            KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups)
        )
    return groups


def _group_layer_pages(group: KVCacheGroupSpec) -> list[tuple[str, int]]:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name].page_size_bytes) for name in group.layer_names]
    return [(name, spec.page_size_bytes) for name in group.layer_names]


def get_kv_cache_config_from_groups(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    num_blocks_override: int | None = None,
    prefix_cache_retention_interval: int | None = None,
) -> KVCacheConfig:
    """Blocks and tensors for `kv_cache_groups` in `available_memory` bytes per device.

    Tensor slot i is shared by the i-th layer of every group; its bytes per
    block are the largest of those layers' pages. `num_blocks` is the budget
    over the bytes one block costs in all tensors (or `num_blocks_override`).
    The null block counts: a config needs at least 2 blocks.
    """
    groups = tuple(kv_cache_groups)
    if not groups:
        return KVCacheConfig(1, (), (), prefix_cache_retention_interval)
    pages = [_group_layer_pages(g) for g in groups]
    num_slots = max(len(p) for p in pages)
    slot_pages = [max(p[i][1] for p in pages if i < len(p)) for i in range(num_slots)]
    bytes_per_block = sum(slot_pages)
    num_blocks = available_memory // bytes_per_block
    if num_blocks_override is not None:
        if not isinstance(num_blocks_override, int) or num_blocks_override < 2:
            raise ValueError(
                f"num_blocks_override must be an integer >= 2 (block 0 is the null block), "
                f"got {num_blocks_override!r}"
            )
        num_blocks = num_blocks_override
    if num_blocks < 2:
        raise ValueError(
            f"{available_memory} bytes hold {num_blocks} KV cache blocks of {bytes_per_block} "
            "bytes; at least 2 are needed (block 0 is the null block)"
        )
    tensors = tuple(
        KVCacheTensor(slot_pages[i] * num_blocks, tuple(p[i][0] for p in pages if i < len(p)))
        for i in range(num_slots)
    )
    return KVCacheConfig(num_blocks, tensors, groups, prefix_cache_retention_interval)


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks_override: int | None = None,
    prefix_cache_retention_interval: int | None = None,
) -> KVCacheConfig:
    """The plan: check one request fits, group the layers, size blocks and tensors."""
    check_enough_kv_cache_memory(
        kv_cache_specs, available_memory, max_model_len, max_num_batched_tokens
    )
    groups = get_kv_cache_groups(kv_cache_specs)
    return get_kv_cache_config_from_groups(
        groups, available_memory, num_blocks_override, prefix_cache_retention_interval
    )


def get_max_concurrency_for_kv_cache_config(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> float:
    """Requests of `max_model_len` tokens the pool holds at once.

    A request takes ceil(peak bytes / page bytes) blocks from each group and
    all device groups share one pool, so blocks per request sum over groups;
    host-resident groups draw from `host_num_blocks` and the smaller limit applies.
    """
    _check_args(max_model_len, max_num_batched_tokens)
    device_blocks = host_blocks = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        required = cdiv(
            spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            spec.page_size_bytes,
        )
        if group.host_resident:
            host_blocks += required
        else:
            device_blocks += required
    limits = []
    if device_blocks:
        limits.append(kv_cache_config.num_blocks / device_blocks)
    if host_blocks:
        if kv_cache_config.host_num_blocks is None:
            raise ValueError("a host-resident KV cache group needs KVCacheConfig.host_num_blocks")
        limits.append(kv_cache_config.host_num_blocks / host_blocks)
    return min(limits) if limits else 0.0


@dataclass(frozen=True)
class KVCacheCapacity:
    """Token capacity of the pool and concurrency at `max_model_len`."""

    num_tokens: int
    max_concurrency: float
    max_model_len: int

    def __str__(self) -> str:
        return (
            f"KV cache size: {self.num_tokens:,} tokens, maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )


def get_kv_cache_capacity(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> KVCacheCapacity:
    concurrency = get_max_concurrency_for_kv_cache_config(
        kv_cache_config, max_model_len, max_num_batched_tokens
    )
    return KVCacheCapacity(int(concurrency * max_model_len), concurrency, max_model_len)


def update_kv_cache_capacity(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    device_name: str = "GPU",
) -> KVCacheCapacity:
    """Compute the capacity and log it as vLLM does ("KV cache size: N tokens, ...")."""
    capacity = get_kv_cache_capacity(kv_cache_config, max_model_len, max_num_batched_tokens)
    logger.info("%s %s", device_name, capacity)
    return capacity


def generate_scheduler_kv_cache_config(kv_cache_configs: Sequence[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's config from the workers' (which differ only in layer names).

    The workers must agree on `num_blocks` and `host_num_blocks` (`ValueError`
    otherwise); uniform-type groups are represented by their first layer spec.
    """
    if not kv_cache_configs:
        raise ValueError("generate_scheduler_kv_cache_config needs at least one worker config")
    num_blocks = [cfg.num_blocks for cfg in kv_cache_configs]
    host = [cfg.host_num_blocks for cfg in kv_cache_configs]
    if len(set(num_blocks)) > 1 or len(set(host)) > 1:
        raise ValueError(
            f"workers disagree on the KV cache size: num_blocks={num_blocks}, "
            f"host_num_blocks={host}; every worker must have the same number of blocks"
        )
    first = kv_cache_configs[0]
    groups = tuple(
        replace(g, kv_cache_spec=g.kv_cache_spec.layer_type_spec)
        if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        else g
        for g in first.kv_cache_groups
    )
    return replace(first, kv_cache_groups=groups)


def kv_cache_per_device_bytes(
    kv_cache_specs: Mapping[str, KVCacheSpec], num_blocks: int, tensor_parallel_size: int
) -> tuple[int, int]:
    """(bytes per device for `num_blocks` pages of every layer, bytes spent on replication).

    Replication (KV heads fewer than the tensor-parallel degree, MLA latents,
    replicated Mamba states) is counted over all devices, not hidden.
    """
    per_device = replicated = 0
    for spec in kv_cache_specs.values():
        tp = spec.tensor_parallel_bytes(tensor_parallel_size)
        per_device += tp.page_size_bytes * num_blocks
        replicated += tp.replicated_bytes * num_blocks
    if replicated:
        logger.warning(
            "KV cache replication under tensor_parallel_size=%d costs %d bytes over all devices",
            tensor_parallel_size,
            replicated,
        )
    return per_device, replicated
