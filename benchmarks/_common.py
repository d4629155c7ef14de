"""Shared plumbing for the benchmarks: peer environment, tables, JSON output.

Every benchmark measures its baseline in the same run and reports ratios; the
absolute times on these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Recorded figures (cited by RESULTS.md), written only with --record; other runs go to OUT_DIR.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
OUT_DIR = REPO_ROOT / "benchmarks" / "out"
PEER_VENV = REPO_ROOT / ".venv-vllm"
_IN_PEER_ENV = "JAXKV_BENCH_IN_PEER"


def peer_available() -> bool:
    """True when this process can import vLLM's v1 core (the peer)."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:
        return False
    return True


def ensure_peer_process(argv: Sequence[str] | None = None) -> bool:
    """Make vLLM importable in this very process, re-executing under `.venv-vllm` if needed.

    Returns True when the peer can be imported here; False (after printing why)
    when no peer environment exists, so the caller skips the comparison cleanly.
    """
    if peer_available():
        return True
    peer_python = PEER_VENV / "bin" / "python"
    if os.environ.get(_IN_PEER_ENV):
        print(f"[peer] vLLM does not import under {peer_python}; skipping the peer comparison.")
        return False
    if not peer_python.exists():
        print(
            f"[peer] {peer_python} is missing; build it with tools/vllm-peer-venv.sh"
            " — skipping the peer comparison."
        )
        return False
    env = dict(os.environ, **{_IN_PEER_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    if argv is not None:
        args = [str(peer_python), *argv]
    elif main_spec is not None:  # started as `python -m benchmarks.<name>`
        args = [str(peer_python), "-m", main_spec.name, *sys.argv[1:]]
    else:
        args = [str(peer_python), *sys.argv]
    os.execve(str(peer_python), args, env)
    return False  # unreachable


def best_of(
    fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.thread_time
) -> tuple[float, object]:
    """Minimum time of `repeats` calls of `fn`, and the last result.

    The default clock is this thread's CPU time, which other load on a shared
    machine disturbs far less than wall time; pass `time.perf_counter` for
    work that waits (device calls).
    """
    best = float("inf")
    result: object = None
    for _ in range(repeats):
        start = clock()
        result = fn()
        best = min(best, clock() - start)
    return best, result


def spread(values: Sequence[float]) -> dict:
    """Median and range of repeated figures (the form every benchmark reports)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Print (and return) a plain aligned table."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text)
    return text


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def results_name(
    base: str,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    measurement_options: Sequence[str] = ("peer", "repeats", "record"),
) -> str:
    """`base`, plus `_<value>_<option>` (`_<option>` for a flag) per workload option off
    its default, so a run of another workload never replaces the recorded figures."""
    parts = [base]
    for option, value in vars(args).items():
        if option in measurement_options or value == parser.get_default(option):
            continue
        if isinstance(value, list | tuple):
            value = "-".join(map(str, value))
        if isinstance(value, str):  # a path names the file by its last part
            value = Path(value).name
        parts.append(option if value is True else f"{value}_{option}")
    return "_".join(parts)


def add_record_option(parser: argparse.ArgumentParser) -> None:
    """`--record`: replace the recorded figures in benchmarks/results/ (else benchmarks/out/)."""
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the JSON into benchmarks/results/, replacing the recorded figures that "
        "RESULTS.md cites (default: benchmarks/out/, git-ignored)",
    )


def write_json(name: str, payload: dict, record: bool = False) -> Path:
    """Write `payload` (plus machine facts) to <name>.json: in benchmarks/results/ (the
    recorded figures) only when `record`, else in benchmarks/out/."""
    directory = RESULTS_DIR if record else OUT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload["machine"] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    return path
