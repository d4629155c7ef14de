"""What KV event publishing may hold in memory and how it shuts down (issue 38): each
subscriber's queue, the replay buffer and each replay client's queue stay within their
bounds whoever reads; replays are paced; `shutdown` stops the publishing thread, which
closes its own sockets, even under a flood of replay requests."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import zmq

from jaxkv.kv_events import BlockStored
from jaxkv.kv_events_publisher import END_SEQ, ZmqEventPublisher
from jaxkv.kv_events_replay import ReplayServer

WAIT_S = 5.0
_names = itertools.count()


def stored(i: int) -> list[BlockStored]:
    return [BlockStored([i.to_bytes(32, "big")], None, [i % 512] * 4, 4, None)]


def inproc() -> str:
    """A fresh in-process endpoint: no kernel buffers, so a peer's queue is exactly the
    sender's high-water mark plus the receiver's."""
    return f"inproc://kv-bounds-{next(_names)}"


def socket(kind: int, endpoint: str, **options: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def drain(sock: zmq.Socket, timeout_ms: int = 200) -> list[list[bytes]]:
    got = []
    while sock.poll(timeout_ms):
        got.append(sock.recv_multipart())
    return got


def answer(sock: zmq.Socket) -> list[list[bytes]]:
    """A replay's messages, up to and with its end marker."""
    got: list[list[bytes]] = []
    while not got or got[-1][2] != END_SEQ:
        assert sock.poll(int(WAIT_S * 1000)), f"no end marker after {len(got)} messages"
        got.append(sock.recv_multipart())
    return got


def request(sock: zmq.Socket, start: int) -> None:
    sock.send_multipart((b"", start.to_bytes(8, "big")))


def test_subscribers_that_never_read_hold_at_most_the_high_water_mark():
    """4 subscribers read nothing while 3000 batches go out: the PUB socket never blocks,
    each subscriber is queued at most `hwm` (+ its own receive mark) messages, and the
    replay buffer keeps `buffer_steps`."""
    pub = ZmqEventPublisher(0, inproc(), buffer_steps=50, hwm=20)
    subs = [socket(zmq.SUB, pub.endpoint, RCVHWM=10) for _ in range(4)]
    for sub in subs:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.2)  # the subscriptions reach the publisher
        for i in range(3000):
            pub.publish(stored(i))
        assert pub.flush(WAIT_S) and pub.num_sent == 3000 and pub.num_dropped == 0
        assert len(pub._buffer) == 50 and pub._buffer[0][0] == 2950
        for sub in subs:
            got = drain(sub)
            assert 10 <= len(got) <= 20 + 10, len(got)
            assert [int.from_bytes(f[1], "big") for f in got] == list(range(len(got)))
    finally:
        pub.shutdown()
        for sub in subs:
            sub.close()


def test_a_replay_longer_than_the_client_queue_is_answered_in_full():
    """A reading client gets every message it asked for, and the end marker, though only
    `replay_hwm` may wait for it at once."""
    pub = ZmqEventPublisher(0, inproc(), inproc(), buffer_steps=200, replay_hwm=5)
    client = socket(zmq.DEALER, pub.replay_endpoint, RCVHWM=5)
    try:
        for i in range(150):
            pub.publish(stored(i))
        assert pub.flush(WAIT_S)
        request(client, 20)
        got = answer(client)
        assert [int.from_bytes(f[2], "big", signed=True) for f in got[:-1]] == list(range(20, 150))
        assert got[-1][2] == END_SEQ and len(got) == 131
    finally:
        pub.shutdown()
        client.close()


def test_a_replay_client_that_never_reads_is_dropped_holding_at_most_its_queue(monkeypatch):
    """While one client reads nothing, another's replay and the publishing go on; the
    silent one is sent at most `replay_hwm` (+ its receive mark), then dropped."""
    monkeypatch.setattr(ReplayServer, "STALL_S", 0.05)
    pub = ZmqEventPublisher(0, inproc(), inproc(), buffer_steps=500, replay_hwm=8)
    silent = socket(zmq.DEALER, pub.replay_endpoint, RCVHWM=4)
    reader = socket(zmq.DEALER, pub.replay_endpoint, RCVHWM=4)
    try:
        for i in range(400):
            pub.publish(stored(i))
        assert pub.flush(WAIT_S)
        request(silent, 0)
        request(reader, 0)
        got = answer(reader)
        assert len(got) == 401 and got[-1][2] == END_SEQ
        deadline = time.monotonic() + WAIT_S
        # Read from this thread while the publishing thread works: wait for both.
        while (pub.replays.num_dropped == 0 or pub.replays.busy) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.replays.num_dropped == 1 and not pub.replays.busy
        assert 1 <= len(drain(silent)) <= 8 + 4
    finally:
        pub.shutdown()
        silent.close()
        reader.close()


def test_replays_are_paced_and_publishing_goes_on():
    """20 clients asking at once: each gets its whole answer, the publishing thread keeps
    sending new batches meanwhile, and no more than `MESSAGES_PER_ROUND` replayed
    messages go out per `ROUND_S`."""
    pub = ZmqEventPublisher(0, inproc(), inproc(), buffer_steps=400, replay_hwm=1000)
    clients = [socket(zmq.DEALER, pub.replay_endpoint) for _ in range(20)]
    try:
        for i in range(300):
            pub.publish(stored(i))
        assert pub.flush(WAIT_S)
        start = time.monotonic()
        for client in clients:
            request(client, 0)
        for i in range(300, 320):
            pub.publish(stored(i))
            time.sleep(0.005)
        assert pub.flush(WAIT_S) and pub.num_sent == 320, (
            "new batches went out while replays were in progress"
        )
        for client in clients:
            # What was sent when the publisher took the request, then the end marker.
            seqs = [int.from_bytes(f[2], "big", signed=True) for f in answer(client)]
            assert seqs[:-1] == list(range(len(seqs) - 1)) and 300 <= len(seqs) - 1 <= 320
        elapsed = time.monotonic() - start
        rate = ReplayServer.MESSAGES_PER_ROUND / ReplayServer.ROUND_S
        assert elapsed >= 20 * 300 / rate * 0.9, elapsed
    finally:
        pub.shutdown()
        for client in clients:
            client.close()


def flood(endpoint: str, stop: threading.Event, errors: list) -> None:
    """A client asking for a full replay over and over, reading little (its own socket,
    its own thread)."""
    sock = socket(zmq.DEALER, endpoint, RCVHWM=50)
    try:
        while not stop.is_set():
            request(sock, 0)
            sock.poll(1)
            for _ in range(10):
                if sock.poll(0):
                    sock.recv_multipart()
    except Exception as error:  # noqa: BLE001 - the test reports it
        errors.append(error)
    finally:
        sock.close()


@pytest.mark.parametrize("repeat", range(2))
def test_shutdown_under_a_flood_of_replay_requests(tmp_path, repeat):
    """Several clients flood the replay socket while batches are published; `shutdown`
    returns without raising, with the publishing thread ended and both sockets closed by
    it; a second `shutdown` does nothing."""
    pub = ZmqEventPublisher(
        0, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", buffer_steps=500
    )
    for i in range(500):
        pub.publish(stored(i))
    stop, errors = threading.Event(), []
    threads = [
        threading.Thread(target=flood, args=(pub.replay_endpoint, stop, errors)) for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.1 + 0.05 * repeat)
        for i in range(200):
            pub.publish(stored(i))
        pub.shutdown()
        assert not pub._thread.is_alive()
        assert pub._pub.closed and pub._replay.closed
        pub.shutdown()
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert not errors
