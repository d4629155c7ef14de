"""KV events on the wire: vLLM's msgpack encoding, byte for byte (host only, no JAX).

A payload is the msgpack array `[ts, [events], data_parallel_rank]` (`KVEventBatch`);
each event a map tagged `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`
with its fields in vLLM's declaration order, fields at vLLM's default omitted and
required fields that are None sent as nil. So a payload jaxkv encodes is the payload
vLLM's `msgspec.msgpack.Encoder` makes of the same events, and either decodes the other's.

Block hashes on the wire are vLLM's default: the low 64 bits of the digest, big-endian,
as an int (`block_hash_to_wire`); `int_block_hashes=False` sends the digest bytes
(vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). In-process events
(`jaxkv.kv_events`) always carry the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from jaxkv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DeferredKVCacheEvent,
    KVCacheEvent,
)

__all__ = [
    "KVEventBatch",
    "KVEventDecodeError",
    "WireAllBlocksCleared",
    "WireBlockRemoved",
    "WireBlockStored",
    "block_hash_to_wire",
    "decode_event_batch",
    "encode_event_batch",
    "to_wire_events",
]

# vLLM's `ExternalBlockHash`: the int form by default, the digest bytes as an option.
ExternalBlockHash = int | bytes


def block_hash_to_wire(block_hash: bytes, int_block_hashes: bool = True) -> ExternalBlockHash:
    """`block_hash` as vLLM publishes it: the low 64 bits of the digest read
    big-endian (`int.from_bytes(digest, "big") & (2**64 - 1)`), or the bytes unchanged."""
    return _low_64_bits(block_hash) if int_block_hashes else block_hash


_UNPACK_U64 = struct.Struct(">Q").unpack_from


def _low_64_bits(block_hash: bytes) -> int:
    size = len(block_hash)
    if size >= 8:  # read in place, no slice
        return _UNPACK_U64(block_hash, size - 8)[0]
    return int.from_bytes(block_hash, "big")


def _unchanged(block_hash: bytes) -> bytes:
    return block_hash


class _WireEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Tagged by class (`"type"`); fields at their default are left out of the map."""


class WireBlockStored(_WireEvent, tag="BlockStored"):
    """`BlockStored` as encoded. The first seven fields have no default (always sent,
    nil when None); the rest are sent only when set. jaxkv never sets the last four
    (offloading tiers, sessions, lookahead hashing); a vLLM publisher may."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(_WireEvent, tag="BlockRemoved"):
    """`BlockRemoved` as encoded (`medium` always sent)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(_WireEvent, tag="AllBlocksCleared"):
    """`AllBlocksCleared`: a map holding only its tag."""


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: `[ts, events, data_parallel_rank]` (the rank is
    left out when None, which a publisher never sends: it stamps its own)."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A payload whose events are left undecoded, to skip unknown types one by one."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _EventType(msgspec.Struct, gc=False):
    type: str


def to_wire_events(
    events: Sequence[KVCacheEvent | DeferredKVCacheEvent],
    int_block_hashes: bool = True,
    redact_prompts: bool = False,
) -> list:
    """jaxkv's events (`take_events()`, deferred ones built here) as the wire structs;
    hashes by `block_hash_to_wire`. `redact_prompts`: `BlockStored` goes out with no
    token ids (`[]`) and no extra keys (None), which hold prompts, cache salts and image
    hashes; its block hashes, parent, size, LoRA and group still let a router place
    requests by prefix.

    TypeError naming the event for anything but `BlockStored`, `BlockRemoved` and
    `AllBlocksCleared`.
    """
    # Fields go positionally, in the structs' declaration order; token lists are sent
    # as they are.
    to_wire = _low_64_bits if int_block_hashes else _unchanged
    wire: list = []
    for event in events:
        if isinstance(event, DeferredKVCacheEvent):
            event = event.build()
        kind = type(event)
        if kind is BlockStored:
            parent = event.parent_block_hash
            tokens = [] if redact_prompts else event.token_ids
            wire.append(
                WireBlockStored(
                    list(map(to_wire, event.block_hashes)),
                    None if parent is None else to_wire(parent),
                    tokens if type(tokens) is list else list(tokens),
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    event.lora_name,
                    None if redact_prompts else event.extra_keys,
                    event.group_idx,
                    event.kv_cache_spec_kind,
                    event.kv_cache_spec_sliding_window,
                )
            )
        elif kind is BlockRemoved:
            wire.append(
                WireBlockRemoved(
                    list(map(to_wire, event.block_hashes)),
                    event.medium,
                    event.group_idx,
                )
            )
        elif kind is AllBlocksCleared:
            wire.append(WireAllBlocksCleared())
        else:
            raise TypeError(
                f"cannot publish {event!r}: KV events are BlockStored, BlockRemoved or "
                "AllBlocksCleared"
            )
    return wire


def _enc_hook(value: Any) -> Any:
    """numpy integers (token ids, ranks) encode as the ints they are."""
    item = getattr(value, "item", None)
    if item is not None:
        return item()
    raise TypeError(f"cannot encode {type(value).__name__} in a KV event")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """The payload bytes of `batch` (vLLM's `msgspec.msgpack.Encoder().encode(batch)`)."""
    return _ENCODER.encode(batch)


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch; the message says what was wrong."""


@dataclass
class DecodedBatch:
    """A decoded payload: its events of known types, and how many of unknown type
    (a newer publisher's) were skipped."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None
    unknown_types: list[str]


_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_RAW_DECODER = msgspec.msgpack.Decoder(_RawBatch)
_EVENT_DECODER = msgspec.msgpack.Decoder(WireEvent)
_TYPE_DECODER = msgspec.msgpack.Decoder(_EventType)
_KNOWN_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def decode_event_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload, all or nothing.

    Events of an unknown type are skipped (named in `unknown_types`); anything else that
    does not match vLLM's schema (not msgpack, not a `[ts, events, rank]` array, a
    known event with a missing or mistyped field) raises `KVEventDecodeError` naming the
    offending place, and nothing of the payload is returned.
    """
    try:
        batch = _BATCH_DECODER.decode(payload)
        return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank, [])
    except msgspec.DecodeError as whole_error:
        try:  # an unknown event type fails the typed decode; sort them out one by one
            raw = _RAW_DECODER.decode(payload)
        except msgspec.DecodeError:
            raise KVEventDecodeError(f"not a KV event batch: {whole_error}") from None
    events: list[WireEvent] = []
    unknown: list[str] = []
    for index, item in enumerate(raw.events):
        try:
            kind = _TYPE_DECODER.decode(item).type
            if kind not in _KNOWN_TYPES:
                unknown.append(kind)
                continue
            events.append(_EVENT_DECODER.decode(item))
        except msgspec.DecodeError as error:
            raise KVEventDecodeError(f"event {index} of the batch: {error}") from None
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank, unknown)
