"""Where the processes of one job meet: `DistributedConfig` and the checks JAX's
coordination service does not make itself.

Without JAX: the `jaxkv` command resolves and checks these settings (and the
coordinator's port) before it starts a worker that imports JAX. What the checks
prevent: gRPC takes a port above 65535 or 0 without complaint and the processes then
never meet; a coordinator port another process listens on makes the coordinator's
process crash (SIGSEGV after "Failed to add port"); a timeout too large for JAX's C++
int (or inf, nan) ends in a TypeError or OverflowError.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_PORT",
    "MAX_TIMEOUT_S",
    "DistributedConfig",
    "check_port_free",
    "lost_peers",
    "split_address",
]

DEFAULT_TIMEOUT_S = 20.0
MAX_TIMEOUT_S = 86400.0  # one day: JAX takes whole seconds as a C++ int
MAX_PORT = 65535
_ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}
# JAX's own override of where process 0's coordinator listens.
BIND_ADDRESS_ENV = "JAX_COORDINATOR_BIND_ADDRESS"


def split_address(address: str, flag: str = "--coordinator-address") -> tuple[str, int]:
    """`(host, port)` of `HOST:PORT` (an IPv6 host in brackets, which are removed).
    ValueError naming `flag` unless HOST is given and PORT is an integer in 1..65535."""
    host, sep, port = address.rpartition(":")
    if not (sep and host):
        raise ValueError(f"{flag} {address!r} must be HOST:PORT")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
        raise ValueError(
            f"{flag} {address!r}: PORT must be an integer in 1..{MAX_PORT}, got {port!r}"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def check_port_free(address: str, flag: str = "--coordinator-address") -> None:
    """ValueError naming `flag` unless this machine can listen on `address` (`HOST:PORT`)
    now: the port is not taken by a listener and HOST is one of this machine's addresses
    (`::` / `0.0.0.0`: all of them). Binds with SO_REUSEADDR, as gRPC does, so a port
    left in TIME_WAIT counts as free. A check, not a reservation: a process that takes
    the port between it and JAX's bind still wins."""
    host, port = split_address(address, flag)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise ValueError(f"{flag} {address!r}: cannot resolve {host!r} ({error})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(where)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"{flag} {address!r}: port {port} is taken on {host} (another process "
                    "listens on it: another job's coordinator?); give a free port"
                ) from None
            if error.errno == errno.EADDRNOTAVAIL:
                raise ValueError(
                    f"{flag} {address!r}: {host} is not an address of this machine; process "
                    "0 serves the coordinator, so run it on that host"
                ) from None
            raise ValueError(f"{flag} {address!r}: cannot listen on it ({error})") from None


def lost_peers(process_id: int, missing: list[int] | None, timeout_s: float) -> str:
    """The error of process `process_id` that lost the processes `missing` (None: the
    coordinator, process 0, stopped answering) for `timeout_s` seconds."""
    why = (
        "the coordinator (process 0) stopped answering"
        if missing is None
        else f"process {', '.join(map(str, missing))} stopped (no heartbeat)"
    )
    return (
        f"process {process_id}: {why} within {timeout_s:g} s (--distributed-timeout); "
        "the engine cannot go on without every process"
    )


def _timeout(value: object) -> float:
    """`--distributed-timeout` as seconds in (0, MAX_TIMEOUT_S], else ValueError."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(
            f"--distributed-timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
            f"got {value!r}"
        )
    return seconds


@dataclass(frozen=True)
class DistributedConfig:
    """Where the processes of one job meet. Invariant (through `resolve`):
    `0 <= process_id < num_processes`, `coordinator_address` is `HOST:PORT` with PORT in
    1..65535 (process 0 serves it), `0 < timeout_s <= MAX_TIMEOUT_S` bounds the join,
    each exchange of settings and the silence of a dead process."""

    coordinator_address: str
    num_processes: int
    process_id: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def bind_address(self) -> str:
        """Where process 0's coordinator listens: `$JAX_COORDINATOR_BIND_ADDRESS` if set,
        else the coordinator address itself (JAX's default would be every interface,
        `[::]:PORT`)."""
        return os.environ.get(BIND_ADDRESS_ENV) or self.coordinator_address

    @classmethod
    def resolve(
        cls,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        environ: Mapping[str, str] | None = None,
    ) -> DistributedConfig | None:
        """The settings given, else from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
        `JAX_PROCESS_ID`; None when neither names a coordinator (one process). ValueError
        naming the setting when one is missing or out of range."""
        env = os.environ if environ is None else environ
        given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                 "process_id": process_id}  # fmt: skip
        for name, var in _ENV.items():
            if given[name] is None and env.get(var):
                given[name] = env[var]
        if given["coordinator_address"] is None:
            if given["num_processes"] is not None or given["process_id"] is not None:
                raise ValueError(
                    "--num-processes and --process-id need --coordinator-address HOST:PORT "
                    "(or JAX_COORDINATOR_ADDRESS)"
                )
            return None
        address = str(given["coordinator_address"])
        split_address(address)
        ints = {}
        for name in ("num_processes", "process_id"):
            flag, value = "--" + name.replace("_", "-"), given[name]
            if value is None:
                raise ValueError(f"{flag} is required with --coordinator-address (or {_ENV[name]})")
            try:
                ints[name] = int(value)
            except ValueError:
                raise ValueError(f"{flag} must be an integer, got {value!r}") from None
        if ints["num_processes"] < 1:
            raise ValueError(f"--num-processes must be >= 1, got {ints['num_processes']}")
        if not 0 <= ints["process_id"] < ints["num_processes"]:
            raise ValueError(
                f"--process-id must be in [0, {ints['num_processes']}), got {ints['process_id']}"
            )
        seconds = _timeout(timeout_s)
        return cls(address, ints["num_processes"], ints["process_id"], seconds)
