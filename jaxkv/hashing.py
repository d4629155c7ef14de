"""Chained block hashing: the keys of the prefix cache.

`hash(block i) = H(parent, tokens of block i, extra_keys)`, with `parent` the
hash of block i-1 or `NONE_HASH` for block 0, so equal hashes mean equal whole
prefixes (SPEC §2).

Hash functions, by name:

- ``sha256_cbor`` / ``xxhash_cbor``: vLLM's wire format. The payload is the
  canonical CBOR array ``[parent_digest, [token ids], extra_keys or null]``,
  hashed with SHA-256 (32-byte digests) or XXH3-128 (16-byte digests). The
  digests are bit-identical to vLLM's, so KV-aware routers agree with us.
  Token ids are CBOR-encoded for a whole run of blocks at once with numpy,
  which is what makes this path faster than calling ``cbor2.dumps`` per block.
- ``sha256`` (the default) / ``xxhash``: jaxkv's own encoding,
  ``parent_digest || uint32_le(n) || n tokens as int64_le || tag`` where
  ``tag`` is ``0x00`` for no extra keys or ``0x01`` followed by the canonical
  CBOR of the extra keys. Fixed-width fields make it unambiguous.

`NONE_HASH = H(seed)`. The seed is, in order: the explicit ``seed`` passed to
`init_none_hash`; ``$PYTHONHASHSEED`` when set; `DEFAULT_NONE_HASH_SEED` for a
cryptographic function (reproducible across machines); a fresh random seed per
process for a non-cryptographic one (an attacker who knew it could precompute
colliding blocks). The resolved seed is `get_none_hash_seed()`.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NewType

import cbor2
import numpy as np
import xxhash

if TYPE_CHECKING:
    from jaxkv.request import Request

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
ExtraKeys = tuple[tuple[Any, ...], ...] | None

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_GROUP_ID_BYTES = 4

# ---------------------------------------------------------------------------
# Encodings


def _canonical_cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


_CBOR_NULL = b"\xf6"
# Head byte of an unsigned int whose argument follows in 1, 2, 4 or 8 bytes.
_CBOR_UINT_HEAD_BY_WIDTH = np.array([0, 24, 25, 0, 26, 0, 0, 0, 27], dtype=np.uint64)


def _cbor_head(major: int, value: int) -> bytes:
    """The canonical (shortest) CBOR head for `major` type with argument `value`."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 1 << 8:
        return bytes((mt | 24, value))
    if value < 1 << 16:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


def _cbor_encode_token_run(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """CBOR-encode each non-negative token id; return the bytes and start offsets.

    `offsets[i]` is where token i's encoding starts; `offsets[-1]` is the length.
    """
    t = tokens.astype(np.uint64, copy=False)
    n = t.shape[0]
    width = np.where(
        t < 24, 0, np.where(t < 256, 1, np.where(t < 65536, 2, np.where(t < 1 << 32, 4, 8)))
    )
    head = np.where(width == 0, t, _CBOR_UINT_HEAD_BY_WIDTH[width])
    rows = np.empty((n, 9), dtype=np.uint8)
    rows[:, 0] = head.astype(np.uint8)
    rows[:, 1:] = t.astype(">u8").view(np.uint8).reshape(n, 8)
    keep = np.arange(9) >= (9 - width)[:, None]
    keep[:, 0] = True
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(width + 1, out=offsets[1:])
    return rows[keep].tobytes(), offsets


class BlockHashFunction:
    """A named block hash: a digest over an encoding of (parent, tokens, extra keys).

    Callable on any object (``fn(obj) -> bytes``), like vLLM's hash functions;
    `hash_blocks` hashes a whole chain of full blocks in one call.
    """

    def __init__(
        self,
        name: str,
        digest: Callable[[bytes], bytes],
        digest_size: int,
        cbor: bool,
        cryptographic: bool,
    ) -> None:
        self.name = name
        self.digest = digest
        self.digest_size = digest_size
        self.cbor = cbor
        self.cryptographic = cryptographic
        self._parent_head = _cbor_head(2, digest_size)
        self._extra_cache: dict[ExtraKeys, bytes] = {}

    def __repr__(self) -> str:
        return f"BlockHashFunction({self.name!r})"

    def __call__(self, obj: Any) -> bytes:
        """Hash an arbitrary object; `(parent, tokens, extra)` triples hash like blocks."""
        if (
            isinstance(obj, tuple)
            and len(obj) == 3
            and isinstance(obj[0], bytes)
            and isinstance(obj[1], (tuple, list))
        ):
            parent, tokens, extra = obj
            return self.hash_blocks(
                parent, np.asarray(tokens, dtype=np.int64), len(tokens), [extra]
            )[0]
        return self.digest(_canonical_cbor(obj))

    def _encode_extra(self, extra_keys: ExtraKeys) -> bytes:
        cached = self._extra_cache.get(extra_keys)
        if cached is None:
            if self.cbor:
                cached = _CBOR_NULL if extra_keys is None else _canonical_cbor(extra_keys)
            else:
                cached = b"\x00" if extra_keys is None else b"\x01" + _canonical_cbor(extra_keys)
            if len(self._extra_cache) < 4096:
                self._extra_cache[extra_keys] = cached
        return cached

    def hash_blocks(
        self,
        parent: bytes,
        tokens: np.ndarray,
        block_size: int,
        extra_keys: Sequence[ExtraKeys],
    ) -> list[BlockHash]:
        """Chain-hash `len(extra_keys)` consecutive full blocks of `tokens`.

        `tokens` holds exactly `len(extra_keys) * block_size` non-negative ids.
        """
        num_blocks = len(extra_keys)
        if tokens.shape[0] != num_blocks * block_size:
            raise ValueError(
                f"hash_blocks needs {num_blocks} x {block_size} tokens, got {tokens.shape[0]}"
            )
        if num_blocks and int(tokens.min()) < 0:
            raise ValueError(f"token ids must be non-negative, got {int(tokens.min())}")
        digest = self.digest
        encode_extra = self._encode_extra
        hashes: list[BlockHash] = []
        if self.cbor:
            data, offsets = _cbor_encode_token_run(tokens)
            starts = offsets[::block_size].tolist()
            prefix = b"\x83" + self._parent_head
            array_head = _cbor_head(4, block_size)
            for i, extra in enumerate(extra_keys):
                parent = digest(
                    prefix
                    + parent
                    + array_head
                    + data[starts[i] : starts[i + 1]]
                    + encode_extra(extra)
                )
                hashes.append(parent)
        else:
            data = tokens.astype("<i8", copy=False).tobytes()
            count = struct.pack("<I", block_size)
            stride = 8 * block_size
            for i, extra in enumerate(extra_keys):
                parent = digest(
                    parent + count + data[i * stride : (i + 1) * stride] + encode_extra(extra)
                )
                hashes.append(parent)
        return hashes


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HASH_FUNCTIONS: dict[str, BlockHashFunction] = {
    fn.name: fn
    for fn in (
        BlockHashFunction("sha256", _sha256, 32, cbor=False, cryptographic=True),
        BlockHashFunction("sha256_cbor", _sha256, 32, cbor=True, cryptographic=True),
        BlockHashFunction("xxhash", xxhash.xxh3_128_digest, 16, cbor=False, cryptographic=False),
        BlockHashFunction(
            "xxhash_cbor", xxhash.xxh3_128_digest, 16, cbor=True, cryptographic=False
        ),
    )
}
DEFAULT_HASH_FN_NAME = "sha256"


def get_hash_fn_by_name(name: str) -> BlockHashFunction:
    """The block hash function called `name`; `ValueError` listing the choices otherwise."""
    try:
        return _HASH_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown hash function {name!r}; choose one of {sorted(_HASH_FUNCTIONS)}"
        ) from None


