"""KV events on the wire, jaxkv against vLLM 0.33, in lockstep over random traces.

Run under the vLLM peer environment with the repository on PYTHONPATH:

    .venv-vllm/bin/python tests/kv_events_wire_driver.py TRACES.json RESULTS.json TMPDIR

The traces are `tests/test_vllm_differential.py`'s, replayed by
`tests/vllm_differential_driver.py` with each side observing its step's events as a
published payload (the same `ts` and rank on both sides):

- jaxkv's payload (`jaxkv.kv_events_wire`) decodes with vLLM's
  `msgspec.msgpack.Decoder(KVEventBatch)` into the events jaxkv meant (its own events,
  hashes converted by vLLM's `maybe_convert_block_hash`) and re-encodes to the same bytes;
- vLLM's payload of its own manager's events (`msgspec.msgpack.Encoder`) is the same
  bytes (vLLM's `[None, ...]` extra keys read as None first: a documented difference);
- a `PrefixIndex` fed each side's payloads holds no block its manager does not, and every
  block it does, but for blocks the manager holds twice and dropped once (counted).

Then one trace's vLLM batches go out through vLLM's own `ZmqEventPublisher` (with its
replay socket) to jaxkv's `ZmqKVEventSubscriber`, which joins late and must recover
through the replay to the same block ownership as an index fed directly.
With `INT_HASHES=0` in the environment both sides send digest bytes instead of ints.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from vllm_differential_driver import Side, run_trace

INT_HASHES = os.environ.get("INT_HASHES", "1") == "1"
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if INT_HASHES else "0"

import msgspec  # noqa: E402
from vllm.distributed import kv_events as vllm_events  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from jaxkv.compat.vllm import install_private_views  # noqa: E402
from jaxkv.hashing import get_block_hash  # noqa: E402
from jaxkv.kv_events import BlockRemoved, BlockStored  # noqa: E402
from jaxkv.kv_events_wire import (  # noqa: E402
    KVEventBatch,
    block_hash_to_wire,
    decode_event_batch,
    encode_event_batch,
    to_wire_events,
)
from jaxkv.prefix_index import EngineRank, PrefixIndex, ZmqKVEventSubscriber  # noqa: E402

VLLM_DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
VLLM_ENCODER = msgspec.msgpack.Encoder()
HOLDER = EngineRank("engine", 0)
install_private_views()  # jaxkv's pool read as vLLM's `_cache` dict, like vLLM's


def vllm_event_of(event: Any) -> Any:
    """The vLLM event jaxkv's `event` stands for, hashes converted by vLLM's rule."""
    if type(event) is BlockStored:
        parent = event.parent_block_hash
        return vllm_events.BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        )
    if type(event) is BlockRemoved:
        return vllm_events.BlockRemoved(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
        )
    return vllm_events.AllBlocksCleared()


def as_lists(value: Any) -> Any:
    """`value` with its tuples as lists: msgpack has one array type, so a tuple nested in
    an extra key decodes as a list."""
    if isinstance(value, (list, tuple)):
        return [as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    return value


class WireSide(Side):
    """A side that observes its events as the payload it would publish."""

    instances: list[WireSide] = []  # the sides made for the trace being replayed

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        super().__init__(name, config)
        WireSide.instances.append(self)
        self.index = PrefixIndex(config["block_size"], config["hash_fn"])
        self.num_ops = 0
        self.batches: list[Any] = []  # vLLM's KVEventBatch objects (vLLM side)
        self.num_missing = 0  # blocks held twice, one copy dropped: the index forgot them

    def observe(self) -> dict[str, Any]:
        events = self.manager.take_events()
        ts, self.num_ops = float(self.num_ops), self.num_ops + 1
        problems = []
        if self.name == "jaxkv":
            payload = encode_event_batch(KVEventBatch(ts, to_wire_events(events, INT_HASHES), 0))
            decoded = VLLM_DECODER.decode(payload)
            meant = vllm_events.KVEventBatch(
                ts=ts, events=[vllm_event_of(e) for e in events], data_parallel_rank=0
            )
            if as_lists(msgspec.to_builtins(decoded)) != as_lists(msgspec.to_builtins(meant)):
                problems.append(f"vLLM decodes {decoded!r}, jaxkv meant {meant!r}")
            if VLLM_ENCODER.encode(decoded) != payload:
                problems.append("vLLM re-encodes the decoded batch to other bytes")
        else:
            for event in events:
                keys = getattr(event, "extra_keys", None)
                if keys is not None and all(k is None for k in keys):
                    event.extra_keys = None
            batch = vllm_events.KVEventBatch(ts=ts, events=events, data_parallel_rank=0)
            self.batches.append(batch)
            payload = VLLM_ENCODER.encode(batch)
        self.index.apply("engine", decode_event_batch(payload))
        pool = self.manager.block_pool
        cached: dict[Any, int] = {}
        for key, value in pool.cached_block_hash_to_block._cache.items():
            wire = block_hash_to_wire(get_block_hash(key))
            cached[wire] = cached.get(wire, 0) + (len(value) if isinstance(value, dict) else 1)
        held = self.index.block_hashes(HOLDER)
        if held - set(cached):
            problems.append(f"the index holds {len(held - set(cached))} blocks the pool does not")
        missing = set(cached) - held
        self.num_missing += len(missing)
        return {"payload": payload.hex(), "problems": problems, "missing": len(missing)}


def replay_through_vllm_publisher(batches: list[Any], config: dict[str, Any], tmp: str) -> dict:
    """vLLM's `ZmqEventPublisher` sends `batches`; jaxkv's subscriber joins after the first
    third and recovers the rest through the replay socket."""
    endpoint, replay = f"ipc://{tmp}/vllm-pub", f"ipc://{tmp}/vllm-replay"
    publisher = vllm_events.ZmqEventPublisher(0, endpoint, replay, topic="kv")
    direct = PrefixIndex(config["block_size"], config["hash_fn"])
    for batch in batches:
        direct.apply("engine", decode_event_batch(VLLM_ENCODER.encode(batch)))
    index = PrefixIndex(config["block_size"], config["hash_fn"])
    third = len(batches) // 3
    try:
        for batch in batches[:third]:
            publisher.publish(batch)
        time.sleep(0.3)  # they are sent before anyone listens
        subscriber = ZmqKVEventSubscriber(index, "engine", endpoint, replay, topic="kv")
        time.sleep(0.3)  # the subscription reaches the publisher
        for batch in batches[third:]:
            publisher.publish(batch)
        deadline = time.monotonic() + 10
        while subscriber.stream.next_seq != len(batches) and time.monotonic() < deadline:
            subscriber.poll(0.1)
        subscriber.close()
    finally:
        publisher.shutdown()
    stream = subscriber.stream
    return {
        "num_batches": len(batches),
        "next_seq": stream.next_seq,
        "applied": stream.num_batches,
        "lost": stream.num_gaps_lost,
        "same_ownership": index.block_hashes(HOLDER) == direct.block_hashes(HOLDER),
        "num_blocks": direct.num_blocks(HOLDER),
    }


def main() -> None:
    traces = json.loads(open(sys.argv[1]).read())
    results, longest = [], None
    for trace in traces:
        WireSide.instances.clear()
        result = run_trace(trace, WireSide)
        sides = WireSide.instances
        result["missing"] = sides[0].num_missing
        results.append(result)
        if longest is None or len(sides[1].batches) > len(longest[0]):
            longest = (sides[1].batches, trace["config"])
    assert longest is not None
    replay = replay_through_vllm_publisher(*longest, sys.argv[3])
    with open(sys.argv[2], "w") as out:
        json.dump({"traces": results, "replay": replay}, out, default=repr)
    assert "jax" not in sys.modules, "import jaxkv must not import JAX"


if __name__ == "__main__":
    main()
