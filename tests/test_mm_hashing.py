"""Content hashes of multimodal items: equal content shares, any difference separates."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxkv.mm_hashing import hash_mm_item, processor_kwargs_digest

IMAGE = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)


def test_hash_is_sha256_hex_and_deterministic():
    digest = hash_mm_item(IMAGE)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert hash_mm_item(IMAGE.copy()) == digest
    assert hash_mm_item(np.array(IMAGE.tolist(), dtype=np.uint8)) == digest


def test_layout_and_byte_order_do_not_matter_values_do():
    fortran = np.asfortranarray(IMAGE)
    assert hash_mm_item(fortran) == hash_mm_item(IMAGE)
    floats = IMAGE.astype("<f4")
    assert hash_mm_item(floats.astype(">f4")) == hash_mm_item(floats)
    strided = np.arange(20, dtype=np.int32)[::2]
    assert hash_mm_item(strided) == hash_mm_item(np.ascontiguousarray(strided))


def test_one_pixel_shape_or_dtype_change_changes_the_hash():
    base = hash_mm_item(IMAGE)
    changed = IMAGE.copy()
    changed[3, 4, 2] ^= 1
    assert hash_mm_item(changed) != base
    assert hash_mm_item(IMAGE.reshape(5, 4, 3)) != base  # same bytes, other shape
    assert hash_mm_item(IMAGE.view(np.int8)) != base  # same bytes, other dtype
    assert hash_mm_item(IMAGE.astype(np.uint16)) != base
    assert hash_mm_item(IMAGE, modality="video") != base
    assert hash_mm_item(IMAGE.tobytes()) != base  # raw bytes are not the array
    assert hash_mm_item(np.uint8(7)) != hash_mm_item(np.array([7], np.uint8))  # 0-d vs 1-d


def test_processor_kwargs_separate_same_pixels_but_not_kwarg_order():
    plain = hash_mm_item(IMAGE)
    assert hash_mm_item(IMAGE, processor_kwargs={}) == plain
    assert hash_mm_item(IMAGE, processor_kwargs=None) == plain
    a = hash_mm_item(IMAGE, processor_kwargs={"size": 336, "crop": True})
    b = hash_mm_item(IMAGE, processor_kwargs={"crop": True, "size": 336})
    assert a == b
    assert a != plain
    assert hash_mm_item(IMAGE, processor_kwargs={"size": 448, "crop": True}) != a
    assert hash_mm_item(IMAGE, processor_kwargs={"size": 336.0, "crop": True}) != a
    assert hash_mm_item(IMAGE, processor_kwargs={"size": np.int64(336), "crop": True}) == a
    nested = {"mean": [0.5, 0.5, 0.5], "grid": {"rows": 2, "cols": 3}}
    reordered = {"grid": {"cols": 3, "rows": 2}, "mean": (0.5, 0.5, 0.5)}
    assert hash_mm_item(IMAGE, processor_kwargs=nested) == hash_mm_item(
        IMAGE, processor_kwargs=reordered
    )
    assert processor_kwargs_digest({"x": np.ones(3, np.float32)}) != processor_kwargs_digest(
        {"x": np.ones(3, np.float64)}
    )


def test_raw_bytes_item():
    data = b"\x89PNG\r\n\x1a\n fake image"
    assert hash_mm_item(data) == hash_mm_item(bytearray(data)) == hash_mm_item(memoryview(data))
    assert hash_mm_item(data) != hash_mm_item(data + b"\0")


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="dtype object"):
        hash_mm_item(np.array([object(), object()]))
    with pytest.raises(TypeError, match="processor kwarg names must be str, got 3"):
        hash_mm_item(IMAGE, processor_kwargs={3: "x"})
    with pytest.raises(TypeError, match="has no canonical encoding"):
        hash_mm_item(IMAGE, processor_kwargs={"fn": len})
    with pytest.raises(TypeError, match="processor_kwargs must be a mapping"):
        processor_kwargs_digest([("size", 3)])
    with pytest.raises(ValueError, match="modality must be a non-empty string"):
        hash_mm_item(IMAGE, modality="")


def test_processor_kwargs_digest_is_sha256_of_canonical_encoding():
    digest = processor_kwargs_digest({"b": 1, "a": 2})
    assert digest == processor_kwargs_digest({"a": 2, "b": 1})
    # Canonical CBOR: a map of 2 with keys in sorted order, "a" -> 2 then "b" -> 1.
    assert digest == hashlib.sha256(bytes.fromhex("a2616102616201")).digest()


arrays = hnp.arrays(
    dtype=st.sampled_from([np.uint8, np.int16, np.float32, np.bool_]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
)


@settings(max_examples=80, deadline=None)
@given(a=arrays, b=arrays)
def test_hash_equal_iff_dtype_shape_and_bytes_equal(a, b):
    same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert (hash_mm_item(a) == hash_mm_item(b)) == same
