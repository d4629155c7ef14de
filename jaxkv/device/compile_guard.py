"""Counting XLA compilations: a counter the engine can report and a test guard.

A listener on JAX's backend-compile monitoring event counts every program XLA
compiles in this process (jit, pjit, shard_map, eager ops alike). After warm-up
a serving loop should compile nothing; `no_compilation()` turns a violation
into an error naming how many programs were compiled.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompilationCounter:
    """Process-wide count of backend compilations since the counter was installed.

    Invariant: `count` only grows, by exactly one per compiled program (the
    listener is registered once per process, however many counters exist).
    """

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def _listener(cls, event: str, duration: float, **kwargs: object) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls._count += 1

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                monitoring.register_event_duration_secs_listener(cls._listener)
                cls._installed = True

    @classmethod
    def count(cls) -> int:
        """Programs compiled since `install()` (installs on first use)."""
        cls.install()
        return cls._count


def compilation_count() -> int:
    """Programs XLA compiled in this process since jaxkv started counting."""
    return CompilationCounter.count()


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
