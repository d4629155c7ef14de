"""Chained block hashing: the keys of the prefix cache.

`hash(block i) = H(parent, tokens of block i, extra_keys)`, with `parent` the
hash of block i-1 or `NONE_HASH` for block 0, so equal hashes mean equal whole
prefixes (SPEC §2).

Hash functions, by name:

- ``sha256_cbor`` / ``xxhash_cbor``: vLLM's wire format. The payload is the
  canonical CBOR array ``[parent_digest, [token ids], extra_keys or null]``,
  hashed with SHA-256 (32-byte digests) or XXH3-128 (16-byte digests). The
  digests are bit-identical to vLLM's, so KV-aware routers agree with us.
  Token ids are CBOR-encoded for a whole run of blocks at once with numpy
  (`jaxkv.cbor_fast`), which is what makes this path faster than calling
  ``cbor2.dumps`` per block.
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

import array
import functools
import hashlib
import marshal
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import numpy as np
import xxhash

from jaxkv._checks import AssertedValueError, check_int
from jaxkv.cbor_fast import CBOR_NULL, cbor_head, cbor_uint_arrays

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
ExtraKeys = tuple[tuple[Any, ...], ...] | None

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_GROUP_ID_BYTES = 4

# ---------------------------------------------------------------------------
# Encodings


@functools.lru_cache(maxsize=64)
def _raw_block_struct(block_size: int) -> struct.Struct:
    """The raw encoding's token count and tokens: ``uint32_le(n) || n x int64_le``."""
    return struct.Struct(f"<I{block_size}q")


def _canonical_cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def tokens_to_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as a numpy array: uint32 when they fit (the fast path), else int64.

    TypeError for anything but integers (a float would be truncated and share
    cache entries with its integer part); ValueError for ids outside [0, 2**63).
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype in (np.uint32, np.int64):
        return token_ids
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"token ids must be a sequence of integers, got {token_ids!r}")
    try:
        return np.frombuffer(array.array("I", token_ids), dtype=np.uint32)
    except OverflowError:
        pass
    except TypeError:
        if not isinstance(token_ids, np.ndarray) or token_ids.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got {list(token_ids)[:8]!r}...") from None
    try:
        return np.frombuffer(array.array("q", token_ids), dtype=np.int64)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**63), got one out of that range") from None
    except TypeError:  # an int64/uint64 array whose values array("q") would not take
        return np.asarray(token_ids, dtype=np.int64)


def extra_keys_identity(extra_keys: ExtraKeys) -> object:
    """A key for caching by extra keys: equal iff the two values encode identically.

    Python's `==` makes `True`, `1` and `1.0` equal (and hash alike), but their CBOR
    encodings differ, so a cache keyed by the extra keys themselves would hand one
    the other's digest. marshal format 0 (no back-references, no interning flags)
    writes each value with its exact type; a value it cannot write gets a fresh
    object, equal to nothing, so it is never shared.
    """
    if extra_keys is None:
        return None
    try:
        return marshal.dumps(extra_keys, 0)
    except ValueError:
        return object()


def _chain_by_seeded_copies(
    seeded_copy: Callable[[], Any], parent: bytes, tails: list[bytes]
) -> list[BlockHash]:
    """`digest(head + parent + tail)` for each tail in turn, each digest the next parent,
    where `seeded_copy()` returns a fresh hasher that has absorbed `head`."""
    digests: list[BlockHash] = []
    append = digests.append
    for tail in tails:
        hasher = seeded_copy()
        hasher.update(parent)
        hasher.update(tail)
        parent = hasher.digest()
        append(parent)
    return digests


def _chain_by_oneshot(
    digest: Callable[[bytes], bytes], head: bytes, parent: bytes, tails: list[bytes]
) -> list[BlockHash]:
    """As `_chain_by_seeded_copies`, with a one-shot digest function."""
    return [parent := digest(head + parent + tail) for tail in tails]


