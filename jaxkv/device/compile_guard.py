"""Counting XLA compilations: a counter the engine can report and a test guard.

A listener on JAX's backend-compile monitoring event counts every program built in
this process (jit, pjit, shard_map, eager ops alike): compiled by XLA, or loaded from
the persistent compilation cache (`jaxkv.device.compilation_cache`; JAX reports both
through the same event, and the loads also as cache hits, counted apart). After
warm-up a serving loop should build nothing; `no_compilation()` turns a violation
into an error naming how many programs were built.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompilationCounter:
    """Process-wide count of backend compilations since the counter was installed.

    Invariant: `count` only grows, by exactly one per program built, and
    `cache_hits <= count` by one per program of those loaded from the persistent
    cache (the listeners are registered once per process, however many counters
    exist).
    """

    _lock = threading.Lock()
    _count = 0
    _cache_hits = 0
    _installed = False

    @classmethod
    def _listener(cls, event: str, duration: float, **kwargs: object) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls._count += 1

    @classmethod
    def _hit_listener(cls, event: str, **kwargs: object) -> None:
        if event == _CACHE_HIT_EVENT:
            with cls._lock:
                cls._cache_hits += 1

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                monitoring.register_event_duration_secs_listener(cls._listener)
                monitoring.register_event_listener(cls._hit_listener)
                cls._installed = True

    @classmethod
    def count(cls) -> int:
        """Programs built since `install()` (installs on first use)."""
        cls.install()
        return cls._count

    @classmethod
    def cache_hits(cls) -> int:
        """Of those, programs loaded from the persistent compilation cache."""
        cls.install()
        return cls._cache_hits


def compilation_count() -> int:
    """Programs built in this process (compiled, or loaded from the persistent
    compilation cache) since jaxkv started counting."""
    return CompilationCounter.count()


def compilation_cache_hits() -> int:
    """Programs of `compilation_count()` loaded from the persistent compilation cache."""
    return CompilationCounter.cache_hits()


class CompilationError(AssertionError):
    """Raised by `no_compilation` when a program was compiled inside the guard."""


@contextmanager
def no_compilation(what: str = "the guarded block") -> Iterator[None]:
    """Fail with `CompilationError` if anything is compiled inside the block."""
    before = compilation_count()
    yield
    compiled = compilation_count() - before
    if compiled:
        raise CompilationError(f"{compiled} program(s) were compiled during {what}; expected 0")
