"""The prefix index: event application, prompt hashing, sequence handling and bad input,
and its predictions against a KV cache manager's own hits (no sockets, no JAX)."""

from __future__ import annotations

import logging

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import FullAttentionSpec, KVCacheManager, LoRARequest, Request, get_request_block_hasher
from jaxkv.hashing import get_hash_fn_by_name, init_none_hash
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from jaxkv.kv_events_wire import (
    KVEventBatch,
    block_hash_to_wire,
    decode_event_batch,
    encode_event_batch,
    to_wire_events,
)
from jaxkv.prefix_index import EngineRank, KVEventStream, PrefixIndex
from jaxkv.routing import choose_engine

BS = 4
HASH = get_hash_fn_by_name("sha256_cbor")
A0 = EngineRank("a", 0)


def payload(events, rank: int = 0, int_block_hashes: bool = True) -> bytes:
    return encode_event_batch(KVEventBatch(1.0, to_wire_events(events, int_block_hashes), rank))


def frames(seq: int, events, rank: int = 0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload(events, rank)]


def manager(num_blocks: int = 24) -> KVCacheManager:
    return KVCacheManager.from_spec(
        FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8),
        num_blocks=num_blocks,
        max_model_len=128,
        enable_kv_cache_events=True,
    )


@pytest.fixture
def hasher():
    init_none_hash(HASH)
    return get_request_block_hasher(BS, HASH)


