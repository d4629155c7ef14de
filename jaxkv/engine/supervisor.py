"""Several processes from the command line: the engine runs in a child process (the
worker) and the `jaxkv` process supervises it, so that every way the job breaks ends in
one `jaxkv: error: ...` line naming this process and the cause.

Why a child: JAX's coordination service ends a process from C++ when the job breaks (a
peer stopped sending heartbeats, the coordinator went away, a second process joined
with a process id already in the job): `LOG(QFATAL)`, then abort (SIGABRT), with no
Python in between. The client's `missed_heartbeat_callback` cannot be a Python function
in this jaxlib (the absl::Status it is called with has no Python conversion: the call
throws std::bad_cast and the process terminates all the same), and a Python signal
handler never runs before abort() ends the process. But the runtime logs the cause on
stderr first, in the process it ends and in process 0 (which hosts the service): the
supervisor relays the worker's stderr, reads those lines (`FaultLog`), and reports the
cause when the worker dies of a signal.

Invariants: the worker gets this process's arguments, environment, stdin and stdout;
its stderr lines are relayed in order, except its own `jaxkv: error:` line, which is
held back and printed last, so a failed job's output ends with exactly one such line
(the runtime's word of a duplicate process id replaces the worker's own line, which
sees only a lost peer). The exit status is the worker's, or 1 when it died of a signal.
The worker dies with the supervisor (Linux: PR_SET_PDEATHSIG), and SIGINT and SIGTERM
sent to the supervisor are passed on to it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxkv.engine.distributed_config import DistributedConfig, lost_peers

__all__ = ["FaultLog", "die_with_supervisor", "in_worker", "supervise"]

# Set in the worker's environment: the supervisor's pid.
WORKER_ENV = "JAXKV_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_ERROR = "jaxkv: error: "

# What the coordination service logs (XLA's coordination_service*.cc, client.h).
_DUPLICATE = re.compile(r"(?:task:)?(\d+) unexpectedly tried to connect with a different")
_HEARTBEATS = "stopped sending heartbeats"
_TASK_LINE = re.compile(r"\s*(?:\S*task:)?(\d+)\s*")
_COORDINATOR_GONE = "Failed to send RPC to coordination service"
_PORT_TAKEN = "Failed to add port to server"
_STATUS = re.compile(r"absl::Status: (.*)")


def in_worker() -> bool:
    """Whether this process is a supervised worker."""
    return WORKER_ENV in os.environ


def die_with_supervisor() -> None:
    """In the worker: be killed (SIGKILL) when the supervisor ends, on Linux, and end at
    once if it has ended already (before this call took effect)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[WORKER_ENV]):
        os._exit(1)


class FaultLog:
    """What the worker's stderr says about how the job broke, read line by line."""

    def __init__(self, config: DistributedConfig) -> None:
        self.config = config
        self.own_error: str | None = None  # the worker's `jaxkv: error:` message
        self.duplicate: int | None = None  # a process id that joined twice
        self.dead: set[int] = set()  # processes that stopped sending heartbeats
        self.coordinator_gone = False
        self.port_taken = False
        self.status: str | None = None  # the first status the runtime died with
        self._listing_dead = False  # inside the service's list of unhealthy tasks

    def read(self, line: str) -> bool:
        """Take one line; True when it is the worker's own error line (held back)."""
        if line.startswith(_ERROR):
            self.own_error = line[len(_ERROR) :].rstrip("\n")
            return True
        if self._listing_dead:
            task = _TASK_LINE.fullmatch(line)
            if task:
                self.dead.add(int(task[1]))
                return False
            self._listing_dead = False
        duplicate = _DUPLICATE.search(line)
        if duplicate and self.duplicate is None:
            self.duplicate = int(duplicate[1])
        self._listing_dead = _HEARTBEATS in line
        self.coordinator_gone |= _COORDINATOR_GONE in line
        self.port_taken |= _PORT_TAKEN in line
        status = _STATUS.search(line)
        if status and self.status is None:
            self.status = status[1].strip()
        return False

    def verdict(self, returncode: int) -> str | None:
        """The error to print last for a worker that ended with `returncode` (negative:
        killed by that signal), or None (it succeeded, or failed with a traceback)."""
        me = self.config.process_id
        if returncode == 0:
            return None
        if self.duplicate is not None:
            return (
                f"process {me}: a second process with --process-id {self.duplicate} tried to "
                "join the running job; JAX's coordination service then ends every process of "
                "the job (start each process id once)"
            )
        if returncode > 0:
            return self.own_error
        if self.dead or self.coordinator_gone:
            missing = sorted(self.dead) if self.dead else None
            return lost_peers(me, missing, self.config.timeout_s)
        signame = signal_name(-returncode)
        if self.port_taken:
            why = f"the coordinator cannot listen on {self.config.bind_address}: the port is taken"
        elif self.status:
            why = f"JAX's distributed runtime ended this process ({signame}): {self.status}"
        else:
            why = f"the worker process died of {signame}"
        return f"process {me}: {why}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def supervise(argv: Sequence[str], config: DistributedConfig) -> int:
    """Run `jaxkv *argv` as a worker of this process and wait for it; relay its stderr and
    end it with the one error line (see the module docstring). The worker's exit status,
    or 1 when it died of a signal."""
    env = dict(os.environ, **{WORKER_ENV: str(os.getpid())})
    # The worker imports the jaxkv this process runs, wherever it was started from.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    worker = subprocess.Popen(
        [sys.executable, "-m", "jaxkv", *argv], env=env, stderr=subprocess.PIPE,
        text=True, errors="replace",
    )  # fmt: skip
    passed_on = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda s, _frame: worker.send_signal(s)) for s in passed_on}
    log = FaultLog(config)
    try:
        assert worker.stderr is not None
        for line in worker.stderr:
            if not log.read(line):
                sys.stderr.write(line)
                sys.stderr.flush()
        returncode = worker.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    message = log.verdict(returncode)
    if message is not None:
        print(_ERROR + message, file=sys.stderr, flush=True)
    return returncode if returncode >= 0 else 1
