"""`jaxkv plan --topology` on the CPU side: what needs no TPU or CUDA compiler (the
compiling itself runs in `tests/test_tpu_aot.py` and `tests/test_gpu_aot.py`, in
environments with `jax[tpu]` and the CUDA plugin), and the platform's default block size."""

from __future__ import annotations

import json

import jax
import pytest

from jaxkv import cli
from jaxkv.device.attention import default_block_size
from jaxkv.device.gpu_targets import GPU_TARGETS, jax_memory_bytes, parse_gpu_topology
from jaxkv.engine import EngineConfig, LLMEngine
from jaxkv.engine.topology_plan import default_model_axis, topology_devices
from jaxkv.models import tiny_configs
from jaxkv.testing.tiny_model import TinyCausalLM
from jaxkv.testing.tiny_model import tiny_configs as tiny_engine_configs

ARGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]


@pytest.mark.parametrize(
    ("chips", "kv_heads", "model"),
    [(4, 8, 4), (16, 8, 8), (256, 16, 16), (256, 1, 1), (8, 2, 2), (6, 4, 2), (1, 8, 1)],
)
def test_default_model_axis_shards_heads_never_replicates(chips, kv_heads, model) -> None:
    assert default_model_axis(chips, kv_heads) == model
    assert chips % model == 0 and kv_heads % model == 0


def test_a_topology_without_libtpu_is_one_line_naming_the_flag() -> None:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("libtpu is installed here: the TPU compiler can describe topologies")
    with pytest.raises(ValueError, match=r"--topology 'v5e:2x2'.*jax\[tpu\]"):
        topology_devices("v5e:2x2")


def test_gpu_names_and_a_missing_cuda_plugin_are_one_line_each(monkeypatch) -> None:
    assert parse_gpu_topology("v5e:2x2") is None
    assert parse_gpu_topology("h100") == (GPU_TARGETS["h100"], 1)
    assert parse_gpu_topology("a100:8") == (GPU_TARGETS["a100"], 8)
    for bad in ("h100:0", "h100:x", "h200:-1"):
        with pytest.raises(ValueError, match="the GPU count after ':' must be a positive"):
            parse_gpu_topology(bad)
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:  # the CUDA compiler absent: one line naming the flag and the plugin
        with pytest.raises(ValueError, match=r"--topology 'h100'.*jax-cuda13-plugin"):
            topology_devices("h100")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert jax_memory_bytes(GPU_TARGETS["a100"]) == int(80 * 2**30 * 0.9)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert jax_memory_bytes(GPU_TARGETS["h100"]) == 60 * 2**30
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='1.5': a number"):
        jax_memory_bytes(GPU_TARGETS["h100"])


def test_topology_needs_aot_and_one_mesh(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_configs()["llama-tiny"]))
    model = ["plan", "--model", str(tmp_path), *ARGS]
    assert cli.main([*model, "--topology", "v5e:2x2"]) == 2
    assert "add --aot" in capsys.readouterr().err
    assert cli.main([*model, "--topology", "v5e:2x2", "--aot", "--mesh", "1x4",
                     "--mesh", "2x2"]) == 2  # fmt: skip
    assert "at most one --mesh" in capsys.readouterr().err
    assert cli.main(model) == 2
    assert "--memory is needed" in capsys.readouterr().err


def test_block_size_defaults_per_platform() -> None:
    assert default_block_size("tpu") == 128
    assert default_block_size("cpu") == default_block_size("gpu") == 16
    model = TinyCausalLM(tiny_engine_configs()["gemma-style-tiny"], seed=0)
    assert LLMEngine(model, EngineConfig(num_blocks=40)).config.block_size == 16
    with pytest.raises(ValueError, match="EngineConfig.block_size must be a positive int"):
        LLMEngine(model, EngineConfig(block_size=0))


def test_the_first_pass_pool_holds_one_request_of_a_hybrid_model() -> None:
    """The plan's smallest pool counts a request's blocks as `plan_kv_cache` does: a
    Gemma 3 with 512-token windows at `max_model_len=256` takes a block more per sliding
    group than its tokens fill (it was refused: 97 blocks against 101 + 1 needed)."""
    from jaxkv.device import make_mesh
    from jaxkv.engine import topology_plan
    from jaxkv.models.config import parse_model_config

    gemma = dict(tiny_configs()["gemma3-tiny"])
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    gemma.update(num_hidden_layers=18, layer_types=types, sliding_window=512)
    config = parse_model_config(gemma, "gemma3")
    engine = EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=4096)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    runner, num_blocks = topology_plan._runner(config, mesh, engine, None)
    assert num_blocks == 1 + 6 * (256 // 16) + 5 and runner.paged[0].num_blocks == num_blocks