def cache(m: KVCacheManager, request: Request) -> int:
    """Admit and compute `request` whole; its hit tokens."""
    blocks, hits, _ = m.get_computed_blocks(request)
    assert m.allocate_slots(request, request.num_tokens - hits, hits, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return hits


def test_stored_removed_cleared_per_engine_rank_and_medium():
    index = PrefixIndex(BS)
    h = [bytes([i]) * 32 for i in range(4)]
    stored = BlockStored(h[:3], None, list(range(12)), BS, None)
    index.apply("a", decode_event_batch(payload([stored])))
    index.apply("a", decode_event_batch(payload([stored], rank=1)))
    index.apply("b", decode_event_batch(payload([BlockStored(h[:1], None, [0] * 4, BS, None)])))
    assert index.holders == [A0, EngineRank("a", 1), EngineRank("b", 0)]
    assert index.num_blocks(A0) == 3
    # A re-announced block (a prefix hit) changes nothing; a removal in another medium
    # leaves the GPU copy.
    index.apply("a", decode_event_batch(payload([stored, BlockRemoved(h[2:3], medium="CPU")])))
    assert index.num_blocks(A0) == 3
    index.apply("a", decode_event_batch(payload([BlockRemoved(h[2:3])])))
    assert index.block_hashes(A0) == {block_hash_to_wire(x) for x in h[:2]}
    index.apply("a", decode_event_batch(payload([AllBlocksCleared()])))
    assert index.num_blocks(A0) == 0 and index.num_blocks(EngineRank("a", 1)) == 3
    # Bytes hashes (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) key the same blocks.
    index.apply("a", decode_event_batch(payload([stored], int_block_hashes=False)))
    assert index.block_hashes(A0) == index.block_hashes(EngineRank("a", 1))
    index.clear("a")
    assert index.holders == [EngineRank("b", 0)]


def test_orphan_stores_are_counted():
    index = PrefixIndex(BS)
    index.apply(
        "a", decode_event_batch(payload([BlockStored([b"c" * 32], b"p" * 32, [1] * 4, BS, None)]))
    )
    assert index.num_orphan_stores == 1 and index.num_blocks(A0) == 1


def test_prompt_hashes_are_the_requests_block_hashes(hasher):
    """The index hashes a prompt as the manager's requests are hashed (last token left out:
    a request always computes it), LoRA and salt keys included."""
    index = PrefixIndex(BS)
    tokens = list(range(4 * BS + 1))
    lora = LoRARequest("adapter", 3, "/adapters/a")
    request = Request("r", tokens, lora_request=lora, cache_salt="tenant", block_hasher=hasher)
    want = [block_hash_to_wire(h) for h in request.block_hashes]
    got = index.prompt_block_hashes(tokens, "adapter", lora_path="/adapters/a", cache_salt="tenant")
    assert got == want
    assert index.prompt_block_hashes(tokens[:-1], "adapter", lora_path="/adapters/a",
                                     cache_salt="tenant") == want[:3]  # fmt: skip
    with pytest.raises(ValueError, match="lora_name needs lora_path"):
        index.longest_prefix(tokens, "adapter")
    with pytest.raises(ValueError, match="extra_keys has 1 entries; the prompt has 4 full"):
        index.longest_prefix(tokens, extra_keys=[None])


def test_longest_prefix_follows_the_chain_and_the_media(hasher):
    m = manager()
    cache(m, Request("r", list(range(3 * BS + 1)), block_hasher=hasher))
    index = PrefixIndex(BS)
    index.apply("a", decode_event_batch(payload(m.take_events())))
    prompt = list(range(2 * BS)) + [99] * (2 * BS)
    assert index.longest_prefix(prompt) == {A0: 2 * BS}
    assert index.longest_prefix(list(range(3 * BS + 1))) == {A0: 3 * BS}
    assert index.longest_prefix(list(range(3 * BS + 1)), media={"CPU"}) == {A0: 0}
    assert index.longest_prefix(list(range(3 * BS + 1)), cache_salt="x") == {A0: 0}


def test_choose_engine_scores_as_choose_data_rank(hasher):
    index = PrefixIndex(BS)
    m = manager()
    cache(m, Request("r", list(range(3 * BS + 1)), block_hasher=hasher))
    index.apply("b", decode_event_batch(payload(m.take_events())))
    prompt = list(range(3 * BS)) + [7]
    loads = {"a": 0, "b": 1, "c": 0}
    holder = lambda name: EngineRank(name, 0)  # noqa: E731
    assert choose_engine(index, loads, prompt, slack=1, holder_of=holder) == "b"
    assert choose_engine(index, loads, prompt, slack=0, holder_of=holder) == "a"  # b too busy
    assert choose_engine(index, {"a": 0, "c": 0}, prompt, slack=4, holder_of=holder) == "a"


# -- the stream: sequence numbers, gaps, bad input ----------------------------------


def test_stream_orders_dedups_and_asks_for_replays():
    index = PrefixIndex(BS)
    stream = KVEventStream(index, "a")
    ev = [[BlockStored([bytes([i]) * 32], None, [i] * 4, BS, None)] for i in range(5)]
    assert stream.receive(frames(0, ev[0])) is None
    assert stream.receive(frames(2, ev[2])) == 1, "a gap: replay from 1"
    assert stream.next_seq == 1 and index.num_blocks(A0) == 1, "nothing applied past a gap"
    assert stream.receive(frames(1, ev[1])) is None
    assert stream.receive(frames(2, ev[2])) is None
    assert stream.receive(frames(1, ev[1])) is None and stream.num_duplicates == 1
    assert index.num_blocks(A0) == 3
    # A gap that cannot be replayed: the engine's blocks may be stale, so they are dropped.
    assert stream.receive(frames(4, ev[4]), allow_gap=True) is None
    assert stream.num_gaps_lost == 1 and index.num_blocks(A0) == 1 and stream.next_seq == 5
    # A late joiner asks for everything from 0.
    assert KVEventStream(PrefixIndex(BS), "b").receive(frames(7, ev[0])) == 0


def test_stream_restart_at_zero_forgets_the_engine():
    index = PrefixIndex(BS)
    stream = KVEventStream(index, "a")
    for seq in range(3):
        stream.receive(frames(seq, [BlockStored([bytes([seq]) * 32], None, [1] * 4, BS, None)]))
    stream.receive(frames(0, [BlockStored([b"z" * 32], None, [1] * 4, BS, None)]))
    assert index.block_hashes(A0) == {block_hash_to_wire(b"z" * 32)} and stream.next_seq == 1


def unknown_event_payload(with_known: bool) -> bytes:
    events = [{"type": "BlockMoved", "block_hashes": [1], "to": "CPU"}]
    if with_known:
        events.append({"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"})
    return msgspec.msgpack.encode([1.0, events, 0])


SEQ1 = (1).to_bytes(8, "big")
BAD_MESSAGES = {
    "two frames": ([b"", SEQ1], "2 frames"),
    "a 24-byte sequence frame": ([b"", b"\0" * 24, b""], "of [0, 24, 0] bytes"),
    "not msgpack": ([b"", SEQ1, b"\xc1garbage"], "not a KV event batch"),
    "not a batch": ([b"", SEQ1, msgspec.msgpack.encode({"ts": 1})], "not a KV event batch"),
    "a stored event missing fields": (
        [b"", SEQ1, msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0])],
        "event 0 of the batch: Object missing required field `block_hashes`",
    ),
    "a mistyped hash": (
        [
            b"",
            SEQ1,
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}], 0]
            ),
        ],
        "event 0 of the batch: Expected `int | bytes`, got `str` - at `$.block_hashes[0]`",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_bad_messages_are_counted_and_skipped(case, caplog):
    index = PrefixIndex(BS)
    stream = KVEventStream(index, "a")
    stream.receive(frames(0, [BlockStored([b"k" * 32], None, [1] * 4, BS, None)]))
    before = index.block_hashes(A0)
    message, logged = BAD_MESSAGES[case]
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert stream.receive(message) is None
    assert stream.num_malformed == 1 and index.block_hashes(A0) == before
    assert logged in caplog.text and "KV events from a" in caplog.text
    stream.receive(frames(stream.next_seq, [AllBlocksCleared()]))
    assert index.num_blocks(A0) == 0, "the stream goes on after a bad message"


