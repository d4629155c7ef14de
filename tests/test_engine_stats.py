"""`EngineStats` keeps running totals and a bounded window (issue 38): its figures are
those of a list of every step, whatever the run's length, and its memory is not."""

from __future__ import annotations

import random
from dataclasses import fields

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jaxkv.engine.stats import EngineStats, StepStats

COUNTERS = [f.name for f in fields(StepStats) if f.name != "step"]
GAUGES = ("kv_usage", "num_running", "num_waiting", "num_loading")


def summary_of_every_step(steps: list[StepStats]) -> dict[str, float]:
    """`summary()` as computed from a list of every step (its definition)."""

    def total(name: str) -> float:
        return sum(getattr(s, name) for s in steps)

    out: dict[str, float] = {"steps": len(steps)}
    for name in COUNTERS:
        if name not in GAUGES:
            out[name] = total(name)
    queries, queried = total("prefix_queries"), total("host_queried_tokens")
    encoder = total("encoder_hits") + total("encoder_misses")
    out["prefix_hit_rate"] = total("prefix_hits") / queries if queries else 0.0
    out["encoder_hit_rate"] = total("encoder_hits") / encoder if encoder else 0.0
    out["host_hit_rate"] = total("host_hit_tokens") / queried if queried else 0.0
    out["max_kv_usage"] = max((s.kv_usage for s in steps), default=0.0)
    return out


def step_stats(rng: random.Random, number: int) -> StepStats:
    values = {
        f.name: rng.uniform(0, 1e3) if f.type == "float" else rng.randrange(10**6)
        for f in fields(StepStats)
        if f.name != "step"
    }
    return StepStats(step=number, **values)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), window=st.integers(1, 12), num_steps=st.integers(0, 40), seed=st.integers(0))
def test_totals_and_window_match_a_list_of_every_step(data, window, num_steps, seed):
    """Whether the run is shorter or longer than the window: `summary()` and `total()`
    equal the figures of a list of every step (floats too: summed in the same order),
    `steps` is the last `window` of them, `steps_since` what the window holds and a
    clear error for what it dropped; `summary()` reads no step (clearing the window
    changes nothing)."""
    stats, every, rng = EngineStats(window_steps=window), [], random.Random(seed)
    for n in range(num_steps):
        step = step_stats(rng, n)
        stats.record(step)
        every.append(step)
    want = summary_of_every_step(every)
    assert stats.summary() == want
    for name in COUNTERS:
        assert stats.total(name) == sum(getattr(s, name) for s in every)
    assert list(stats.steps) == every[-window:] if every else not stats.steps
    assert stats.num_steps == num_steps
    start = data.draw(st.integers(0, num_steps))
    if num_steps - start <= window:
        assert stats.steps_since(start) == every[start:]
    else:
        with pytest.raises(ValueError, match=f"steps from {start} on are not all kept"):
            stats.steps_since(start)
    stats.steps.clear()
    assert stats.summary() == want


def test_bad_window_and_unknown_total_are_refused():
    with pytest.raises(ValueError, match="EngineStats.window_steps must be >= 1, got 0"):
        EngineStats(window_steps=0)
    with pytest.raises(TypeError, match="EngineStats.window_steps must be an integer"):
        EngineStats(window_steps=2.0)
    with pytest.raises(ValueError, match="no running total named 'step'"):
        EngineStats().total("step")
