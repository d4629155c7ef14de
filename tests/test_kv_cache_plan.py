"""`jaxkv plan` and a built engine agree on the KV cache (`jaxkv.engine.sizing.plan_kv_cache`):
the same `num_blocks` and `max_model_len` for every model config in the repo, on one
device and on a simulated `4x2` mesh; the sizing allocates nothing."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from eight_devices import call_on_8_devices
from models_util import family_configs

from jaxkv import cli, models
from jaxkv.device import PagedKVCache, make_mesh
from jaxkv.device.page_geometry import page_geometry
from jaxkv.engine import EngineConfig, LLMEngine
from jaxkv.engine.sizing import plan_kv_cache
from jaxkv.testing import tiny_model

MEMORY, MAX_LEN, BATCH = 512 * 2**10, 64, 32
CHECKPOINTS = [*family_configs().items(), ("llava", models.tiny_configs()["llava-tiny"])]


def _engine_config(kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(
        block_size=16, kv_cache_memory=MEMORY, max_model_len=MAX_LEN,
        max_num_batched_tokens=BATCH, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def _cli_plan(model_dir: str, *mesh: str) -> dict:
    """`jaxkv plan --json` of the checkpoint (with `--mesh`: its one mesh's object)."""
    argv = ["plan", "--model", model_dir, "--memory", str(MEMORY), "--max-model-len",
            str(MAX_LEN), "--max-num-batched-tokens", str(BATCH), "--block-size", "16",
            "--dtype", "float32", "--json", *mesh]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return json.loads(out.getvalue())


def _sizes(engine: LLMEngine) -> dict:
    return {"num_blocks": engine.config.num_blocks, "max_model_len": engine.config.max_model_len}


def _write_checkpoints(root: Path) -> list[str]:
    dirs = []
    for name, config in CHECKPOINTS:
        models.save_random_checkpoint(root / name, config, seed=0)
        dirs.append(str(root / name))
    return dirs


def plans_on_8_devices(*model_dirs: str) -> list[list[dict]]:
    """(Run under 8 devices.) Per checkpoint: `jaxkv plan --mesh 4x2` and the engine's
    sizes on that mesh."""
    mesh = make_mesh(4, 2)
    pairs = []
    for model_dir in model_dirs:
        engine = LLMEngine(models.load_model(model_dir, mesh=mesh), _engine_config(), mesh=mesh)
        planned = _cli_plan(model_dir, "--mesh", "4x2")
        pairs.append([{k: planned[k] for k in ("num_blocks", "max_model_len")}, _sizes(engine)])
    return pairs


@pytest.mark.parametrize(("name", "config"), CHECKPOINTS, ids=[n for n, _ in CHECKPOINTS])
def test_cli_plan_and_engine_agree_on_a_checkpoint(tmp_path, name, config) -> None:
    models.save_random_checkpoint(tmp_path, config, seed=0)
    planned = _cli_plan(str(tmp_path))
    engine = LLMEngine(models.load_model(tmp_path), _engine_config())
    assert {k: planned[k] for k in ("num_blocks", "max_model_len")} == _sizes(engine)
    assert planned["bytes_per_device"] == engine.runner.kv_cache.nbytes <= MEMORY


@pytest.mark.parametrize("name", sorted(tiny_model.tiny_configs()))
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cli_plan_and_engine_agree_on_the_tiny_models(name, kv_cache_dtype) -> None:
    model = tiny_model.TinyCausalLM(tiny_model.tiny_configs()[name])
    config = _engine_config(kv_cache_dtype)
    planned = cli.capacity_plan(model.kv_cache_specs(16, config.dtype), config)
    engine = LLMEngine(model, config)
    assert {k: planned[k] for k in ("num_blocks", "max_model_len")} == _sizes(engine)
    assert planned["bytes_per_device"] == engine.runner.kv_cache.nbytes <= MEMORY


def test_cli_plan_and_engine_agree_on_a_4x2_mesh(tmp_path) -> None:
    pairs = call_on_8_devices(
        "test_kv_cache_plan", "plans_on_8_devices", *_write_checkpoints(tmp_path)
    )
    assert len(pairs) == len(CHECKPOINTS)
    for (name, _), (planned, built) in zip(CHECKPOINTS, pairs, strict=True):
        assert planned == built, name


@pytest.mark.parametrize("kv_quant", [None, "int8", "fp8"])
def test_page_geometry_is_the_caches_bytes_per_block(kv_quant) -> None:
    """The plan's arithmetic is the allocator's: no cache needs building to learn it."""
    model = tiny_model.TinyCausalLM(tiny_model.tiny_configs()["gemma-style-tiny"])
    specs = model.kv_cache_specs(16, "float32")
    spec = next(iter(specs.values()))
    cache = PagedKVCache(spec, 4, kv_quant=kv_quant)
    assert page_geometry(spec, kv_quant=kv_quant).bytes_per_block == cache.bytes_per_block
    config = _engine_config("auto" if kv_quant is None else kv_quant)
    plan = plan_kv_cache(specs, config, None)
    assert plan.bytes_per_block == len(specs) * cache.bytes_per_block
    assert plan.num_blocks == MEMORY // plan.bytes_per_block
    assert plan.page_shape == cache.shape[1:] and plan.storage_dtype == cache.storage_dtype
