"""The TPU kernel compiles for real, without a TPU: the Mosaic compiler in libtpu, deviceless.

A TPU environment (`jax[tpu]` at this process's jax version, and this repository's jaxkv)
is built once at `REPO/.venv-tpu-ci` (or `$JAXKV_TPU_VENV`) and reused while it imports
`jax` at that version and `libtpu`; `tests/tpu_aot_matrix.py` runs in it and compiles
`ragged_paged_attention(platform="tpu")` for a covering matrix of storage dtypes, head sizes,
block sizes, groups, KV heads, masks and head modes on v5e, v6e and v5p. Skipped (with
pip's last line) when the environment cannot be installed, e.g. without network.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MATRIX = REPO / "tests" / "tpu_aot_matrix.py"
VENV = Path(os.environ.get("JAXKV_TPU_VENV", REPO / ".venv-tpu-ci")).absolute()
JAX_VERSION = importlib.metadata.version("jax")
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
PIP_TIMEOUT_S, MATRIX_TIMEOUT_S = 1200, 1800


def _env() -> dict[str, str]:
    """The subprocesses' environment: this repository's jaxkv first, no CPU-only JAX settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # Both tests may compile at once (xdist workers): libtpu's process lock would refuse.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env["TPU_SKIP_MDS_QUERY"] = "1"
    return env


def _not_ready(python: Path) -> str | None:
    """Why `python` cannot run the matrix (None if it imports jax at our version and libtpu)."""
    if not python.exists():
        return f"{python} does not exist"
    check = "import jax, libtpu, jaxkv; print(jax.__version__)"
    proc = subprocess.run(
        [python, "-c", check], capture_output=True, text=True, env=_env(), timeout=300
    )
    if proc.returncode:
        return f"{python} cannot import jax, libtpu and jaxkv: {_last_line(proc)}"
    if proc.stdout.strip() != JAX_VERSION:
        return f"{python} has jax {proc.stdout.strip()}, need {JAX_VERSION}"
    return None


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {proc.returncode}"


def _install(*command: str | Path) -> None:
    """Run one build step; skip the test (with the step's last line) if it fails."""
    proc = subprocess.run(
        command, capture_output=True, text=True, env=_env(), timeout=PIP_TIMEOUT_S
    )
    if proc.returncode:
        step = " ".join(map(str, command[2:]))
        pytest.skip(f"cannot build the TPU environment ({step}): {_last_line(proc)}")


@pytest.fixture(scope="module")
def tpu_python() -> Path:
    """The TPU environment's python, built under a file lock (one xdist worker builds it)."""
    python = VENV / "bin" / "python"
    if _not_ready(python) is None:
        return python
    key = hashlib.sha256(str(VENV).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"jaxkv-tpu-venv-{key}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that waited finds it built
        if _not_ready(python) is not None:
            if not python.exists():
                _install(sys.executable, "-m", "venv", VENV)
            _install(python, "-m", "pip", "install", "-q", f"jax[tpu]=={JAX_VERSION}")
            _install(python, "-m", "pip", "install", "-q", "-e", REPO)
        reason = _not_ready(python)
    assert reason is None, f"the TPU environment at {VENV} was installed but is unusable: {reason}"
    return python


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


def _real_shaped_configs() -> dict[str, dict]:
    """Two-layer models with real widths, heads and head sizes (compile time stays small):
    Llama-3.2-1B (head 64), Gemma-3-270M (head 256, a sliding and a global layer) and a
    LLaVA-style model (a Llama text model of head 128 behind the tiny vision tower)."""
    from jaxkv.models import tiny_configs

    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    gemma = dict(tiny_configs()["gemma3-tiny"])
    gemma.update(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=8192,
    )  # fmt: skip
    llava = json.loads(json.dumps(tiny_configs()["llava-tiny"]))
    llava["text_config"].update(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    return {"llama-3.2-1b-2l": llama, "gemma-3-270m-2l": gemma, "llava-style-2l": llava}


@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + MATRIX_TIMEOUT_S)
def test_engine_steps_compile_in_place_for_a_tpu_slice(tpu_python, tmp_path):
    """`jaxkv plan --topology v5e:2x2 --aot --json` compiles the engine's decode and prefill
    steps, block zeroing, copies and host-tier loads for real-shaped models; every donated
    cache is aliased (no cache-sized copy), and the per-chip figures are filled in."""
    for name, config in _real_shaped_configs().items():
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        proc = subprocess.run(
            [tpu_python, "-m", "jaxkv", "plan", "--model", model_dir, "--topology", "v5e:2x2",
             "--aot", "--json", "--memory", "1GiB", "--max-model-len", "2048",
             "--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
            capture_output=True, text=True, env=_env(), cwd=REPO, timeout=MATRIX_TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 0, f"{name}: {_last_line(proc)}"
        plan = json.loads(proc.stdout.strip().splitlines()[-1])
        programs = {p["name"]: p for p in plan["programs"]}
        assert {"decode", "prefill", "zero_blocks", "copy_blocks"} <= set(programs), programs
        assert plan["kv_in_place"], (name, [p["cache_copies"] for p in plan["programs"]])
        assert plan["device_kind"] == "TPU v5 lite" and plan["chips"] == 4
        assert plan["weight_bytes"] > 0 and plan["num_blocks"] > 2048 // 16
        assert plan["decode_seconds"] > 0 and plan["longest_model_len"] >= 2048
