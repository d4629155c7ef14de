"""The server's handle on one engine: any number of client event loops (the HTTP
server's handlers) submit requests and read each request's outputs as a stream, while
the engine is stepped elsewhere: by `engine_core` on a thread of this process (given an
engine) or in a process of its own (given an `EngineProcess`).

Invariants:
- Only the core touches the engine: clients hand it commands (add, abort, call) and get
  a request's outputs on that request's own `RequestStream`, in order, the last one
  `finished`.
- A request is *pending* from `submit` until its final output: at most `max_pending`
  are, so memory stays bounded under any load (`QueueFull` past that: the server
  answers 503).
- `submit` returns only once the engine accepted the request (else its `ValueError`,
  nothing changed) so a client's mistake is reported before any output.
- After `begin_close()`/`close()` no request is accepted (`EngineLoopClosed`); requests
  still running finish within the grace period or are aborted (a final output with
  `finish_reason="abort"`), then the engine shuts down.
- If the core stops without being closed (a step raised, or its process died), every
  pending request gets a final output with `finish_reason="error"`, `failure` says why,
  and the loop accepts nothing more.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from jaxkv.engine.outputs import RequestOutput
from jaxkv.serving.engine_core import EngineLoopClosed, run_engine_core
from jaxkv.serving.engine_process import EngineProcess

__all__ = ["EngineLoop", "EngineLoopClosed", "QueueFull", "RequestStream"]

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests pending than the loop's `max_pending`."""


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


class _InThread:
    """The core on a daemon thread of this process, commands on a queue."""

    def __init__(self, engine, on_event: Callable[[tuple], None]) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.send = self._commands.put
        self._thread = threading.Thread(
            target=run_engine_core, args=(engine, self._receive, on_event), daemon=True,
            name="jaxkv-engine-loop",
        )  # fmt: skip
        self._thread.start()

    def _receive(self, timeout: float | None) -> tuple | None:
        try:
            return self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return None

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)


class _InProcess:
    """The core in its own process; a reader thread here takes its events."""

    def __init__(self, process: EngineProcess, on_event: Callable[[tuple], None]) -> None:
        self.process, self.send, self._on_event = process, process.send, on_event
        self._reader = threading.Thread(target=self._read, daemon=True, name="jaxkv-engine-io")
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                event = self.process.receive()
            except (EOFError, OSError):
                self.process.join(5.0)
                code = self.process.exitcode
                self._on_event(("stopped", f"the engine process exited (code {code})"))
                return
            try:
                self._on_event(event)
            except Exception as error:  # a bug on this side: end every stream, never hang one
                logger.exception("taking an engine event failed: stopping the engine")
                self.process.process.kill()
                self._on_event(("stopped", f"the server failed on an engine event: {error!r}"))
                return
            if event[0] == "stopped":
                return

    def join(self, timeout: float | None) -> None:
        self._reader.join(timeout)
        self.process.join(timeout)


class EngineLoop:
    """Serves `core` (an engine, stepped on a thread here, or an `EngineProcess`) to
    asyncio clients (module docstring). `on_step(step_stats)` runs after each step, on
    the thread that takes the core's events (the server's metrics)."""

    def __init__(
        self,
        core,
        *,
        max_pending: int = 1024,
        on_step: Callable[[Any], None] | None = None,
    ) -> None:
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.max_pending = max_pending
        self._on_step = on_step
        self._streams: dict[str, RequestStream] = {}  # accepted, without a final output
        self._accepting: dict[str, tuple[RequestStream, Future]] = {}
        self._calls: dict[int, Future] = {}
        self._pending = 0  # guarded by _lock: counted at submit, released at the end
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closing = False
        self.failure: str | None = None  # why the core stopped early
        transport = _InProcess if isinstance(core, EngineProcess) else _InThread
        self._core = transport(core, self._on_event)

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
        request_id = kwargs.pop("request_id", None)
        accepted: Future = Future()
        with self._lock:  # a close is sent after every add sent before it
            if self._closing:
                raise EngineLoopClosed(self.failure or "the server is shutting down")
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests pending (the limit)")
            self._pending += 1
            request_id = request_id or f"req-{next(self._ids)}"
            stream = RequestStream(
                request_id, time.monotonic(),
                asyncio.Queue() if output_queue is None else output_queue,
                asyncio.get_running_loop(),
            )  # fmt: skip
            self._accepting[request_id] = (stream, accepted)
            self._core.send(("add", request_id, prompt, kwargs))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            self._release()
            raise
        return stream

    async def call(self, method: str | Callable[..., Any], *args: Any) -> Any:
        """`engine.<method>(*args)` (or `method(engine, *args)`) run between steps; its
        result (or error). `EngineLoopClosed` once the loop is closing."""
        done: Future = Future()
        with self._lock:
            if self._closing:
                raise EngineLoopClosed(self.failure or "the server is shutting down")
            call_id = next(self._ids)
            self._calls[call_id] = done
            self._core.send(("call", call_id, method, args))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Abort `request_id` if it is still pending (a client went away); its blocks are
        freed at the next step. Thread-safe; a finished request is left alone."""
        self._core.send(("abort", request_id))

    def begin_close(self, grace_s: float = 30.0) -> None:
        """Refuse new requests from now on; pending ones get `grace_s` to finish (or the
        earlier deadline of a previous call), then they are aborted (their streams end
        with `finish_reason="abort"`) and the engine is shut down. Returns at once."""
        with self._lock:
            self._closing = True
            self._core.send(("close", grace_s))

    def close(self, grace_s: float = 30.0, timeout_s: float | None = None) -> None:
        """`begin_close(grace_s)`, then wait for the engine to stop (at most `timeout_s`)."""
        self.begin_close(grace_s)
        self._core.join(timeout_s)

    # -- the core's events (on the thread that takes them) -----------------------------

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "outputs":
            self._deliver(event[1])
            if self._on_step is not None:
                self._on_step(event[2])
        elif kind == "accepted":
            _, request_id, error = event
            stream, accepted = self._accepting.pop(request_id)
            if error is None:
                self._streams[request_id] = stream
                accepted.set_result(True)
            else:
                accepted.set_exception(error)
        elif kind == "result":
            _, call_id, value, error = event
            done = self._calls.pop(call_id)
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)
        elif kind == "stopped":
            self._stop(event[1])

    def _stop(self, failure: str | None) -> None:
        """The core stopped: end what is still pending (nothing, after a close)."""
        with self._lock:
            self._closing = True
            if failure is None and self._streams:
                failure = "the engine stopped with requests still running"
            self.failure = failure
        refused = EngineLoopClosed(f"the engine failed: {failure}" if failure else "closed")
        for _, accepted in self._accepting.values():
            accepted.set_exception(refused)
        for done in self._calls.values():
            done.set_exception(refused)
        self._accepting.clear()
        self._calls.clear()
        for request_id, stream in list(self._streams.items()):
            failed = RequestOutput.rejected([], f"the engine failed: {failure}")
            failed.request_id, failed.finish_reason = request_id, "error"
            self._release()  # before its consumer can see the end: pending means unended
            _hand_over(stream._loop, [(stream.queue, (time.monotonic(), failed))])
        self._streams.clear()

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
        for request_id in finished:  # released before their consumers see the end
            del streams[request_id]
            self._release()
        for loop, items in by_loop.items():
            _hand_over(loop, items)
