"""Publishing KV events over ZeroMQ as vLLM does (host only, no JAX).

`ZmqEventPublisher` sends each step's events (`KVCacheManager.take_events()`) on a PUB
socket, one three-frame message per batch: the topic, the sequence number (8 bytes,
big-endian, counting from 0) and the payload (`jaxkv.kv_events_wire`). An optional
ROUTER socket replays the last `buffer_steps` messages: a request `[b"", start_seq]`
(8 bytes, big-endian) is answered with every buffered message whose sequence number is
at least `start_seq`, as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", (-1 as 8 signed bytes), b""]`.

Publishing never blocks the caller. `publish` converts and encodes the step's events at
once (about a microsecond per event) and puts the payload on a bounded queue; on a full
queue the oldest payload is dropped and counted in `num_dropped` (it never gets a
sequence number, so subscribers see no gap for it: the drop is the publisher's, reported
by its count and a warning). Whoever holds the send lock numbers and sends what is
queued, in order: `publish` itself when the lock is free (the usual case: the step's
message goes out before `publish` returns), else a background thread, woken to send what
the holder may have left (and at least every `DRAIN_INTERVAL`, 1 s); the same thread
answers replay requests as they come. The PUB socket never blocks: it drops messages
for a subscriber past the high-water mark.

Why the step loop sends (`benchmarks/bench_kv_events.py`, a 2-core machine): each frame
sent lets go of the GIL, and a background thread getting it back while the step loop
runs Python costs both threads far more than the send itself, three times a message;
the step loop gets it back at once (no other thread wants it). For the same reason the
thread sleeps in `zmq_poll` (no GIL), woken only by a replay request, a payload left
queued, or `shutdown`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from jaxkv.kv_events import KVCacheEvent
from jaxkv.kv_events_wire import KVEventBatch, encode_event_batch, to_wire_events

__all__ = [
    "END_SEQ",
    "EventPublisher",
    "EventPublisherFactory",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "offset_endpoint_port",
]

logger = logging.getLogger("jaxkv")

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
            if value is not None and not (isinstance(value, str) and "://" in value):
                raise ValueError(
                    f"KVEventsConfig.{name} must be a ZeroMQ address such as "
                    f"'tcp://*:5557' or 'ipc:///tmp/kv-events', got {value!r}"
                )
        if not isinstance(self.topic, str):
            raise TypeError(f"KVEventsConfig.topic must be a str, got {self.topic!r}")


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


class EventPublisher:
    """Sends each step's KV events; one per data-parallel rank, stamping its rank."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> None:
        """Queue one step's events (`ts`: when, default now); never blocks."""

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every batch published so far is sent (True) or `timeout` seconds
        pass (False)."""
        return True

    def shutdown(self) -> None:
        """Send what is queued (within a second) and close the sockets."""


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events off)."""


class ZmqEventPublisher(EventPublisher):
    """The PUB socket (and optional replay ROUTER socket) of one data-parallel rank.

    Invariants: sequence numbers are consecutive from 0 over the messages sent; the
    replay buffer holds the last `buffer_steps` of them in order; `num_dropped` counts
    payloads dropped from a full queue (never sent, never numbered); the PUB socket is
    used only under the send lock, the ROUTER socket only by the background thread.
    """

    SHUTDOWN_TIMEOUT = 1.0
    # The background thread is woken when `publish` leaves a payload queued (it found the
    # send lock taken); it also drains the queue at least this often, in case a payload
    # was queued after the holder's last look and the wake-up came first.
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
        self.int_block_hashes = int_block_hashes
        self.max_queue_size = max_queue_size
        self.num_dropped = 0
        self.num_sent = 0
        self._topic = topic.encode()
        self._queue: deque[bytes] = deque()  # encoded payloads not yet sent
        self._queue_lock = threading.Lock()  # the bounded append against the sender's pops
        self._send_lock = threading.Lock()  # the PUB socket, the sequence, the buffer
        self._stop = threading.Event()
        # Written (a byte, never blocking) to wake the background thread from its poll.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
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
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-pub")
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        payload = self._encode(time.time() if ts is None else ts, events)
        if payload is None:
            return
        if self._send_lock.acquire(blocking=False):
            try:
                if self._queue:  # left by an earlier holder: those go first
                    self._enqueue(payload)
                    self._send_queued()
                else:
                    self._send(payload)
            finally:
                self._send_lock.release()
        else:  # the holder may be past its last look at the queue: the thread sends it
            self._enqueue(payload)
            self._wake()

    def _enqueue(self, payload: bytes) -> None:
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
            self._queue.append(payload)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def cpu_time(self) -> float:
        """CPU seconds the background thread has used (0.0 once it has ended)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (OSError, TypeError):
            return 0.0

    def flush(self, timeout: float = 1.0) -> bool:
        # Taking the send lock also waits out a send in progress elsewhere (the queue can
        # be empty while the thread still sends the payload it took last).
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

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        timeout_ms = int(1000 * self.DRAIN_INTERVAL)
        while not self._stop.is_set():
            ready = dict(poller.poll(timeout_ms))
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()
            if self._queue:  # `publish` found the lock taken and left these
                with self._send_lock:
                    self._send_queued()

    def _encode(self, ts: float, events: Sequence[KVCacheEvent]) -> bytes | None:
        """One batch's payload (None: it cannot be encoded, and is skipped)."""
        try:
            wire = to_wire_events(events, self.int_block_hashes)
            return encode_event_batch(KVEventBatch(ts, wire, self.data_parallel_rank))
        except Exception:  # a bad event must not stop publishing; the step loop goes on
            logger.exception("KV events: could not encode a batch; it is skipped")
            return None

    def _send_queued(self) -> None:
        """Send every queued payload, in order (the caller holds the send lock)."""
        queue, lock = self._queue, self._queue_lock
        while queue:
            with lock:
                if not queue:
                    return
                payload = queue.popleft()
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
        self._wake()
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning(
                "KV events: the publisher thread did not finish within %.1f s",
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
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)


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
