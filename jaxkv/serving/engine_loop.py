"""One engine driven by one stepping thread, fed by any number of client threads or
event loops (the HTTP server's handlers).

Invariants:
- Only the stepping thread touches the engine: clients hand it commands (add, abort)
  through a thread-safe queue and get a request's outputs on that request's own
  `RequestStream`, in order, the last one `finished`.
- A request is *pending* from `submit` until its final output: at most
  `max_pending` are, so memory stays bounded under any load (`QueueFull` past that:
  the server answers 503).
- `submit` returns only once the engine accepted the request (else its `ValueError`,
  nothing changed) so a client's mistake is reported before any output.
- After `begin_close()`/`close()` no request is accepted (`EngineLoopClosed`); requests
  still running finish within the grace period or are aborted (a final output with
  `finish_reason="abort"`), then the engine shuts down.
- A step that raises (a bug, not a request's fault: the engine contains those) ends
  the loop: every pending request gets a final output with `finish_reason="error"`,
  `failure` says why, and the loop accepts nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from jaxkv.engine.outputs import RequestOutput

__all__ = ["EngineLoop", "EngineLoopClosed", "QueueFull", "RequestStream"]

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests pending than the loop's `max_pending`."""


class EngineLoopClosed(RuntimeError):
    """The loop is closing or closed: it accepts no request."""


@dataclass
class RequestStream:
    """Where one request's outputs go, for an asyncio consumer: `(arrival time, output)`
    items on `queue`, in order, stamped with time.monotonic(). Several requests may share
    a queue (`EngineLoop.submit(output_queue=...)`): their items interleave, told apart by
    `output.request_id`."""

    request_id: str
    arrival: float
    queue: asyncio.Queue
    _loop: asyncio.AbstractEventLoop

    async def get(self) -> tuple[float, RequestOutput]:
        """The next item of this stream's queue."""
        return await self.queue.get()

    async def get_ready(self) -> list[tuple[float, RequestOutput]]:
        """The next item and every other one already queued (a consumer that fell behind
        catches up in one go)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


def _put_all(items: list[tuple[asyncio.Queue, tuple[float, RequestOutput]]]) -> None:
    for destination, item in items:
        destination.put_nowait(item)


def _hand_over(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """From the stepping thread: queue `items` on `loop` with one wake-up (dropped once
    that loop is closed: nobody is left to read them)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        if not loop.is_closed():
            raise


@dataclass
class _Add:
    prompt: Any
    kwargs: dict
    stream: RequestStream
    accepted: Future


