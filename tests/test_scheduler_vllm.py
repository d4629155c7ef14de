"""The engine's scheduler drives vLLM's `KVCacheManager` exactly as it drives jaxkv's.

The scheduler calls only vLLM-signature manager methods, so one class serves both (this
is what benchmarks/bench_host.py relies on). A workload with shared prefixes, chunked
prefill and a pool small enough to preempt runs through both, synchronously and with one
step in flight; every step's scheduled requests, positions, token counts, block-id
changes (and the rows they rebuild, each checked against the manager's block ids),
preemptions and finishes must be identical, and so must the outputs. Runs under the
peer environment (`REPO_ROOT/.venv-vllm`; skipped when absent), which has no JAX: the
scheduler must not import it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "scheduler_vllm_driver.py"

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON.exists(), reason="no vLLM peer environment (tools/vllm-peer-venv.sh)"
)


@pytest.mark.parametrize(("seed", "num_blocks", "overlap"), [(0, 40, False), (1, 30, True)])
def test_same_schedule_over_jaxkv_and_vllm_managers(seed, num_blocks, overlap):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [str(PEER_PYTHON), str(DRIVER), str(seed), str(num_blocks), "1" if overlap else "0"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    assert not result["jax_imported"]
    ours, theirs = result["jaxkv"], result["vllm"]
    assert ours["preemptions"] > 0, "the pool is sized to preempt"
    assert ours["hit_tokens"] > 0, "shared prefixes hit the cache"
    assert len(ours["outputs"]) == 40
    assert any(s["scheduled"][0][2] == 20 for s in ours["steps"] if s["scheduled"]), "chunked"
    for i, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
        assert a == b, f"step {i} differs"
    assert ours == theirs
    assert ours["free_blocks"] == num_blocks - 1, "everything returned"
