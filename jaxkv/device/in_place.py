"""Whether a compiled program updates its donated cache buffers in place.

A buffer is updated in place only if the compiled program says so: `jax.jit`'s
`donate_argnums` is a request, and XLA silently falls back to copying when the
program's structure needs the old and new buffer at once (an update written through
one reshape of the buffer and read through another, a read after the write that
cannot be scheduled before it, ...). `check_in_place` reads the optimized program:

- every cache parameter is aliased to an output (`memory_analysis().alias_size_in_bytes`
  covers all of them),
- no temporary is as large as one cache buffer (`temp_size_in_bytes` below the smallest
  cache's per-device bytes), so nothing of a cache's size is materialised, and
- no `copy`-like instruction produces an array of a cache's per-device size.

Sizes are per device: an SPMD program is compiled for one shard.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

__all__ = ["InPlaceReport", "check_in_place"]

# Opcodes that write a new buffer from their operands (never in place).
_MATERIALISING = ("copy", "copy-start", "broadcast", "concatenate", "transpose", "pad", "gather")
_INSTRUCTION = re.compile(r"=\s*\w+\[([\d,]*)\]\S*\s+([\w-]+)\(")


@dataclass(frozen=True)
class InPlaceReport:
    """What the compiled program does with its cache buffers (module docstring)."""

    cache_bytes: tuple[int, ...]  # per device, one per cache argument
    alias_bytes: int
    temp_bytes: int
    cache_sized_copies: tuple[str, ...]  # offending HLO instructions, abbreviated

    @property
    def problems(self) -> list[str]:
        out = []
        if self.alias_bytes < sum(self.cache_bytes):
            out.append(
                f"only {self.alias_bytes} of the caches' {sum(self.cache_bytes)} bytes are "
                "aliased to outputs (a donated cache is copied into a fresh output)"
            )
        if self.cache_bytes and self.temp_bytes >= min(self.cache_bytes):
            out.append(
                f"{self.temp_bytes} temporary bytes, at least one cache buffer "
                f"({min(self.cache_bytes)} bytes per device)"
            )
        out += [f"cache-sized instruction: {line}" for line in self.cache_sized_copies]
        return out

    @property
    def in_place(self) -> bool:
        return not self.problems


def _per_device_bytes(x: jax.Array | jax.ShapeDtypeStruct) -> tuple[int, int]:
    """(elements, bytes) of one device's shard of `x`."""
    shape = tuple(x.shape)
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        shape = tuple(sharding.shard_shape(shape))
    elements = int(np.prod(shape))
    return elements, elements * np.dtype(x.dtype).itemsize


def check_in_place(
    compiled: jax.stages.Compiled, caches: Sequence[jax.Array | jax.ShapeDtypeStruct]
) -> InPlaceReport:
    """Report on `compiled`, whose donated cache arguments are shaped like `caches`."""
    sizes = [_per_device_bytes(c) for c in caches]
    stats = compiled.memory_analysis()
    smallest = min((n for n, _ in sizes), default=0)
    offending = []
    if smallest:
        for line in compiled.as_text().splitlines():
            m = _INSTRUCTION.search(line)
            if m is None or m.group(2) not in _MATERIALISING:
                continue
            elements = int(np.prod([int(d) for d in m.group(1).split(",") if d] or [1]))
            if elements >= smallest:
                offending.append(line.strip()[:160])
    return InPlaceReport(
        cache_bytes=tuple(b for _, b in sizes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        cache_sized_copies=tuple(offending),
    )
