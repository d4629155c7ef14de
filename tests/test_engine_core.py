"""The engine core's loop (`jaxkv.serving.engine_core`) over a scripted engine: when it
takes commands, and its refill wait after a step that finished requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from jaxkv.serving import engine_core
from jaxkv.serving.engine_core import run_engine_core


@dataclass
class _Output:
    request_id: str
    finished: bool = True


@dataclass
class _Stats:
    steps: list = field(default_factory=lambda: [None])


class _Engine:
    """An engine whose step k takes `step_s` and finishes `finishing[k]` requests, and
    whose step in flight runs until `running` says otherwise; it records what happened
    in order."""

    def __init__(self, finishing: list[int], running: bool = True, step_s: float = 0.1) -> None:
        self.finishing, self.running, self.step_s = finishing, running, step_s
        self.stats, self.log = _Stats(), []
        self.stepped = 0
        self.starts: list[float] = []  # when each step began, time.monotonic()
        self.returns: list[float] = []  # when each step returned

    def add_request(self, prompt, request_id: str, **kwargs) -> None:
        self.log.append(("add", request_id))

    def has_unfinished_requests(self) -> bool:
        return self.stepped < len(self.finishing)

    def step_running(self) -> bool:
        return self.running

    def step(self) -> list[_Output]:
        self.starts.append(time.monotonic())
        time.sleep(self.step_s)
        count = self.finishing[self.stepped]
        self.stepped += 1
        self.log.append(("step", self.stepped))
        self.returns.append(time.monotonic())
        return [_Output(f"done-{self.stepped}-{i}") for i in range(count)]

    def shutdown(self) -> None:
        self.log.append(("shutdown",))


class _Commands:
    """`receive` for the core: after step `after_step`, each poll that may wait hands
    over the next command of `late` (a client's request arriving while the step in
    flight runs), else it waits its timeout out; a close once the engine ran out of
    work. Every timeout asked for is kept."""

    def __init__(self, engine: _Engine, after_step: int, late: list[tuple]) -> None:
        self.engine, self.after_step, self.late = engine, after_step, list(late)
        self.timeouts: list[float | None] = []
        self.closed = False

    def __call__(self, timeout: float | None) -> tuple | None:
        self.timeouts.append(timeout)
        if self.engine.stepped >= self.after_step and self.late and timeout:
            return self.late.pop(0)
        if not (self.closed or self.engine.has_unfinished_requests() or self.late):
            self.closed = True
            return ("close", 0.0)
        time.sleep(timeout or 0)
        return None

    def refill_polls(self) -> list[float]:
        """The timeouts of the refill wait's polls (the idle wait's are longer)."""
        return [t for t in self.timeouts if t and t <= engine_core.REFILL_POLL_S]


def _run(engine: _Engine, commands: _Commands) -> None:
    run_engine_core(engine, commands, lambda event: None)


def test_adds_arriving_while_the_step_in_flight_runs_join_the_next_step() -> None:
    engine = _Engine(finishing=[0, 2, 0, 0])  # the first step gives no interval to go by
    adds = [("add", f"new-{i}", [1, 2], {}) for i in range(2)]
    commands = _Commands(engine, after_step=2, late=adds)
    _run(engine, commands)
    assert engine.log[:5] == [("step", 1), ("step", 2), ("add", "new-0"), ("add", "new-1"),
                              ("step", 3)]  # fmt: skip
    assert len(commands.refill_polls()) == 2


def test_the_core_waits_for_no_more_adds_than_requests_finished() -> None:
    engine = _Engine(finishing=[0, 1, 0, 0])
    adds = [("add", f"new-{i}", [1, 2], {}) for i in range(3)]
    _run(engine, _Commands(engine, after_step=2, late=adds))
    # One request finished: one add joins before step 3; the others only after it.
    assert engine.log.index(("add", "new-0")) < engine.log.index(("step", 3))
    assert engine.log.index(("add", "new-1")) > engine.log.index(("step", 3))


def test_no_wait_once_the_device_is_idle_or_nothing_finished() -> None:
    for engine in (_Engine(finishing=[0, 2, 0], running=False), _Engine(finishing=[0, 0, 0])):
        commands = _Commands(engine, after_step=2, late=[("add", "new", [1], {})])
        _run(engine, commands)
        assert commands.refill_polls() == []
        assert engine.log.index(("add", "new")) > engine.log.index(("step", 3))


@pytest.mark.parametrize("step_s", [0.2, 0.04])
def test_the_wait_is_bounded_when_no_client_comes_back(monkeypatch, step_s) -> None:
    """At most `REFILL_WAIT_S` (0.06 here), and at most half the last step's interval."""
    monkeypatch.setattr(engine_core, "REFILL_WAIT_S", 0.06)
    engine = _Engine(finishing=[0, 3, 0], step_s=step_s)
    _run(engine, _Commands(engine, after_step=99, late=[]))
    window = min(0.06, engine_core.REFILL_SHARE * (engine.starts[1] - engine.starts[0]))
    waited = engine.starts[2] - engine.returns[1]
    assert 0.95 * window <= waited <= window + 0.02  # not for 3 adds forever
