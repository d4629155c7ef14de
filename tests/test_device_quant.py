"""Quantised KV caches (int8, fp8 e4m3; per token-head scales stored inline)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_device_attention import random_case, reference_attention, rel_error, run_attention
from test_device_step_metadata import _run_step

from jaxkv.device import PagedKVCache
from jaxkv.device.storage import dequantize, quantize
from jaxkv.kv_cache_interface import FullAttentionSpec

# Attention output error vs float64 on unquantised data (unit-normal K/V, stated bound).
ATTENTION_BOUND = {"int8": 2e-2, "fp8": 1e-1}


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(["int8", "fp8"]),
    seed=st.integers(0, 2**32 - 1),
    log_scale=st.floats(-6, 6),
    zero_row=st.booleans(),
)
def test_elementwise_error_within_the_documented_bound(mode, seed, log_scale, zero_row) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 3, 32)) * 10.0**log_scale).astype(np.float32)
    if zero_row:
        x[2, 1] = 0.0
    back = np.asarray(dequantize(quantize(jnp.asarray(x), mode), mode))
    row_max = np.abs(x).max(-1, keepdims=True)
    scale = row_max / (127.0 if mode == "int8" else 448.0)
    err = np.abs(back - x)
    # float32 arithmetic (the scale, the division, the product, the error itself) adds a
    # few roundings of the row's largest value to the exact bound.
    rounding = 4 * np.finfo(np.float32).eps * row_max
    if mode == "int8":
        bound = scale / 2 + rounding
    else:
        bound = np.abs(x) / 16 + scale * 2.0**-9 + rounding
    assert (err <= bound).all(), float((err - bound).max())
    if zero_row:
        assert not back[2, 1].any()


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, 3.0)])
def test_attention_over_a_quantised_cache(mode, window, soft_cap) -> None:
    rng = np.random.default_rng()
    spec = FullAttentionSpec(4, 2, 16, "float32")
    cache = PagedKVCache(spec, 40, kv_quant=mode)
    case = random_case(rng, [23, 7, 13, 1], [9, 1, 4, 1], cache=cache, head_size=16, width=8)
    want = reference_attention(case, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)
    got = run_attention(case, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap,
                        kv_quant=mode)  # fmt: skip
    num_q = int(case.q_lens.sum())
    assert np.isfinite(got).all(), "NaN scales of unwritten pages leaked"
    err = rel_error(got[:num_q], want[:num_q])
    assert 1e-7 < err < ATTENTION_BOUND[mode], err  # quantised: close, but not exact
    masks = {"sliding_window": window, "soft_cap": soft_cap}
    want_step = reference_attention(case, sm_scale=0.4, **masks)[:num_q]  # _run_step's scale
    assert rel_error(_run_step(case, rng, **masks), want_step) < ATTENTION_BOUND[mode]


def test_quantised_bytes_and_reads() -> None:
    spec = FullAttentionSpec(16, 8, 128, "bfloat16")
    bf16 = PagedKVCache(spec, 64)
    for mode, dtype in (("int8", np.int8), ("fp8", np.uint8)):
        cache = PagedKVCache(spec, 64, kv_quant=mode)
        assert cache.storage_dtype == dtype and cache.shape == (64, 16, 16, 132)
        assert cache.bytes_per_device == 64 * cache.bytes_per_block
        assert cache.bytes_per_device / bf16.bytes_per_device == pytest.approx(132 / 256)
        kv = cache.allocate_stacked(1)
        k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 128)), jnp.bfloat16)
        kv = cache.write_kv(kv, k, k, np.array([16, 17]))
        rk, _ = cache.read_kv(kv, np.array([16, 17]))
        assert rk.dtype == jnp.bfloat16
        bound = ATTENTION_BOUND[mode] * 2
        assert rel_error(np.asarray(rk, np.float32), np.asarray(k, np.float64)) < bound
        with pytest.raises(ValueError, match="dtype bfloat16 \\(compute dtype"):
            cache.write_kv(kv, k.view(jnp.uint16), k, np.array([16, 17]))
    with pytest.raises(ValueError, match="kv_quant must be None or one of"):
        PagedKVCache(spec, 8, kv_quant="int4")
    with pytest.raises(ValueError, match="conflicts with kv_quant='int8'"):
        PagedKVCache(spec, 8, kv_quant="int8", storage_dtype="bfloat16")
