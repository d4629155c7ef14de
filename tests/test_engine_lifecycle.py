"""The engine's lifecycle: shut down is a state (every call after `shutdown()` refuses
before changing anything), no finished or refused request holds a block, and a server
that never stops keeps bounded stats (issue 38).

Tiny built-in model (random weights) on one small config, so the programs compile once
for the module and every engine after the first is cheap.
"""

from __future__ import annotations

import dataclasses
import tempfile

import hypothesis.strategies as st
import pytest
from _state import manager_state
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

CONFIG = EngineConfig(
    block_size=4, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32
)
SAMPLING = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)


def events_config(**fields) -> EngineConfig:
    """CONFIG publishing KV events (with replay) on fresh ipc paths."""
    where = tempfile.mkdtemp(prefix="jaxkv-lifecycle-")
    return dataclasses.replace(
        CONFIG, kv_events_endpoint=f"ipc://{where}/pub",
        kv_events_replay_endpoint=f"ipc://{where}/replay", **fields,
    )  # fmt: skip


def engine_state(engine: LLMEngine) -> tuple:
    """Everything a refused call must leave as it was."""
    scheduler = engine.scheduler
    return (
        [manager_state(m) for m in engine.kv_cache_managers],
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.running],
        sorted(scheduler._tracked),
        engine.num_steps,
        engine.stats.num_steps,
        engine.has_unfinished_requests(),
        [p.num_sent for p in engine.kv_event_publishers],
    )


def assert_no_block_held_by_a_finished_request(engine: LLMEngine) -> None:
    """Only unfinished requests own blocks, and every block is free or owned."""
    for scheduler, manager in zip(engine.schedulers, engine.kv_cache_managers, strict=True):
        held: set[int] = set()
        for group in manager.coordinator.single_type_managers:
            assert set(group.req_to_blocks) <= set(scheduler._tracked)
            held |= {b.block_id for bs in group.req_to_blocks.values() for b in bs if not b.is_null}
        assert manager.num_free_blocks + len(held) == engine.config.num_blocks - 1


def refused_calls(engine: LLMEngine) -> dict:
    return {
        "add_request": lambda: engine.add_request([1, 2, 3], sampling=SAMPLING),
        "step": engine.step,
        "generate": lambda: engine.generate([[1, 2, 3]], SAMPLING),
        "abort": lambda: engine.abort("0"),
        "reset_prefix_cache": engine.reset_prefix_cache,
        "take_kv_events": engine.take_kv_events,
        "warm_up": engine.warm_up,
        "follow": engine.follow,
    }


def test_every_call_after_shutdown_refuses_and_changes_nothing(model) -> None:
    engine = LLMEngine(model, events_config())
    ids = [engine.add_request(list(range(5 + i, 15 + i)), sampling=SAMPLING) for i in range(3)]
    engine.step()
    engine.step()
    engine.shutdown()
    before = engine_state(engine)
    assert before[3] == sorted(ids)  # requests were running: they stay as they were
    for name, call in refused_calls(engine).items():
        with pytest.raises(RuntimeError, match=f"LLMEngine.{name}: the engine is shut down"):
            call()
        assert engine_state(engine) == before, name
    engine.shutdown()  # idempotent
    assert engine_state(engine) == before
    assert not any(p._thread.is_alive() for p in engine.kv_event_publishers)


def test_stats_keep_a_window_and_totals_over_the_whole_run(model) -> None:
    """A run longer than the window: `steps` holds the last `stats_window_steps`, the totals
    and `summary()` count every step (each step's count checked as it ran), and the
    publisher's buffer and queue stay within their bounds."""
    engine = LLMEngine(
        model,
        events_config(stats_window_steps=16, kv_events_buffer_steps=8, kv_events_hwm=4),
    )
    for i in range(12):
        (out,) = engine.generate([[3 + i, 4, 5, 6, 7]], SAMPLING)
        assert len(out.output_token_ids) == 3
    summary = engine.stats.summary()
    assert summary["steps"] == engine.num_steps == engine.stats.num_steps > 16
    assert len(engine.stats.steps) == 16
    assert [s.step for s in engine.stats.steps] == list(
        range(engine.num_steps - 16, engine.num_steps)
    )
    assert summary["num_generated_tokens"] == 12 * 3
    assert summary["num_scheduled_tokens"] == 12 * (
        5 + 2
    )  # each prompt, then two decode tokens (the last is sampled)
    assert engine.stats.steps_since(engine.num_steps - 3) == list(engine.stats.steps)[-3:]
    with pytest.raises(ValueError, match="raise EngineConfig.stats_window_steps"):
        engine.stats.steps_since(0)
    (publisher,) = engine.kv_event_publishers
    assert publisher.flush(5.0)
    assert publisher.num_sent > 8 and len(publisher._buffer) == 8
    engine.shutdown()


