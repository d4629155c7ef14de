"""An engine in a process of its own (vLLM's EngineCore beside AsyncLLM): the server's
process parses, streams and counts, this one schedules and steps, so neither waits for
the other's Python. They talk over one pipe with the messages of `engine_core`.

Invariants:
- The child is spawned (a fresh interpreter: no inherited JAX runtime) and builds its
  engine with `build(*args)`, a module-level function returning `(engine, info)`;
  construction returns once the engine is ready (`info`, a dict, is the child's word on
  it) or raises what `build` raised there (nothing is left running then).
- The child ignores SIGINT and SIGTERM: the server stops it with a `close` command, so
  a Ctrl-C or SIGTERM to the server's process group still ends streams properly. If the
  server's process dies, the child sees the pipe close and shuts its engine down.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

from jaxkv.serving.engine_core import run_engine_core

__all__ = ["EngineProcess"]


class EngineProcess:
    """A spawned process serving the engine `build(*args)` makes (module docstring)."""

    def __init__(self, build: Callable[..., tuple[Any, dict]], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._send_lock = threading.Lock()
        self.process = context.Process(
            target=_serve, args=(child_end, build, args), daemon=True, name="jaxkv-engine"
        )
        self.process.start()
        child_end.close()  # so a dead child reads as EOF here
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine process exited with code {self.process.exitcode} before it "
                "was ready (its error is in the log above)"
            ) from None
        if kind == "failed":
            self.process.join()
            raise payload
        self.info: dict = payload

    def send(self, command: tuple) -> None:
        """Hand `command` to the engine (thread-safe); dropped if the engine is gone (the
        reader then reports it stopped)."""
        with self._send_lock:
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError):
                pass

    def receive(self) -> tuple:
        """The engine's next event; EOFError once the process is gone."""
        return self._conn.recv()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


def _serve(conn, build: Callable[..., tuple[Any, dict]], args: tuple) -> None:
    """The child's main: build the engine, report, then run the core over the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine, info = build(*args)
    except (ValueError, OSError) as error:  # bad flags or files: the caller's to report
        conn.send(("failed", error))
        return
    except Exception as error:  # a bug: its traceback here, its name there
        traceback.print_exc()
        conn.send(("failed", RuntimeError(f"building the engine failed: {error!r}")))
        return
    conn.send(("ready", info))

    def receive(timeout: float | None) -> tuple | None:
        return conn.recv() if conn.poll(timeout) else None

    run_engine_core(engine, receive, conn.send)
