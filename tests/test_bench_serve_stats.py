"""`benchmarks/bench_serve.py`'s statistics: a run's steady state leaves out the opening
burst, and the pooled ratios and their bootstrap intervals say what the samples say."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_serve import per_request, pooled_ratios, run_summary


def _runs(rng, scale: float = 1.0, runs: int = 3, requests: int = 40) -> list[list]:
    return [
        [(scale * rng.uniform(100, 900), scale * rng.uniform(20, 60, int(rng.integers(2, 9))),
          scale * rng.uniform(0, 50))
         for _ in range(requests)]
        for _ in range(runs)
    ]  # fmt: skip


def test_per_request_times_each_request_and_checks_every_token() -> None:
    results = [(1.0, 1.25, [1.5, 1.75, 2.0], 3), (2.0, 2.0, [2.25], 1)]
    (ttft_a, gaps_a, admit_a), (ttft_b, gaps_b, admit_b) = per_request(
        results, [([1], 3), ([2], 1)]
    )
    assert (ttft_a, ttft_b, admit_a, admit_b) == (500.0, 250.0, 250.0, 0.0)
    assert gaps_a.tolist() == [250.0, 250.0] and gaps_b.size == 0
    with pytest.raises(RuntimeError, match="3 output tokens, expected 4"):
        per_request(results[:1], [([1], 3), ([2], 1)])


def test_run_summary_leaves_the_opening_burst_out_of_the_steady_state() -> None:
    burst = [(10_000.0, np.array([5_000.0]), 400.0)] * 2
    steady = [(100.0, np.array([10.0, 30.0]), 5.0)] * 4
    summary = run_summary(burst + steady, skip=2, tokens=60, wall_s=2.0)
    assert summary["ttft_ms_median"] == summary["ttft_ms_p90"] == 100.0
    assert summary["itl_ms_median"] == 20.0 and summary["admit_ms_p90"] == 5.0
    assert summary["all_ttft_ms_p90"] > 100.0 and summary["all_itl_ms_p90"] > 30.0
    assert summary["throughput_tok_s"] == 30.0


def test_pooled_ratios_find_a_mode_twice_as_slow_and_an_equal_one_equal() -> None:
    base = _runs(np.random.default_rng(1))
    doubled = [[(2 * t, 2 * gaps, 2 * a) for t, gaps, a in run] for run in base]
    pooled = pooled_ratios(
        {"in-process": base, "same": base, "slow": doubled}, draws=200
    )  # fmt: skip
    assert set(pooled["slow"]) == {"ttft_ms_median", "ttft_ms_p90", "itl_ms_median", "itl_ms_p90"}
    for metric, cell in pooled["slow"].items():  # each mode resampled on its own
        low, high = cell["ci95"]
        assert cell["ratio"] == pytest.approx(2.0) and low < 2.0 < high < 3.0
        same = pooled["same"][metric]
        assert same["ratio"] == 1.0 and same["ci95"][0] < 1.0 < same["ci95"][1]
    other = pooled_ratios({"in-process": base, "other": _runs(np.random.default_rng(2))})
    for cell in other["other"].values():  # independent draws of one distribution
        low, high = cell["ci95"]
        assert 0.7 < low < high < 1.4 and 0.7 < cell["ratio"] < 1.4
