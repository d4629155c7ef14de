"""The `jaxkv` command: generate from a local checkpoint, plan capacity, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxkv import cli, models
from jaxkv._checks import parse_memory
from jaxkv.testing.reference import DenseReference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    models.save_random_checkpoint(path, models.tiny_configs()["llama-tiny"], seed=0)
    return path


def test_generate_json_matches_the_dense_reference(checkpoint, capsys) -> None:
    argv = ["generate", "--model", str(checkpoint), "--prompt-token-ids", "5,6,7,8,9",
            "--max-tokens", "5", "--json", "--max-model-len", "64"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompt_token_ids"] == [5, 6, 7, 8, 9]
    outputs = result["output_token_ids"]
    assert 1 <= len(outputs) <= 5
    reference = DenseReference(models.load_model(checkpoint), 64)
    assert outputs == reference.expected([5, 6, 7, 8, 9], outputs)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["--prompt", "hello"], "tokenizer.json"),
        (["--prompt-token-ids", "1,2", "--image", "nope.png"], "preprocessor_config.json"),
        (
            ["--prompt-token-ids", "1", "--tensor-parallel-size", "2"],
            "needs 2 devices; 1 available",
        ),
        (
            ["--prompt-token-ids", "1", "--data-parallel-size", "0"],
            "--data-parallel-size must be a positive integer, got 0",
        ),
    ],
)
def test_generate_bad_input_is_a_clear_error(checkpoint, capsys, argv, message) -> None:
    assert cli.main(["generate", "--model", str(checkpoint), *argv]) == 2
    assert message in capsys.readouterr().err


def test_logprobs_mode_flag_takes_vllms_values_only(checkpoint, capsys) -> None:
    argv = ["generate", "--model", str(checkpoint), "--prompt-token-ids", "1"]
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--logprobs-mode", "raw"])
    assert exited.value.code == 2
    assert "--logprobs-mode: invalid choice: 'raw' (choose from 'raw_logprobs'" in (
        capsys.readouterr().err
    )


def test_generate_unknown_directory(tmp_path, capsys) -> None:
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt-token-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_plan_prints_blocks_and_concurrency(checkpoint, capsys) -> None:
    argv = ["plan", "--model", str(checkpoint), "--memory", "1MiB", "--max-model-len", "128",
            "--max-num-batched-tokens", "64", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    specs = cli.read_kv_cache_specs(str(checkpoint), 16, "bfloat16")
    page = sum(s.page_size_bytes for s in specs.values())
    assert plan["num_blocks"] == 2**20 // page
    assert plan["bytes_per_device"] == plan["num_blocks"] * page <= 2**20
    assert plan["max_concurrency"] == pytest.approx(plan["num_blocks"] / (128 / 16), rel=0.2)
    assert cli.main(argv[:-1]) == 0
    assert "max concurrency at 128 tokens" in capsys.readouterr().out


def test_plan_hybrid_checkpoint_has_sliding_groups(tmp_path, capsys) -> None:
    models.save_random_checkpoint(tmp_path, models.tiny_configs()["gemma3-tiny"], seed=0)
    argv = ["plan", "--model", str(tmp_path), "--memory", "4MiB", "--max-model-len", "256",
            "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {g["spec"] for g in plan["groups"]} == {"FullAttentionSpec", "SlidingWindowSpec"}


@pytest.mark.parametrize("bad", ["16 parsecs", "GiB", "-3GB"])
def test_plan_rejects_a_bad_memory_size(checkpoint, capsys, bad) -> None:
    argv = ["plan", "--model", str(checkpoint), f"--memory={bad}", "--max-model-len", "128"]
    assert cli.main(argv) == 2
    assert "is not a size" in capsys.readouterr().err


def test_parse_memory_units() -> None:
    assert parse_memory("16GiB") == 16 * 2**30
    assert parse_memory("1.5 GB") == 1_500_000_000
    assert parse_memory("2e3") == 2000


def test_python_dash_m_jaxkv_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "jaxkv", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for command in ("demo", "generate", "plan"):
        assert command in result.stdout


def test_generate_with_a_host_tier_and_bad_tier_sizes(checkpoint, capsys) -> None:
    argv = ["generate", "--model", str(checkpoint), "--prompt-token-ids", "5,6,7,8,9",
            "--max-tokens", "3", "--json", "--max-model-len", "64"]  # fmt: skip
    assert cli.main([*argv, "--kv-offloading-size", "8MiB"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_host_cached_tokens"] == 0 and len(result["output_token_ids"]) == 3
    for size, message in (("1KiB", "at least one block"), ("-1GiB", "is not a size")):
        assert cli.main([*argv, f"--kv-offloading-size={size}"]) == 2
        err = capsys.readouterr().err
        assert "kv_offloading_size" in err or "--kv-offloading-size" in err
        assert message in err
