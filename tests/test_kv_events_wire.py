"""KV events on the wire: the payload layout, the ZeroMQ publisher and subscriber over
loopback (ipc sockets in a temporary directory, bounded waits), and byte compatibility
with vLLM 0.33 itself (`tests/kv_events_wire_driver.py` under the peer environment
`REPO_ROOT/.venv-vllm`; skipped without it)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from jaxkv.kv_events_publisher import (
    EventPublisherFactory,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    offset_endpoint_port,
)
from jaxkv.kv_events_wire import (
    KVEventBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_event_batch,
    encode_event_batch,
    to_wire_events,
)
from jaxkv.prefix_index import EngineRank, PrefixIndex, ZmqKVEventSubscriber

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "kv_events_wire_driver.py"
HASH = bytes(range(32))
LOW_64 = int.from_bytes(HASH[-8:], "big")
WAIT_MS = 3000


def stored(i: int, parent: bytes | None = None) -> BlockStored:
    return BlockStored([bytes([i]) * 32], parent, [i] * 4, 4, None)


def test_payload_layout_is_vllms():
    """`[ts, [events], rank]`; events are maps tagged "type", vLLM's field order, required
    fields sent even when None, defaulted fields left out; hashes the low 64 bits."""
    event = BlockStored([HASH], None, [1, 2, 3, 4], 4, None, extra_keys=[("salt",)])
    batch = KVEventBatch(1.5, to_wire_events([event, BlockRemoved([HASH]), AllBlocksCleared()]), 3)
    raw = msgspec.msgpack.decode(encode_event_batch(batch))
    assert raw == [
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [LOW_64], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": [["salt"]], "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [LOW_64], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]  # fmt: skip
    assert list(raw[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx",
    ]  # fmt: skip
    as_bytes = to_wire_events([event], int_block_hashes=False)[0]
    assert as_bytes.block_hashes == [HASH]
    with pytest.raises(TypeError, match="KV events are BlockStored, BlockRemoved or"):
        to_wire_events(["not an event"])


def test_endpoints_offset_by_data_rank_and_bad_config():
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    with pytest.raises(ValueError, match="use a tcp:// or inproc:// endpoint"):
        offset_endpoint_port("ipc:///tmp/kv", 1)
    with pytest.raises(ValueError, match="KVEventsConfig.endpoint must be a ZeroMQ address"):
        KVEventsConfig(endpoint="localhost:5557")
    with pytest.raises(ValueError, match="KVEventsConfig.buffer_steps must be a positive int"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="publisher must be 'zmq' or 'null'"):
        KVEventsConfig(publisher="kafka")
    assert isinstance(EventPublisherFactory.create(KVEventsConfig()), NullEventPublisher)
    with pytest.raises(ValueError, match="endpoint 'tcp://\\*:notaport': give tcp://HOST:PORT"):
        ZmqEventPublisher(endpoint="tcp://*:notaport")


@pytest.mark.parametrize(
    ("endpoint", "got"),
    [("tcp://127.0.0.1:99999", "port '99999'"), ("tcp://*:0", "port '0'"),
     ("tcp://*:65536", "port '65536'"), ("tcp://*:*", "port '\\*'"), ("tcp://*:", "port ''"),
     ("tcp://127.0.0.1", "no port"), ("tcp://:5557", "no port"), ("tcp://*:-1", "port '-1'")],
)  # fmt: skip
def test_tcp_port_outside_1_to_65535_is_refused(endpoint, got):
    """libzmq would bind 99999 as 34463 (modulo 2**16) and 0 as any free port."""
    message = f"{re.escape(endpoint)}': give tcp://HOST:PORT with PORT an integer in 1..65535"
    with pytest.raises(ValueError, match=f"KVEventsConfig.replay_endpoint '{message}.*{got}"):
        KVEventsConfig(replay_endpoint=endpoint)
    with pytest.raises(ValueError, match=f"KV events endpoint '{message}"):
        ZmqEventPublisher(endpoint=endpoint)


def test_tcp_port_bounds_and_the_rank_offset():
    KVEventsConfig(endpoint="tcp://*:65535", replay_endpoint="tcp://127.0.0.1:1")
    KVEventsConfig(endpoint="tcp://[::1]:5557")
    # Rank 2 of a port two below the top: the offset port is out of range, before binding.
    with pytest.raises(ValueError, match="endpoint of data parallel rank 2 'tcp://\\*:65536'"):
        ZmqEventPublisher(2, endpoint="tcp://*:65534")


def test_ipc_path_of_a_live_socket_is_refused_a_stale_one_reused(tmp_path):
    endpoint = f"ipc://{tmp_path}/pub"
    first = ZmqEventPublisher(0, endpoint)
    sub = sub_socket(endpoint, b"")
    try:
        with pytest.raises(ValueError, match="endpoint '.*/pub': .*is in use by a live socket"):
            ZmqEventPublisher(0, endpoint)
        with pytest.raises(ValueError, match="replay endpoint .*is in use by a live socket"):
            ZmqEventPublisher(0, f"ipc://{tmp_path}/other", replay_endpoint=endpoint)
        assert not (tmp_path / "other").exists()  # refused before any socket opened
        time.sleep(0.5)  # the subscription reaches the publisher
        first.publish([stored(1)])
        assert first.flush(WAIT_MS / 1000)
        assert sub.poll(WAIT_MS)  # the first publisher still owns the path
    finally:
        first.shutdown()
        sub.close()
    # A socket file nobody listens on (its process died without unlinking it) is stale.
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))
    assert stale.is_socket()
    ZmqEventPublisher(0, f"ipc://{stale}").shutdown()
    # libzmq would delete a regular file at the path before binding.
    (tmp_path / "notes").write_text("keep")
    with pytest.raises(ValueError, match="notes exists and is not a socket"):
        ZmqEventPublisher(0, f"ipc://{tmp_path}/notes")
    assert (tmp_path / "notes").read_text() == "keep"


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def sub_socket(endpoint: str, topic: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def test_sequence_numbers_and_topic_filtering(endpoints):
    pub = ZmqEventPublisher(0, endpoints[0], topic="kv@engine-a")
    mine, other = sub_socket(endpoints[0], b"kv@engine-a"), sub_socket(endpoints[0], b"kv@b")
    try:
        time.sleep(0.5)  # the subscriptions reach the publisher
        for i in range(5):
            pub.publish([stored(i)], ts=float(i))
        assert pub.flush(WAIT_MS / 1000) and pub.num_sent == 5
        for i in range(5):
            assert mine.poll(WAIT_MS)
            topic, seq, payload = mine.recv_multipart()
            assert topic == b"kv@engine-a" and seq == i.to_bytes(8, "big")
            batch = decode_event_batch(payload)
            assert batch.ts == float(i) and batch.data_parallel_rank == 0
            assert batch.events[0].token_ids == [i] * 4
        assert not other.poll(100)
    finally:
        pub.shutdown()
        mine.close()
        other.close()


def test_redacted_events_carry_hashes_and_no_prompt_or_salt(endpoints):
    """`redact_prompts`: a subscriber gets each block's hashes, parent and size (enough to
    index prefixes) and neither its token ids nor its extra keys (the cache salt)."""
    secret = BlockStored([HASH], HASH[::-1], [7, 8, 9, 10], 4, None, extra_keys=[("salt-a",)])
    pub = ZmqEventPublisher(0, endpoints[0], redact_prompts=True)
    sub = sub_socket(endpoints[0], b"")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        pub.publish([secret, BlockRemoved([HASH])], ts=1.0)
        assert pub.flush(WAIT_MS / 1000) and sub.poll(WAIT_MS)
        payload = sub.recv_multipart()[-1]
    finally:
        pub.shutdown()
        sub.close()
    assert b"salt-a" not in payload
    events = decode_event_batch(payload).events
    assert events[0].token_ids == [] and events[0].extra_keys is None
    assert events[0].block_hashes == [LOW_64] and events[0].block_size == 4
    assert events[0].parent_block_hash == int.from_bytes(HASH[::-1][-8:], "big")
    assert events[1].block_hashes == [LOW_64]
    plain = to_wire_events([secret])[0]
    assert plain.token_ids == [7, 8, 9, 10] and plain.extra_keys == [("salt-a",)]


def test_the_engine_setting_reaches_its_publishers(endpoints):
    from jaxkv.engine.config import EngineConfig, check_config
    from jaxkv.engine.events import make_publishers

    config = EngineConfig(kv_events_endpoint=endpoints[0], kv_events_redact_prompts=True)
    (publisher,) = make_publishers(config, 1)
    publisher.shutdown()
    assert publisher.redact_prompts is True
    with pytest.raises(TypeError, match="kv_events_redact_prompts must be a bool, got 'yes'"):
        check_config(EngineConfig(kv_events_redact_prompts="yes"))


def test_a_batch_that_cannot_be_encoded_is_skipped_and_publishing_goes_on(endpoints, caplog):
    pub = ZmqEventPublisher(0, endpoints[0])
    sub = sub_socket(endpoints[0], b"")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        pub.publish([stored(0)], ts=0.0)
        pub.publish([stored(1), "not an event"], ts=1.0)  # the whole batch is skipped
        pub.publish([stored(2)], ts=2.0)
        assert pub.flush(WAIT_MS / 1000) and pub.num_sent == 2
        got = []
        for _ in range(2):
            assert sub.poll(WAIT_MS)
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), decode_event_batch(payload).ts))
        assert got == [(0, 0.0), (1, 2.0)]  # no gap in the numbering for the skipped batch
        assert "could not encode a batch" in caplog.text
    finally:
        pub.shutdown()
        sub.close()


def published_index(events_per_batch) -> PrefixIndex:
    index = PrefixIndex(4)
    for events in events_per_batch:
        index.apply("e", decode_event_batch(encode_event_batch(
            KVEventBatch(0.0, to_wire_events(events), 0))))  # fmt: skip
    return index


def wait_for(subscriber: ZmqKVEventSubscriber, next_seq: int) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while subscriber.stream.next_seq != next_seq and time.monotonic() < deadline:
        subscriber.poll(0.05)
    assert subscriber.stream.next_seq == next_seq


BATCHES = [[stored(0)], [stored(1, bytes([0]) * 32)], [BlockRemoved([bytes([0]) * 32])],
           [stored(2)], [stored(3, bytes([2]) * 32)], [stored(4)]]  # fmt: skip
E0 = EngineRank("e", 0)


def test_a_late_subscriber_recovers_through_the_replay(endpoints):
    pub = ZmqEventPublisher(0, *endpoints, buffer_steps=100)
    index = PrefixIndex(4)
    try:
        for events in BATCHES[:3]:
            pub.publish(events)
        time.sleep(0.2)  # sent before anyone listens
        subscriber = ZmqKVEventSubscriber(index, "e", *endpoints)
        time.sleep(0.2)
        for events in BATCHES[3:]:
            pub.publish(events)
        wait_for(subscriber, len(BATCHES))
        subscriber.close()
    finally:
        pub.shutdown()
    assert subscriber.stream.num_gaps_lost == 0
    assert index.block_hashes(E0) == published_index(BATCHES).block_hashes(E0)


class DroppingSocket:
    """A SUB socket that loses the messages numbered in `lose` (as a slow subscriber past
    the high-water mark would)."""

    def __init__(self, sock: zmq.Socket, lose: set[int]) -> None:
        self.sock, self.lose = sock, lose

    def poll(self, timeout: int) -> int:
        return self.sock.poll(timeout)

    def recv_multipart(self) -> list[bytes]:
        while True:
            frames = self.sock.recv_multipart()
            if int.from_bytes(frames[1], "big") not in self.lose:
                return frames

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger=linger)


@pytest.mark.parametrize("buffer_steps", [100, 2])
def test_missed_messages_are_replayed_or_counted_lost(endpoints, buffer_steps):
    pub = ZmqEventPublisher(0, *endpoints, buffer_steps=buffer_steps)
    index = PrefixIndex(4)
    subscriber = ZmqKVEventSubscriber(index, "e", *endpoints, replay_timeout=1.0)
    subscriber._sub = DroppingSocket(subscriber._sub, lose={1, 2, 3})
    try:
        time.sleep(0.2)
        for events in BATCHES:
            pub.publish(events)
        time.sleep(0.2)  # all sent (and buffered) before the subscriber reads any
        wait_for(subscriber, len(BATCHES))
        subscriber.close()
    finally:
        pub.shutdown()
    if buffer_steps == 100:  # replayed exactly
        assert subscriber.stream.num_gaps_lost == 0
        assert index.block_hashes(E0) == published_index(BATCHES).block_hashes(E0)
    else:  # the buffer holds only 4 and 5: the engine's blocks are forgotten, then resumed
        assert subscriber.stream.num_gaps_lost == 1
        assert index.block_hashes(E0) == published_index(BATCHES[4:]).block_hashes(E0)


class StallingSocket:
    """The PUB socket, its first send waiting for `release` (a sender stuck in a send)."""

    def __init__(self, sock: zmq.Socket, release: threading.Event) -> None:
        self.sock, self.release, self.senders = sock, release, []

    def send(self, frame: bytes, flags: int = 0) -> None:
        if not self.senders:
            self.senders.append(threading.current_thread().name)
            self.release.wait(WAIT_MS / 1000)
        self.sock.send(frame, flags)

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger=linger)


def test_a_full_queue_drops_the_oldest_without_blocking(endpoints):
    """While the publishing thread's send is stuck, `publish` queues and returns at once,
    and a full queue drops its oldest payloads, counted and never numbered."""
    release = threading.Event()
    pub = ZmqEventPublisher(0, endpoints[0], max_queue_size=2)
    pub._pub = stalling = StallingSocket(pub._pub, release)
    sock = sub_socket(endpoints[0], b"")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        pub.publish([stored(0)])
        time.sleep(0.2)  # the thread took batch 0 and waits in its send
        assert pub.num_sent == 0
        assert stalling.senders == ["kv-events-pub"]
        start = time.perf_counter()
        for i in range(1, 6):
            pub.publish([stored(i)])
        assert time.perf_counter() - start < 0.05, "publish must not wait for the thread"
        assert pub.num_dropped == 3 and pub.num_sent == 0
        release.set()
        assert pub.flush(WAIT_MS / 1000) and pub.num_sent == 3
        got = []
        for _ in range(3):
            assert sock.poll(WAIT_MS)
            _, seq, payload = sock.recv_multipart()
            got.append(
                (int.from_bytes(seq, "big"), decode_event_batch(payload).events[0].token_ids[0])
            )
        assert got == [(0, 0), (1, 4), (2, 5)], (
            "no sequence gap: dropped batches are never numbered"
        )
    finally:
        release.set()
        pub.shutdown()
        sock.close()
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish([stored(9)])


def wait_until_sent(pub: ZmqEventPublisher, num_sent: int) -> None:
    """Sleep (letting go of the GIL, as a step waiting for the device does) until the
    publisher's thread has sent `num_sent` messages, without sending any here."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while pub.num_sent < num_sent and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pub.num_sent == num_sent


