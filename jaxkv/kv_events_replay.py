"""Answering KV-event replay requests with bounded memory and bounded work (host only).

A replay request `[identity, b"", start_seq]` on the publisher's ROUTER socket is
answered with the buffered messages numbered from `start_seq` up to the last one sent
when it was asked (vLLM's answer: a snapshot of the buffer), each as
`[identity, b"", topic, seq, payload]`, then the end marker `[identity, b"", b"",
END_SEQ, b""]` (`jaxkv.kv_events_publisher`). Messages evicted from the buffer before
their turn are skipped, as a request for a start older than the buffer skips them.

Unlike vLLM's, the answer goes out a few messages at a time, between the publishing
thread's batches, so that neither a flood of requests nor clients that never read can
grow memory without bound or starve the step loop:

- per client, at most the ROUTER socket's `replay_hwm` messages wait in its queue
  (`ZMQ_ROUTER_MANDATORY`: a full queue is reported, not silently dropped); a client
  whose queue stays full for `STALL_S` seconds, or that has gone, loses its replay
  (counted in `num_dropped`, with a warning);
- at most `MESSAGES_PER_ROUND` replayed messages go out per round and at most one round
  runs per `ROUND_S` seconds, shared round-robin by the replays in progress: replaying
  costs the process at most that rate, however many clients ask;
- at most `MAX_ACTIVE` replays are in progress, and at most `MAX_ACTIVE` requests are
  taken per round; further requests stay in the socket's own receive queue (libzmq's
  high-water mark bounds it) until their turn.

Invariants: only the publishing thread calls `ReplayServer` (it owns the socket); a
client has at most one replay in progress (a new request replaces it); every replay in
progress ends with its end marker, or is dropped and counted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import zmq

logger = logging.getLogger("jaxkv")

__all__ = ["END_SEQ", "ReplayServer"]

# The end-of-replay sequence frame: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class _Replay:
    """One client's replay in progress: it has yet to get `next_seq` .. `end_seq - 1`
    and the end marker; `stalled_since`: when its queue was first found full (None:
    it is not)."""

    next_seq: int
    end_seq: int
    stalled_since: float | None = None


class ReplayServer:
    """The replays of one ROUTER socket (see the module docstring)."""

    MESSAGES_PER_ROUND = 16
    ROUND_S = 0.001
    MAX_ACTIVE = 64
    STALL_S = 1.0

    def __init__(self, sock: zmq.Socket, topic: bytes, buffer: deque[tuple[int, bytes]]) -> None:
        """`sock`: a bound ROUTER socket with `ZMQ_ROUTER_MANDATORY` set; `buffer`: the
        publisher's `(seq, payload)` messages, consecutive and oldest first."""
        self.sock, self.topic, self.buffer = sock, topic, buffer
        self.active: OrderedDict[bytes, _Replay] = OrderedDict()
        self.num_dropped = 0
        self._next_round = 0.0

    @property
    def busy(self) -> bool:
        """Replays are in progress."""
        return bool(self.active)

    def serve(self, num_sent: int, now: float) -> float | None:
        """One round, unless the last was less than `ROUND_S` ago: take the waiting
        requests (`num_sent`: the messages sent so far, the end of their snapshot), then
        send up to `MESSAGES_PER_ROUND` messages of the replays in progress. Returns the
        seconds until the next round is due while replays are in progress, else None."""
        if now < self._next_round:
            return self._next_round - now
        self._next_round = now + self.ROUND_S
        self._round(num_sent, now)
        return self.ROUND_S if self.active else None

    def _round(self, num_sent: int, now: float) -> None:
        self._take_requests(num_sent)
        budget = self.MESSAGES_PER_ROUND
        while budget and self.active:
            sent = 0
            for client in list(self.active):
                if budget == 0:
                    break
                if self._send_next(client, self.active[client], now):
                    sent += 1
                    budget -= 1
                    if client in self.active:  # its next turn after the others'
                        self.active.move_to_end(client)
            if not sent:
                return  # every queue is full: wait for the clients to read

    def _take_requests(self, num_sent: int) -> None:
        """Take at most `MAX_ACTIVE` waiting requests (a flood of them cannot hold the
        thread), while fewer than `MAX_ACTIVE` replays are in progress."""
        sock = self.sock
        for _ in range(self.MAX_ACTIVE):
            if len(self.active) >= self.MAX_ACTIVE or not sock.poll(0):
                return
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "KV events: ignored a replay request of %d frames; expected "
                    "[identity, b'', start sequence (8 bytes)]",
                    len(frames),
                )
                continue
            client, _, start = frames
            self.active.pop(client, None)  # a new request replaces the one in progress
            self.active[client] = _Replay(int.from_bytes(start, "big"), num_sent)

    def _send_next(self, client: bytes, replay: _Replay, now: float) -> bool:
        """Send `client` its next message (or the end marker, then forget it); False when
        its queue is full or it is gone (then dropped, if for good)."""
        buffer = self.buffer
        first = buffer[0][0] if buffer else replay.end_seq
        seq = max(replay.next_seq, first)
        if seq < replay.end_seq:
            frames = (client, b"", self.topic, seq.to_bytes(8, "big"), buffer[seq - first][1])
        else:
            frames = (client, b"", b"", END_SEQ, b"")
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # its queue is full
            if replay.stalled_since is None:
                replay.stalled_since = now
            elif now - replay.stalled_since > self.STALL_S:
                self._drop(client, f"it read nothing for {self.STALL_S:.1f} s")
            return False
        except zmq.ZMQError as error:  # EHOSTUNREACH: it has disconnected
            self._drop(client, str(error))
            return False
        replay.stalled_since = None
        if seq < replay.end_seq:
            replay.next_seq = seq + 1
        else:
            del self.active[client]
        return True

    def _drop(self, client: bytes, why: str) -> None:
        del self.active[client]
        self.num_dropped += 1
        logger.warning(
            "KV events: dropped a replay client's replay (%s); %d dropped so far",
            why,
            self.num_dropped,
        )
