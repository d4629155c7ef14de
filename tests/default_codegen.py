"""Compiling as XLA's CPU backend does by default, for the tests that read what a
compiled program does with its buffers (aliasing, temporaries, cache-sized copies).

The suite's XLA flags (tests/conftest.py) switch the CPU backend to its elemental
emitters, which compile faster but fuse differently; a test of the compiled program's
buffers compiles it with the default code generation instead, as users get it.
"""

from __future__ import annotations

import jax

__all__ = ["compile_by_default"]

_DEFAULT_CPU_CODEGEN = {"xla_cpu_use_fusion_emitters": True}


def compile_by_default(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered.compile()` with the CPU backend's default code generation."""
    return lowered.compile(compiler_options=_DEFAULT_CPU_CODEGEN)