def test_the_background_thread_encodes_and_sends_what_publish_queues(endpoints):
    """`publish` only queues: the background thread converts, encodes, numbers and sends
    each batch (the caller's thread never encodes), one message per call, in order."""
    pub = ZmqEventPublisher(0, endpoints[0])
    encoders, senders = [], []
    encode, send = pub._encode, pub._pub.send

    def recording_encode(ts, events):
        encoders.append(threading.current_thread().name)
        return encode(ts, events)

    class Recording:
        def send(self, frame: bytes, flags: int = 0) -> None:
            if not flags & zmq.SNDMORE:  # a message's last frame
                senders.append(threading.current_thread().name)
            send(frame, flags)

        def close(self, linger: int = 0) -> None:
            pub_sock.close(linger=linger)

    pub._encode = recording_encode
    pub_sock, pub._pub = pub._pub, Recording()
    sock = sub_socket(endpoints[0], b"")
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        for i in range(4):
            pub.publish([stored(i), BlockRemoved([bytes([i]) * 32])], ts=float(i))
            wait_until_sent(pub, i + 1)
        assert encoders == senders == ["kv-events-pub"] * 4
        for i in range(4):
            assert sock.poll(WAIT_MS)
            _, seq, payload = sock.recv_multipart()
            batch = decode_event_batch(payload)
            assert int.from_bytes(seq, "big") == i and batch.ts == float(i)
            assert [type(e) for e in batch.events] == [WireBlockStored, WireBlockRemoved]
    finally:
        pub.shutdown()
        sock.close()


