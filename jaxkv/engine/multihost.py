"""One engine over several processes (JAX's multi-controller runtime, `jax.distributed`).

Every process runs the same engine over one global `(data, model)` mesh; each drives
only its own devices. Requests enter on process 0. **Replay**: at the start of every
step process 0 broadcasts what changed since the last one (the requests added, aborted,
the prefix caches reset: `RequestStream`), every process applies it in the same order,
and every process then runs the same deterministic schedulers, packs the same step
buffer and dispatches the same device step. The sampled tokens are replicated on every
device, so each process reads them from its own and updates identical host state; only
process 0 returns outputs to a caller.

Why replay rather than process 0 scheduling and broadcasting each step's packed buffer:
the buffer alone does not make a step (the runner also zeroes and copies blocks, keeps
row tables and the encoder store from the scheduler's output), so the other processes
would need a second, buffer-driven path through the runner and a broadcast of kilobytes
every step; replay needs one 4-byte broadcast on a step with no new requests (plus one of
the pickled requests when some arrive) and no second code path. The price: host
scheduling runs on every process (in parallel, so it adds no latency), and it must be
deterministic, which the schedulers and block pools are (no clock, no iteration over
sets of strings).

Faults: `initialize` bounds the join (`timeout_s`) and the heartbeat that declares a
process dead, and on process 0 checks the coordinator's port first; `Watchdog` polls the
coordinator's list of live processes and ends this process with an error naming the
dead ones (a collective waiting on a dead peer would otherwise never return).
`check_same_everywhere` refuses processes started with different settings, naming the
first difference. What JAX's runtime ends from C++ (abort: the coordinator gone, a
duplicate process id) Python cannot catch; the `jaxkv` command runs the engine in a
supervised worker that reports it (`jaxkv.engine.supervisor`).

Payloads are pickled: the processes of one job trust each other. Process 0's coordinator
listens on the coordinator address given (not JAX's default, every interface); the
collectives (gloo) and a non-loopback address still need a trusted network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import jax
import numpy as np

from jaxkv.engine.distributed_config import (
    DEFAULT_TIMEOUT_S,
    DistributedConfig,
    check_port_free,
    lost_peers,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedConfig",
    "DistributedError",
    "RequestStream",
    "Watchdog",
    "check_same_everywhere",
    "digest",
    "exit_now",
    "host_tokens",
    "initialize",
    "peers_alive",
]


class DistributedError(RuntimeError):
    """A process of the job is missing, dead or configured differently."""


_state: dict[str, Any] = {}  # "config", "watchdog", "exchanges": this process's runtime


def initialize(config: DistributedConfig) -> None:
    """Join the job: `jax.distributed.initialize` with gloo CPU collectives, the heartbeat
    bounded by `config.timeout_s`, process 0's coordinator listening on
    `config.bind_address` (JAX's default is every interface), then a `Watchdog`. Call
    before anything touches a device. ValueError on process 0 when it cannot listen there
    (the port taken: gRPC's failed bind would crash the process). When the processes do
    not all join within the timeout, this process ends (`exit_now`) with an error naming
    the coordinator: JAX's own join timeout (a few seconds later) would abort the process
    from C++."""
    if config.process_id == 0:
        check_port_free(config.bind_address)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(1, round(config.timeout_s))
    late = DistributedError(
        f"process {config.process_id}: the {config.num_processes} processes did not all join "
        f"the coordinator at {config.coordinator_address} within {timeout} s "
        "(--distributed-timeout): one was not started, has other --num-processes or died, "
        f"or --process-id {config.process_id} was already in a running job (a duplicate, "
        "which ends that job)"
    )
    timer = threading.Timer(timeout, exit_now, (late,))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=timeout + 10,
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=timeout,
            coordinator_bind_address=config.bind_address,
        )
    finally:
        timer.cancel()
    _state.update(config=config, exchanges=0)
    _state["watchdog"] = Watchdog(config.num_processes, config.timeout_s)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or "config" not in _state:
        raise DistributedError(
            "several processes need jaxkv.engine.multihost.initialize (not a bare "
            "jax.distributed.initialize): it bounds the timeouts and starts the watchdog"
        )
    return client


def digest(data: bytes | str) -> str:
    """A short content digest (SHA-256, 16 hex digits)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def check_same_everywhere(settings: Mapping[str, str], what: str = "settings") -> None:
    """DistributedError on every process unless all processes give equal `settings`
    (name -> short text or digest, compared in order), naming the first difference and
    the processes. Exchanged through the coordinator's key-value store, bounded by the
    timeout; a no-op in one process."""
    if jax.process_count() == 1:
        return
    client = _client()
    config = _state["config"]
    n = _state["exchanges"] = _state["exchanges"] + 1
    mine = json.dumps(list(settings.items()))
    client.key_value_set(f"jaxkv/check/{n}/{jax.process_index()}", mine)
    timeout_ms = int(config.timeout_s * 1000)
    base = dict(settings)
    for pid in range(jax.process_count()):
        try:
            theirs = client.blocking_key_value_get(f"jaxkv/check/{n}/{pid}", timeout_ms)
        except Exception:
            raise DistributedError(
                f"process {pid} did not report its {what} within {config.timeout_s:g} s "
                "(--distributed-timeout): it died or was started with other flags"
            ) from None
        other = dict(json.loads(theirs))
        for name in [*base, *(k for k in other if k not in base)]:
            if base.get(name) != other.get(name):
                _leave_coordinator_last(client, n)
                raise DistributedError(
                    f"the processes were started with different {what}: {name} is "
                    f"{base.get(name)!r} on process {jax.process_index()} but "
                    f"{other.get(name)!r} on process {pid}; start every process with the same "
                    "flags, checkpoint and jaxkv version"
                )


# How long the coordinator's process outlives the word of the others that they are leaving:
# their exit follows it at once; the margin is for a loaded machine.
_LEAVING_MARGIN_S = 1.0


def _leave_coordinator_last(client, exchange: int) -> None:
    """Before every process refuses to go on: the coordination service lives in process
    0, and a process that loses it before it exits aborts (status -6, not its error). So
    the others say they are leaving and process 0 waits for their word (a few seconds at
    most) and a margin."""
    pid = jax.process_index()
    if pid:
        client.key_value_set(f"jaxkv/leaving/{exchange}/{pid}", "")
        return
    for other in range(1, jax.process_count()):
        with contextlib.suppress(Exception):
            client.blocking_key_value_get(f"jaxkv/leaving/{exchange}/{other}", 5000)
    time.sleep(_LEAVING_MARGIN_S)


def _missing(num_processes: int) -> list[int] | None:
    """The processes the coordinator does not list as alive (None: it did not answer)."""
    try:
        live = _client().get_live_nodes(list(range(num_processes)))
    except Exception:
        return None
    return [pid for pid in range(num_processes) if pid not in live]


def _lost(missing: list[int] | None, timeout_s: float) -> DistributedError:
    return DistributedError(lost_peers(jax.process_index(), missing, timeout_s))


def exit_now(error: BaseException) -> NoReturn:
    """Print `jaxkv: error: ...` and end this process with status 1 at once: with a peer
    gone, JAX's orderly shutdown would wait for it (then abort)."""
    print(f"jaxkv: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


@contextlib.contextmanager
def peers_alive(stream: RequestStream) -> Iterator[None]:
    """Around the engine's collectives: a runtime error there (a peer's connection closed)
    becomes a DistributedError naming the dead process, once the coordinator names it
    (waiting at most the timeout for its heartbeat to lapse). Any error marks `stream`
    lost: its `stop` then sends nothing."""
    try:
        yield
    except BaseException as error:
        stream.lost = True
        if not isinstance(error, jax.errors.JaxRuntimeError):
            raise
        config = _state["config"]  # set: the engine checked its settings through it
        deadline = time.monotonic() + config.timeout_s + 1
        missing = _missing(config.num_processes)
        while missing == [] and time.monotonic() < deadline:
            time.sleep(0.1)
            missing = _missing(config.num_processes)
        if missing == []:
            raise
        raise _lost(missing, config.timeout_s) from error


class Watchdog:
    """A daemon thread that asks the coordinator every `timeout_s / 10` seconds which
    processes are alive; when one is not (dead for longer than the heartbeat timeout, or
    the coordinator itself gone that long), it ends this process (`exit_now`) with an error
    naming it, instead of leaving it blocked in a collective forever."""

    def __init__(self, num_processes: int, timeout_s: float) -> None:
        self.num_processes, self.timeout_s = num_processes, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        silent_since = None
        while not self._stop.wait(max(self.timeout_s / 10, 0.1)):
            missing = _missing(self.num_processes)
            if missing == []:
                silent_since = None
                continue
            if missing is None:  # the coordinator (process 0) did not answer
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since < self.timeout_s:
                    continue
            if not self._stop.is_set():
                exit_now(_lost(missing, self.timeout_s))

    def stop(self) -> None:
        self._stop.set()


def shutdown() -> None:
    """Stop the watchdog and leave the job (every process must call it)."""
    watchdog = _state.pop("watchdog", None)
    if watchdog is not None:
        watchdog.stop()
    jax.distributed.shutdown()


def host_tokens(sampled: jax.Array) -> np.ndarray:
    """The step's sampled tokens on this host (they are replicated on every device)."""
    if sampled.is_fully_addressable or sampled.is_fully_replicated:
        return np.asarray(sampled)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(sampled, tiled=True))


Op = tuple  # ("add", kwargs) | ("abort", request_id) | ("reset_prefix_cache",)
_STOP = -1


class RequestStream:
    """What process 0 tells the others at each step: the engine calls changing requests
    since the last step, in order. `record` (process 0) queues one; `exchange` (every
    process, once a step, in the same order everywhere) returns the calls to replay (none
    on process 0, which made them already), or None once process 0 called `stop`.

    Wire: a 1-element int32 broadcast (the payload's length; -1: stop), then, when
    positive, the pickled calls padded to a power of two (so few programs compile), both
    with `multihost_utils.broadcast_one_to_all`."""

    def __init__(self) -> None:
        self.is_source = jax.process_index() == 0
        self._pending: list[Op] = []
        self.replaying = False
        self.lost = False  # a step failed part-way: the processes are out of step
        self.stopped = False  # process 0 called `stop`: no step follows
        self.num_bytes = 0  # payload bytes exchanged so far
        self.seconds = 0.0  # time spent in `exchange` so far

    def record(self, op: Op) -> None:
        if self.is_source and not self.replaying:
            self._pending.append(op)

    def check_source(self, call: str) -> None:
        """RuntimeError unless `call` happens on process 0 (or replays its call) while
        the engine runs."""
        self._check_running(call)
        if not (self.is_source or self.replaying):
            raise RuntimeError(
                f"{call} on process {jax.process_index()}: requests enter on process 0 only; "
                "the other processes call LLMEngine.follow()"
            )

    def _check_running(self, call: str) -> None:
        if self.stopped:
            raise RuntimeError(
                f"{call} on process {jax.process_index()}: process 0 shut the engine down "
                "(its follow() returned); this engine serves no more steps"
            )

    def exchange(self) -> list[Op] | None:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        self._check_running("step")
        start = time.perf_counter()
        try:
            return self._exchange(broadcast_one_to_all)
        finally:
            self.seconds += time.perf_counter() - start

    def _exchange(self, broadcast_one_to_all) -> list[Op] | None:
        payload = pickle.dumps(self._pending) if self._pending else b""
        self._pending = []
        length = np.array([len(payload)], np.int32)
        (length,) = broadcast_one_to_all((length,))
        n = int(length[0])
        if n == _STOP:
            self.stopped = True
            return None
        if n == 0:
            return []
        size = max(256, 1 << (n - 1).bit_length())
        buf = np.zeros(size, np.uint8)
        if self.is_source:
            buf[:n] = np.frombuffer(payload, np.uint8)
        (buf,) = broadcast_one_to_all((buf,))
        self.num_bytes += n
        if self.is_source:
            return []
        return pickle.loads(np.asarray(buf[:n]).tobytes())

    def stop(self) -> None:
        """Process 0: release the others from `LLMEngine.follow()` (once, at shutdown;
        nothing once `lost`)."""
        from jax.experimental.multihost_utils import broadcast_one_to_all

        if self.lost:
            return
        broadcast_one_to_all((np.array([_STOP], np.int32),))

    def replay(self, ops: list[Op], apply: Callable[[Op], None]) -> None:
        self.replaying = True
        try:
            for op in ops:
                apply(op)
        finally:
            self.replaying = False
