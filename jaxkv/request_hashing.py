"""Per-request block hashing: extra keys, the shared-prefix memo, the request hasher.

A request's hashes cover its full blocks only and grow as tokens are appended
(SPEC §2); `get_request_block_hasher` returns the `RequestBlockHasher` a `Request` calls.
The hash functions themselves live in `jaxkv.hashing`.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxkv._checks import check_int
from jaxkv.hashing import (
    BlockHash,
    BlockHashFunction,
    ExtraKeys,
    extra_keys_identity,
    get_none_hash,
    hash_block_tokens,
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
    return block_extra_keys(
        request, start_token_idx, end_token_idx, start_mm_idx, request_weight_version(request)
    )


def request_weight_version(request: Request) -> int | str | None:
    """The weight version the request's blocks are keyed under (None: unkeyed)."""
    return getattr(request, "weight_version", None)


def block_extra_keys(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
    weight_version: int | str | None,
) -> tuple[ExtraKeys, int]:
    """`generate_block_hash_extra_keys` with the blocks keyed under `weight_version`
    (the request's own when its blocks were hashed: an event built later must not take
    a version the request was re-keyed to since)."""
    keys: list[tuple[Any, ...]] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    next_mm_idx = start_mm_idx
    if request.mm_features:
        mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
        keys.extend(mm_keys)
    if request.cache_salt is not None and start_token_idx == 0:  # `Request` made "" None
        keys.append(("cache_salt", request.cache_salt))
    # The first block's key reaches every block through the hash chain, as the salt's.
    if weight_version is not None and start_token_idx == 0:
        keys.append(("weight_version", weight_version))
    if request.prompt_embeds is not None and start_token_idx < request.num_prompt_tokens:
        end = min(end_token_idx, request.num_prompt_tokens)
        keys.append(("prompt_embeds", _prompt_embeds_digest(request, start_token_idx, end)))
    return (tuple(keys) if keys else None), next_mm_idx


def needs_extra_keys(request: Request, weight_version: int | str | None) -> bool:
    """Whether any of the request's blocks can have hash extra keys (LoRA, multimodal
    inputs, a cache salt, prompt embeddings, a weight version: `weight_version`, the
    version the blocks in question are keyed under)."""
    return bool(
        request.lora_request is not None
        or request.mm_features
        or request.cache_salt is not None
        or request.prompt_embeds is not None
        or weight_version is not None
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
        check_int("capacity", capacity, min_value=1)
        if not isinstance(hash_fn, BlockHashFunction):
            raise TypeError(f"hash_fn must come from get_hash_fn_by_name, got {hash_fn!r}")
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
            return self.hash_fn.hash_checked_blocks(parent, token_ids, block_size, extra_keys)
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
        hashes += self.hash_fn.hash_checked_blocks(
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


class RequestBlockHasher:
    """Hashes a request's newly full blocks of `block_size` tokens, chained from `none_hash`.

    A `Request` calls it whenever a block fills up. Both facts the hashes depend
    on are declared here and fixed at construction: `block_size` (a manager
    refuses a request hashed at another size) and `none_hash`, the NONE_HASH
    current when the hasher was made (a later `init_none_hash` does not change
    the chain of requests already hashed, so two chains cannot mix in one
    request). `hash_fn` is a `BlockHashFunction` (fast run hashing, optional
    memo) or any callable on `(parent, token tuple, extra keys)` such as the
    builtin `hash`, as vLLM accepts.
    """

    __slots__ = ("_hash_blocks", "_hash_few_blocks", "block_size", "hash_fn", "memo", "none_hash")

    def __init__(
        self,
        block_size: int,
        hash_fn: BlockHashFunction | Callable[[Any], Any],
        memo_capacity: int = DEFAULT_MEMO_CAPACITY,
    ) -> None:
        self.block_size = check_int("block_size", block_size, min_value=1)
        if not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {hash_fn!r}")
        memo_capacity = check_int("memo_capacity", memo_capacity, min_value=0)
        self.hash_fn = hash_fn
        self.none_hash = get_none_hash()
        self.memo: BlockHashMemo | None = None
        if not isinstance(hash_fn, BlockHashFunction):
            self._hash_blocks = functools.partial(_hash_blocks_one_by_one, hash_fn)
        elif memo_capacity:
            self.memo = BlockHashMemo(hash_fn, memo_capacity)
            self._hash_blocks = self.memo.hash_blocks
        else:
            self._hash_blocks = hash_fn.hash_checked_blocks
        # Runs of at most MEMO_BYPASS_BLOCKS (decode steps) skip the memo, as it would.
        self._hash_few_blocks = (
            hash_fn.hash_checked_blocks if self.memo is not None else self._hash_blocks
        )

    def __repr__(self) -> str:
        return f"RequestBlockHasher(block_size={self.block_size}, hash_fn={self.hash_fn!r})"

    def __call__(self, request: Request) -> list[BlockHash]:
        block_size = self.block_size
        num_hashed = len(request.block_hashes)
        num_full = request.num_tokens // block_size
        if num_full <= num_hashed:
            return []
        start = num_hashed * block_size
        end = num_full * block_size
        if needs_extra_keys(request, request_weight_version(request)):
            extra, mm_idx = [], 0
            for s in range(start, end, block_size):
                keys, mm_idx = generate_block_hash_extra_keys(request, s, s + block_size, mm_idx)
                extra.append(keys)
        else:
            extra = [None] * (num_full - num_hashed)
        parent = request.block_hashes[-1] if num_hashed else self.none_hash
        if num_full - num_hashed <= MEMO_BYPASS_BLOCKS:
            tokens = request.all_token_ids[start:end]
            return self._hash_few_blocks(parent, tokens, block_size, extra)
        if end <= request.num_prompt_tokens:
            # A long run of the prompt: its ids are already packed in an array.
            tokens = request.prompt_token_array[start:end]
        else:
            tokens = request.all_token_ids[start:end]
        return self._hash_blocks(parent, tokens, block_size, extra)


def _hash_blocks_one_by_one(
    hash_fn: Callable[[Any], Any],
    parent: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: list[ExtraKeys],
) -> list[BlockHash]:
    """`hash_block_tokens` block by block, for a hash function that is a plain callable."""
    hashes: list[BlockHash] = []
    for i, extra in enumerate(extra_keys):
        parent = hash_block_tokens(
            hash_fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra
        )
        hashes.append(parent)
    return hashes


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: BlockHashFunction | Callable[[Any], Any],
    num_hash_lookahead_tokens: int = 0,
    *,
    memo_capacity: int = DEFAULT_MEMO_CAPACITY,
) -> RequestBlockHasher:
    """The hasher a `Request` calls for its newly full blocks (vLLM's signature).

    With `memo_capacity > 0` recent block digests are remembered (`BlockHashMemo`),
    so prefixes shared between requests are hashed once; 0 turns that off.
    `num_hash_lookahead_tokens` (vLLM's hashing of speculative tokens) must be 0.
    """
    if check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, min_value=0):
        raise ValueError(
            f"num_hash_lookahead_tokens={num_hash_lookahead_tokens} is not supported; jaxkv "
            "hashes verified tokens only (0)"
        )
    return RequestBlockHasher(hash_block_size, caching_hash_fn, memo_capacity)
