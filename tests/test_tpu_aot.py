"""The TPU kernel compiles for real, without a TPU: the Mosaic compiler in libtpu, deviceless.

A TPU environment (`jax[tpu]` at this process's jax version, and this repository's jaxkv)
is built once at `REPO/.venv-tpu-ci` (or `$JAXKV_TPU_VENV`) and reused while it imports
`jax` at that version and `libtpu`; `tests/tpu_aot_matrix.py` runs in it and compiles
`ragged_paged_attention(platform="tpu")` for a covering matrix of storage dtypes, head sizes,
block sizes, groups, KV heads, masks and head modes on v5e, v6e and v5p. Skipped (with
pip's last line) when the environment cannot be installed, e.g. without network.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from aot_venv import JAX_VERSION, PIP_TIMEOUT_S, REPO, last_line, side_python, subprocess_env
from models_util import real_shaped_two_layer_configs

pytestmark = pytest.mark.slow

MATRIX = REPO / "tests" / "tpu_aot_matrix.py"
VENV = Path(os.environ.get("JAXKV_TPU_VENV", REPO / ".venv-tpu-ci")).absolute()
TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")
# the values the matrix must compile bf16 with, on every topology
BF16_VALUES = {
    "head_size": {64, 128, 256},
    "block_size": {16, 32, 64, 128},
    "group": {1, 2, 4, 8},
    "kv_heads": {1, 2, 4, 8, 16},
}
# how a refusal reason names the dimension it refuses: "name=value" of the configuration's
REASON_NAMES = {"num_kv_heads": "kv_heads", "head_size": "head_size", "block_size": "block_size"}
MATRIX_TIMEOUT_S = 1800


def _env() -> dict[str, str]:
    # Both tests may compile at once (xdist workers): libtpu's process lock would refuse.
    return subprocess_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")


@pytest.fixture(scope="module")
def tpu_python() -> Path:
    """The TPU environment's python (`aot_venv.side_python`)."""
    return side_python(VENV, [f"jax[tpu]=={JAX_VERSION}"], ("libtpu",), _env(), "TPU")


def run_matrix(python: Path) -> tuple[list[dict], dict, subprocess.CompletedProcess]:
    """`(one record per configuration, the summary, the process)` of the matrix in `python`."""
    proc = subprocess.run(
        [python, MATRIX, *TOPOLOGIES],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=MATRIX_TIMEOUT_S,
    )  # fmt: skip
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records and records[-1].get("summary"), (
        f"the matrix printed no summary (exit status {proc.returncode}); "
        f"stderr ends: {proc.stderr[-3000:]}"
    )
    return records[:-1], records[-1], proc


def check_outcomes(configs: list[dict], summary: dict) -> None:
    """Each configuration either compiled the Mosaic kernel or was refused by
    `tpu_kernel_error` and compiled `impl="auto"`'s blockwise fallback; the run used this
    repository's jaxkv and jax version, and every topology's counts add up."""
    failed = [c for c in configs if c["outcome"] not in ("compiled", "refused")]
    assert not failed, "configurations that neither compiled nor fell back:\n" + "\n".join(
        json.dumps(c) for c in failed
    )
    assert Path(summary["jaxkv"]).resolve().is_relative_to(REPO.resolve()), summary["jaxkv"]
    assert summary["jax"] == JAX_VERSION, summary["jax"]
    assert list(summary["topologies"]) == list(TOPOLOGIES), summary["topologies"]
    for name, counts in summary["topologies"].items():
        mine = [c for c in configs if c["topology"] == name]
        assert counts["configs"] == len(mine) == counts["compiled"] + counts["refused"] > 0, (
            name, counts, len(mine),
        )  # fmt: skip
    assert summary["failed"] == 0, summary


def check_bf16_coverage(configs: list[dict], topology: str) -> None:
    """On `topology` bf16 compiled the kernel with every head size, block size, group and
    KV heads value (never refused); f32, int8 and fp8 each compiled at least once."""
    configs = [c for c in configs if c["topology"] == topology]
    bf16 = [c for c in configs if c["dtype"] == "bf16"]
    refused = [c for c in bf16 if c["outcome"] != "compiled"]
    assert not refused, f"{topology}: bf16 refused: {refused}"
    for key, values in BF16_VALUES.items():
        missing = values - {c[key] for c in bf16}
        assert not missing, f"{topology}: bf16 never compiled with {key} in {sorted(missing)}"
    for dtype in ("f32", "int8", "fp8"):
        compiled = [c for c in configs if c["dtype"] == dtype and c["outcome"] == "compiled"]
        assert compiled, f"{topology}: the kernel never compiled for {dtype}"


def check_refusals(configs: list[dict]) -> None:
    """A refused configuration's reason names the refused dimension with its value
    (e.g. `num_kv_heads=1` for an int8/fp8 cache with an odd number of KV heads)."""
    for config in configs:
        if config["outcome"] != "refused":
            continue
        named = {name: int(v) for name, v in re.findall(r"(\w+)=(\d+)", config["reason"])}
        assert any(named.get(name) == config[key] for name, key in REASON_NAMES.items()), (
            f"the reason does not name the refused dimension with its value: {config}"
        )


# One test (not one per check): under `--dist load` each test could land on another xdist
# worker, and each worker would compile the whole matrix again.
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + MATRIX_TIMEOUT_S)
def test_tpu_kernel_compiles_on_v5e_v6e_v5p(tpu_python):
    """The matrix compiled (or fell back) everywhere; see the check_* functions."""
    configs, summary, proc = run_matrix(tpu_python)
    check_outcomes(configs, summary)
    for topology in TOPOLOGIES:
        check_bf16_coverage(configs, topology)
    check_refusals(configs)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-3000:]}"


@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + MATRIX_TIMEOUT_S)
def test_engine_steps_compile_in_place_for_a_tpu_slice(tpu_python, tmp_path):
    """`jaxkv plan --topology v5e:2x2 --aot --json` compiles the engine's decode and prefill
    steps, block zeroing, copies and host-tier loads for real-shaped models; every donated
    cache is aliased (no cache-sized copy), and the per-chip figures are filled in."""
    for name, config in real_shaped_two_layer_configs().items():
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        proc = subprocess.run(
            [tpu_python, "-m", "jaxkv", "plan", "--model", model_dir, "--topology", "v5e:2x2",
             "--aot", "--json", "--memory", "1GiB", "--max-model-len", "2048",
             "--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
            capture_output=True, text=True, env=_env(), cwd=REPO, timeout=MATRIX_TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 0, f"{name}: {last_line(proc)}"
        plan = json.loads(proc.stdout.strip().splitlines()[-1])
        programs = {p["name"]: p for p in plan["programs"]}
        assert {"decode", "prefill", "zero_blocks", "copy_blocks"} <= set(programs), programs
        assert plan["kv_in_place"], (name, [p["cache_copies"] for p in plan["programs"]])
        assert plan["device_kind"] == "TPU v5 lite" and plan["chips"] == 4
        assert plan["weight_bytes"] > 0 and plan["num_blocks"] > 2048 // 16
        assert plan["decode_seconds"] > 0 and plan["longest_model_len"] >= 2048
