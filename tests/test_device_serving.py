"""Serving-loop properties: warm-up compiles everything, all layers in one program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from test_device_step_metadata import _packer, _random_step

from jaxkv.device import AttentionOptions, PagedKVCache, compilation_count, no_compilation
from jaxkv.kv_cache_interface import FullAttentionSpec

HALF = AttentionOptions(sm_scale=0.5)


def test_no_compilation_after_warmup_over_300_random_steps_two_layers() -> None:
    rng = np.random.default_rng()
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    packer = _packer()
    kv = cache.allocate_stacked(2)
    start = compilation_count()
    kv = cache.warmup(kv, packer, num_q_heads=4, options=HALF)
    assert compilation_count() > start
    model = np.asarray(kv).reshape(2, -1, 4, 8).copy()
    bs = cache.block_size
    with no_compilation("300 random serving steps after warmup"):
        for _ in range(300):
            freed = rng.choice(np.arange(1, 64), size=int(rng.integers(0, 9)), replace=False)
            kv = cache.zero_blocks_stacked(kv, freed)
            for b in freed:
                model[:, b * bs : (b + 1) * bs] = 0
            buf, shape = packer.pack(_random_step(rng, packer))
            fields = shape.layout.unpack(buf[0])
            n = int(fields["num_tokens"][0])
            slots = fields["slot_mapping"][:n]
            put = packer.put(buf)
            for layer in range(2):
                t = shape.num_tokens
                # jax.device_put: jnp.asarray of a NumPy array compiles a copy per shape.
                q = jax.device_put(rng.standard_normal((t, 4, 8)).astype(np.float32))
                k = rng.standard_normal((t, 2, 8)).astype(np.float32)
                v = rng.standard_normal((t, 2, 8)).astype(np.float32)
                kv, out = cache.step(
                    kv, q, jax.device_put(k), jax.device_put(v), put, shape, HALF, layer=layer
                )
                model[layer, slots, 0::2], model[layer, slots, 1::2] = k[:n], v[:n]
            assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(kv).reshape(2, -1, 4, 8), model)


def test_stacked_layer_step_runs_every_layer_in_one_program() -> None:
    rng = np.random.default_rng()
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    packer = _packer()
    buf, shape = packer.pack(_random_step(rng, packer))
    t = shape.num_tokens
    qs = jnp.asarray(rng.standard_normal((3, t, 4, 8)), jnp.float32)
    ks = jnp.asarray(rng.standard_normal((3, t, 2, 8)), jnp.float32)

    @jax.jit
    def forward(kv, put):
        outs = []
        for layer in range(3):
            kv, out = cache.stacked_layer_step(
                kv, layer, qs[layer], ks[layer], ks[layer] * 2, put, shape, HALF
            )
            outs.append(out)
        return kv, jnp.stack(outs)

    base = rng.standard_normal((3, *cache.shape)).astype(np.float32)
    want_kv, want = jnp.array(base), []
    for layer in range(3):
        want_kv, out = cache.step(
            want_kv, qs[layer], ks[layer], ks[layer] * 2, packer.put(buf), shape, HALF,
            layer=layer,
        )  # fmt: skip
        want.append(np.asarray(out))
    before = compilation_count()
    got_kv, got = forward(jnp.array(base), packer.put(buf))
    assert compilation_count() - before == 1, "one program for all layers"
    np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))


def test_step_inside_a_users_jit_matches_step_outside() -> None:
    rng = np.random.default_rng()
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    packer = _packer()
    buf, shape = packer.pack(_random_step(rng, packer))
    t = shape.num_tokens
    q = jax.device_put(rng.standard_normal((t, 4, 8)).astype(np.float32))
    k = jax.device_put(rng.standard_normal((t, 2, 8)).astype(np.float32))
    base = rng.standard_normal((2, *cache.shape)).astype(np.float32)
    want_kv, want = cache.step(jnp.asarray(base), q, k, k, packer.put(buf), shape, layer=1)
    inside = jax.jit(lambda kv, q, k, buf: cache.step(kv, q, k, k, buf, shape, layer=1))
    got_kv, got = inside(jnp.asarray(base), q, k, packer.put(buf))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))
