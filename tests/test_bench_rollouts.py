"""`benchmarks/bench_rollouts.py` end to end on a small grid of the tiny model: its
figures are the engine's (the prompt computed about once per parent, the blocks held
within the issue's bound, nothing compiled after the warm-up, updates that compile
nothing), and its vLLM side (`.venv-vllm`, skipped without it) drives vLLM's own
scheduler to the same prompt tokens per sample on this workload, its children hitting
the leader's blocks though scheduled in the leader's own step."""

from __future__ import annotations

import json

import pytest

from benchmarks import _common, bench_rollouts

pytestmark = pytest.mark.slow  # compiles an engine and starts two more processes

PROMPT, MAX_TOKENS, BLOCK = 40, 4, bench_rollouts.BLOCK


@pytest.mark.timeout(900)
def test_small_grid_reports_the_engines_figures(tmp_path, monkeypatch) -> None:
    for module in (_common, bench_rollouts):
        monkeypatch.setattr(module, "OUT_DIR", tmp_path / "out")
    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path / "results")
    argv = ["--models", "tiny", "--n", "1", "3", "--prompt-lens", str(PROMPT),
            "--max-tokens", str(MAX_TOKENS), "--batch-tokens", "64", "--repeats", "1",
            "--updates", "2"]  # fmt: skip
    payload = bench_rollouts.main(argv)
    tiny = payload["models"]["tiny"]
    cases = {case["n"]: case for case in tiny["cases"]}
    assert sorted(cases) == [1, 3]
    assert cases[1]["prompt_computed_per_sample"] == [PROMPT]
    # The leader computes the prompt, each other sample only its partial last block.
    partial = PROMPT - PROMPT // BLOCK * BLOCK
    assert cases[3]["prompt_computed_per_sample"] == [(PROMPT + 2 * partial) / 3]
    for case in cases.values():
        assert 0 < max(case["blocks_held"]) <= case["blocks_bound"], case
        assert case["compilations"] == 0 and case["tokens_per_s"]["min"] > 0
    assert tiny["update_compilations"] == 0 and tiny["update_weights_s"]["min"] > 0
    new_process = tiny["rebuilds"]["new process"][0]
    assert new_process["programs"] > 0 and new_process["seconds"] > new_process["warm_up_s"]
    [written] = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("bench_rollouts_*")]
    assert written["models"]["tiny"]["cases"] == json.loads(json.dumps(tiny["cases"]))
    if payload["vllm"] is None:
        pytest.skip("no .venv-vllm: the vLLM side was not run")
    assert payload["vllm"]["version"].startswith("0.33")
    for case in cases.values():
        theirs = case["vllm"]
        assert theirs["prompt_computed_per_sample"] == case["prompt_computed_per_sample"][0]
        assert theirs["hit_tokens"] == [0] + [PROMPT // BLOCK * BLOCK] * (case["n"] - 1)
    # 40 + 2 x 8 tokens fit one 64-token step: vLLM schedules the children beside their
    # leader, and they hit its full blocks all the same (cached when allocated).
    assert cases[3]["vllm"]["first_step"] == [1, 1, 1]