@pytest.mark.parametrize("with_known", [False, True])
def test_unknown_event_types_are_skipped_one_by_one(with_known, caplog):
    index = PrefixIndex(BS)
    stream = KVEventStream(index, "a")
    stream.receive(frames(0, [BlockStored([b"k" * 32, b"\0" * 24 + (5).to_bytes(8, "big")],
                                          None, [1] * 8, BS, None)]))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        stream.receive([b"", (1).to_bytes(8, "big"), unknown_event_payload(with_known)])
    assert stream.num_unknown_events == 1 and stream.num_malformed == 0
    assert "unknown type ['BlockMoved']" in caplog.text
    assert index.num_blocks(A0) == (1 if with_known else 2)


# -- against the manager: the hits the index predicts are the hits it gets -----------

PREFIXES = [list(range(100, 100 + 3 * BS)), list(range(200, 200 + 5 * BS + 2)), []]


@st.composite
def traces(draw):
    ops = []
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["add", "add", "step", "step", "free", "reset"]))
        if kind == "add":
            prefix = draw(st.sampled_from(PREFIXES))
            tail = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3 * BS))
            ops.append(("add", prefix + tail, draw(st.sampled_from([None, None, "s"]))))
        else:
            ops.append((kind, draw(st.integers(0, 7))))
    return ops


@settings(max_examples=80, deadline=None)
@given(traces(), st.sampled_from([10, 24]), st.sampled_from([BS + 2, 64]), st.booleans())
def test_predicted_hits_are_the_managers_hits(trace, num_blocks, chunk, int_block_hashes):
    """Chunked prefill: a request racing ahead of another over the same prompt computes
    blocks the other computes too (two copies, dropped one by one)."""
    init_none_hash(HASH)
    hasher = get_request_block_hasher(BS, HASH)
    m = manager(num_blocks)
    index = PrefixIndex(BS)
    stream = KVEventStream(index, "a")
    running: list[Request] = []
    for i, op in enumerate(trace):
        if op[0] == "add":
            request = Request(f"r{i}", op[1], cache_salt=op[2], block_hasher=hasher)
            predicted = index.longest_prefix(op[1], cache_salt=op[2]).get(A0, 0)
            blocks, hits, _ = m.get_computed_blocks(request)
            assert predicted == hits, (i, op)
            num_new = min(request.num_tokens - hits, chunk)
            if m.allocate_slots(request, num_new, hits, blocks) is not None:
                request.num_computed_tokens = hits + num_new
                running.append(request)
        elif op[0] == "step" and running:
            request = running[op[1] % len(running)]
            num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
            if num_new == 0:  # prefilled: decode one token
                request.append_output_token_ids(op[1])
                num_new = 1
            if m.allocate_slots(request, num_new) is not None:
                request.num_computed_tokens += num_new
        elif op[0] == "free" and running:
            m.free(running.pop(op[1] % len(running)))
        elif op[0] == "reset":
            m.reset_prefix_cache()
        events = m.take_events()
        if events:
            seq = (stream.next_seq or 0).to_bytes(8, "big")
            assert stream.receive([b"", seq, payload(events, 0, int_block_hashes)]) is None
