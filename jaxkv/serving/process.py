"""`jaxkv serve` in a child process (what a router, a benchmark or a test starts): the
command on a free loopback port, ready once `/health` answers, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

__all__ = ["ServeProcess", "free_port"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m jaxkv serve --model MODEL --port PORT ARGS` (this `jaxkv`, this Python).

    Invariant: once constructed, the server answers on `url`; its output (stdout and
    stderr together) goes to a temporary file, `log()`, so a chatty server never blocks
    on a full pipe. `stop()` (or leaving the `with` block) sends SIGTERM and waits.
    """

    def __init__(
        self,
        model: str | Path,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "jaxkv", "serve", "--model", str(model),
                   "--port", str(self.port), *args]  # fmt: skip
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
        )  # fmt: skip
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxkv serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jaxkv serve not up after {timeout_s} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self, tail: int = 4000) -> str:
        """The last `tail` characters the server wrote."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-tail:]

    def terminate(self) -> None:
        """SIGTERM: the server stops accepting and finishes within its grace period."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit status (SIGKILL and TimeoutError past `timeout_s`)."""
        if self.proc.poll() is None:
            self.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"jaxkv serve ignored SIGTERM for {timeout_s} s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._log.close()