class BlockHashFunction:
    """A named block hash: a digest over an encoding of (parent, tokens, extra keys).

    Callable on any object (``fn(obj) -> bytes``), like vLLM's hash functions;
    `hash_blocks` hashes a whole chain of full blocks in one call.
    """

    def __init__(
        self,
        name: str,
        new_hasher: Callable[[bytes], Any],
        cbor: bool,
        cryptographic: bool,
        oneshot_digest: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.name = name
        self.__name__ = name  # as vLLM's hash functions (plain functions) have
        # hashlib-style constructor: new_hasher(data).digest() is the digest of data.
        self.new_hasher = new_hasher
        self.oneshot_digest = oneshot_digest
        self.digest_size = new_hasher(b"").digest_size
        self.cbor = cbor
        self.cryptographic = cryptographic
        self.per_block_run_limit = 3 if cbor else 1
        # What precedes a parent digest of the usual length in a payload.
        self._payload_head = b"\x83" + cbor_head(2, self.digest_size) if cbor else b""
        self._extra_cache: dict[object, bytes] = {}
        self._null_extra = self._encode_extra_uncached(None)  # a block without extra keys
        self._chain: Callable[[bytes, list[bytes]], list[BlockHash]]
        if oneshot_digest is not None:
            self._chain = functools.partial(_chain_by_oneshot, oneshot_digest, self._payload_head)
        else:
            # hashlib's constructors pay OpenSSL 3's algorithm fetch on every call;
            # copying a hasher that already holds the head skips it, and the head +
            # parent concatenation per block (benchmarks/RESULTS.md, design figures).
            seeded_copy = new_hasher(self._payload_head).copy
            self._chain = functools.partial(_chain_by_seeded_copies, seeded_copy)

    def __repr__(self) -> str:
        return f"BlockHashFunction({self.name!r})"

    def digest(self, data: bytes) -> bytes:
        if self.oneshot_digest is not None:
            return self.oneshot_digest(data)
        return self.new_hasher(data).digest()

    def __call__(self, obj: Any) -> bytes:
        """Hash an arbitrary object; `(parent, tokens, extra)` triples hash like blocks."""
        if (
            isinstance(obj, tuple)
            and len(obj) == 3
            and isinstance(obj[0], bytes)
            and isinstance(obj[1], (tuple, list))
        ):
            parent, tokens, extra = obj
            return self.hash_blocks(parent, list(tokens), len(tokens), [extra])[0]
        return self.digest(_canonical_cbor(obj))

    def _encode_extra(self, extra_keys: ExtraKeys) -> bytes:
        identity = extra_keys_identity(extra_keys)
        cached = self._extra_cache.get(identity)
        if cached is None:
            cached = self._encode_extra_uncached(extra_keys)
            # A fresh object (keys marshal cannot write) would never be looked up again.
            if type(identity) is not object and len(self._extra_cache) < 4096:
                self._extra_cache[identity] = cached
        return cached

    def _encode_extra_uncached(self, extra_keys: ExtraKeys) -> bytes:
        if self.cbor:
            return CBOR_NULL if extra_keys is None else _canonical_cbor(extra_keys)
        return b"\x00" if extra_keys is None else b"\x01" + _canonical_cbor(extra_keys)

    def hash_blocks(
        self,
        parent: bytes,
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        extra_keys: Sequence[ExtraKeys],
    ) -> list[BlockHash]:
        """Chain-hash `len(extra_keys)` consecutive full blocks of `token_ids`.

        `token_ids` holds exactly `len(extra_keys) * block_size` ids, integers in
        [0, 2**63) (TypeError/ValueError otherwise, before anything is hashed).
        """
        if not isinstance(parent, bytes):
            raise TypeError(f"parent must be a bytes digest, got {parent!r}")
        if not isinstance(extra_keys, Sequence) or isinstance(extra_keys, (str, bytes)):
            raise TypeError(
                f"extra_keys must be a sequence (one entry per block), got {extra_keys!r}"
            )
        check_int("block_size", block_size, min_value=1)
        tokens = tokens_to_array(token_ids)
        if tokens.dtype.kind == "i" and tokens.size and int(tokens.min()) < 0:
            raise ValueError(f"token ids must be non-negative, got {int(tokens.min())}")
        return self.hash_checked_blocks(parent, tokens, block_size, extra_keys)

    def hash_checked_blocks(
        self,
        parent: bytes,
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        extra_keys: Sequence[ExtraKeys],
    ) -> list[BlockHash]:
        """`hash_blocks` for ids known to be integers in [0, 2**63): a `Request`'s, checked
        when they entered it (the request hasher's path)."""
        num_blocks = len(extra_keys)
        if block_size <= 0 or len(token_ids) != num_blocks * block_size:
            raise ValueError(
                f"hash_blocks needs a positive block size and {num_blocks} x {block_size} "
                f"tokens, got {len(token_ids)}"
            )
        if num_blocks == 1:  # a decode step filled a block: the lean path
            tails = [self._encode_block(token_ids, extra_keys[0])]
        else:
            tails = self._encode_run(token_ids, block_size, extra_keys)
        if len(parent) == self.digest_size or not self.cbor or not tails:
            return self._chain(parent, tails)
        # A first parent of another length (e.g. a NONE_HASH made by another function)
        # takes another CBOR head.
        parent = self.digest(b"\x83" + cbor_head(2, len(parent)) + parent + tails[0])
        return [parent, *self._chain(parent, tails[1:])]

    def _encode_block(self, token_ids: Sequence[int] | np.ndarray, extra_keys: ExtraKeys) -> bytes:
        """What follows the parent digest in one block's payload; the ids are integers in
        [0, 2**63) (`hash_blocks` checks them, `hash_checked_blocks`' callers did)."""
        if type(token_ids) is not list:
            token_ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
        if self.cbor:
            try:  # cbor2 encodes integers in their shortest (canonical) form
                encoded = cbor2.dumps(token_ids)
            except cbor2.CBOREncodeError:  # numpy integers in a Python list
                encoded = cbor2.dumps([int(t) for t in token_ids])
        else:
            encoded = _raw_block_struct(len(token_ids)).pack(len(token_ids), *token_ids)
        if extra_keys is None:
            return encoded + self._null_extra
        return encoded + self._encode_extra(extra_keys)

    def _encode_run(
        self,
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        extra_keys: Sequence[ExtraKeys],
    ) -> list[bytes]:
        """`_encode_block` of each block of a run.

        Runs of up to `per_block_run_limit` blocks are encoded block by block,
        longer ones in numpy passes, whose fixed cost per call only pays off
        beyond that (the break-even points are in benchmarks/RESULTS.md, design
        figures).
        """
        num_blocks = len(extra_keys)
        if num_blocks <= self.per_block_run_limit:
            encode = self._encode_block
            return [
                encode(token_ids[i * block_size : (i + 1) * block_size], extra)
                for i, extra in enumerate(extra_keys)
            ]
        if extra_keys.count(None) == num_blocks:
            trailers = [self._null_extra] * num_blocks
        else:
            trailers = [self._encode_extra(e) for e in extra_keys]
        tokens = token_ids if isinstance(token_ids, np.ndarray) else tokens_to_array(token_ids)
        if tokens.dtype.kind == "i" and int(tokens.min()) < 0:
            raise ValueError(f"token ids must be non-negative, got {int(tokens.min())}")
        if not self.cbor:
            data = tokens.astype("<i8", copy=False).tobytes()
            count = struct.pack("<I", block_size)
            stride = 8 * block_size
            return [
                count + data[i * stride : (i + 1) * stride] + trailer
                for i, trailer in enumerate(trailers)
            ]
        if tokens.dtype != np.uint32:
            if int(tokens.max()) >= 1 << 32:
                token_list = tokens.tolist()
                return [
                    self._encode_block(token_list[i * block_size : (i + 1) * block_size], e)
                    for i, e in enumerate(extra_keys)
                ]
            tokens = tokens.astype(np.uint32)
        return cbor_uint_arrays(tokens, block_size, trailers)


_HASH_FUNCTIONS: dict[str, BlockHashFunction] = {
    fn.name: fn
    for fn in (
        BlockHashFunction("sha256", hashlib.sha256, cbor=False, cryptographic=True),
        BlockHashFunction("sha256_cbor", hashlib.sha256, cbor=True, cryptographic=True),
        BlockHashFunction(
            "xxhash", xxhash.xxh3_128, False, False, oneshot_digest=xxhash.xxh3_128_digest
        ),
        BlockHashFunction(
            "xxhash_cbor", xxhash.xxh3_128, True, False, oneshot_digest=xxhash.xxh3_128_digest
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


def resolve_none_hash_seed(hash_fn: BlockHashFunction | Callable[[Any], bytes]) -> str:
    """The seed NONE_HASH derives from (vLLM's rule): ``PYTHONHASHSEED`` when set; else
    a fixed seed for a cryptographic hash (processes then share a prefix cache) and a
    fresh random one for a non-cryptographic hash (a known seed would let colliding
    blocks be precomputed)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if getattr(hash_fn, "cryptographic", True):
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(16).hex()


def init_none_hash(
    hash_fn: BlockHashFunction | Callable[[Any], bytes], seed: str | None = None
) -> BlockHash:
    """Set (and return) `NONE_HASH = hash_fn(seed)`, resolving the seed by the module rules."""
    global NONE_HASH, _none_hash_seed
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be callable, got {hash_fn!r}")
    if seed is not None and not isinstance(seed, str):
        raise TypeError(f"seed must be a str or None, got {seed!r}")
    if seed is None:
        seed = resolve_none_hash_seed(hash_fn)
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
    hash_fn: BlockHashFunction | Callable[[Any], Any],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """Hash one block given its parent's hash (`None` → `NONE_HASH`), as in vLLM.

    `hash_fn` is a `BlockHashFunction` or any callable on `(parent, token tuple,
    extra keys)`, e.g. the builtin `hash`.
    """
    parent = get_none_hash() if parent_block_hash is None else parent_block_hash
    tokens = tokens_to_array(curr_block_token_ids)  # TypeError/ValueError for bad ids
    if tokens.dtype.kind == "i" and tokens.size and int(tokens.min()) < 0:
        raise ValueError(f"token ids must be non-negative, got {int(tokens.min())}")
    if isinstance(hash_fn, BlockHashFunction):
        return hash_fn.hash_blocks(parent, tokens, len(tokens), [extra_keys])[0]
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be callable, got {hash_fn!r}")
    return BlockHash(hash_fn((parent, tuple(tokens.tolist()), extra_keys)))


# ---------------------------------------------------------------------------
# Group-qualified keys


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """vLLM's cache key: the block hash, then the group id (4 bytes, big-endian)."""
    if type(group_id) is not int or not 0 <= group_id < 1 << 32:
        check_int("group_id", group_id, min_value=0, max_value=(1 << 32) - 1)
    if not isinstance(block_hash, bytes):
        raise TypeError(f"block_hash must be bytes, got {block_hash!r}")
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """Lazy view of fine-grained hashes as hashes of blocks `k` times larger.

    Block `j` of the coarse view is fine hash `(j + 1) * k - 1`, which already
    chains over the whole prefix.
    """

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        check_int("hash_block_size", hash_block_size, min_value=1)
        check_int("target_block_size", target_block_size, min_value=1)
        if target_block_size % hash_block_size:
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


def resolve_block_hashes(
    block_hashes: Sequence[BlockHash],
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> Sequence[BlockHash]:
    """The request's hashes viewed at `block_size` (the list itself when equal).

    Fine-grained lookups (alignment below the block, dividing it) keep the raw
    hash-unit list so interior boundaries can be probed.
    """
    if block_size == hash_block_size and type(block_hashes) is list:
        return block_hashes  # a request's own hashes (checked first: `isinstance` with an
        # abstract base class costs more than the rest of a lookup's setup)
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        view_block_size = hash_block_size * block_hashes.scale_factor
        if view_block_size != block_size:
            raise AssertedValueError(
                f"block_hashes is a view of {view_block_size}-token blocks; it cannot be read "
                f"as {block_size}-token blocks"
            )
        return block_hashes
    if block_size == hash_block_size:
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    if block_size % hash_block_size:
        raise ValueError(
            f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
        )
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
