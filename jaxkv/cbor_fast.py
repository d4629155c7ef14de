"""Canonical CBOR of runs of token blocks, built with numpy passes instead of per token.

What it equals: for `tokens` a uint32 array of `len(trailers) * block_size`
ids, `cbor_uint_arrays(tokens, block_size, trailers)[i]` is
``cbor2.dumps(tokens[i * block_size:(i + 1) * block_size].tolist(), canonical=True)
+ trailers[i]`` — the canonical (shortest-form) CBOR array of each block's ids,
then its trailer. `cbor_head(major, value)` is the canonical CBOR head
cbor2 writes for major type `major` with argument `value`; `CBOR_NULL` is
``cbor2.dumps(None)``. `tests/test_cbor_fast.py::test_cbor_uint_arrays_equal_cbor2_canonical`
proves the equality on random and edge-case ids (every width boundary, bytes
like the block separator) and block sizes; the digests built from it are
checked against vLLM's in `tests/test_hashing.py`.

How: each token's encoding (head byte + 0, 1, 2 or 4 argument bytes) is
written into a little-endian uint64 "row" (a lookup table below 2**18), the
rows of a run are laid out with the array heads, trailers and a separator
that cannot occur inside an encoding, compacted to their real bytes in one
numpy pass and split per block with one `bytes.split`.
"""

from __future__ import annotations

import functools

import numpy as np

CBOR_NULL = b"\xf6"


@functools.lru_cache(maxsize=256)
def cbor_head(major: int, value: int) -> bytes:
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


# Rows are read back byte by byte, so they are little-endian on any host.
_ROW_DTYPE = np.dtype("<u8")


def _cbor_uint_rows(tokens: np.ndarray) -> np.ndarray:
    """Canonical CBOR of each uint32 token as a little-endian uint64 "row".

    A row holds the encoding in its first bytes (head byte, then the big-endian
    argument), zeros after it.
    """
    ge256 = (tokens >= 256).view(np.uint8)
    ge64k = (tokens >= 65536).view(np.uint8)
    width = (tokens >= 24).view(np.uint8) + ge256  # argument bytes: 0, 1, 2 or 4
    width += ge64k
    width += ge64k
    shift = np.uint8(32) - np.uint8(8) * width
    rows = tokens.byteswap().astype(_ROW_DTYPE)
    np.right_shift(rows, shift, out=rows)  # drop the argument's leading zero bytes
    np.left_shift(rows, np.uint64(8), out=rows)  # room for the head byte
    head = np.where(width == 0, tokens.astype(np.uint8), np.uint8(24) + ge256 + ge64k)
    np.bitwise_or(rows, head, out=rows)
    return rows


# Token ids below this (2**18 covers today's vocabularies) encode through a lookup table.
_CBOR_TABLE_SIZE = 1 << 18


@functools.cache
def _cbor_table_rows() -> np.ndarray:
    """`_cbor_uint_rows` of every id below `_CBOR_TABLE_SIZE` (built on first use)."""
    return _cbor_uint_rows(np.arange(_CBOR_TABLE_SIZE, dtype=np.uint32))


def _cbor_rows(tokens: np.ndarray) -> np.ndarray:
    """`_cbor_uint_rows(tokens)`, by table lookup where the ids allow."""
    try:  # `take` checks the bounds anyway: cheaper than a max() up front
        return _cbor_table_rows().take(tokens)
    except IndexError:
        return _cbor_uint_rows(tokens)


# Separates the blocks of an encoded run, so that one C-level `bytes.split` cuts the
# run into per-block payloads. It cannot occur inside a block's encoding: every token
# starts with a head byte <= 0x1a and has at most 4 argument bytes after it, so at most
# 5 bytes in a row (argument bytes then the 0xf6 trailer, or the array head) are above
# 0x1a, and its 8 bytes all are. Being border-free (no proper prefix equal to a
# suffix), it cannot overlap a real separator either.
_BLOCK_SEPARATOR = b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8"


def _row_length(first_byte: int) -> int:
    """Real bytes in a row starting with `first_byte`.

    Rows hold a CBOR uint or array head (1 + 0, 1, 2 or 4 argument bytes), the
    null trailer (1 byte) or the block separator.
    """
    if first_byte == _BLOCK_SEPARATOR[0]:
        return len(_BLOCK_SEPARATOR)
    return 1 + {24: 1, 25: 2, 26: 4}.get(first_byte & 0x1F, 0)


# By a row's first byte: its mask, a 0x01 byte at each real byte.
_ROW_MASK_BY_FIRST_BYTE = np.array(
    [int.from_bytes(b"\x01" * _row_length(first), "little") for first in range(256)],
    dtype=_ROW_DTYPE,
)


@functools.lru_cache(maxsize=16)
def _run_rows_template(block_size: int, null_trailers: bool, capacity: int) -> np.ndarray:
    """Rows of `capacity` blocks: array head, `block_size` token slots (zero), the null
    trailer if `null_trailers`, the separator."""
    extras = [CBOR_NULL, _BLOCK_SEPARATOR] if null_trailers else [_BLOCK_SEPARATOR]
    template = np.zeros((capacity, block_size + 1 + len(extras)), dtype=_ROW_DTYPE)
    template[:, 0] = int.from_bytes(cbor_head(4, block_size), "little")
    for column, encoding in enumerate(extras, start=block_size + 1):
        template[:, column] = int.from_bytes(encoding, "little")
    template.flags.writeable = False
    return template


def cbor_uint_arrays(tokens: np.ndarray, block_size: int, trailers: list[bytes]) -> list[bytes]:
    """Per block of `block_size` uint32 tokens: their canonical CBOR array, then its trailer.

    Each block's rows ([array head, tokens..., null trailer when every block has
    one, separator]) are compacted to their real bytes in one numpy pass, then
    split at the separators.
    """
    num_blocks = len(trailers)
    null_trailers = trailers.count(CBOR_NULL) == num_blocks
    capacity = 1 << (num_blocks - 1).bit_length()
    rows = _run_rows_template(block_size, null_trailers, capacity)[:num_blocks].copy()
    rows[:, 1 : block_size + 1] = _cbor_rows(tokens).reshape(num_blocks, block_size)
    row_bytes = rows.view(np.uint8)
    masks = _ROW_MASK_BY_FIRST_BYTE.take(row_bytes[:, ::8])
    stream = row_bytes.ravel().compress(masks.view(np.bool_).ravel()).tobytes()
    arrays = stream.split(_BLOCK_SEPARATOR)
    arrays.pop()  # the empty remainder after the last separator
    if null_trailers:
        return arrays
    return [array + trailer for array, trailer in zip(arrays, trailers, strict=True)]
