"""Content hashes (`mm_hash`) of multimodal items, the keys of the encoder cache.

`hash_mm_item` is SHA-256 over a framed encoding of: a format tag, the
modality, the item itself and the processor kwargs. An array item is encoded
as its dtype (normalised to little-endian), its shape and its C-order bytes, so
identical pixels give identical hashes and any change to a value, the shape
or the dtype gives a different one. Raw bytes (an encoded file) are hashed as
bytes. The processor kwargs are encoded as canonical CBOR (map keys sorted),
so the same pixels preprocessed differently never share a cache entry, while
the order in which kwargs were passed does not matter.

Every component is length-prefixed, so no two different (item, kwargs) pairs
encode to the same byte stream.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import cbor2
import numpy as np

__all__ = ["hash_mm_item", "processor_kwargs_digest"]

_FORMAT = b"jaxkv-mm-hash-v1"


def _frame(hasher: Any, data: bytes | memoryview) -> None:
    hasher.update(struct.pack("<Q", len(data)))
    hasher.update(data)


def _cbor_default(encoder: cbor2.CBOREncoder, value: Any) -> None:
    if isinstance(value, np.generic):
        encoder.encode(value.item())
    elif isinstance(value, np.ndarray):
        array = _canonical_array(value)
        encoder.encode([array.dtype.str, list(array.shape), array.tobytes()])
    else:
        raise TypeError(
            f"processor kwarg value {value!r} of type {type(value).__name__} has no canonical "
            "encoding; use None, bool, int, float, str, bytes, lists, dicts or numpy values"
        )


def processor_kwargs_digest(processor_kwargs: Mapping[str, Any] | None) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `processor_kwargs` (None counts as `{}`).

    Keys must be strings. Lists and tuples encode alike; dict key order does
    not matter; numpy scalars encode as the Python value they hold.
    """
    kwargs = {} if processor_kwargs is None else processor_kwargs
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"processor_kwargs must be a mapping or None, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise TypeError(f"processor kwarg names must be str, got {key!r}")
    try:
        encoded = cbor2.dumps(dict(kwargs), canonical=True, default=_cbor_default)
    except cbor2.CBOREncodeError as error:
        raise TypeError(f"processor kwargs cannot be encoded canonically: {error}") from error
    return hashlib.sha256(encoded).digest()


def _canonical_array(array: np.ndarray) -> np.ndarray:
    if array.dtype.hasobject:
        raise ValueError(
            f"cannot hash an array of dtype {array.dtype}: object arrays hold pointers, not "
            "values; convert it to a numeric dtype first"
        )
    little = array.dtype.newbyteorder("<")
    return np.asarray(array, dtype=little, order="C")  # unlike ascontiguousarray, keeps 0-d


def hash_mm_item(
    item: np.ndarray | bytes | bytearray | memoryview | Any,
    *,
    processor_kwargs: Mapping[str, Any] | None = None,
    modality: str = "image",
) -> str:
    """The hex SHA-256 `mm_hash` of one multimodal item and the kwargs that preprocess it.

    `item` is raw bytes (e.g. an encoded image file) or anything
    `numpy.asarray` accepts (a decoded image, a PIL image, an audio array).
    """
    if not isinstance(modality, str) or not modality:
        raise ValueError(f"modality must be a non-empty string, got {modality!r}")
    hasher = hashlib.sha256()
    _frame(hasher, _FORMAT)
    _frame(hasher, modality.encode())
    if isinstance(item, bytes | bytearray | memoryview):
        _frame(hasher, b"bytes")
        _frame(hasher, memoryview(item).cast("B"))
    else:
        array = _canonical_array(np.asarray(item))
        _frame(hasher, b"array")
        _frame(hasher, array.dtype.str.encode())
        _frame(hasher, struct.pack(f"<{array.ndim}Q", *array.shape))
        _frame(hasher, array.reshape(-1).view(np.uint8).data)
    _frame(hasher, processor_kwargs_digest(processor_kwargs))
    return hasher.hexdigest()
