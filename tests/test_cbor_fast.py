"""`jaxkv.cbor_fast` equals cbor2's canonical encoding, as its docstring states."""

from __future__ import annotations

import cbor2
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.cbor_fast import CBOR_NULL, cbor_head, cbor_uint_arrays

# Every CBOR width boundary, ids past the lookup table, and bytes of the block separator.
_EDGE_IDS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**18 - 1, 2**18, 2**32 - 1]
_SEPARATOR_LIKE = [0xFF, 0xFEFD, 0xFFFEFDFC, 0xFBFAF9F8, 0xF9F8FFFE, 0xF8]
_TRAILERS = [CBOR_NULL, cbor2.dumps((("cache_salt", "s"),), canonical=True), b"\xf6\x00"]


_SPECIAL = np.array(_EDGE_IDS + _SEPARATOR_LIKE, np.uint32)


def _draw_ids(data, n: int) -> np.ndarray:
    """`n` token ids, each on its own an edge id or a random id of a random CBOR width (one,
    two, three or five bytes). Two byte strings are drawn, not a list of `n` integers:
    Hypothesis draws a list element by element, ten times slower for blocks of 256 ids;
    shrinking the bytes towards zeros still shrinks the ids towards 0."""
    kind = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.uint8) % 5
    raw = np.frombuffer(data.draw(st.binary(min_size=4 * n, max_size=4 * n)), np.uint32)
    widths = [raw % 24, raw % 256, raw % 65536, raw, _SPECIAL[raw % len(_SPECIAL)]]
    return np.choose(kind, widths).astype(np.uint32)


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 5, 16, 23, 24, 25, 256]),
    data=st.data(),
)
def test_cbor_uint_arrays_equal_cbor2_canonical(block_size, data):
    num_blocks = data.draw(st.integers(1, 6))
    tokens = _draw_ids(data, num_blocks * block_size)
    ids = tokens.tolist()
    trailers = data.draw(
        st.one_of(
            st.just([CBOR_NULL] * num_blocks),
            st.lists(st.sampled_from(_TRAILERS), min_size=num_blocks, max_size=num_blocks),
        )
    )
    got = cbor_uint_arrays(tokens, block_size, trailers)
    expected = [
        cbor2.dumps(ids[i * block_size : (i + 1) * block_size], canonical=True) + trailer
        for i, trailer in enumerate(trailers)
    ]
    assert got == expected


def test_cbor_head_and_null_equal_cbor2():
    assert CBOR_NULL == cbor2.dumps(None)
    for value in (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1):
        assert cbor_head(0, value) == cbor2.dumps(value, canonical=True)
    for length in (0, 5, 24, 300):
        assert cbor_head(4, length) == cbor2.dumps([0] * length, canonical=True)[: -length or None]
        assert cbor_head(2, length) + b"x" * length == cbor2.dumps(b"x" * length, canonical=True)
