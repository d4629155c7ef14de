"""PagedKVCache: writes/copies/zeroing of a stacked cache vs a dense NumPy model, donation,
bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from default_codegen import compile_by_default

from jaxkv.device import PagedKVCache
from jaxkv.device.storage import to_storage
from jaxkv.kv_cache_interface import FullAttentionSpec


def _cache(dtype: str = "float32", num_blocks: int = 24, **kw) -> PagedKVCache:
    return PagedKVCache(FullAttentionSpec(4, 2, 8, dtype), num_blocks, **kw)


def _as_compute(cache: PagedKVCache, kv: jax.Array) -> np.ndarray:
    return np.asarray(kv).view(cache.dtype)


def _on_device(cache: PagedKVCache, model: np.ndarray) -> jax.Array:
    """A stacked cache `[L, *shape]` holding `model`'s values (as stored)."""
    return jax.device_put(model.view(cache.storage_dtype), cache.stacked_sharding)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_updates_match_dense_model(dtype: str) -> None:
    rng = np.random.default_rng()
    cache = _cache(dtype)
    model = rng.standard_normal((2, *cache.shape)).astype(cache.dtype)  # never zeros
    kv = _on_device(cache, model)
    nb, bs = cache.num_blocks, cache.block_size
    for step in range(6):
        layer = step % 2
        n = int(rng.integers(1, 20))
        slots = rng.choice(np.arange(bs, nb * bs), size=n, replace=False)
        slots[rng.random(n) < 0.2] = cache.padding_slot  # padding is dropped
        k = rng.standard_normal((n, 2, 8)).astype(cache.dtype)
        v = rng.standard_normal((n, 2, 8)).astype(cache.dtype)
        kv = cache.write_kv(kv, jnp.asarray(k), jnp.asarray(v), slots, layer)
        flat = model[layer].reshape(nb * bs, 4, 8)
        live = slots != cache.padding_slot
        flat[slots[live], 0::2] = k[live]
        flat[slots[live], 1::2] = v[live]

        blocks = rng.permutation(np.arange(1, nb))
        src, dst = blocks[:3], blocks[3:6]
        kv = cache.copy_blocks_stacked(kv, src, dst)
        model[:, dst] = model[:, src]
        zero = rng.choice(np.arange(nb), size=2, replace=False)
        kv = cache.zero_blocks_stacked(kv, zero)
        model[:, zero] = 0
        np.testing.assert_array_equal(_as_compute(cache, kv), model)

    read_slots = rng.choice(np.arange(nb * bs), size=7, replace=False)
    rk, rv = cache.read_kv(kv, read_slots, layer=1)
    flat = model[1].reshape(nb * bs, 4, 8)
    np.testing.assert_array_equal(np.asarray(rk), flat[read_slots, 0::2])
    np.testing.assert_array_equal(np.asarray(rv), flat[read_slots, 1::2])


def test_bf16_storage_keeps_bits_and_defaults_to_uint16_on_cpu() -> None:
    cache = _cache("bfloat16")
    assert cache.storage_dtype == np.uint16
    assert _cache("bfloat16", storage_dtype="bfloat16").storage_dtype == ml_dtypes.bfloat16
    assert _cache("float32").storage_dtype == np.float32
    with pytest.raises(ValueError, match=r"storage dtype uint8 \(1 bytes\) must have the width"):
        _cache("bfloat16", storage_dtype="uint8")
    kv = cache.allocate_stacked(1)
    k = jnp.asarray(np.random.default_rng().standard_normal((1, 2, 8)), jnp.bfloat16)
    kv = cache.write_kv(kv, k, -k, np.array([5]))
    stored = np.asarray(kv)[0, 1, 1].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(stored[0::2], np.asarray(k)[0])
    np.testing.assert_array_equal(stored[1::2], -np.asarray(k)[0])


