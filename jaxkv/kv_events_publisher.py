"""Publishing KV events over ZeroMQ as vLLM does (host only, no JAX).

`ZmqEventPublisher` sends each step's events (`KVCacheManager.take_events()`) on a PUB
socket, one three-frame message per batch: the topic, the sequence number (8 bytes,
big-endian, counting from 0) and the payload (`jaxkv.kv_events_wire`). An optional
ROUTER socket replays the last `buffer_steps` messages: a request `[b"", start_seq]`
(8 bytes, big-endian) is answered with every buffered message whose sequence number is
at least `start_seq`, as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", (-1 as 8 signed bytes), b""]`, a few messages at a time and at most
`replay_hwm` queued per client (`jaxkv.kv_events_replay`).

Memory is bounded: at most `max_queue_size` batches wait for the thread, `buffer_steps`
messages are kept for replay, `hwm` messages wait for each subscriber and `replay_hwm`
for each replay client.

Publishing never blocks the caller: `publish` puts the step's events on a bounded queue
and does nothing else. One thread, the publishing thread, owns the sockets (it opens,
uses and closes them: a libzmq socket must only be used by the thread that owns it, so
`shutdown` stops the thread and the thread closes them): it takes each batch off the
queue, builds (`DeferredKVCacheEvent`), converts, encodes,
numbers and sends it, in order, and between batches answers replay requests. On a full
queue the oldest batch is dropped and counted in `num_dropped` (it never gets a sequence
number, so subscribers see no gap for it: the drop is the publisher's, reported by its
count and a warning). The PUB socket never blocks: it drops messages for a subscriber
past the high-water mark. `flush` waits for the publishing thread to send what is queued.

This is vLLM's `ZmqEventPublisher` design: the step loop's share is one `queue.put`; the
queue's own mutex is the only lock, and the sequence numbers, the replay buffer and both
sockets belong to the publishing thread alone.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from jaxkv.kv_events import DeferredKVCacheEvent, KVCacheEvent
from jaxkv.kv_events_replay import END_SEQ, ReplayServer
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
_NOBLOCK = zmq.NOBLOCK
_SNDMORE_NOBLOCK = zmq.SNDMORE | zmq.NOBLOCK


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields, plus `int_block_hashes` (vLLM's
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: hashes as 64-bit ints, else digest bytes).

    `endpoint` binds when it names a wildcard host (`*`, `::`) or an ipc/inproc address
    and connects otherwise; `replay_endpoint` always binds. Both are offset by the data
    parallel rank (`offset_endpoint_port`). The bounds (each a positive int): `hwm`
    messages queued per subscriber, `buffer_steps` kept for replay, `max_queue_size`
    batches waiting to be sent, and (jaxkv's) `replay_hwm` queued per replay client.
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
    redact_prompts: bool = False  # jaxkv's: `to_wire_events`'s redact_prompts
    replay_hwm: int = 1_000

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(
                f"KVEventsConfig.publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size", "replay_hwm"):
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


# Put on the queue by `shutdown`: the publishing thread ends when it takes it.
_STOP = object()


class _BatchQueue(queue.Queue):
    """The publish queue: FIFO, at most `limit` batches; a batch put on a full queue drops
    the oldest one, counted in `num_dropped` and marked done (so `join`-style waits for
    the queue do not wait for it). `_STOP` is never dropped and is not counted. Every
    `_put` runs under the queue's one mutex, which is all the locking the bound needs."""

    def __init__(self, limit: int) -> None:
        super().__init__()  # unbounded for `queue.Queue`: `_put` keeps the bound
        self.limit = limit
        self.num_dropped = 0

    def _put(self, item) -> None:
        if item is not _STOP and len(self.queue) >= self.limit:
            self.queue.popleft()
            self.num_dropped += 1
            self.unfinished_tasks -= 1  # `put` counts the new one after this
        self.queue.append(item)