# ---------------------------------------------------------------------------
# NONE_HASH

NONE_HASH: BlockHash = BlockHash(b"")
_none_hash_seed: str = ""


def init_none_hash(
    hash_fn: BlockHashFunction | Callable[[Any], bytes], seed: str | None = None
) -> BlockHash:
    """Set (and return) `NONE_HASH = hash_fn(seed)`, resolving the seed by the module rules."""
    global NONE_HASH, _none_hash_seed
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        cryptographic = getattr(hash_fn, "cryptographic", True)
        seed = DEFAULT_NONE_HASH_SEED if cryptographic else os.urandom(16).hex()
    _none_hash_seed = seed
    NONE_HASH = BlockHash(hash_fn(seed))
    return NONE_HASH


def get_none_hash() -> BlockHash:
    """The current NONE_HASH (initialised with the default hash function on first use)."""
    if not NONE_HASH:
        init_none_hash(get_hash_fn_by_name(DEFAULT_HASH_FN_NAME))
    return NONE_HASH


def get_none_hash_seed() -> str:
    get_none_hash()
    return _none_hash_seed


def hash_block_tokens(
    hash_fn: BlockHashFunction | Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """Hash one block given its parent's hash (`None` → `NONE_HASH`), as in vLLM."""
    parent = get_none_hash() if parent_block_hash is None else parent_block_hash
    if isinstance(hash_fn, BlockHashFunction):
        tokens = np.asarray(curr_block_token_ids, dtype=np.int64)
        return hash_fn.hash_blocks(parent, tokens, tokens.shape[0], [extra_keys])[0]
    return BlockHash(hash_fn((parent, tuple(curr_block_token_ids), extra_keys)))


# ---------------------------------------------------------------------------
# Group-qualified keys


def group_id_suffix(group_id: int) -> bytes:
    """The bytes appended to a block hash to key it for `group_id` (4 bytes, big-endian)."""
    return group_id.to_bytes(_GROUP_ID_BYTES, "big")


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """The cache-map key: the block hash with the group id suffix appended."""
    return BlockHashWithGroupId(block_hash + group_id_suffix(group_id))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


# ---------------------------------------------------------------------------
# Extra keys


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


def get_request_block_hasher(
    block_size: int, hash_fn: BlockHashFunction
) -> Callable[[Request], list[BlockHash]]:
    """A hasher returning the hashes of the request's newly full blocks, in order."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    if not isinstance(hash_fn, BlockHashFunction):
        raise ValueError(f"hash_fn must come from get_hash_fn_by_name, got {hash_fn!r}")

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
        tokens = np.asarray(request.all_token_ids[start:end], dtype=np.int64)
        return hash_fn.hash_blocks(parent, tokens, block_size, extra)

    return request_block_hasher


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """Lazy view of fine-grained hashes as hashes of blocks `k` times larger.

    Block `j` of the coarse view is fine hash `(j + 1) * k - 1`, which already
    chains over the whole prefix.
    """

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if hash_block_size <= 0 or target_block_size % hash_block_size != 0:
            raise ValueError(
                f"target block size {target_block_size} must be a positive integer multiple "
                f"of the hash block size {hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"block index {idx} out of range for {n} blocks")
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]