def test_bf16_bits_input_writes_the_same_cache_with_token_sized_temporaries() -> None:
    """K/V handed over as stored bits land exactly like bf16 K/V; either way the write's
    temporaries are a few times the step's K/V bytes, never the cache's."""
    cache = _cache("bfloat16", num_blocks=512)
    rng = np.random.default_rng()
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.bfloat16) for _ in range(2))
    slots = rng.choice(np.arange(4, cache.padding_slot), 6, replace=False)
    a = cache.allocate_stacked(1)
    b = cache.allocate_stacked(1)
    a = cache.write_kv(a, k, v, slots)
    bits = [to_storage(x, cache.dtype, cache.storage_dtype) for x in (k, v)]
    assert bits[0].dtype == np.uint16
    b = cache.write_kv(b, *bits, slots)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    payload = 2 * 64 * 2 * 8 * 2  # K and V bytes of 64 tokens
    temp_bf16 = compile_by_default(cache.lower_write_kv(64)).memory_analysis().temp_size_in_bytes
    temp_bits = (
        compile_by_default(cache.lower_write_kv(64, "uint16")).memory_analysis().temp_size_in_bytes
    )
    assert temp_bits <= 2 * payload and temp_bf16 <= 2 * payload, (temp_bits, temp_bf16)


def test_allocate_creates_sharded_zeroed_layers() -> None:
    cache = _cache()
    kv = cache.allocate_stacked(num_layers=3)
    assert kv.shape == (3, 24, 4, 4, 8) and kv.dtype == np.float32
    assert kv.sharding.is_equivalent_to(cache.stacked_sharding, kv.ndim)
    assert not np.asarray(kv).any()
    assert cache.cache_bytes == cache.bytes_per_device == 24 * 4 * 4 * 8 * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donation_updates_in_place(dtype: str) -> None:
    """The compiled update aliases the cache; its temporaries follow the tokens, not the cache."""
    temps = []
    for num_blocks in (512, 4096):
        cache = _cache(dtype, num_blocks=num_blocks)
        stats = compile_by_default(cache.lower_write_kv(32, num_layers=2)).memory_analysis()
        assert stats.alias_size_in_bytes == 2 * cache.cache_bytes
        assert stats.temp_size_in_bytes < 0.05 * cache.cache_bytes
        temps.append(stats.temp_size_in_bytes)
    assert temps[0] == temps[1], f"temporary bytes grew with the cache: {temps}"

    cache = _cache(dtype)
    kv = cache.allocate_stacked(2)
    k = jnp.ones((2, 2, 8), cache.dtype)
    new = cache.write_kv(kv, k, k, np.array([4, 9]), layer=1)
    assert kv.is_deleted(), "the input cache must be donated"
    new2 = cache.copy_blocks_stacked(new, [1], [2])
    assert new.is_deleted()
    new3 = cache.zero_blocks_stacked(new2, [1])
    assert new2.is_deleted() and not new3.is_deleted()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([3, 8])), r"slot value 3 .*\[4, 96\)"),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([8, 97])), r"slot value 97"),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([-1, 8])), r"slot value -1"),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([8])), r"new_k has shape \(2, 2, 8\)"),
        (
            lambda c, kv, k: c.write_kv(kv, k.astype(jnp.bfloat16), k, np.array([8, 9])),
            r"dtype bfloat16; expected shape \(2, 2, 8\) dtype float32 \(compute dtype",
        ),
        (
            lambda c, kv, k: c.write_kv(kv[0], k, k, np.array([8, 9])),
            r"cache has shape \(24, 4, 4, 8\)",
        ),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([8, 9]), 2), r"layer must be .*got 2"),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([8.0, 9.0])), r"1-D integer array"),
        (lambda c, kv, k: c.write_kv(kv, k, k, np.array([8, 8])), r"slot 8 appears more than"),
        (lambda c, kv, k: c.copy_blocks_stacked(kv, [1, 2], [3]), r"src has 2 ids but dst has 1"),
        (lambda c, kv, k: c.copy_blocks_stacked(kv, [1, 2], [3, 3]), r"dst block id 3 appears"),
        (lambda c, kv, k: c.copy_blocks_stacked(kv, [1], [24]), r"dst block id value 24 .*\[1,"),
        (lambda c, kv, k: c.copy_blocks_stacked(kv, [0], [5]), r"src block id value 0"),
        (lambda c, kv, k: c.zero_blocks_stacked(kv, [24]), r"block id value 24 is out of range"),
    ],
)
def test_bad_input_raises_before_the_device(call, match) -> None:
    cache = _cache()
    kv = cache.allocate_stacked(2)
    k = jnp.ones((2, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        call(cache, kv, k)
    assert not kv.is_deleted(), "a rejected call must not consume the cache"


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks must be at least 2"):
        _cache(num_blocks=1)
    with pytest.raises(ValueError, match="unknown KV head policy 'spread'"):
        _cache(head_policy="spread")


def test_padding_slots_may_repeat_and_allocate_compiles_once() -> None:
    from jaxkv.device import compilation_count

    cache = _cache()
    kv = cache.allocate_stacked(1)
    k = jnp.ones((3, 2, 8), jnp.float32)
    pad = cache.padding_slot
    kv = cache.write_kv(kv, k, k, np.array([pad, 9, pad]))  # padding twice: fine
    assert float(cache.read_kv(kv, np.array([9]))[0].sum()) == 16.0
    cache.allocate_stacked(2)
    before = compilation_count()
    for _ in range(3):
        cache.allocate_stacked(2)
    assert compilation_count() == before, "allocate must reuse its jitted program"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_blocks_copies_every_layer_and_drops_padding(dtype: str) -> None:
    rng = np.random.default_rng(3)
    cache = _cache(dtype)
    model = rng.standard_normal((3, *cache.shape)).astype(cache.dtype)
    kv = _on_device(cache, model)
    src, dst = [3, 7, 9, 0], [5, 4, 11, cache.num_blocks]  # the last entry is padding
    new = cache.copy_blocks_stacked(kv, src, dst, allow_padding=True)
    assert kv.is_deleted(), "the input cache must be donated"
    want = model.copy()
    want[:, [5, 4, 11]] = model[:, [3, 7, 9]]
    assert np.asarray(new).dtype == cache.storage_dtype  # bf16 stays uint16 on CPU
    np.testing.assert_array_equal(_as_compute(cache, new), want)
    with pytest.raises(ValueError, match=r"dst block id value 24"):
        cache.copy_blocks_stacked(new, [1], [cache.num_blocks])  # padding only when allowed
    with pytest.raises(ValueError, match=r"dst block id 5 appears more than once"):
        cache.copy_blocks_stacked(new, [1, 2], [5, 5], allow_padding=True)
    with pytest.raises(ValueError, match=r"block 3 is both a copy source and a destination"):
        cache.copy_blocks_stacked(new, [3, 7], [5, 3])  # a chain: its order would matter
    assert cache.copy_blocks_stacked(new, [], []) is new


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copies_and_zeroing_of_many_blocks_run_in_chunks_like_one_scatter(dtype: str) -> None:
    """More ids than one chunk (`kv_blocks.IDS_PER_CHUNK`): the chunked loop copies and
    zeroes exactly what one scatter would, padding included."""
    rng = np.random.default_rng(5)
    cache = _cache(dtype, num_blocks=400)
    model = rng.standard_normal((2, *cache.shape)).astype(cache.dtype)
    kv = _on_device(cache, model)
    blocks = rng.permutation(np.arange(1, cache.num_blocks))
    src, dst = blocks[:150], blocks[150:300]
    kv = cache.copy_blocks_stacked(kv, src, dst)
    model[:, dst] = model[:, src]
    zero = blocks[200:330]
    kv = cache.zero_blocks_stacked(kv, zero)
    model[:, zero] = 0
    np.testing.assert_array_equal(_as_compute(cache, kv), model)