class EventPublisher:
    """Sends each step's KV events; one per data-parallel rank, stamping its rank."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    def publish(self, events: Events, ts: float | None = None) -> None:
        """Queue one step's events (`ts`: when, default now) for the publishing thread to
        send; never blocks, never encodes or sends on the calling thread."""

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every batch published so far is sent, skipped or dropped (True) or
        `timeout` seconds pass (False)."""
        return True

    def shutdown(self) -> None:
        """Send what is queued (within a second) and close the sockets."""


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events off)."""


class ZmqEventPublisher(EventPublisher):
    """The PUB socket (and optional replay ROUTER socket) of one data-parallel rank.

    Invariants: only the publishing thread ("kv-events-pub") touches the sockets, the
    sequence and the replay buffer: it opens the sockets (the constructor waits for
    that, raising ValueError when they cannot be opened), uses them and closes them when
    it ends; sequence numbers are consecutive from 0 over the messages sent; the replay
    buffer holds the last `buffer_steps` of them in order; `num_dropped` counts batches
    dropped from a full queue (never sent, never numbered); the queue holds at most
    `max_queue_size` batches. A batch's events must not change once published: the
    publishing thread reads them when it sends them. Once `shutdown` returns, the thread
    has ended and closed both sockets.
    """

    # How long `shutdown` lets the thread send what is queued before it drops the rest.
    SHUTDOWN_TIMEOUT = 1.0
    # With a replay socket, how long the idle publishing thread waits on the queue before
    # looking for replay requests again (vLLM's 0.1 s): the longest a replay waits.
    REPLAY_POLL_INTERVAL = 0.1

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
        redact_prompts: bool = False,
        replay_hwm: int = 1_000,
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
        self.redact_prompts = redact_prompts
        self.max_queue_size = max_queue_size
        self.num_sent = 0
        self._topic = topic.encode()
        self._hwm, self._replay_hwm = hwm, replay_hwm
        self._queue = _BatchQueue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self.replays: ReplayServer | None = None
        self._abandon = threading.Event()  # set by `shutdown`: drop what is still queued
        self._open_error: zmq.ZMQError | None = None
        opened = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(opened,), daemon=True, name="kv-events-pub"
        )
        self._thread.start()
        opened.wait()
        if self._open_error is not None:
            self._thread.join()
            raise ValueError(
                f"KV events: cannot open {self.endpoint!r} / {self.replay_endpoint!r}: "
                f"{self._open_error}"
            ) from None
        self._running = True

    @property
    def num_dropped(self) -> int:
        """Batches dropped from a full queue so far."""
        return self._queue.num_dropped

    def publish(self, events: Events, ts: float | None = None) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        dropped = self._queue.num_dropped
        self._queue.put((time.time() if ts is None else ts, events))
        if self._queue.num_dropped != dropped:
            self._warn_dropped()

    def _warn_dropped(self) -> None:
        n = self._queue.num_dropped
        if n == 1 or n % 1000 == 0:
            logger.warning(
                "KV events: the publish queue is full (%d batches); dropped the oldest "
                "(%d dropped so far)",
                self.max_queue_size,
                n,
            )

    def cpu_time(self) -> float:
        """CPU seconds the publishing thread has used (0 once it has ended)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (OSError, TypeError):  # ended
            return 0.0

    def flush(self, timeout: float = 1.0) -> bool:
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    # -- the publishing thread ----------------------------------------------------------

    def _run(self, opened: threading.Event) -> None:
        """The publishing thread: open the sockets, send and serve replays until `_STOP`,
        close the sockets."""
        try:
            self._open_sockets()
        except zmq.ZMQError as error:
            self._open_error = error
            self._close_sockets()
            return
        finally:
            opened.set()
        try:
            self._serve()
        finally:
            self._close_sockets()

    def _open_sockets(self) -> None:
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        if _is_bind_endpoint(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, self._replay_hwm)
            # A client's full queue is reported (zmq.Again), not silently dropped from.
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._replay.bind(self.replay_endpoint)
            self.replays = ReplayServer(self._replay, self._topic, self._buffer)

    def _serve(self) -> None:
        """Send each queued batch in order; between batches (and every
        `REPLAY_POLL_INTERVAL` when idle, `ReplayServer.ROUND_S` while replays are in
        progress) answer replay requests. Ends at `_STOP`; once `shutdown` gives up
        waiting, the batches still queued are dropped."""
        get, done, replays = self._queue.get, self._queue.task_done, self.replays
        while True:
            timeout = None
            if replays is not None:
                due = replays.serve(self.num_sent, time.monotonic())
                timeout = self.REPLAY_POLL_INTERVAL if due is None else due
            try:
                batch = get(timeout=timeout)
            except queue.Empty:
                continue
            try:
                if batch is _STOP:
                    return
                if not self._abandon.is_set():
                    self._send_batch(batch)
            finally:
                done()

    def _send_batch(self, batch: tuple[float, Events]) -> None:
        """Build, encode, number and send one batch (one that cannot be encoded is
        skipped)."""
        payload = self._encode(*batch)
        if payload is not None:
            self._send(payload)

    def _encode(self, ts: float, events: Events) -> bytes | None:
        """One batch's payload (None: it cannot be encoded, and is skipped)."""
        try:
            wire = to_wire_events(events, self.int_block_hashes, self.redact_prompts)
            return encode_event_batch(KVEventBatch(ts, wire, self.data_parallel_rank))
        except Exception:  # a bad event must not stop publishing; the step loop goes on
            logger.exception("KV events: could not encode a batch; it is skipped")
            return None

    def _send(self, payload: bytes) -> None:
        """Number and send `payload`; one that cannot be sent is skipped without a number.
        Three `send`s: a third of `send_multipart`'s time, which checks each frame in
        Python."""
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

    def _close_sockets(self) -> None:
        """Close the sockets (on the publishing thread, which owns them)."""
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def shutdown(self) -> None:
        """Stop the publishing thread (it sends what is queued within `SHUTDOWN_TIMEOUT`,
        drops the rest, then closes its sockets) and wait for it; idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(_STOP)
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning(
                "KV events: %d batches were not sent within %.1f s of shutdown; dropped",
                self._queue.qsize() - 1,
                self.SHUTDOWN_TIMEOUT,
            )
            self._abandon.set()
            self._thread.join()  # each send is non-blocking: it ends promptly


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
            redact_prompts=config.redact_prompts,
            replay_hwm=config.replay_hwm,
        )