class GatedEncode:
    """The publisher's `_encode`, made to wait while `gate` is closed (a publishing thread
    busy with one batch); `entered` is set when the thread has taken a batch."""

    def __init__(self, pub: ZmqEventPublisher) -> None:
        self.encode, self.gate, self.entered = pub._encode, threading.Event(), threading.Event()
        self.gate.set()
        pub._encode = self

    def __call__(self, ts, events):
        self.entered.set()
        assert self.gate.wait(WAIT_MS / 1000)
        return self.encode(ts, events)


@settings(max_examples=40, deadline=None)
@given(
    actions=st.lists(
        st.one_of(
            st.tuples(st.just("publish"), st.booleans()),  # the publishing thread busy?
            st.tuples(st.just("bad"), st.booleans()),  # a batch that cannot be encoded
            st.tuples(st.just("flush"), st.just(False)),
        ),
        max_size=24,
    ),
    max_queue_size=st.integers(1, 4),
)
def test_publishing_sequences_match_a_model(tmp_path_factory, actions, max_queue_size):
    """Any interleaving of publishes with the publishing thread free or stuck on a batch
    (for a run of publishes), unencodable batches and flushes: the messages sent are the
    batches published, in order, less the oldest ones a full queue dropped (counted; a
    bad batch takes its place in the queue too; the batch the thread is stuck on is out
    of the queue) and the bad ones (skipped at encoding), numbered 0, 1, 2, ... without
    gaps; nothing is sent while the thread is stuck, and `flush` returns once everything
    queued is sent."""
    endpoint = f"ipc://{tmp_path_factory.mktemp('model')}/pub"
    pub = ZmqEventPublisher(0, endpoint, max_queue_size=max_queue_size)
    gated = GatedEncode(pub)
    sent, taken, queued, dropped, holding = [], [], [], 0, False
    try:
        for i, (action, held) in enumerate(actions):
            if holding and not held:  # the thread goes on; what it left goes out
                gated.gate.set()
                holding = False
                assert pub.flush(WAIT_MS / 1000)
                sent, taken, queued = sent + [b for b in taken + queued if b is not None], [], []
            if action == "flush":
                if not holding:
                    assert pub.flush(WAIT_MS / 1000)
                else:
                    assert not pub.flush(0.01), "nothing is sent while the thread is stuck"
                continue
            batch = i % 256 if action == "publish" else None
            if held and not holding:  # the thread takes this batch and gets stuck on it
                gated.gate.clear()
                gated.entered.clear()
                pub.publish([stored(i % 256)] + (["bad"] if action == "bad" else []))
                assert gated.entered.wait(WAIT_MS / 1000)
                holding, taken = True, [batch]
            elif holding:
                pub.publish([stored(i % 256)] + (["bad"] if action == "bad" else []))
                queued.append(batch)
                if len(queued) > max_queue_size:
                    queued.pop(0)
                    dropped += 1
            else:  # the queue was empty: the thread sends it
                pub.publish([stored(i % 256)] + (["bad"] if action == "bad" else []))
                assert pub.flush(WAIT_MS / 1000)
                if batch is not None:
                    sent.append(batch)
            assert pub.num_sent == len(sent) and pub.num_dropped == dropped
        gated.gate.set()
        assert pub.flush(WAIT_MS / 1000)
        sent += [b for b in taken + queued if b is not None]
        assert pub.num_sent == len(sent) and pub.num_dropped == dropped
        buffered = [(seq, decode_event_batch(p).events[0].token_ids[0]) for seq, p in pub._buffer]
        assert buffered == list(enumerate(sent))
    finally:
        gated.gate.set()
        pub.shutdown()


