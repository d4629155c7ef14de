"""Per-request block hashing: extra keys, the shared-prefix memo, the request hasher.

A request's hashes cover its full blocks only and grow as tokens are appended
(SPEC §2); `get_request_block_hasher` returns the callable a `Request` calls.
The hash functions themselves live in `jaxkv.hashing`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxkv.hashing import (
    BlockHash,
    BlockHashFunction,
    ExtraKeys,
    extra_keys_identity,
    get_none_hash,
    tokens_to_array,
)

if TYPE_CHECKING:
    from jaxkv.request import Request


def _mm_extra_keys(request: Request, start: int, end: int, mm_idx: int) -> tuple[list, int]:
    """("mm", id, offset - start) for each item overlapping [start, end); next item index."""
    keys = []
    features = request.mm_features
    # Items are sorted by offset; skip those that ended before this block.
    while mm_idx < len(features) and features[mm_idx].offset + features[mm_idx].length <= start:
        mm_idx += 1
    i = mm_idx
    while i < len(features) and features[i].offset < end:
        feature = features[i]
        if feature.offset + feature.length > start:
            keys.append(("mm", feature.identifier, feature.offset - start))
        i += 1
    return keys, mm_idx


def _prompt_embeds_digest(request: Request, start: int, end: int) -> bytes:
    digests = request.prompt_embeds_digests
    digest = digests.get((start, end))
    if digest is None:
        rows = np.ascontiguousarray(request.prompt_embeds[start:end])
        digest = hashlib.sha256(rows.tobytes()).digest()
        digests[(start, end)] = digest
    return digest


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0
) -> tuple[ExtraKeys, int]:
    """Extra keys of the block `[start, end)` (SPEC §2 order) and the next mm index to scan."""
    keys: list[tuple[Any, ...]] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    next_mm_idx = start_mm_idx
    if request.mm_features:
        mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
        keys.extend(mm_keys)
    if request.cache_salt is not None and start_token_idx == 0:
        keys.append(("cache_salt", request.cache_salt))
    if request.prompt_embeds is not None and start_token_idx < request.num_prompt_tokens:
        end = min(end_token_idx, request.num_prompt_tokens)
        keys.append(("prompt_embeds", _prompt_embeds_digest(request, start_token_idx, end)))
    return (tuple(keys) if keys else None), next_mm_idx


def _needs_extra_keys(request: Request) -> bool:
    return bool(
        request.lora_request is not None
        or request.mm_features
        or request.cache_salt is not None
        or request.prompt_embeds is not None
    )


class _HashedRun:
    """A memoized run of blocks: token bytes, extra keys and the hashes they chained to.

    Extra keys are held as `extra_keys_identity` values (None for a block without).

    `common_hint` is the shared-prefix length the last lookup found (the next
    request after a shared system prompt usually shares exactly as much).
    """

    __slots__ = ("common_hint", "data", "extra_keys", "hashes", "stride")

    def __init__(
        self,
        data: bytes,
        extra_keys: tuple[object, ...],
        hashes: list[BlockHash],
        stride: int,
        common_hint: int = 0,
    ) -> None:
        self.data = data
        self.extra_keys = extra_keys
        self.hashes = hashes
        self.stride = stride
        self.common_hint = common_hint

    def num_common_blocks(self, data: bytes, extra_keys: tuple[object, ...]) -> int:
        """Leading blocks whose token bytes and extra keys equal this run's.

        Tries `common_hint` first (two comparisons), else binary search.
        """
        stride = self.stride
        mine = self.data
        mine_extra = self.extra_keys

        def equal(start: int, stop: int) -> bool:
            # Byte-string slices compare with memcmp (memoryview comparison does not).
            return (
                mine[start * stride : stop * stride] == data[start * stride : stop * stride]
                and mine_extra[start:stop] == extra_keys[start:stop]
            )

        lo, hi = 0, min(len(self.hashes), len(extra_keys))
        hint = self.common_hint
        if 0 < hint < hi and equal(0, hint) and not equal(hint, hint + 1):
            return hint
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if equal(0, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


# Runs of at most this many blocks (decode steps) skip the memo: a lookup costs more.
MEMO_BYPASS_BLOCKS = 8


class BlockHashMemo:
    """Recently hashed runs of blocks, so prefixes shared between requests hash once.

    A run is found by exactly what determines its first hash (parent digest,
    first block's token bytes, first extra keys); its leading blocks whose
    tokens and extra keys match the new run have, by induction over the chain,
    the same hashes. System prompts and earlier conversation turns are reused;
    results are identical to hashing. Keeps at most `capacity` runs, least
    recently used dropped first. Runs of a few blocks (decode) bypass it.
    """

    def __init__(self, hash_fn: BlockHashFunction, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"memo capacity must be positive, got {capacity}")
        self.hash_fn = hash_fn
        self.capacity = capacity
        self._runs: OrderedDict[tuple[bytes, bytes, object], _HashedRun] = OrderedDict()
        self.num_reused_blocks = 0

    def __len__(self) -> int:
        return len(self._runs)

    def hash_blocks(
        self,
        parent: bytes,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: list[ExtraKeys],
    ) -> list[BlockHash]:
        """Same result as `hash_fn.hash_blocks`, reusing a memoized shared prefix."""
        num_blocks = len(extra_keys)
        if num_blocks <= MEMO_BYPASS_BLOCKS:
            return self.hash_fn.hash_blocks(parent, token_ids, block_size, extra_keys)
        tokens = tokens_to_array(token_ids)
        data = tokens.tobytes()
        stride = len(data) // num_blocks
        # Extra keys are matched by exact type and value (True, 1 and 1.0 hash apart).
        if extra_keys.count(None) == num_blocks:
            extras = tuple(extra_keys)
        else:
            extras = tuple(map(extra_keys_identity, extra_keys))
        key = (parent, data[:stride], extras[0])
        run = self._runs.get(key)
        num_shared = 0
        if run is not None and run.stride == stride:
            num_shared = run.num_common_blocks(data, extras)
        self.num_reused_blocks += num_shared
        if num_shared == num_blocks:
            self._runs.move_to_end(key)
            return run.hashes[:num_blocks]  # type: ignore[union-attr]
        hashes = run.hashes[:num_shared] if num_shared else []  # type: ignore[union-attr]
        hashes += self.hash_fn.hash_blocks(
            hashes[-1] if hashes else parent,
            tokens[num_shared * block_size :],
            block_size,
            extra_keys[num_shared:],
        )
        self._runs[key] = _HashedRun(data, extras, hashes, stride, num_shared)
        self._runs.move_to_end(key)
        if len(self._runs) > self.capacity:
            self._runs.popitem(last=False)
        return hashes


DEFAULT_MEMO_CAPACITY = 256


def get_request_block_hasher(
    block_size: int, hash_fn: BlockHashFunction, memo_capacity: int = DEFAULT_MEMO_CAPACITY
) -> Callable[[Request], list[BlockHash]]:
    """A hasher returning the hashes of the request's newly full blocks, in order.

    With `memo_capacity > 0` recent block digests are remembered (`BlockHashMemo`),
    so prefixes shared between requests are hashed once; 0 turns that off.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    if not isinstance(hash_fn, BlockHashFunction):
        raise ValueError(f"hash_fn must come from get_hash_fn_by_name, got {hash_fn!r}")
    if memo_capacity < 0:
        raise ValueError(f"memo_capacity must be >= 0, got {memo_capacity}")
    hash_blocks = (
        BlockHashMemo(hash_fn, memo_capacity).hash_blocks if memo_capacity else hash_fn.hash_blocks
    )

    def request_block_hasher(request: Request) -> list[BlockHash]:
        num_hashed = len(request.block_hashes)
        num_full = request.num_tokens // block_size
        if num_full <= num_hashed:
            return []
        start = num_hashed * block_size
        end = num_full * block_size
        if _needs_extra_keys(request):
            extra, mm_idx = [], 0
            for s in range(start, end, block_size):
                keys, mm_idx = generate_block_hash_extra_keys(request, s, s + block_size, mm_idx)
                extra.append(keys)
        else:
            extra = [None] * (num_full - num_hashed)
        parent = request.block_hashes[-1] if num_hashed else get_none_hash()
        return hash_blocks(parent, request.all_token_ids[start:end], block_size, extra)

    # Lets a request skip the call until a block has filled up.
    request_block_hasher.block_size = block_size  # type: ignore[attr-defined]
    return request_block_hasher