class EngineLoop:
    """Drives `engine` in a daemon thread (module docstring). `on_step(outputs)` runs
    on the stepping thread after each step (the server's metrics)."""

    IDLE_WAIT_S = 0.05

    def __init__(
        self,
        engine,
        *,
        max_pending: int = 1024,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.engine = engine
        self.max_pending = max_pending
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # pending requests, stepping thread's
        self._pending = 0  # guarded by _lock: counted at submit, released at the end
        self._lock = threading.Lock()
        self._next_id = 0
        self._closing = threading.Event()
        self._grace_deadline = float("inf")
        self.failure: str | None = None  # why the loop stopped early (a step raised)
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxkv-engine-loop")
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._pending

    async def submit(
        self, prompt: Any, output_queue: asyncio.Queue | None = None, **kwargs: Any
    ) -> RequestStream:
        """Queue `engine.add_request(prompt, **kwargs)`; the request's stream (its outputs
        on `output_queue`, a new one by default) once the engine accepted it. `QueueFull`,
        `EngineLoopClosed`, or the engine's ValueError/TypeError/KeyError for bad input
        (nothing pending then)."""
        with self._lock:
            if self._closing.is_set():
                raise EngineLoopClosed("the server is shutting down")
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests pending (the limit)")
            self._pending += 1
            self._next_id += 1
            request_id = kwargs.pop("request_id", None) or f"req-{self._next_id}"
        stream = RequestStream(
            request_id, time.monotonic(), asyncio.Queue() if output_queue is None else output_queue,
            asyncio.get_running_loop(),
        )  # fmt: skip
        accepted: Future = Future()
        self._commands.put(_Add(prompt, {**kwargs, "request_id": request_id}, stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            self._release()
            raise
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` run on the stepping thread between steps; its result (or error).
        `EngineLoopClosed` once the loop is closing."""
        if self._closing.is_set():
            raise EngineLoopClosed("the server is shutting down")
        done: Future = Future()
        self._commands.put(("call", fn, done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Abort `request_id` if it is still pending (a client went away); its blocks are
        freed at the next step. Thread-safe; a finished request is left alone."""
        self._commands.put(("abort", request_id))

    def begin_close(self, grace_s: float = 30.0) -> None:
        """Refuse new requests from now on; pending ones get `grace_s` to finish (or the
        earlier deadline of a previous call), then they are aborted (their streams end
        with `finish_reason="abort"`) and the engine is shut down. Returns at once."""
        with self._lock:
            self._grace_deadline = min(self._grace_deadline, time.monotonic() + grace_s)
            self._closing.set()
        self._commands.put(("wake",))

    def close(self, grace_s: float = 30.0, timeout_s: float | None = None) -> None:
        """`begin_close(grace_s)`, then join the thread (at most `timeout_s` more)."""
        self.begin_close(grace_s)
        self._thread.join(timeout_s)

    # -- the stepping thread ----------------------------------------------------------

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _run(self) -> None:
        try:
            self._step_until_closed()
        except Exception as error:
            logger.exception("the engine loop stopped: a step raised")
            self.failure = f"{type(error).__name__}: {error}"
            with self._lock:
                self._closing.set()
            for request_id, stream in list(self._streams.items()):
                failed = RequestOutput.rejected([], f"the engine failed: {self.failure}")
                failed.request_id, failed.finish_reason = request_id, "error"
                _hand_over(stream._loop, [(stream.queue, (time.monotonic(), failed))])
                self._release()
            self._streams.clear()
            self._refuse_queued(EngineLoopClosed(f"the engine failed: {self.failure}"))
        finally:
            self.engine.shutdown()

    def _refuse_queued(self, error: Exception) -> None:
        """Fail the adds still queued (the loop will not take them)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.accepted.set_exception(error)
            elif command[0] == "call":
                command[2].set_exception(error)

    def _step_until_closed(self) -> None:
        engine = self.engine
        while True:
            self._take_commands(block=not engine.has_unfinished_requests())
            if self._closing.is_set():
                # Every submitted request is counted in _pending before its add is queued:
                # none can be left in the queue once it is 0.
                if self._pending == 0 and not engine.has_unfinished_requests():
                    self._refuse_queued(EngineLoopClosed("the server is shutting down"))
                    return
                if time.monotonic() > self._grace_deadline:
                    for request_id in list(self._streams):
                        self._abort(request_id)
            if engine.has_unfinished_requests():
                self._deliver(engine.step())

    def _take_commands(self, block: bool) -> None:
        commands = self._commands
        try:
            command = commands.get(timeout=self.IDLE_WAIT_S) if block else commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.prompt, **command.kwargs)
            except Exception as error:  # the client's mistake: reported to its handler
                command.accepted.set_exception(error)
                return
            self._streams[command.stream.request_id] = command.stream
            command.accepted.set_result(True)
        elif command[0] == "abort":
            self._abort(command[1])
        elif command[0] == "call":
            _, fn, done = command
            try:
                done.set_result(fn(self.engine))
            except Exception as error:
                done.set_exception(error)

    def _abort(self, request_id: str) -> None:
        if request_id in self._streams:
            try:
                self.engine.abort(request_id)
            except KeyError:  # finished in the step that just ran; its output is on its way
                pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand the step's outputs to their consumers: one wake-up per event loop per
        step (not per output: each costs a syscall and a GIL hand-off)."""
        streams = self._streams
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        finished = []
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream._loop, []).append((stream.queue, (now, output)))
            if output.finished:
                finished.append(output.request_id)
        for loop, items in by_loop.items():
            _hand_over(loop, items)
        for request_id in finished:
            del streams[request_id]
            self._release()
        if self._on_step is not None:
            self._on_step(outputs)
