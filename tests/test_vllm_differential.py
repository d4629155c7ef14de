"""Differential test against vLLM: random traces replayed through both, in lockstep.

Skipped when the peer environment (`REPO_ROOT/.venv-vllm`, built by
`tools/vllm-peer-venv.sh`) is absent. vLLM runs in a subprocess under that
environment's Python (with numpy, cbor2 and xxhash but no JAX), which imports
jaxkv from this repository. Every returned block id, hit length, free-queue
order, ref count and KV event is compared after each operation
(`tests/vllm_differential_driver.py`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_differential_driver.py"
NUM_TRACES = 160
VOCAB = 50

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON.exists(), reason="no vLLM peer environment (tools/vllm-peer-venv.sh)"
)


def make_request(rng: random.Random, rid: str, prefixes: list[list[int]]) -> dict:
    prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    mm = []
    if rng.random() < 0.3 and len(prompt) >= 4:
        offset = rng.randrange(len(prompt) - 2)
        length = rng.randint(1, min(6, len(prompt) - offset))
        mm.append([rng.choice(["img-a", "img-b", "img-c"]), offset, length])
        if offset + length + 1 < len(prompt) and rng.random() < 0.5:
            second = rng.randrange(offset + length, len(prompt) - 1)
            mm.append([rng.choice(["img-a", "img-d"]), second, 1])
    return {
        "id": rid,
        "prompt": prompt,
        "max_tokens": rng.randint(2, 12),
        "salt": rng.choice([None, None, "", "", "salt-1", "salt-2"]),
        "lora": rng.choice([None, None, ["adapter-1", 1, "/a1"], ["adapter-2", 2, "/a2"]]),
        "mm": mm,
    }


def make_trace(seed: int) -> dict:
    rng = random.Random(seed)
    prefixes = [[]] + [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    config = {
        "block_size": rng.choice([2, 4, 8]),
        "num_blocks": rng.randint(6, 40),
        "max_model_len": 96,
        "hash_fn": rng.choice(["sha256_cbor", "xxhash_cbor"]),
        "chunk": rng.choice([3, 8, 64]),
    }
    ops, next_id = [], 0
    for _ in range(rng.randint(20, 80)):
        kind = rng.choices(["add", "admit", "step", "finish", "reset"], weights=[15, 25, 45, 8, 3])[
            0
        ]
        if kind == "add":
            ops.append({"op": "add", "request": make_request(rng, f"r{next_id}", prefixes)})
            next_id += 1
        elif kind == "admit":
            ops.append(
                {
                    "op": "admit",
                    "lookahead": rng.choice([0, 0, 1, 3]),
                    "token": rng.randrange(VOCAB),
                }
            )
        elif kind == "step":
            ops.append(
                {
                    "op": "step",
                    "which": rng.randrange(8),
                    "spec": rng.choice([0, 0, 0, 1, 2]),
                    "accepted": rng.randint(0, 2),
                    "lookahead": rng.choice([0, 0, 1, 3]),
                    "token": rng.randrange(VOCAB),
                }
            )
        else:
            ops.append({"op": kind, "which": rng.randrange(8)})
    return {"seed": seed, "config": config, "ops": ops}


def test_random_traces_match_vllm(tmp_path):
    traces = [make_trace(seed) for seed in range(NUM_TRACES)]
    traces_file, results_file = tmp_path / "traces.json", tmp_path / "results.json"
    traces_file.write_text(json.dumps(traces))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONHASHSEED="12345")
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"  # events carry the bytes, as jaxkv
    proc = subprocess.run(
        [str(PEER_PYTHON), str(DRIVER), str(traces_file), str(results_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(results_file.read_text())
    failures = [(t["seed"], r) for t, r in zip(traces, results, strict=True) if not r["ok"]]
    assert not failures, json.dumps(failures[0], indent=1)[:6000]
    # The traces exercised what they are meant to.
    ops = [op for t in traces for op in t["ops"]]
    requests = [op["request"] for op in ops if op["op"] == "add"]
    assert sum(r["salt"] == "" for r in requests) > 50
    assert sum(bool(r["mm"]) for r in requests) > 50
    assert sum(r["lora"] is not None for r in requests) > 50
    assert sum(op["op"] == "reset" for op in ops) > 50
    assert sum(r["ops"] for r in results) == len(ops)