def test_sockets_are_opened_used_and_closed_by_the_publishing_thread(endpoints):
    """Every call on the PUB and ROUTER sockets (binding, sending, replaying, closing)
    happens on the publishing thread, and shutdown closes both there."""
    callers: dict[str, set[str]] = {}
    real_socket = zmq.Context.socket

    class Watched:
        def __init__(self, sock: zmq.Socket) -> None:
            self._sock = sock

        def __getattr__(self, name):
            attr = getattr(self._sock, name)
            if not callable(attr):
                return attr

            def call(*args, **kwargs):
                callers.setdefault(name, set()).add(threading.current_thread().name)
                return attr(*args, **kwargs)

            return call

    def watched_socket(ctx, kind, *args, **kwargs):
        callers.setdefault("socket", set()).add(threading.current_thread().name)
        return Watched(real_socket(ctx, kind, *args, **kwargs))

    zmq.Context.socket = watched_socket
    try:
        pub = ZmqEventPublisher(0, *endpoints, buffer_steps=10)
    finally:
        zmq.Context.socket = real_socket
    index = PrefixIndex(4)
    try:
        pub.publish(BATCHES[0])
        assert pub.flush(WAIT_MS / 1000)
        subscriber = ZmqKVEventSubscriber(index, "e", *endpoints)  # replays batch 0
        time.sleep(0.2)
        pub.publish(BATCHES[1])
        wait_for(subscriber, 2)
        subscriber.close()
    finally:
        pub.shutdown()
    assert not pub._thread.is_alive()
    assert {"socket", "bind", "send", "send_multipart", "close"} <= set(callers)
    assert all(names == {"kv-events-pub"} for names in callers.values()), callers


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="no vLLM peer environment")
@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_wire_bytes_match_vllm(tmp_path, int_hashes):
    from test_vllm_differential import make_trace

    traces = [make_trace(seed) for seed in range(40 if int_hashes == "1" else 15)]
    traces_file, results_file = tmp_path / "traces.json", tmp_path / "results.json"
    traces_file.write_text(json.dumps(traces))
    env = dict(os.environ, PYTHONHASHSEED="12345", INT_HASHES=int_hashes)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(DRIVER.parent)])
    proc = subprocess.run(
        [str(PEER_PYTHON), str(DRIVER), str(traces_file), str(results_file), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(results_file.read_text())
    failures = [r for r in results["traces"] if not r["ok"]]
    assert not failures, json.dumps(failures[0], indent=1)[:6000]
    replay = results["replay"]
    assert replay["applied"] == replay["num_batches"] == replay["next_seq"] > 20, replay
    assert replay["lost"] == 0 and replay["same_ownership"] and replay["num_blocks"] > 0, replay


def test_engine_publishes_what_its_managers_hold(endpoints):
    """An engine with `kv_events_endpoint` publishes every step's events; an index that
    joins after the engine has served some requests catches up through the replay and
    then predicts the engine's own prefix hits."""
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
    from jaxkv.request import Request
    from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

    config = EngineConfig(
        block_size=8, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=128, compilation_cache_dir="none", kv_events_endpoint=endpoints[0],
        kv_events_replay_endpoint=endpoints[1], kv_events_topic="kv",
    )  # fmt: skip
    engine = LLMEngine(TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0), config)
    system = list(range(10, 34))
    prompts = [system + [40 + i] * (3 + 5 * i) for i in range(6)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    index = PrefixIndex(8, "sha256")
    try:
        engine.generate(prompts[:3], sampling)
        subscriber = ZmqKVEventSubscriber(index, "e", *endpoints, topic="kv")
        time.sleep(0.2)
        engine.generate(prompts[3:], sampling)
        publisher = engine.kv_event_publishers[0]
        assert publisher.flush(WAIT_MS / 1000)
        wait_for(subscriber, publisher.num_sent)
        manager = engine.kv_cache_manager
        pool = manager.block_pool
        cached = pool.cached_block_hash_to_block.items()
        held = {int.from_bytes(k[-12:-4], "big") for k, _ in cached}
        assert index.block_hashes(E0) == held and len(held) > 3
        for i, prompt in enumerate(prompts + [system + [7] * 9, [1, 2, 3] * 9]):
            request = Request(f"q{i}", prompt, block_hasher=engine._requests.block_hasher)
            want = manager.get_num_cached_prefix_tokens(request)
            assert index.longest_prefix(prompt) == {E0: want}
        assert engine.reset_prefix_cache()  # AllBlocksCleared goes out at once
        assert publisher.flush(WAIT_MS / 1000)
        wait_for(subscriber, publisher.num_sent)
        assert index.num_blocks(E0) == 0
        subscriber.close()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_stepping_thread_only_queues_the_events(endpoints, async_scheduling):
    """The engine's step loop hands each step's events to the publisher's queue and
    nothing else: every batch is built, encoded and sent on the publishing thread."""
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
    from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

    config = EngineConfig(
        block_size=8, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=128, compilation_cache_dir="none", kv_events_endpoint=endpoints[0],
        async_scheduling=async_scheduling,
    )  # fmt: skip
    engine = LLMEngine(TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0), config)
    publisher = engine.kv_event_publishers[0]
    workers: list[str] = []
    encode, send = publisher._encode, publisher._send

    def recording_encode(ts, events):
        workers.append(threading.current_thread().name)
        return encode(ts, events)

    def recording_send(payload: bytes) -> None:
        workers.append(threading.current_thread().name)
        send(payload)

    publisher._encode, publisher._send = recording_encode, recording_send
    try:
        prompts = [list(range(10, 30 + 3 * i)) for i in range(4)]
        engine.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
        assert engine.reset_prefix_cache()
        assert publisher.flush(WAIT_MS / 1000)
        assert publisher.num_sent > 2 and len(workers) == 2 * publisher.num_sent
        assert set(workers) == {"kv-events-pub"}
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_routing_example_beats_round_robin():
    """The example's servers, router and multi-turn workload: routing by the servers' KV
    events finds more of each prompt cached (the servers' own /metrics) than round-robin."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "kv_aware_routing.py"), "--json",
         "--conversations", "8", "--turns", "3", "--repeats", "1"],
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["median"]
    rr, prefix = results["round-robin"], results["prefix"]
    assert prefix["requests"] == rr["requests"] == 24
    assert prefix["hit_rate"] > rr["hit_rate"] and prefix["prefill_tokens"] < rr["prefill_tokens"]
