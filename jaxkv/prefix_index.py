"""A KV-aware router's view of the engines' prefix caches, from their KV events (host
only, no JAX).

Three layers, each testable without the one above:

- `PrefixIndex` applies decoded event batches: which engine (data-parallel rank, medium,
  KV cache group) holds which block hashes, and `longest_prefix(token_ids)` answers how
  many tokens of a prompt each engine holds, hashing the prompt with the engines' chained
  block hashes (`jaxkv.hashing`).
- `KVEventStream` takes one publisher's raw messages (three frames: topic, 8-byte
  sequence number, payload): it drops duplicates, detects gaps (asking its caller to
  replay from the first missing sequence number) and counts and skips bad messages.
- `ZmqKVEventSubscriber` connects a stream to a publisher's PUB socket (jaxkv's
  `ZmqEventPublisher` or vLLM's) and recovers gaps through its replay socket.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import zmq

from jaxkv.hashing import ExtraKeys, get_hash_fn_by_name, resolve_none_hash_seed
from jaxkv.kv_events_publisher import END_SEQ
from jaxkv.kv_events_wire import (
    DecodedBatch,
    ExternalBlockHash,
    KVEventDecodeError,
    WireBlockRemoved,
    WireBlockStored,
    block_hash_to_wire,
    decode_event_batch,
)

__all__ = ["EngineRank", "KVEventStream", "PrefixIndex", "ZmqKVEventSubscriber"]

logger = logging.getLogger("jaxkv")


class EngineRank(NamedTuple):
    """A holder of blocks: an engine (the name its stream was given) and the data
    parallel rank its batches carry."""

    engine: str
    data_parallel_rank: int | None


# Where a block is held within an engine rank: (medium, KV cache group).
_Place = tuple[str | None, int | None]


def _key(block_hash: ExternalBlockHash) -> int:
    """A wire hash as the index keys it: the int form (bytes hashes reduced as vLLM
    reduces them), so publishers of either form agree."""
    return block_hash if type(block_hash) is int else block_hash_to_wire(block_hash)


class PrefixIndex:
    """Block ownership per engine rank, kept from `BlockStored` / `BlockRemoved` /
    `AllBlocksCleared` events.

    Invariants: for each engine rank, block hash and place (medium, KV cache group) the
    index counts the copies the engine announced (`BlockStored`) and has not removed
    (`BlockRemoved`, `AllBlocksCleared`); a hash is held while some place has a copy.
    An engine may hold two copies of a block (two requests computed it at once) and
    drops them one by one, so copies are counted; a store without a parent of a block
    already held is vLLM's re-announcement of a prefix hit and adds no copy (so a second
    copy of a prompt's first blocks goes uncounted: when one copy goes, the index misses
    the other until the engine stores or reuses it again). A removal whose `medium` or
    `group_idx` is None removes a copy in whichever medium or group holds one.
    `longest_prefix` counts the leading full blocks of a prompt an engine rank holds, so
    all engines must use the index's `block_size`, hash function and NONE_HASH seed
    (vLLM's routers assume the same).
    Thread-safe: `apply` and the queries take one lock.
    """

    def __init__(
        self, block_size: int = 16, hash_fn: str = "sha256_cbor", none_hash_seed: str | None = None
    ) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(hash_fn)
        seed = resolve_none_hash_seed(self.hash_fn) if none_hash_seed is None else none_hash_seed
        self._none_hash = self.hash_fn(seed)
        self._held: dict[EngineRank, dict[int, dict[_Place, int]]] = {}
        self._lock = threading.Lock()
        self.num_orphan_stores = 0  # stores whose parent block the rank did not hold

    def apply(self, engine: str, batch: DecodedBatch) -> None:
        """Apply one decoded batch of `engine`'s events, in order."""
        holder = EngineRank(engine, batch.data_parallel_rank)
        with self._lock:
            held = self._held.setdefault(holder, {})
            for event in batch.events:
                kind = type(event)
                if kind is WireBlockStored:
                    place = (event.medium, event.group_idx)
                    parent = event.parent_block_hash
                    if parent is not None and _key(parent) not in held:
                        self.num_orphan_stores += 1
                    for block_hash in event.block_hashes:
                        copies = held.setdefault(_key(block_hash), {})
                        # Without a parent, a held block is a prefix hit announced again
                        # (or, indistinguishably, a copy computed at once with another).
                        if parent is None and place in copies:
                            continue
                        copies[place] = copies.get(place, 0) + 1
                elif kind is WireBlockRemoved:
                    medium, group = event.medium, event.group_idx
                    for block_hash in event.block_hashes:
                        key = _key(block_hash)
                        copies = held.get(key)
                        if copies is None:
                            continue
                        # An unnamed medium or group: that block's copies in any.
                        for m, g in list(copies):
                            if medium in (None, m) and group in (None, g):
                                copies[m, g] -= 1
                                if not copies[m, g]:
                                    del copies[m, g]
                                break
                        if not copies:
                            del held[key]
                else:  # AllBlocksCleared
                    held.clear()

    def clear(self, engine: str) -> None:
        """Forget every block of `engine` (all its ranks): its events can no longer be
        trusted to be complete (a lost message, a restarted publisher)."""
        with self._lock:
            for holder in [h for h in self._held if h.engine == engine]:
                del self._held[holder]

    @property
    def holders(self) -> list[EngineRank]:
        with self._lock:
            return list(self._held)

    def num_blocks(self, holder: EngineRank) -> int:
        """How many block hashes `holder` holds (0 for an unknown one)."""
        with self._lock:
            return len(self._held.get(holder, ()))

    def block_hashes(self, holder: EngineRank) -> set[int]:
        """The block hashes (int form) `holder` holds."""
        with self._lock:
            return set(self._held.get(holder, ()))

    def prompt_block_hashes(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
        *,
        lora_path: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The int-form hashes of the full blocks a request of `token_ids` could hit: the
        first `(len(token_ids) - 1) // block_size` blocks (the last token is always
        computed, as in vLLM).

        `extra_keys`: the blocks' hash extra keys as `generate_block_hash_extra_keys`
        gives them (tagged, one entry per block, None for none); at least as many entries
        as blocks. Without them each block's keys are built from `lora_name` with
        `lora_path` (vLLM hashes both: ``("lora", name, path)``) and, on the first
        block, `cache_salt`. ValueError for `lora_name` without `lora_path`, or too few
        `extra_keys`.
        """
        num_blocks = max(len(token_ids) - 1, 0) // self.block_size
        if extra_keys is None:
            if lora_name is not None and lora_path is None:
                raise ValueError("lora_name needs lora_path (vLLM hashes both); or pass extra_keys")
            lora: tuple[tuple[Any, ...], ...] = (
                (("lora", lora_name, lora_path),) if lora_name is not None else ()
            )
            salt = (("cache_salt", cache_salt),) if cache_salt else ()
            extra_keys = [(lora + salt) or None] + [lora or None] * (num_blocks - 1)
        elif len(extra_keys) < num_blocks:
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries; the prompt has {num_blocks} "
                "full blocks that could hit, one entry each"
            )
        if num_blocks == 0:
            return []
        digests = self.hash_fn.hash_blocks(
            self._none_hash,
            list(token_ids[: num_blocks * self.block_size]),
            self.block_size,
            list(extra_keys[:num_blocks]),
        )
        return [block_hash_to_wire(d) for d in digests]

    def longest_prefix(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
        *,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        media: Collection[str | None] | None = None,
    ) -> dict[EngineRank, int]:
        """`{engine rank: tokens of the prompt it holds}` for every known engine rank: the
        prefix-cache hit a request of `token_ids` would get there (whole blocks, at most
        `len(token_ids) - 1` tokens). `media`: count only blocks held in these (None:
        any). The keys as `prompt_block_hashes` takes them."""
        hashes = self.prompt_block_hashes(
            token_ids, lora_name, extra_keys, lora_path=lora_path, cache_salt=cache_salt
        )
        result: dict[EngineRank, int] = {}
        with self._lock:
            for holder, held in self._held.items():
                n = 0
                for key in hashes:
                    copies = held.get(key)
                    if copies is None or (
                        media is not None and not any(m in media for m, _ in copies)
                    ):
                        break
                    n += 1
                result[holder] = n * self.block_size
        return result


class KVEventStream:
    """One publisher's messages, in sequence order, into a `PrefixIndex` as `engine`.

    Invariants: messages are applied in sequence order, each at most once; `next_seq`
    is the sequence number expected next (None before the first message). A message
    past `next_seq` is a gap: `receive` returns the sequence number to replay from and
    applies nothing, unless told the gap cannot be filled (`allow_gap`), when the engine's
    blocks are forgotten (they may be stale) and the stream resumes at the message. A
    malformed message (frame count, a sequence frame not 8 bytes, an undecodable payload)
    is counted and skipped with a warning, the index unchanged; unknown event types in a
    good batch are skipped one by one and counted.
    """

    def __init__(self, index: PrefixIndex, engine: str) -> None:
        self.index = index
        self.engine = engine
        self.next_seq: int | None = None
        self.num_batches = 0
        self.num_malformed = 0
        self.num_unknown_events = 0
        self.num_duplicates = 0
        self.num_gaps_lost = 0

    def receive(self, frames: Sequence[bytes], allow_gap: bool = False) -> int | None:
        """Apply one message `[topic, seq, payload]`; returns the replay start when it
        reveals a gap (and `allow_gap` is False), else None."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_malformed += 1
            sizes = [len(f) for f in frames]
            logger.warning(
                "KV events from %s: skipped a message of %d frames of %s bytes; expected 3 "
                "frames [topic, sequence number (8 bytes), payload]",
                self.engine, len(frames), sizes,
            )  # fmt: skip
            return None
        seq = int.from_bytes(frames[1], "big")
        expected = self.next_seq
        if expected is not None and seq < expected:
            if seq != 0:
                self.num_duplicates += 1
                return None
            logger.warning(
                "KV events from %s: sequence restarted at 0 (publisher restarted); its "
                "blocks are forgotten", self.engine,
            )  # fmt: skip
            self.index.clear(self.engine)
        elif seq != (expected or 0):
            if not allow_gap:
                return expected or 0
            self.num_gaps_lost += 1
            logger.warning(
                "KV events from %s: messages %d..%d are lost (not replayable); its blocks "
                "are forgotten", self.engine, expected or 0, seq - 1,
            )  # fmt: skip
            self.index.clear(self.engine)
        self.next_seq = seq + 1
        try:
            batch = decode_event_batch(frames[2])
        except KVEventDecodeError as error:
            self.num_malformed += 1
            logger.warning("KV events from %s: skipped message %d: %s", self.engine, seq, error)
            return None
        if batch.unknown_types:
            self.num_unknown_events += len(batch.unknown_types)
            logger.warning(
                "KV events from %s: message %d: skipped events of unknown type %s; known "
                "types are BlockStored, BlockRemoved, AllBlocksCleared",
                self.engine, seq, sorted(set(batch.unknown_types)),
            )  # fmt: skip
        self.index.apply(self.engine, batch)
        self.num_batches += 1
        return None


class ZmqKVEventSubscriber:
    """A `KVEventStream` fed from a publisher's sockets: SUB on `endpoint` (subscribed to
    `topic`, a prefix), gaps refilled from the ROUTER socket at `replay_endpoint` (within
    `replay_timeout` seconds; without one, or when it fails, the gap is lost).

    `bind=True` binds the SUB socket instead of connecting it (for a publisher whose
    endpoint connects). Drive it with `poll()` or run it in its own thread (`start()`).
    """

    def __init__(
        self,
        index: PrefixIndex,
        engine: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 1.0,
        bind: bool = False,
    ) -> None:
        self.stream = KVEventStream(index, engine)
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        (self._sub.bind if bind else self._sub.connect)(endpoint)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def poll(self, timeout: float = 0.0) -> int:
        """Apply the messages waiting (the first waited for up to `timeout` seconds);
        returns how many were read."""
        count = 0
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            self._handle(self._sub.recv_multipart())
            count += 1
            wait_ms = 0
        return count

    def _handle(self, frames: list[bytes]) -> None:
        start = self.stream.receive(frames)
        if start is None:
            return
        if self.replay_endpoint is not None:
            self._replay(start)
        self.stream.receive(frames, allow_gap=True)  # a duplicate now, unless still lost

    def _replay(self, start: int) -> None:
        """Ask the replay socket for the messages from `start` and apply them."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            timeout_ms = int(self.replay_timeout * 1000)
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:
                    return
                self.stream.receive(frames[1:], allow_gap=True)
            logger.warning(
                "KV events from %s: the replay socket %s did not answer within %.1f s",
                self.stream.engine, self.replay_endpoint, self.replay_timeout,
            )  # fmt: skip
        finally:
            sock.close()

    def start(self) -> None:
        """Poll in a daemon thread until `close()`."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-sub")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(0.05)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._sub.close(linger=0)
