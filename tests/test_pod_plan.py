"""`jaxkv plan --mesh DATAxMODEL [--aot]`: a pod plan from `config.json` alone, the step
compiled ahead of time on abstract inputs (`jaxkv.engine.pod_plan`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eight_devices import simulated_devices_env
from jax.sharding import PartitionSpec as P

from jaxkv import cli
from jaxkv.device import MODEL_AXIS, make_mesh
from jaxkv.engine.pod_plan import parse_mesh, plan_mesh
from jaxkv.models import tiny_configs
from jaxkv.models.checkpoint import AbstractTensors
from jaxkv.models.config import parse_model_config
from jaxkv.models.loading import PARTS, build_model
from jaxkv.models.testing import RandomTensors

REPO = Path(__file__).resolve().parent.parent
PLAN_ARGS = ["--memory", "1MiB", "--max-model-len", "256", "--max-num-batched-tokens", "64",
             "--max-num-seqs", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3")
    (path / "config.json").write_text(json.dumps(tiny_configs()["gemma3-tiny"]))
    return path


def bf16_weight_bytes(config: dict) -> int:
    """Every parameter's bytes in bfloat16, counted on a model of random tensors."""
    recorder = RandomTensors(0)
    prefixes = {key: part.prefixes[0] for key, part in PARTS["decoder"].items()}
    build_model(parse_model_config(config), recorder, prefixes)
    return sum(t.size * 2 for t in recorder.tensors.values())


def test_abstract_tensors_are_placed_as_the_checkpoint_reader_places_them() -> None:
    reader = AbstractTensors("bfloat16", make_mesh(1, 1))
    struct = reader.get_stacked(["a", "b", "c"], (8, 4), P(MODEL_AXIS, None), units=2)
    assert (struct.shape, str(struct.dtype)) == ((3, 8, 4), "bfloat16")
    assert struct.sharding.spec == P(None, MODEL_AXIS, None)


@pytest.mark.parametrize("text", ["3x", "x4", "0x16", "16x16x1", "sixteen", "4*4"])
def test_bad_mesh_text_is_one_line_naming_the_form(gemma3_dir, capsys, text) -> None:
    with pytest.raises(ValueError, match="is not DATAxMODEL"):
        parse_mesh(text)
    assert cli.main(["plan", "--model", str(gemma3_dir), "--mesh", text, *PLAN_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "DATAxMODEL" in err and repr(text) in err


def test_mesh_of_another_size_than_the_devices_names_the_allowed_size(gemma3_dir, capsys) -> None:
    assert cli.main(["plan", "--model", str(gemma3_dir), "--mesh", "2x2", *PLAN_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "spans 4 devices; this process has 1" in err and "DATA * MODEL = 1" in err


def test_aot_needs_a_mesh(gemma3_dir, capsys) -> None:
    assert cli.main(["plan", "--model", str(gemma3_dir), "--aot", *PLAN_ARGS]) == 2
    assert "--mesh" in capsys.readouterr().err


def test_one_device_plan_counts_every_weight_once(gemma3_dir) -> None:
    config = tiny_configs()["gemma3-tiny"]
    plan = plan_mesh(
        parse_model_config(config), make_mesh(1, 1), kv_cache_memory=2**20,
        max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, aot=False,
    )  # fmt: skip
    assert plan.weight_bytes == bf16_weight_bytes(config)
    # 4 layers x 16 tokens x (K, V) x 2 KV heads x 16 dims x 2 bytes per block, 1 MiB.
    assert plan.num_blocks == 2**20 // (4 * 16 * 2 * 2 * 16 * 2)
    assert plan.kv_bytes == plan.num_blocks * 4 * 16 * 2 * 2 * 16 * 2
    assert plan.decode is None and plan.prefill is None


def _plans_on_16_devices(model_dir: str) -> list[dict]:
    """(Run under 16 devices.) The CLI's AOT plan on 4x4, and a 16x1 plan without AOT."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", "--model", model_dir, "--mesh", "4x4", "--aot", "--json",
                         *PLAN_ARGS]) == 0  # fmt: skip
    config = parse_model_config(json.loads((Path(model_dir) / "config.json").read_text()))
    replicated = plan_mesh(
        config, make_mesh(16, 1), kv_cache_memory=2**20, max_model_len=256,
        max_num_batched_tokens=64, max_num_seqs=8, aot=False,
    )  # fmt: skip
    return [json.loads(out.getvalue()), replicated.as_dict()]


def test_aot_plan_on_16_devices_is_checked_by_the_compiler(gemma3_dir) -> None:
    env = simulated_devices_env(16)
    code = (
        "import json, sys, test_pod_plan as t; "
        "print('RESULT ' + json.dumps(t._plans_on_16_devices(sys.argv[1])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(gemma3_dir)], env=env, cwd=REPO / "tests",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    sharded, replicated = json.loads(line[len("RESULT ") :])
    total = bf16_weight_bytes(tiny_configs()["gemma3-tiny"])
    # 16x1: nothing split, every device holds every weight.
    assert (replicated["data_ranks"], replicated["weight_bytes"]) == (16, total)
    # 4x4: q/o projections, MLP and embeddings split 4 ways; 2 KV heads do not divide by 4,
    # so k/v stay whole and attention runs data parallel over all 16 devices.
    assert (sharded["data"], sharded["model"], sharded["data_ranks"]) == (4, 4, 16)
    assert total // 4 < sharded["weight_bytes"] < total
    assert sharded["kv_bytes"] == replicated["kv_bytes"] <= 2**20
    for step, tokens in (("decode", 8), ("prefill", 64)):
        stats = sharded[step]
        assert stats["num_tokens"] >= tokens and stats["temp_bytes"] > 0
        # The compiler's per-device arguments: the weights and KV cache on paper, plus the
        # packed step buffer and the previous tokens (a few KiB here).
        paper = sharded["weight_bytes"] + sharded["kv_bytes"]
        assert paper <= stats["argument_bytes"] < paper + 64 * 2**10
        assert stats["alias_bytes"] == sharded["kv_bytes"]  # the cache is updated in place
