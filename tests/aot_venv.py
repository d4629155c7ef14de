"""Side environments for the deviceless compilers (`test_tpu_aot.py`, `test_gpu_aot.py`).

A compiler for an accelerator this machine lacks comes with that accelerator's JAX
plugin (`jax[tpu]`'s libtpu, the CUDA plugin), which the test process must not load. Each
is installed once into a virtual environment beside the repository (this process's jax
version, this repository's jaxkv, editable) and reused while it imports them; the
matrices run in it as subprocesses. Building it needs the package registry: when a step
fails, the test is skipped with pip's last line.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JAX_VERSION = importlib.metadata.version("jax")
PIP_TIMEOUT_S = 1200


def subprocess_env(**extra: str) -> dict[str, str]:
    """The subprocesses' environment: this repository's jaxkv first, no CPU-only JAX
    settings, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The last non-empty line a process printed (stderr first), or its exit status."""
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {proc.returncode}"


def not_ready(python: Path, modules: tuple[str, ...], env: dict[str, str]) -> str | None:
    """Why `python` cannot run a matrix (None if it imports jax at our version, `modules`
    and jaxkv)."""
    if not python.exists():
        return f"{python} does not exist"
    check = f"import jax, jaxkv, {', '.join(modules)}; print(jax.__version__)"
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    if proc.returncode:
        return f"{python} cannot import jax, jaxkv and {', '.join(modules)}: {last_line(proc)}"
    if proc.stdout.strip() != JAX_VERSION:
        return f"{python} has jax {proc.stdout.strip()}, need {JAX_VERSION}"
    return None


def _install(command: list, env: dict[str, str], what: str) -> None:
    """Run one build step; skip the test (with the step's last line) if it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S)
    if proc.returncode:
        step = " ".join(map(str, command[2:]))
        pytest.skip(f"cannot build the {what} environment ({step}): {last_line(proc)}")


def side_python(
    venv: Path, requirements: list[str], modules: tuple[str, ...], env: dict[str, str], what: str
) -> Path:
    """The python of `venv` holding `requirements` and this repository's jaxkv, built under
    a file lock (one xdist worker builds it, the others find it built)."""
    python = venv / "bin" / "python"
    if not_ready(python, modules, env) is None:
        return python
    key = hashlib.sha256(str(venv).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"jaxkv-side-venv-{key}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not_ready(python, modules, env) is not None:
            if not python.exists():
                _install([sys.executable, "-m", "venv", venv], env, what)
            _install([python, "-m", "pip", "install", "-q", *requirements], env, what)
            _install([python, "-m", "pip", "install", "-q", "-e", REPO], env, what)
        reason = not_ready(python, modules, env)
    assert reason is None, f"the {what} environment at {venv} is installed but unusable: {reason}"
    return python
