"""Every program the engine runs on its donated caches updates them in place.

Compiled at a pool of 4,096 blocks (a cache buffer far larger than any step
temporary), each program's optimized HLO must alias every cache parameter to an
output and hold no copy or temporary of a cache buffer's size
(`jaxkv.device.in_place.check_in_place`): the forward + sampling step (smallest and
largest step shape), block zeroing, copy-on-write block copies and host-tier loads
(the block scatter) per KV-cache group, and the encoder store's write. For the tiny
engine model, both real decoder families
(Gemma 3 with sliding and full layers in two groups, Llama), LLaVA, a Gemma 3 deep
enough to run several layers per layer program; float32, bfloat16
(kept as uint16 bits on CPU), int8 and fp8 caches; one device and 8 simulated devices.
"""

from __future__ import annotations

import pytest
from default_codegen import compile_by_default
from eight_devices import call_on_8_devices
from models_util import deep_gemma3_config

from jaxkv.device.in_place import check_in_place
from jaxkv.engine import EngineConfig, LLMEngine
from jaxkv.testing.tiny_model import TinyCausalLM
from jaxkv.testing.tiny_model import tiny_configs as engine_tiny_configs

NUM_BLOCKS = 4096


def _model(family: str, dtype: str, mesh=None):
    """`family`, or `family+scan` for one scanned layer body (the default off CPU);
    `gemma3-deep`: 23 layers, run in groups of 3 and 2 layers per program."""
    family, _, scan = family.partition("+")
    if family == "tiny":
        return TinyCausalLM(engine_tiny_configs()["gemma-style-tiny"])
    import tempfile

    from jaxkv import models

    names = {"gemma3": "gemma3-tiny", "llama": "llama-tiny", "llava": "llava-tiny"}
    config = deep_gemma3_config(23) if family == "gemma3-deep" else None
    path = tempfile.mkdtemp(prefix=f"jaxkv-{family}-")
    models.save_random_checkpoint(path, config or models.tiny_configs()[names[family]], seed=0)
    return models.load_model(path, dtype=dtype, mesh=mesh, scan_layers=True if scan else None)


def engine_programs_report(family: str, dtype: str, kv_cache_dtype: str, devices: str = "1"):
    """{program name: problems} for the engine built on `family`, `dtype`, `kv_cache_dtype`
    (JSON-able, so the 8-device run can send it back)."""
    mesh = None
    if devices == "8":
        from jaxkv.device import make_mesh

        mesh = make_mesh(2, 4)
    model = _model(family, dtype, mesh)
    config = EngineConfig(
        num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=256, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    engine = LLMEngine(model, config, mesh=mesh)
    report = {}
    for name, (lowered, caches) in engine.runner.lowered_programs().items():
        result = check_in_place(compile_by_default(lowered), caches)
        assert result.cache_bytes and min(result.cache_bytes) > 0
        report[name] = result.problems
    return report


# The quick suite compiles two cases; the rest run in the slow part (tests/conftest.py).
CASES = [
    ("tiny", "float32", "auto"),
    pytest.param("tiny", "float32", "int8", marks=pytest.mark.slow),
    pytest.param("tiny", "float32", "fp8", marks=pytest.mark.slow),
    pytest.param("gemma3", "float32", "auto", marks=pytest.mark.slow),
    pytest.param("gemma3-deep", "float32", "auto", marks=pytest.mark.slow),
    ("gemma3", "bfloat16", "auto"),
    ("gemma3+scan", "bfloat16", "auto"),
    pytest.param("llama+scan", "float32", "int8", marks=pytest.mark.slow),
    pytest.param("llama", "float32", "int8", marks=pytest.mark.slow),
    pytest.param("llama", "bfloat16", "fp8", marks=pytest.mark.slow),
    pytest.param("llava", "float32", "auto", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "dtype", "kv_cache_dtype"), CASES)
def test_every_engine_program_updates_its_caches_in_place(family, dtype, kv_cache_dtype):
    report = engine_programs_report(family, dtype, kv_cache_dtype)
    kinds = {name.split()[0] for name in report}
    assert {"step", "zero_blocks", "copy_blocks"} <= kinds
    if family.startswith("llava"):
        assert "encoder_store" in kinds
    assert not any(report.values()), report


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "dtype"), [("gemma3", "bfloat16"), ("gemma3+scan", "bfloat16"), ("llava", "float32")]
)
def test_every_engine_program_is_in_place_on_8_devices(family, dtype):
    report = call_on_8_devices(
        "test_engine_in_place", "engine_programs_report", family, dtype, "auto", "8"
    )
    assert report and not any(report.values()), report


def test_the_check_sees_a_cache_copy():
    """The checker is not vacuous: an update whose output cannot alias the cache (not
    donated) is reported; the same update donated is not."""
    import jax
    import jax.numpy as jnp

    cache = jax.ShapeDtypeStruct((NUM_BLOCKS, 16, 4, 32), jnp.float32)

    @jax.jit
    def copies(kv):  # not donated: the output cannot alias the input
        return kv.at[0].set(1.0)

    result = check_in_place(compile_by_default(copies.lower(cache)), [cache])
    assert not result.in_place and "aliased" in result.problems[0]

    def in_place(kv):
        return kv.at[0].set(1.0)

    program = jax.jit(in_place, donate_argnums=0).lower(cache)
    result = check_in_place(compile_by_default(program), [cache])
    assert result.in_place, result.problems
