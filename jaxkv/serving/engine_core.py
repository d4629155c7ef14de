"""The stepping side of the server: one engine, stepped whenever it has work, taking
commands between steps and reporting what happened as events. It runs on a thread of
the server's process or in a process of its own (`engine_process`); either way it only
talks through `receive` and `emit`, with messages that pickle.

Commands (tuples, first item the kind):
- `("add", request_id, prompt, kwargs)`: `engine.add_request(prompt, request_id=...,
  **kwargs)`; answered by `("accepted", request_id, error)` (error None, or the
  exception the engine raised: nothing changed then).
- `("abort", request_id)`: abort it if the core still serves it (a finished request is
  left alone: its final output is on its way).
- `("call", call_id, method, args)`: `getattr(engine, method)(*args)` between steps
  (`method(engine, *args)` when it is a function: one that pickles, for an engine in
  another process); answered by `("result", call_id, value, error)`.
- `("close", grace_s)`: accept nothing more; requests still running get `grace_s`
  seconds (or an earlier deadline already set), then they are aborted (their final
  outputs say `finish_reason="abort"`).

Events: the answers above, `("outputs", outputs, step_stats)` after every step, and
last `("stopped", failure)`: the engine is shut down; failure is None after a close, or
why a step raised (a bug, not a request's fault: the engine contains those).

Invariant: every accepted request gets outputs until a final one, unless the core
stops with a failure (then the other side ends it).

Refill: the core takes commands only between two `step()` calls, and the next call
schedules at once. A closed-loop client (a chat turn, a benchmark, a router) sends its
next request milliseconds after its last output: over HTTP from another process, after
the core has already scheduled the next step, so that request would wait a whole step.
So after a step that finished requests, while the step dispatched last still runs on
the device (async scheduling), the core takes commands until as many adds came as
requests finished, for at most `REFILL_WAIT_S` and `REFILL_SHARE` of the last interval
between steps. The device does not idle for it: the wait ends within `REFILL_POLL_S` of
the step in flight, and leaves the rest of a step's time to schedule the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["EngineLoopClosed", "run_engine_core"]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
REFILL_WAIT_S = 0.05
REFILL_SHARE = 0.5
REFILL_POLL_S = 0.002


class EngineLoopClosed(RuntimeError):
    """The engine is closing or closed: it accepts no request."""


class _Core:
    def __init__(self, engine, emit: Callable[[tuple], None]) -> None:
        self.engine, self.emit = engine, emit
        self.live: set[str] = set()  # accepted requests without their final output
        self.closing = False
        self.deadline = float("inf")
        self.last_step_start: float | None = None
        self.step_interval = 0.0  # between the last two steps' starts

    def apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, kwargs = command
            self.emit(("accepted", request_id, self._add(request_id, prompt, kwargs)))
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            _, call_id, method, args = command
            try:
                if isinstance(method, str):
                    value = getattr(self.engine, method)(*args)
                else:
                    value = method(self.engine, *args)
                error = None
            except Exception as raised:
                value, error = None, raised
            self.emit(("result", call_id, value, error))
        elif kind == "close":
            self.closing = True
            self.deadline = min(self.deadline, time.monotonic() + command[1])
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, request_id: str, prompt, kwargs: dict) -> Exception | None:
        if self.closing:
            return EngineLoopClosed("the server is shutting down")
        try:
            self.engine.add_request(prompt, request_id=request_id, **kwargs)
        except Exception as error:  # the client's mistake: reported to its handler
            return error
        self.live.add(request_id)
        return None

    def _abort(self, request_id: str) -> None:
        if request_id in self.live:
            try:
                self.engine.abort(request_id)
            except KeyError:  # finished in the step that just ran; its output is on its way
                pass

    def step(self) -> int:
        """Step the engine and emit its outputs; how many requests finished."""
        start = time.monotonic()
        if self.last_step_start is not None:
            self.step_interval = start - self.last_step_start
        self.last_step_start = start
        outputs = self.engine.step()
        finished = 0
        for output in outputs:
            if output.finished:
                self.live.discard(output.request_id)
                finished += 1
        self.emit(("outputs", outputs, self.engine.stats.steps[-1]))
        return finished

    def refill(self, receive: Callable[[float | None], tuple | None], finished: int) -> None:
        """Apply commands until `finished` adds came, the step in flight ended or the
        refill window closed (module docstring)."""
        deadline = time.monotonic() + min(REFILL_WAIT_S, REFILL_SHARE * self.step_interval)
        while finished > 0 and not self.closing and self.engine.step_running():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            command = receive(min(left, REFILL_POLL_S))
            if command is not None:
                self.apply(command)
                if command[0] == "add":
                    finished -= 1

    def done(self) -> bool:
        """Closing and nothing left to serve; past the grace deadline, what is left is
        aborted first."""
        if not self.closing:
            return False
        if not self.engine.has_unfinished_requests():
            return True
        if time.monotonic() > self.deadline:
            for request_id in list(self.live):
                self._abort(request_id)
        return False


def run_engine_core(
    engine, receive: Callable[[float | None], tuple | None], emit: Callable[[tuple], None]
) -> None:
    """Serve `engine` until closed (module docstring). `receive(timeout)` returns the next
    command or None once `timeout` seconds passed (`timeout=0`: only one already there);
    it raises EOFError when the other side is gone, which ends the core like a close
    with no grace (and no last event: nobody is left to read it). The engine is shut
    down before the last event."""
    core, failure = _Core(engine, emit), None
    gone = False
    try:
        while not core.done():
            busy = engine.has_unfinished_requests()
            command = receive(0 if busy else IDLE_WAIT_S)
            while command is not None:
                core.apply(command)
                command = receive(0)
            if engine.has_unfinished_requests():
                core.refill(receive, core.step())
    except EOFError:
        logger.warning("the server's side of the engine is gone: stopping")
        gone = True
    except Exception as error:
        logger.exception("the engine stopped: a step raised")
        failure = f"{type(error).__name__}: {error}"
    finally:
        engine.shutdown()
    if not gone:
        emit(("stopped", failure))
