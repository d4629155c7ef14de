"""`DeferredBlockStored`: a `BlockStored` KV event built only when the events are taken.

The block pool records one per stored span of a request's blocks (`BlockPool`'s
caching paths); the event's token span, hashes and extra keys are read from the request
when `build()` runs (`KVCacheManager.take_events()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxkv.hashing import BlockHash
from jaxkv.kv_events import MEDIUM_GPU, BlockStored, DeferredKVCacheEvent, to_event_extra_keys
from jaxkv.request_hashing import block_extra_keys, needs_extra_keys, request_weight_version

if TYPE_CHECKING:
    from jaxkv.request import Request


# The spec kind and sliding window of an event whose group has none recorded.
_NO_SPEC = (None, None)


class DeferredBlockStored(DeferredKVCacheEvent):
    """The `BlockStored` of a request's blocks `indices` (the ones stored, within
    [`start`, `end`)), whose token span is blocks [`start`, `end`) of the request, built
    by `build()` from the request's tokens, block hashes and hash keys (which only grow)
    and the group's entry in `group_specs`, (spec kind, sliding window) per group."""

    __slots__ = ("block_hashes", "block_size", "end", "group", "group_specs", "indices",
                 "request", "start", "weight_version")  # fmt: skip

    def __init__(
        self,
        request: Request,
        block_hashes: Sequence[BlockHash],
        indices: Sequence[int],
        start: int,
        end: int,
        block_size: int,
        group: int,
        group_specs: Sequence[tuple[str | None, int | None]],
    ) -> None:
        self.request = request
        self.block_hashes = block_hashes
        self.indices = indices
        self.start = start
        self.end = end
        self.block_size = block_size
        self.group = group
        self.group_specs = group_specs
        # What the blocks are keyed under now: `update_weights` may re-key the request
        # before the event is built.
        self.weight_version = request_weight_version(request)

    def build(self) -> BlockStored:
        request, block_hashes, indices = self.request, self.block_hashes, self.indices
        start, end, block_size, group = self.start, self.end, self.block_size, self.group
        extra_keys = None
        version = self.weight_version
        if needs_extra_keys(request, version):  # else no block has any (a decode's usual case)
            keys_per_block, mm_idx = [], 0
            for i in indices:
                keys, mm_idx = block_extra_keys(
                    request, i * block_size, (i + 1) * block_size, mm_idx, version
                )
                keys_per_block.append(keys)
            extra_keys = to_event_extra_keys(keys_per_block)
        lora = request.lora_request
        specs = self.group_specs
        return BlockStored(
            block_hashes[start:end]  # every block of the span stored (the usual case)
            if len(indices) == end - start
            else [block_hashes[i] for i in indices],
            block_hashes[start - 1] if start else None,
            request.all_token_ids.span(start * block_size, end * block_size),
            block_size,
            None if lora is None else lora.lora_int_id,
            MEDIUM_GPU,
            None if lora is None else lora.lora_name,
            extra_keys,
            group,
            *(specs[group] if group < len(specs) else _NO_SPEC),
        )

    def __repr__(self) -> str:
        return f"DeferredBlockStored({self.build()!r})"
