"""Differential test: the `n > 1` fan-out (`jaxkv.engine.fanout`) against vLLM 0.33's
(`ParentRequest` through its `LLMEngine.add_request` and `OutputProcessor`, driven with
no model by `tests/fanout_vllm_driver.py` under `REPO_ROOT/.venv-vllm/bin/python`;
skipped when that environment is absent).

The same event scripts (children's tokens and finishes per step, aborts of the parent
or of one child) are played through both, for `CUMULATIVE`, `DELTA` and `FINAL_ONLY`:
the children's ids and seeds, and every parent output's id, `finished` and completions
(index, tokens, finish and stop reason) must agree. The engine-level test plays the
events the real engine produced.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from jaxkv.engine import EngineConfig, LLMEngine
from jaxkv.engine.fanout import FanOut, child_requests
from jaxkv.engine.outputs import OutputStream
from jaxkv.request import Request
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, TinyConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "fanout_vllm_driver.py"

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON.exists(), reason=f"no vLLM peer environment at {PEER_PYTHON}"
)
PROMPT = [5, 6, 7, 8, 9]


def vllm(cases: list[dict]) -> list[dict]:
    proc = subprocess.run(
        [str(PEER_PYTHON), str(DRIVER)], input=json.dumps(cases), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def summary(output) -> list:
    completions = [
        [c.index, list(c.token_ids), c.finish_reason, c.stop_reason] for c in output.outputs
    ]
    return [output.request_id, output.finished, completions]


def jaxkv_case(case: dict) -> dict:
    """The case through jaxkv's fan-out, as `LLMEngine` drives it: each child's outputs
    from its `OutputStream`, merged by `FanOut`; an abort finishes each unfinished
    child with no new token (`RequestTable.finish_now`)."""
    params = SamplingParams(n=case["n"], temperature=1.0, seed=case["seed"], max_tokens=64,
                            output_kind=RequestOutputKind[case["kind"]])  # fmt: skip
    children = child_requests(case["parent"], params)
    fanout = FanOut()
    fanout.add(case["parent"], params, [child for child, _ in children], [])
    requests = [Request(child, case["prompt"], p, max_tokens=64) for child, p in children]
    streams = [OutputStream.for_params(p) for _, p in children]
    unfinished = set(range(len(children)))

    def finish(indices) -> list:
        unfinished.difference_update(indices)
        return [streams[i].output(requests[i], 0, "abort") for i in sorted(indices)]

    outputs = []
    for event in case["events"]:
        if event[0] == "step":
            made = []
            for child, tokens, reason in event[1]:
                requests[child].append_output_token_ids(tokens)
                if reason is not None:
                    unfinished.discard(child)
                stream = streams[child]
                if reason is not None or not stream.final_only:
                    made.append(stream.output(requests[child], len(tokens), reason))
        elif event[0] == "abort_parent":
            made = finish(set(unfinished))
        else:
            made = finish({event[1]} & unfinished)
        outputs.append([summary(o) for o in fanout.merge(made)])
    added = [[child, p.n, p.seed] for child, p in children]
    return {"children": added, "outputs": outputs}


def random_case(rng: np.random.Generator, number: int) -> dict:
    """A parent of 2-4 children: per step some unfinished children get a token, some
    finish; now and then one child or the whole parent is aborted."""
    n = int(rng.integers(2, 5))
    kind = ["CUMULATIVE", "DELTA", "FINAL_ONLY"][number % 3]
    seed = None if rng.random() < 0.3 else int(rng.integers(0, 1000))
    unfinished, events = set(range(n)), []
    while unfinished:
        roll = rng.random()
        if roll < 0.05:
            events.append(["abort_parent"])
            break
        if roll < 0.12:
            child = int(rng.choice(sorted(unfinished)))
            events.append(["abort_child", child])
            unfinished.discard(child)
            continue
        step = []
        for child in sorted(unfinished):
            if rng.random() < 0.7:
                reason = None if rng.random() < 0.75 else str(rng.choice(["stop", "length"]))
                step.append([child, [int(rng.integers(3, 200))], reason])
                if reason is not None:
                    unfinished.discard(child)
        events.append(["step", step])
    return {"parent": f"p{number}", "n": n, "kind": kind, "seed": seed, "prompt": PROMPT,
            "events": events}  # fmt: skip


def test_fanout_outputs_match_vllm_over_random_scripts() -> None:
    rng = np.random.default_rng(0)
    cases = [random_case(rng, i) for i in range(90)]
    for case, theirs in zip(cases, vllm(cases), strict=True):
        mine = jaxkv_case(case)
        assert mine["children"] == theirs["children"], case
        for event, got, want in zip(case["events"], mine["outputs"], theirs["outputs"],
                                    strict=True):  # fmt: skip
            assert got == want, (case["kind"], event)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_parent_outputs_match_vllm_for_every_kind() -> None:
    """The real engine's `n=3` request, streamed as DELTA: its children's tokens and
    finishes per step are replayed through vLLM for all three kinds, and compared with
    what the engine streams for each kind (the same seeds: the same tokens and steps)."""
    tiny = TinyConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    config = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4,
                          max_num_batched_tokens=16, max_model_len=32)  # fmt: skip
    engine = LLMEngine(TinyCausalLM(tiny, seed=0), config)
    streamed, cases = {}, []
    for kind in RequestOutputKind:
        params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=5, ignore_eos=True,
                                stop_token_ids=[9], output_kind=kind)  # fmt: skip
        engine.add_request(PROMPT + [10, 11, 12, 13], sampling=params, request_id=kind.name)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
        streamed[kind.name] = [[summary(o) for o in step] for step in steps]
        if kind is RequestOutputKind.DELTA:
            events = [["step", [[c.index, c.token_ids, c.finish_reason]
                                for o in step for c in o.outputs]] for step in steps]  # fmt: skip
    for kind in RequestOutputKind:
        cases.append({"parent": kind.name, "n": 3, "kind": kind.name, "seed": 4,
                      "prompt": PROMPT + [10, 11, 12, 13], "events": events})  # fmt: skip
    for case, theirs in zip(cases, vllm(cases), strict=True):
        assert streamed[case["kind"]] == theirs["outputs"], case["kind"]
