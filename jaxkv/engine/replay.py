"""Several processes, one engine: process 0's request calls replayed on the others
(`multihost.RequestStream`), so every process holds the same host state and schedules
the same steps. With one process every call here is a no-op.

Invariants: requests enter on process 0 only (`check` refuses them elsewhere); a call
is recorded only once it has succeeded (so a refused call is replayed nowhere); the
recorded calls are replayed on the other processes before the step that follows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax

from jaxkv.engine import multihost

__all__ = ["ProcessReplay", "engine_settings"]


def engine_settings(config, model, mesh) -> dict[str, str]:
    """What every process of a multi-process engine must agree on, in order."""
    from importlib.metadata import version

    settings = {"jaxkv version": version("jaxkv")}
    for f in dataclasses.fields(config):
        settings[f"EngineConfig.{f.name}"] = repr(getattr(config, f.name))
    settings["model config"] = multihost.digest(repr(model.config))
    settings["mesh"] = repr(None if mesh is None else dict(mesh.shape))
    return settings


class ProcessReplay:
    """The engine's replay of process 0's calls (`stream`: None with one process)."""

    def __init__(self, settings: Callable[[], Mapping[str, str]]) -> None:
        """`settings`: the engine's `engine_settings`, checked the same on every process
        (only asked for with several processes)."""
        self.stream: multihost.RequestStream | None = None
        if jax.process_count() > 1:
            multihost.check_same_everywhere(settings(), "engine settings")
            self.stream = multihost.RequestStream()

    def check(self, call: str) -> None:
        """RuntimeError unless `call` may change requests here (process 0, or a replay)."""
        if self.stream is not None:
            self.stream.check_source(call)

    def record(self, *op) -> None:
        """Queue a succeeded call for the other processes (`multihost.Op`)."""
        if self.stream is not None:
            self.stream.record(op)

    def step(self, step: Callable[[], list], apply: Callable[[multihost.Op], None]) -> list:
        """Replay the calls since the last step (`apply` each), then `step()`."""
        stream = self.stream
        if stream is None:
            return step()
        with multihost.peers_alive(stream):
            stream.replay(stream.exchange() or [], apply)
            return step()

    def follow(self, step: Callable[[], list], apply: Callable[[multihost.Op], None]) -> None:
        """On a process other than 0: replay and step until process 0 stops."""
        stream = self.stream
        if stream is None or stream.is_source:
            raise RuntimeError(
                "follow() is for the processes other than 0 of a multi-process engine"
            )
        with multihost.peers_alive(stream):
            while (ops := stream.exchange()) is not None:
                stream.replay(ops, apply)
                step()

    def stop(self) -> None:
        """On process 0: release the others from `follow()` (once)."""
        if self.stream is not None and self.stream.is_source:
            self.stream.stop()
            self.stream = None
