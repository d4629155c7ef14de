"""Runs the HTTP API (`jaxkv.serving.app`) with uvicorn over one engine.

Lifecycle: the engine loop starts with the server; SIGTERM or SIGINT (uvicorn's
handlers) stops accepting connections and gives in-flight responses `grace_s` to
finish; then the loop is closed (what is left is aborted) and the engine shut down,
and `serve` returns 0.
"""

from __future__ import annotations

import uvicorn

from jaxkv.serving.app import ServedModel, build_app
from jaxkv.serving.engine_loop import EngineLoop
from jaxkv.serving.metrics import ServerMetrics

__all__ = ["Server"]


class Server:
    """One engine behind the OpenAI API on `host:port`."""

    def __init__(
        self,
        engine,
        model: ServedModel,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_pending: int = 1024,
        grace_s: float = 30.0,
    ) -> None:
        self.metrics = ServerMetrics(model.name)
        stats = engine.stats
        self.loop = EngineLoop(
            engine,
            max_pending=max_pending,
            on_step=lambda outputs: self.metrics.observe_step(stats.steps[-1]),
        )
        self.grace_s = grace_s
        self.app = build_app(self.loop, model, self.metrics)
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=grace_s, lifespan="off",
        )  # fmt: skip
        self.uvicorn = uvicorn.Server(config)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (or `stop()`); 0 once everything stopped."""
        try:
            self.uvicorn.run()
        finally:
            self.loop.close(grace_s=self.grace_s)
        return 0

    def stop(self) -> None:
        """Ask the server to stop as SIGTERM does (from another thread)."""
        self.uvicorn.should_exit = True

    @property
    def started(self) -> bool:
        return self.uvicorn.started
