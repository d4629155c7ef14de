"""Runs the HTTP API (`jaxkv.serving.app`) with uvicorn over one engine.

Lifecycle: the engine loop starts with the server (`jaxkv serve` gives it an engine in
a process of its own). SIGTERM or SIGINT (or `stop()`)
stops accepting connections and requests at once; in-flight requests get `grace_s` to
finish, then the engine loop aborts them, so every open stream still ends properly
(its last chunk says `finish_reason="abort"`, then `[DONE]`). Then the engine shuts
down and `run` returns 0 (the signal is not re-raised: a graceful stop is a success).
"""

from __future__ import annotations

import uvicorn

from jaxkv.serving.app import ServedModel, build_app
from jaxkv.serving.engine_loop import EngineLoop
from jaxkv.serving.metrics import ServerMetrics

__all__ = ["Server"]

# Past the grace period, the time aborted streams get to send their last chunk before
# uvicorn cuts their connections.
FLUSH_MARGIN_S = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, whose shutdown starts the engine loop's grace period and whose
    signal handling ends in a normal return."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, grace_s: float) -> None:
        super().__init__(config)
        self.engine_loop, self.grace_s = loop, grace_s

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has stopped, which would kill the
        # process before the engine shuts down and make the exit status -SIGTERM.
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.begin_close(self.grace_s)
        await super().shutdown(sockets)


class Server:
    """One engine behind the OpenAI API on `host:port`: `core` is the engine itself
    (stepped on a thread of this process) or an `EngineProcess` (stepped in its own)."""

    def __init__(
        self,
        core,
        model: ServedModel,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_pending: int = 1024,
        grace_s: float = 30.0,
    ) -> None:
        self.metrics = ServerMetrics(model.name)
        self.loop = EngineLoop(core, max_pending=max_pending, on_step=self.metrics.observe_step)
        self.grace_s = grace_s
        self.app = build_app(self.loop, model, self.metrics)
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning", lifespan="off",
            timeout_graceful_shutdown=grace_s + FLUSH_MARGIN_S,
        )  # fmt: skip
        self.uvicorn = _Uvicorn(config, self.loop, grace_s)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or `stop()`); 0 once everything stopped."""
        try:
            self.uvicorn.run()
        finally:
            # Every connection is closed by now: nobody waits for what is still pending.
            self.loop.close(grace_s=0.0)
        return 0

    def stop(self) -> None:
        """Ask the server to stop as SIGTERM does (from another thread)."""
        self.uvicorn.should_exit = True

    @property
    def started(self) -> bool:
        return self.uvicorn.started