@pytest.mark.parametrize(
    ("field", "value"),
    [("stats_window_steps", 0), ("kv_events_hwm", 0), ("kv_events_buffer_steps", -1),
     ("kv_events_max_queue_size", 1.5), ("kv_events_replay_hwm", True)],
)  # fmt: skip
def test_bounds_must_be_positive_ints(model, field, value) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be a positive int, got"):
        LLMEngine(model, dataclasses.replace(CONFIG, **{field: value}))


class LifecycleMachine(RuleBasedStateMachine):
    """Random adds (some too long: refused), steps, aborts (some of unknown ids), prefix
    cache resets and shutdowns on a tiny engine publishing KV events. Only the documented
    exceptions escape; no finished or refused request holds a block; once shut down,
    every call raises RuntimeError and changes nothing."""

    model = None

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLMEngine(self.model, events_config())
        self.accepted: set[str] = set()
        self.finished: set[str] = set()
        self.abort_due: set[str] = set()  # aborted, final output not yet stepped out
        self.shut_down = False

    def refused_after_shutdown(self, call) -> bool:
        """Run `call`; once shut down, check that it refuses and changes nothing."""
        if not self.shut_down:
            return False
        before = engine_state(self.engine)
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            call()
        assert engine_state(self.engine) == before
        return True

    @rule(length=st.integers(1, 36), token=st.integers(0, 500), max_tokens=st.integers(1, 6))
    def add(self, length, token, max_tokens):
        prompt = [(token + i) % 512 for i in range(length)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        call = lambda: self.engine.add_request(prompt, sampling=params)  # noqa: E731
        if self.refused_after_shutdown(call):
            return
        try:
            self.accepted.add(call())
        except ValueError as error:
            assert length >= CONFIG.max_model_len and "max_model_len" in str(error)

    @rule()
    def step(self):
        if self.refused_after_shutdown(self.engine.step):
            return
        for out in self.engine.step():
            if out.finished:
                assert out.request_id not in self.finished, "finished twice"
                self.finished.add(out.request_id)
                self.abort_due.discard(out.request_id)

    @precondition(lambda self: self.accepted)
    @rule(data=st.data(), unknown=st.booleans())
    def abort(self, data, unknown):
        rid = "unknown" if unknown else data.draw(st.sampled_from(sorted(self.accepted)))
        if self.refused_after_shutdown(lambda: self.engine.abort(rid)):
            return
        if unknown or rid in self.finished:
            with pytest.raises(KeyError, match="no unfinished request"):
                self.engine.abort(rid)
        elif rid in self.abort_due:  # its final output comes with the next step: a no-op
            before = engine_state(self.engine)
            self.engine.abort(rid)
            # All but the publisher's count of sends, which its thread advances meanwhile.
            assert engine_state(self.engine)[:-1] == before[:-1]
        else:
            self.engine.abort(rid)
            self.abort_due.add(rid)

    @rule()
    def reset_prefix_cache(self):
        if self.refused_after_shutdown(self.engine.reset_prefix_cache):
            return
        running = any(s.running for s in self.engine.schedulers)
        reset = self.engine.reset_prefix_cache()
        assert reset or running

    @rule()
    def shutdown(self):
        before = engine_state(self.engine)
        self.engine.shutdown()
        after = engine_state(self.engine)
        assert after[:-1] == before[:-1]  # nothing but the publisher's last sends
        self.shut_down = True

    @invariant()
    def no_block_held_by_a_finished_request(self):
        assert_no_block_held_by_a_finished_request(self.engine)

    def teardown(self):
        if not self.shut_down:
            for _ in range(300):
                if not self.engine.has_unfinished_requests():
                    break
                self.step()
            assert self.finished == self.accepted
            assert self.engine.num_free_blocks == CONFIG.num_blocks - 1
        self.engine.shutdown()


@pytest.mark.parametrize(
    ("max_examples", "steps"),
    [(5, 15), pytest.param(40, 40, marks=pytest.mark.slow)],
)
def test_engine_lifecycle_state_machine(model, max_examples, steps) -> None:
    LifecycleMachine.model = model
    LifecycleMachine.TestCase.settings = settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    LifecycleMachine.TestCase().runTest()
