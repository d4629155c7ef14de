"""Specs, capacity planning and block-size resolution (SPEC §5-6), exact numbers."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

import jaxkv
from jaxkv.hashing import resolve_block_hashes
from jaxkv.kv_cache_coordinator import resolve_cache_hit_alignment_tokens
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from jaxkv.kv_cache_planning import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
    get_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    kv_cache_per_device_bytes,
    max_memory_usage_bytes,
    update_kv_cache_capacity,
)
from jaxkv.kv_cache_utils import (
    partial_hash_hits_enabled,
    resolve_dcp_kv_block_size,
    resolve_dcp_kv_cache_spec,
    resolve_kv_cache_block_sizes,
)

LLAMA = FullAttentionSpec(16, 32, 128, "float16")  # 32 KV heads x 128, fp16, block 16
MiB = 1 << 20


def llama_specs(n=32):
    return {f"layers.{i}": LLAMA for i in range(n)}


# -- specs -------------------------------------------------------------------


def test_page_sizes_and_peaks():
    assert LLAMA.page_size_bytes == 2 * 16 * 32 * 128 * 2 == 256 * 1024
    assert LLAMA.max_memory_usage_bytes(16384, 2048) == 1024 * LLAMA.page_size_bytes
    sw = SlidingWindowSpec(16, 32, 128, "float16", sliding_window=1024)
    # ceil((1024 - 1 + 1024) / 16) + 1 = 128 + 1 pages
    assert sw.max_num_blocks_per_req(16384, 1024) == 129
    assert sw.max_num_blocks_per_req(100, 1024) == 7 + 1  # capped by max_model_len
    chunked = ChunkedLocalAttentionSpec(16, 8, 128, attention_chunk_size=8192)
    assert chunked.max_num_blocks_per_req(16384, 2048) == (8192 + 2048) // 16
    mla = MLAAttentionSpec(64, 1, 576)
    assert mla.page_size_bytes == 64 * 576 * 2 and mla.kind is KVCacheSpecKind.MLA_ATTENTION
    cross = CrossAttentionSpec(16, 8, 64, max_num_encoder_input_tokens=1500)
    assert cross.max_num_blocks_per_req(448, 448) == 94 and not cross.prefix_cacheable
    mamba = MambaSpec(
        16,
        shapes=((4, 2048), (32, 64, 128)),
        dtypes=("bfloat16", "float32"),
        mamba_cache_mode="align",
    )
    assert mamba.page_size_bytes == 4 * 2048 * 2 + 32 * 64 * 128 * 4
    assert mamba.max_num_blocks_per_req(16384, 2048) == 2
    assert MambaSpec(16, shapes=((8,),), dtypes=("float32",)).max_num_blocks_per_req(9, 9) == 1
    assert mamba.numpy_dtypes[1] == np.float32 and str(mamba.numpy_dtypes[0]) == "bfloat16"
    assert LLAMA.numpy_dtype == np.float16
    assert not MambaSpec(16, shapes=((8,),), dtypes=("float32",)).prefix_cacheable


def test_tensor_parallel_bytes_report_replication():
    tp = LLAMA.tensor_parallel_bytes(8)
    assert (tp.page_size_bytes, tp.num_replicas, tp.replicated_bytes) == (
        LLAMA.page_size_bytes // 8,
        1,
        0,
    )
    gqa = FullAttentionSpec(16, 2, 128, "float16")  # 2 KV heads on 8 devices: 4 copies each
    tp = gqa.tensor_parallel_bytes(8)
    per_head = gqa.page_size_bytes // 2
    assert (tp.page_size_bytes, tp.num_replicas, tp.replicated_bytes) == (
        per_head,
        4,
        per_head * 2 * 3,
    )
    mla = MLAAttentionSpec(16, 1, 576).tensor_parallel_bytes(4)
    assert (mla.num_replicas, mla.replicated_bytes) == (4, 3 * 16 * 576 * 2)
    with pytest.raises(
        ValueError, match="num_kv_heads=6 cannot be split evenly over tensor_parallel_size=4"
    ):
        FullAttentionSpec(16, 6, 64).tensor_parallel_bytes(4)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        FullAttentionSpec(16, 3, 64).tensor_parallel_bytes(4)
    per_device, replicated = kv_cache_per_device_bytes({"a": gqa, "b": LLAMA}, 10, 8)
    assert per_device == 10 * (per_head + LLAMA.page_size_bytes // 8)
    assert replicated == 10 * per_head * 2 * 3


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: SlidingWindowSpec(16, 8, 64, sliding_window=0),
            "sliding_window must be a positive",
        ),
        (
            lambda: ChunkedLocalAttentionSpec(16, 8, 64, attention_chunk_size=-8),
            "attention_chunk_size",
        ),
        (lambda: FullAttentionSpec(0, 8, 64), "block_size must be a positive"),
        (lambda: FullAttentionSpec(16, 0, 64), "num_kv_heads"),
        (
            lambda: MambaSpec(16, shapes=((4, 0),), dtypes=("float32",)),
            "positive size, got \\(4, 0\\)",
        ),
        (lambda: MambaSpec(16, shapes=(), dtypes=()), "at least one state"),
        (lambda: MambaSpec(16, shapes=((4,),), dtypes=()), "one dtype per state shape"),
        (
            lambda: MambaSpec(16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="x"),
            "mamba_cache_mode",
        ),
        (lambda: MLAAttentionSpec(16, 2, 576), "one latent KV head"),
        (lambda: FullAttentionSpec(16, 8, 64, "nonsense"), "dtype 'nonsense'"),
    ],
)
def test_bad_specs_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_uniform_type_specs():
    a, b = FullAttentionSpec(16, 8, 64), FullAttentionSpec(16, 4, 128, "float32")
    u = UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b})
    assert u is not None and u.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    assert u.kind is KVCacheSpecKind.FULL_ATTENTION
    assert u.max_memory_usage_bytes(100, 10) == 7 * u.page_size_bytes
    sw1, sw2 = (
        SlidingWindowSpec(16, 8, 64, sliding_window=128),
        SlidingWindowSpec(16, 8, 64, sliding_window=256),
    )
    assert UniformTypeKVCacheSpecs.from_specs({"a": sw1, "b": sw2}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": a, "b": FullAttentionSpec(32, 8, 64)}) is None
    mixed = UniformTypeKVCacheSpecs(16, kv_cache_specs={"a": a, "b": sw1})  # as vLLM: built
    assert mixed.kind is KVCacheSpecKind.UNKNOWN
    with pytest.raises(ValueError, match="share spec type"):
        _ = mixed.layer_type_spec


# -- capacity ----------------------------------------------------------------


def test_llama_capacity_exact_numbers(caplog):
    specs = llama_specs()
    per_block = 32 * LLAMA.page_size_bytes  # 8 MiB
    config = get_kv_cache_config(
        specs, 1536 * per_block, max_model_len=16384, max_num_batched_tokens=2048
    )
    assert config.num_blocks == 1536
    assert len(config.kv_cache_groups) == 1 and config.kv_cache_groups[0].kv_cache_spec == LLAMA
    assert len(config.kv_cache_tensors) == 32
    assert all(t.size == 1536 * LLAMA.page_size_bytes for t in config.kv_cache_tensors)
    assert get_max_concurrency_for_kv_cache_config(config, 16384, 2048) == 1.5
    cap = get_kv_cache_capacity(config, 16384, 2048)
    assert (cap.num_tokens, cap.max_concurrency) == (24576, 1.5)
    with caplog.at_level(logging.INFO, logger="jaxkv"):
        update_kv_cache_capacity(config, 16384, 2048)
    assert (
        "KV cache size: 24,576 tokens, maximum concurrency for 16,384 tokens per request: 1.50x"
        in caplog.text
    )
    override = get_kv_cache_config(specs, 1536 * per_block, 16384, 2048, num_blocks_override=1024)
    assert get_max_concurrency_for_kv_cache_config(override, 16384, 2048) == 1.0


def test_too_little_memory_names_needed_available_and_longest_len():
    specs = llama_specs()
    per_block = 32 * LLAMA.page_size_bytes
    available = 500 * per_block  # 500 blocks of 16 tokens: 8000 tokens fit
    assert max_memory_usage_bytes(specs, 16384, 2048) == 1024 * per_block
    assert estimate_max_model_len(specs, available, 16384, 2048) == 8000
    msg = (
        f"needs {1024 * per_block} bytes, more than the {available} bytes available; "
        "the longest max_model_len that fits is 8000"
    )
    with pytest.raises(ValueError, match=msg):
        get_kv_cache_config(specs, available, 16384, 2048)
    with pytest.raises(ValueError, match="longest max_model_len that fits is 0"):
        check_enough_kv_cache_memory(specs, 100, 16384, 2048)
    with pytest.raises(ValueError, match="available_memory=0"):
        check_enough_kv_cache_memory(specs, 0, 16384, 2048)
    with pytest.raises(ValueError, match="max_model_len must be a positive"):
        check_enough_kv_cache_memory(specs, 10, 0, 2048)


def test_estimate_max_model_len_is_the_largest_that_fits():
    rng = np.random.default_rng(0)
    specs = {
        "full": FullAttentionSpec(16, 4, 64),
        "sw": SlidingWindowSpec(16, 4, 64, sliding_window=300),
    }
    for _ in range(30):
        available = int(rng.integers(1, 400)) * 16 * 4 * 64 * 4
        longest = estimate_max_model_len(specs, available, 8192, 256)

        def fits(n: int, available: int = available) -> bool:
            return max_memory_usage_bytes(specs, n, min(256, n)) <= available

        assert longest == 0 or fits(longest)
        assert longest == 8192 or not fits(longest + 1)


def test_hybrid_grouping_gemma3_style():
    full = FullAttentionSpec(16, 8, 128)
    sw = SlidingWindowSpec(16, 8, 128, sliding_window=1024)
    specs = {f"l{i}": (full if i % 6 == 5 else sw) for i in range(12)}  # 10 sliding, 2 full
    groups = get_kv_cache_groups(specs)
    # Two full layers set the group size: 5 sliding groups of 2 and one full group.
    assert [g.layer_names for g in groups] == [
        ("l0", "l6"),
        ("l1", "l7"),
        ("l2", "l8"),
        ("l3", "l9"),
        ("l4", "l10"),
        ("l5", "l11"),
    ]
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"] * 5 + [
        "FullAttentionSpec"
    ]
    config = get_kv_cache_config_from_groups(groups, 100 * 2 * full.page_size_bytes)
    assert config.num_blocks == 100
    # Tensor slot i is shared by layer i of every group.
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ("l0", "l1", "l2", "l3", "l4", "l5"),
        ("l6", "l7", "l8", "l9", "l10", "l11"),
    ]
    # Per request at 16384 tokens: 5 sliding groups x 129 pages + 1024 full pages.
    assert get_max_concurrency_for_kv_cache_config(config, 16384, 1024) == 100 / (5 * 129 + 1024)


def test_hybrid_grouping_unifies_page_sizes():
    full = FullAttentionSpec(16, 8, 128)
    small = SlidingWindowSpec(16, 4, 128, sliding_window=64)  # half the page: block 32
    groups = get_kv_cache_groups({"f": full, "s": small})
    assert groups[1].kv_cache_spec.block_size == 32
    assert groups[1].kv_cache_spec.page_size_bytes == full.page_size_bytes
    # A page that does not divide the largest is padded (as vLLM does), except MLA's.
    odd = SlidingWindowSpec(16, 3, 128, sliding_window=64)
    padded = get_kv_cache_groups({"f": full, "s": odd})[1].kv_cache_spec
    assert padded == replace(odd, page_size_padded=full.page_size_bytes)
    assert padded.unpadded_page_size_bytes == odd.page_size_bytes
    with pytest.raises(ValueError, match="common page size"):
        get_kv_cache_groups({"f": full, "m": MLAAttentionSpec(16, 1, 96)})


def test_uniform_type_model_is_one_group_with_one_tensor_per_layer():
    a, b = FullAttentionSpec(16, 8, 64), FullAttentionSpec(16, 4, 64)
    groups = get_kv_cache_groups({"a": a, "b": b})
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    config = get_kv_cache_config_from_groups(groups, 10 * (a.page_size_bytes + b.page_size_bytes))
    assert config.num_blocks == 10
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [
        (10 * a.page_size_bytes, ("a",)),
        (10 * b.page_size_bytes, ("b",)),
    ]
    sched = generate_scheduler_kv_cache_config([config, config])
    assert sched.kv_cache_groups[0].kv_cache_spec == a


def test_workers_must_agree_and_one_layer_one_spec():
    config = KVCacheConfig.single_group(LLAMA, 10)
    with pytest.raises(ValueError, match=r"num_blocks=\[10, 11\]"):
        generate_scheduler_kv_cache_config([config, KVCacheConfig.single_group(LLAMA, 11)])
    with pytest.raises(ValueError, match="layer 'x' is in KV cache groups 0 and 1"):
        KVCacheConfig(4, (), (KVCacheGroupSpec(("x",), LLAMA), KVCacheGroupSpec(("x",), LLAMA)))
    with pytest.raises(ValueError, match="at least 2 are needed"):
        get_kv_cache_config_from_groups(get_kv_cache_groups({"a": LLAMA}), LLAMA.page_size_bytes)


def test_host_resident_group_concurrency_takes_the_smaller_limit():
    sw = SlidingWindowSpec(16, 8, 64, sliding_window=32)
    config = KVCacheConfig(
        100,
        (),
        (
            KVCacheGroupSpec(("f",), FullAttentionSpec(16, 8, 64)),
            KVCacheGroupSpec(("s",), sw, host_resident=True),
        ),
        host_num_blocks=12,
    )
    # device: 100 / 4 pages; host: 12 / (ceil((31 + 16) / 16) + 1) = 12 / 4
    assert get_max_concurrency_for_kv_cache_config(config, 64, 16) == 3.0


def test_device_cache_allocates_from_planned_tensors():
    config = get_kv_cache_config(llama_specs(2), 64 * 2 * LLAMA.page_size_bytes, 512, 64)
    for tensor in config.kv_cache_tensors:
        assert tensor.size // LLAMA.page_size_bytes == config.num_blocks == 64


# -- block sizes ---------------------------------------------------------------


def two_groups(*specs):
    return KVCacheConfig(8, (), tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


def test_block_size_resolution():
    full32, sw16 = FullAttentionSpec(32, 8, 64), SlidingWindowSpec(16, 8, 64, sliding_window=64)
    assert resolve_kv_cache_block_sizes(two_groups(full32, sw16)) == (32, 16)
    assert resolve_kv_cache_block_sizes(two_groups(full32, sw16), prefix_match_unit=8) == (32, 8)
    assert resolve_kv_cache_block_sizes(two_groups(full32, sw16), enable_prefix_caching=False) == (
        32,
        32,
    )
    assert resolve_kv_cache_block_sizes(KVCacheConfig.single_group(full32, 8)) == (32, 32)
    dcp = FullAttentionSpec(16, 8, 64, dcp_sharded=True)
    assert resolve_kv_cache_block_sizes(KVCacheConfig.single_group(dcp, 8), dcp_world_size=4) == (
        64,
        64,
    )
    assert (
        resolve_dcp_kv_block_size(dcp, 4) == 64
        and resolve_dcp_kv_cache_spec(dcp, 4).block_size == 64
    )
    assert full32.dcp_sharded  # vLLM's default for attention
    unsharded = replace(full32, dcp_sharded=False)
    assert resolve_dcp_kv_cache_spec(unsharded, 4) is unsharded
    mamba_none = MambaSpec(48, shapes=((8,),), dtypes=("float32",))
    assert resolve_kv_cache_block_sizes(two_groups(sw16, mamba_none)) == (48, 48)
    mamba = MambaSpec(64, shapes=((8,),), dtypes=("float32",), mamba_cache_mode="align")
    config = two_groups(FullAttentionSpec(16, 8, 64), mamba)
    assert resolve_kv_cache_block_sizes(config) == (64, 16)
    assert partial_hash_hits_enabled(config.kv_cache_groups, 16)
    assert resolve_cache_hit_alignment_tokens(config, 64, 16) == 16
    assert resolve_cache_hit_alignment_tokens(two_groups(full32, sw16), 32, 16) == 32


@pytest.mark.parametrize(
    "config, unit, match",
    [
        (
            two_groups(FullAttentionSpec(32, 8, 64), SlidingWindowSpec(16, 8, 64)),
            12,
            "prefix_match_unit=12; prefix-cacheable KV cache group block sizes must be divisible",
        ),
        (
            two_groups(FullAttentionSpec(32, 8, 64), SlidingWindowSpec(16, 8, 64)),
            32,
            "divisible by prefix_match_unit. Got group block sizes=\\[32, 16\\]",
        ),
        (
            KVCacheConfig.single_group(FullAttentionSpec(32, 8, 64), 8),
            16,
            "with a single KV cache group, prefix-cache hits land on the block size \\(32\\)",
        ),
        (KVCacheConfig.single_group(FullAttentionSpec(32, 8, 64), 8), 0, "positive integer"),
        (KVCacheConfig.single_group(FullAttentionSpec(32, 8, 64), 8), -16, "positive integer"),
    ],
)
def test_invalid_prefix_match_unit(config, unit, match):
    with pytest.raises(ValueError, match=match):
        resolve_kv_cache_block_sizes(config, prefix_match_unit=unit)


def test_resolve_block_hashes_views():
    hashes = [bytes([i]) * 4 for i in range(8)]
    assert resolve_block_hashes(hashes, 16, 16) is hashes
    view = resolve_block_hashes(hashes, 16, 64)
    assert len(view) == 2 and view[1] == hashes[7]
    assert (
        resolve_block_hashes(
            hashes, 16, 64, supports_fine_grained_hash_lookup=True, alignment_tokens=16
        )
        is hashes
    )
    with pytest.raises(ValueError, match="not a multiple"):
        resolve_block_hashes(hashes, 16, 40)


def test_public_names_exported():
    for name in (
        "MambaSpec",
        "CrossAttentionSpec",
        "MLAAttentionSpec",
        "UniformTypeKVCacheSpecs",
        "get_kv_cache_config",
        "resolve_kv_cache_block_sizes",
        "estimate_max_model_len",
    ):
        assert hasattr(jaxkv, name), name
