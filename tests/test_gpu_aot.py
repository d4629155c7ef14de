"""The GPU kernels compile for real, without a GPU: XLA's CUDA compiler and Triton, deviceless.

A CUDA environment (the `jax-cuda13-plugin` and `jax-cuda13-pjrt` wheels at this
process's jax version: the compiler, without the CUDA libraries a GPU run would load, and
this repository's jaxkv) is built once at `REPO/.venv-gpu-ci` (or `$JAXKV_GPU_VENV`) and
reused (`aot_venv`); `tests/gpu_aot_matrix.py` runs in it once per part and compiles
`ragged_paged_attention(platform="gpu")` for the dispatch's plan on that part, then
probes each kernel's real shared memory; `jaxkv plan --topology h100 --aot` compiles the
engine's programs for the part. XLA refuses at compile time a Triton kernel whose shared
memory passes the part's limit, so what compiles here fits the part. Skipped (with pip's
last line) when the environment cannot be installed, e.g. without network.
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

MATRIX = REPO / "tests" / "gpu_aot_matrix.py"
VENV = Path(os.environ.get("JAXKV_GPU_VENV", REPO / ".venv-gpu-ci")).absolute()
REQUIREMENTS = [
    f"jax=={JAX_VERSION}",
    f"jaxlib=={JAX_VERSION}",
    f"jax-cuda13-plugin=={JAX_VERSION}",
    f"jax-cuda13-pjrt=={JAX_VERSION}",
]
# part -> (its device kind, its shared memory per block)
PARTS = {
    "h100": ("NVIDIA H100 80GB HBM3", 232448),
    "h200": ("NVIDIA H200", 232448),
    "a100": ("NVIDIA A100-SXM4-80GB", 166912),
}
HEAD_SIZES = {64, 128, 256}
FULL_MATRIX_PARTS = ("h100", "a100")  # `gpu_aot_matrix.FULL_MATRIX`
# Triton's request for the rows kernel (head 256, 128 keys, 16 rows) on an H200, as the
# launch failure reported it there (`pallas_gpu`'s calibration)
H200_ROWS_KERNEL_SMEM = {"bf16": 286816, "f32": 417888}
DEFAULT_BLOCK_SIZE = 16  # the engine's on a GPU (`attention.default_block_size`)
MATRIX_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def gpu_python() -> Path:
    """The CUDA environment's python (`aot_venv.side_python`)."""
    return side_python(VENV, REQUIREMENTS, ("jax_plugins.xla_cuda13",), subprocess_env(), "CUDA")


def run_matrix(python: Path, part: str) -> tuple[list[dict], list[dict], list[dict], dict, int]:
    """`(matrix records, probe records, layer-layout records, the summary, exit status)`
    of one part's run."""
    proc = subprocess.run(
        [python, MATRIX, part], capture_output=True, text=True, env=subprocess_env(),
        cwd=REPO, timeout=MATRIX_TIMEOUT_S,
    )  # fmt: skip
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records and records[-1].get("summary"), (
        f"the matrix printed no summary (exit status {proc.returncode}); "
        f"stderr ends: {proc.stderr[-3000:]}"
    )
    probes = [r for r in records[:-1] if r.get("probe")]
    layers = [r for r in records[:-1] if r.get("layers")]
    configs = [r for r in records[:-1] if not r.get("probe") and not r.get("layers")]
    return configs, probes, layers, records[-1], proc.returncode


def check_summary(part: str, configs: list[dict], summary: dict) -> None:
    """The run used this repository's jaxkv and jax version, compiled for the part named,
    the dispatch planned for that part's limit, and every configuration compiled or was
    refused with the blockwise fallback compiling."""
    kind, limit = PARTS[part]
    assert Path(summary["jaxkv"]).resolve().is_relative_to(REPO.resolve()), summary["jaxkv"]
    assert summary["jax"] == JAX_VERSION, summary["jax"]
    assert summary["device_kind"] == kind and summary["limit"] == limit, summary
    assert summary["plan_limit"] == limit, summary["plan_limit_source"]
    failed = [c for c in configs if c["outcome"] not in ("compiled", "refused")]
    assert not failed, "configurations that neither compiled nor fell back:\n" + "\n".join(
        json.dumps(c) for c in failed
    )
    assert summary["configs"] == len(configs) == summary["compiled"] + summary["refused"]


def check_coverage(configs: list[dict]) -> None:
    """At the default block size both dtypes compiled the kernels for every head size and
    group, the prefill kernel included; refusals name the refused shape or feature."""
    default = [c for c in configs if c["block_size"] == DEFAULT_BLOCK_SIZE and "kv_quant" not in c]
    default = [c for c in default if not c.get("kv_head_mode")]
    refused = [c for c in default if c["outcome"] != "compiled"]
    assert not refused, f"refused at block size {DEFAULT_BLOCK_SIZE}: {refused}"
    for dtype in ("bf16", "f32"):
        mine = [c for c in configs if c["dtype"] == dtype and c["outcome"] == "compiled"]
        assert {c["head_size"] for c in mine} == HEAD_SIZES, dtype
        assert {c["head_size"] for c in mine if c["kernels"] == 2} == HEAD_SIZES, dtype
    for c in configs:
        if c["outcome"] == "refused":
            named = dict(re.findall(r"(head_size|block_size)=(\d+)", c["reason"]))
            shape = named == {"head_size": str(c["head_size"]), "block_size": str(c["block_size"])}
            assert shape or "not supported" in c["reason"], c


