"""examples/rl_loop.py end to end: a GRPO loop sampled by the engine learns its toy
reward, the engine's logprobs are the trainer's, weight updates compile nothing, and the
`n` samples of a prompt compute it about once (issue 39)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_loop.py"
PROMPT_LEN, N, GROUPS, STEPS = 33, 4, 2, 12


def load_example():
    spec = importlib.util.spec_from_file_location("jaxkv_example_rl_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rl_loop_learns_with_matching_logprobs_and_no_recompiles(tmp_path, capsys) -> None:
    plot = tmp_path / "rl.png"
    records = load_example().main([
        "--steps", str(STEPS), "--prompts", str(GROUPS), "--n", str(N),
        "--prompt-len", str(PROMPT_LEN), "--max-tokens", "8", "--lr", "3e-2",
        "--plot", str(plot),
    ])  # fmt: skip
    assert len(records) == STEPS
    first, last = records[:3], records[-3:]
    mean = lambda rs: sum(r.reward for r in rs) / len(rs)  # noqa: E731
    assert mean(last) > mean(first) + 0.1, [r.reward for r in records]
    assert max(r.logprob_error for r in records) <= 1e-5
    assert records[0].compilations > 0 and all(r.compilations == 0 for r in records[1:])
    for r in records:
        assert r.prompt_total == GROUPS * N * PROMPT_LEN
        assert r.prompt_computed <= 1.1 * PROMPT_LEN * GROUPS, r
        assert r.prefix_hit_rate > 0.5
    assert plot.stat().st_size > 0
    out = capsys.readouterr().out
    assert "step  11" in out and "max |error|" in out


def test_group_advantages_are_normalised_within_each_group() -> None:
    import numpy as np

    example = load_example()
    reward = np.asarray([0.0, 1.0, 0.5, 0.5, 0.25, 0.75])
    advantages = example.group_advantages(reward, 2)
    np.testing.assert_allclose(advantages, [-1, 1, 0, 0, -1, 1], atol=1e-5)
    tokens = np.asarray([[example.TARGET.start, 0], [example.TARGET.stop - 1, example.TARGET.stop]])
    np.testing.assert_allclose(example.rewards(tokens), [0.5, 0.5])
