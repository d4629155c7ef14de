"""One compile of a deviceless matrix (`tpu_aot_matrix.py`, `gpu_aot_matrix.py`), classified.

Imported by the matrices inside their side environments, never by the CPU test process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def first_line(error: BaseException, marker: str = "") -> str:
    """The line of an error that says what went wrong: the first holding `marker` (a
    compiler's own message), else the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    marked = [line for line in lines if marker and marker in line]
    line = (marked or lines or [type(error).__name__])[0]
    return f"{type(error).__name__}: {line}"[:400]


def compile_outcome(
    lower: Callable[[], jax.stages.Lowered],
    mismatch: Callable[[str], str | None],
    reason: str | None,
    marker: str = "",
) -> dict:
    """Lower and compile one program: `"compiled"` (no refusal `reason`), `"refused"` (a
    reason, the fallback compiled), or `"failed"` with the error's line, when lowering or
    compiling raised or `mismatch(the lowered text)` names a program other than planned.
    Also the reason and the seconds taken."""
    result = {"outcome": "failed", "reason": reason, "error": None}
    start = time.perf_counter()
    try:
        lowered = lower()
        wrong = mismatch(lowered.as_text())
        lowered.compile()
        if wrong is not None:
            result["error"] = wrong
        else:
            result["outcome"] = "refused" if reason else "compiled"
    except Exception as error:  # noqa: BLE001 - every failure is reported, not raised
        result["error"] = first_line(error, marker)
    result["compile_s"] = round(time.perf_counter() - start, 3)
    return result