def check_probes(part: str, probes: list[dict]) -> None:
    """Each dispatched kernel's real shared memory under the plan's tiles: reported, within
    the part's limit, and within the plan's model (the bound the plan relies on). On the
    Hopper parts the rows kernel asks for exactly what an H200 reported when it ran."""
    _, limit = PARTS[part]
    dispatched = [p for p in probes if p["kernel"] != "rows"]
    kernels = {(p["kernel"], p["group"] >= 16) for p in dispatched}
    assert kernels == {("decode", False), ("decode", True), ("prefill", False)}, kernels
    for probe in dispatched:
        assert probe["smem"] is not None, probe
        assert probe["smem"] <= min(limit, probe["modelled"]), probe
    rows = {p["dtype"]: p["smem"] for p in probes if p["kernel"] == "rows"}
    if part in ("h100", "h200"):
        assert rows == H200_ROWS_KERNEL_SMEM, rows


def check_layer_layout(layers: list[dict]) -> None:
    """On a GPU `load_model` keeps one stack per layer by default, and the engine's step
    programs then copy no slice of a weight; the scanned layout's count is the reason."""
    scanned, default = layers
    assert scanned["scan_layers"] and not default["scan_layers"], layers
    assert default["copies"] and not any(default["copies"].values()), layers
    assert all(scanned["copies"].values()), f"the scan no longer copies weights: {scanned}"


@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + MATRIX_TIMEOUT_S)
@pytest.mark.parametrize("part", sorted(PARTS))
def test_gpu_kernels_compile_for(gpu_python, part):
    """The matrix compiled (or fell back) for the part; see the check_* functions."""
    configs, probes, layers, summary, returncode = run_matrix(gpu_python, part)
    check_summary(part, configs, summary)
    check_coverage(configs)
    check_probes(part, probes)
    if part in FULL_MATRIX_PARTS:  # the H200's small matrix leaves the layouts out
        check_layer_layout(layers)
    assert returncode == 0, f"exit status {returncode}"


@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + MATRIX_TIMEOUT_S)
def test_engine_steps_compile_in_place_for_gpus(gpu_python, tmp_path):
    """`jaxkv plan --topology h100 --aot --json` compiles the engine's decode and prefill
    steps (the Triton kernels planned for the part), block zeroing and copies for
    real-shaped models (Llama-3.2-1B, Gemma-3-270M at 64 sequences a step, LLaVA), the
    last for an A100; every donated cache is aliased (no cache-sized copy). Without
    `--memory` the pool fills JAX's share of the part's memory."""
    runs = [
        ("llama-3.2-1b-2l", "h100", []),
        ("gemma-3-270m-2l", "h100", ["--memory", "1GiB"]),
        ("llava-style-2l", "a100", ["--memory", "1GiB"]),
    ]
    for name, config in real_shaped_two_layer_configs().items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    for name, part, memory in runs:
        seqs = "64" if name.startswith("gemma") else "16"
        proc = subprocess.run(
            [gpu_python, "-m", "jaxkv", "plan", "--model", tmp_path / name, "--topology", part,
             "--aot", "--json", "--max-model-len", "2048", "--max-num-seqs", seqs,
             "--max-num-batched-tokens", "256", *memory],
            capture_output=True, text=True, env=subprocess_env(), cwd=REPO,
            timeout=MATRIX_TIMEOUT_S,
        )  # fmt: skip
        where = f"{name} on {part}"
        assert proc.returncode == 0, f"{where}: {last_line(proc)}"
        plan = json.loads(proc.stdout.strip().splitlines()[-1])
        programs = {p["name"]: p for p in plan["programs"]}
        assert {"decode", "prefill", "zero_blocks", "copy_blocks"} <= set(programs), where
        assert plan["kv_in_place"], (where, [p["cache_copies"] for p in plan["programs"]])
        assert (plan["device_kind"], plan["chips"], plan["block_size"]) == (
            PARTS[part][0], 1, DEFAULT_BLOCK_SIZE,
        ), where  # fmt: skip
        assert plan["decode_seconds"] > 0 and plan["longest_model_len"] >= 2048, where
        if not memory:  # JAX's 75% of the H100's 80 GiB, the KV cache most of what is left
            assert plan["hbm_bytes"] == 60 * 2**30, plan["hbm_bytes"]
            assert 0.8 * plan["hbm_bytes"] < plan["kv_bytes"] < plan["hbm_bytes"], plan
