"""Publishing KV events over ZeroMQ as vLLM does (host only, no JAX).

`ZmqEventPublisher` sends each step's events (`KVCacheManager.take_events()`) on a PUB
socket, one three-frame message per batch: the topic, the sequence number (8 bytes,
big-endian, counting from 0) and the payload (`jaxkv.kv_events_wire`). An optional
ROUTER socket replays the last `buffer_steps` messages: a request `[b"", start_seq]`
(8 bytes, big-endian) is answered with every buffered message whose sequence number is
at least `start_seq`, as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", (-1 as 8 signed bytes), b""]`.

Publishing never blocks the caller: `publish` puts the step's events on a bounded queue
and wakes the background thread, which builds (`DeferredKVCacheEvent`), converts,
encodes, numbers and sends them, in order. On a full queue the oldest batch is dropped
and counted in `num_dropped` (it never gets a sequence number, so subscribers see no gap
for it: the drop is the publisher's, reported by its count and a warning). The PUB socket
never blocks: it drops messages for a subscriber past the high-water mark. `flush` sends
what is queued from the calling thread; so does `publish(..., in_background=False)`,
unless the thread is sending.

Why a thread does the work: the engine publishes a step's events right after
dispatching the step and wakes the thread when the step is about to wait for the device,
which lets go of the GIL: the thread works while the step loop waits, and the loop's
share is a queue append and a wake-up. When the loop will not wait (the host is the
bottleneck), a woken thread would take the GIL in the middle of the loop's work, so the
engine sends from the loop itself (`in_background=False`) unless the thread is sending. The
wake-up is a lock released, not a byte written to a pipe: a system call lets go of the
GIL. Replay requests have a thread of their own, asleep in `zmq_poll` (no GIL) on the
ROUTER socket.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from jaxkv.kv_events import DeferredKVCacheEvent, KVCacheEvent
from jaxkv.kv_events_wire import KVEventBatch, encode_event_batch, to_wire_events

__all__ = [
    "END_SEQ",
    "EventPublisher",
    "EventPublisherFactory",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "check_endpoint",
    "offset_endpoint_port",
]

logger = logging.getLogger("jaxkv")

# One step's events; deferred ones are built by the thread that sends them.
Events = Sequence[KVCacheEvent | DeferredKVCacheEvent]
# The replay socket's end-of-replay sequence frame: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_NOBLOCK = zmq.NOBLOCK
_SNDMORE_NOBLOCK = zmq.SNDMORE | zmq.NOBLOCK


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields, plus `int_block_hashes` (vLLM's
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: hashes as 64-bit ints, else digest bytes).

    `endpoint` binds when it names a wildcard host (`*`, `::`) or an ipc/inproc address
    and connects otherwise; `replay_endpoint` always binds. Both are offset by the data
    parallel rank (`offset_endpoint_port`).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    int_block_hashes: bool = True

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(
                f"KVEventsConfig.publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"KVEventsConfig.{name} must be a positive int, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                # The address only: whether an ipc path is free is checked when binding.
                check_endpoint(value, f"KVEventsConfig.{name}", probe=False)
        if not isinstance(self.topic, str):
            raise TypeError(f"KVEventsConfig.topic must be a str, got {self.topic!r}")


MAX_PORT = 65535
# How long the probe of an ipc path waits for a listener to accept.
_PROBE_TIMEOUT = 1.0


def check_endpoint(endpoint: object, name: str, *, probe: bool = True) -> None:
    """ValueError naming `name` and `endpoint` unless it is an address the publisher can
    use: `transport://address`; for tcp `tcp://HOST:PORT` with PORT an integer in
    1..MAX_PORT (libzmq takes a larger port modulo 2**16 and 0 as "any free port", both
    silent surprises; HOST may be `*`). With `probe`, an `ipc://` path must not be taken:
    libzmq unlinks whatever is at the path before binding, so another process's live
    socket would be taken over silently and a regular file deleted. A socket file that
    refuses a connection (its owner is gone) is stale and may be reused. The probe is a
    check before the bind, not a lock: two processes starting at the same moment can
    both pass it."""
    if not (isinstance(endpoint, str) and "://" in endpoint):
        raise ValueError(
            f"{name} must be a ZeroMQ address such as 'tcp://*:5557' or "
            f"'ipc:///tmp/kv-events', got {endpoint!r}"
        )
    transport, _, address = endpoint.partition("://")
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
            got = f"port {port!r}" if sep and host else "no port"
            raise ValueError(
                f"{name} {endpoint!r}: give tcp://HOST:PORT with PORT an integer in "
                f"1..{MAX_PORT} (HOST may be *), got {got}"
            )
    elif transport == "ipc" and probe:
        _check_ipc_path_free(address, endpoint, name)


def _check_ipc_path_free(path: str, endpoint: str, name: str) -> None:
    """ValueError unless nothing is at `path` or only a stale socket file is."""
    if path in ("", "*") or path.startswith("@"):
        return  # libzmq picks the path, or an abstract name (its bind fails when taken)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # nothing there (or unreadable: the bind reports it)
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{name} {endpoint!r}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale: no process listens on it
        except (TimeoutError, BlockingIOError):
            pass  # a listener whose backlog is full: live
        except OSError:
            return  # cannot tell (e.g. the path is too long): the bind reports it
    raise ValueError(
        f"{name} {endpoint!r}: {path} is in use by a live socket (another engine's "
        "publisher?); give another path or stop that process"
    )


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """`endpoint` for data-parallel rank `data_parallel_rank` (vLLM's rule): a tcp port
    plus the rank (port 0 left for the OS to choose), an inproc name suffixed `_dp{rank}`;
    unchanged for rank 0. ValueError for another transport on a rank above 0."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        if int(port) == 0:
            return endpoint
        return f"{host}:{int(port) + data_parallel_rank}"
    raise ValueError(
        f"cannot offset {endpoint!r} for data parallel rank {data_parallel_rank}: "
        "use a tcp:// or inproc:// endpoint"
    )


def _is_bind_endpoint(endpoint: str) -> bool:
    """Wildcard hosts and ipc/inproc addresses bind; any other address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class _WakeUp:
    """A wake-up one thread waits for and others give without letting go of the GIL;
    wake-ups given while none is awaited merge into one."""

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()  # held while no wake-up is pending

    def give(self) -> None:
        try:
            self._pending.release()
        except RuntimeError:  # one is pending already
            pass

    def wait(self, timeout: float) -> None:
        """Return once a wake-up is given (taking it), or after `timeout` seconds."""
        self._pending.acquire(timeout=timeout)


class EventPublisher:
    """Sends each step's KV events; one per data-parallel rank, stamping its rank."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    def publish(self, events: Events, ts: float | None = None, in_background: bool = True) -> None:
        """Queue one step's events (`ts`: when, default now) for the background thread to
        send; never blocks. `in_background=False`: send what is queued from the calling
        thread instead, unless the background thread is sending (it then sends these)."""

    def flush(self, timeout: float = 1.0) -> bool:
        """Send what is queued from the calling thread; wait until every batch published
        so far is sent (True) or `timeout` seconds pass (False)."""
        return True

    def shutdown(self) -> None:
        """Send what is queued (within a second) and close the sockets."""


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events off)."""


class ZmqEventPublisher(EventPublisher):
    """The PUB socket (and optional replay ROUTER socket) of one data-parallel rank.

    Invariants: sequence numbers are consecutive from 0 over the messages sent; the
    replay buffer holds the last `buffer_steps` of them in order; `num_dropped` counts
    batches dropped from a full queue (never sent, never numbered); the queue holds at
    most `max_queue_size` batches; the PUB socket is used only under the send lock, the
    ROUTER socket only by the replay thread. A batch's events must not change once
    published: they are read when the thread sends them.
    """

    SHUTDOWN_TIMEOUT = 1.0
    # The background thread is woken by `publish`; it also drains the queue at least this
    # often, for a batch queued after a sender's last look at the queue.
    DRAIN_INTERVAL = 1.0

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        int_block_hashes: bool = True,
    ) -> None:
        super().__init__(data_parallel_rank)
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        # Before any socket opens; the rank's offset can push a port past MAX_PORT.
        where = f" of data parallel rank {data_parallel_rank}" if data_parallel_rank else ""
        check_endpoint(self.endpoint, f"KV events endpoint{where}")
        if self.replay_endpoint is not None:
            check_endpoint(self.replay_endpoint, f"KV events replay endpoint{where}")
        self.int_block_hashes = int_block_hashes
        self.max_queue_size = max_queue_size
        self.num_dropped = 0
        self.num_sent = 0
        self._topic = topic.encode()
        self._queue: deque[tuple[float, Events]] = deque()  # (ts, events)
        self._queue_lock = threading.Lock()  # the bounded append against the sender's pops
        self._send_lock = threading.Lock()  # the PUB socket, the sequence, the buffer
        self._stop = threading.Event()
        self._wake_up = _WakeUp()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            if _is_bind_endpoint(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                # Written at shutdown to end the replay thread's poll.
                self._stop_read, self._stop_write = os.pipe()
                self._replay = ctx.socket(zmq.ROUTER)
                # A full replay plus its end marker fits even when the peer reads slowly.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(
                f"KV events: cannot open {self.endpoint!r} / {self.replay_endpoint!r}: {error}"
            ) from None
        self._running = True
        self._threads = [threading.Thread(target=self._send_loop, daemon=True,
                                          name="kv-events-pub")]  # fmt: skip
        if self._replay is not None:
            self._threads.append(threading.Thread(target=self._replay_loop, daemon=True,
                                                  name="kv-events-replay"))  # fmt: skip
        for thread in self._threads:
            thread.start()

    def publish(self, events: Events, ts: float | None = None, in_background: bool = True) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        self._enqueue((time.time() if ts is None else ts, events))
        if in_background or not self.flush(0.0):  # flush(0.0) fails while the thread sends
            self._wake_up.give()

    def _enqueue(self, batch: tuple[float, Events]) -> None:
        with self._queue_lock:
            if len(self._queue) >= self.max_queue_size:
                self._queue.popleft()
                self.num_dropped += 1
                if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                    logger.warning(
                        "KV events: the publish queue is full (%d batches); dropped the "
                        "oldest (%d dropped so far)",
                        self.max_queue_size,
                        self.num_dropped,
                    )
            self._queue.append(batch)

    def cpu_time(self) -> float:
        """CPU seconds the background threads have used (those still running)."""
        seconds = 0.0
        for thread in self._threads:
            try:
                seconds += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, TypeError):  # ended
                pass
        return seconds

    def flush(self, timeout: float = 1.0) -> bool:
        # Taking the send lock also waits out a send in progress elsewhere (the queue can
        # be empty while the thread still sends the batch it took last).
        deadline = time.monotonic() + timeout
        while True:
            if not self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                self._send_queued()
            finally:
                self._send_lock.release()
            if not self._queue:
                return True
            if time.monotonic() >= deadline:
                return False

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._wake_up.wait(self.DRAIN_INTERVAL)
            if self._queue:
                with self._send_lock:
                    self._send_queued()

    def _replay_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        poller.register(self._stop_read, zmq.POLLIN)
        while self._stop_read not in dict(poller.poll()):
            self._serve_replay()

    def _encode(self, ts: float, events: Events) -> bytes | None:
        """One batch's payload (None: it cannot be encoded, and is skipped)."""
        try:
            wire = to_wire_events(events, self.int_block_hashes)
            return encode_event_batch(KVEventBatch(ts, wire, self.data_parallel_rank))
        except Exception:  # a bad event must not stop publishing; the step loop goes on
            logger.exception("KV events: could not encode a batch; it is skipped")
            return None

    def _send_queued(self) -> None:
        """Build, encode and send every queued batch, in order (the caller holds the send
        lock)."""
        queue, lock = self._queue, self._queue_lock
        while queue:
            with lock:
                if not queue:
                    return
                ts, events = queue.popleft()
            payload = self._encode(ts, events)
            if payload is not None:
                self._send(payload)

    def _send(self, payload: bytes) -> None:
        """Number and send `payload` (the caller holds the send lock); one that cannot be
        sent is skipped without a number. Three `send`s: a third of `send_multipart`'s
        time, which checks each frame in Python."""
        seq = self.num_sent
        send = self._pub.send
        try:  # a PUB socket never blocks (it drops at the high-water mark); NOBLOCK says so
            send(self._topic, _SNDMORE_NOBLOCK)
            send(seq.to_bytes(8, "big"), _SNDMORE_NOBLOCK)
            send(payload, _NOBLOCK)
        except zmq.ZMQError:
            logger.exception("KV events: could not send a batch; it is skipped")
            return
        self._buffer.append((seq, payload))
        self.num_sent = seq + 1

    def _serve_replay(self) -> None:
        """Answer every waiting replay request."""
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "KV events: ignored a replay request of %d frames; expected "
                    "[identity, b'', start sequence (8 bytes)]",
                    len(frames),
                )
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._stop.set()
        self._wake_up.give()
        if self._replay is not None:
            os.write(self._stop_write, b"\0")
        for thread in self._threads:
            thread.join(self.SHUTDOWN_TIMEOUT)
        if any(thread.is_alive() for thread in self._threads):
            logger.warning(
                "KV events: the publisher threads did not finish within %.1f s",
                self.SHUTDOWN_TIMEOUT,
            )
        elif not self.flush(self.SHUTDOWN_TIMEOUT):
            logger.warning(
                "KV events: %d batches were not sent within %.1f s of shutdown",
                len(self._queue),
                self.SHUTDOWN_TIMEOUT,
            )
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._replay is not None:
            os.close(self._stop_read)
            os.close(self._stop_write)


class EventPublisherFactory:
    """Makes the publisher a `KVEventsConfig` asks for."""

    @staticmethod
    def create(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        """`NullEventPublisher` unless events are enabled with the zmq publisher."""
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        return ZmqEventPublisher(
            data_parallel_rank,
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
            int_block_hashes=config.int_block_hashes,
        )
