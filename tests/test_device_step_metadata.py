"""Packed step metadata, buckets, the fused step, and the compile guard."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_device_attention import (
    query_kv,
    random_case,
    random_spans,
    reference_attention,
    rel_error,
)

from jaxkv.block_table import BlockTable
from jaxkv.device import (
    AttentionOptions,
    CompilationError,
    PagedKVCache,
    StepField,
    StepInputs,
    StepLayout,
    StepMetadataPacker,
    StepRows,
    StepShape,
    compilation_count,
    no_compilation,
    padding_buckets,
    pick_bucket,
    token_buckets,
    unpack_step,
)
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)


def test_padding_buckets() -> None:
    assert padding_buckets(1000, 256) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1000)
    assert padding_buckets(16, 256) == (1, 2, 4, 8, 16)
    assert padding_buckets(12, 4) == (1, 2, 4, 8, 12)
    assert padding_buckets(1) == (1,)
    assert pick_bucket(0, (1, 2, 4)) == 1 and pick_bucket(3, (1, 2, 4)) == 4
    with pytest.raises(ValueError, match=r"size 5 is out of range \[0, 4\]"):
        pick_bucket(5, (1, 2, 4))
    with pytest.raises(ValueError, match="must be positive"):
        padding_buckets(0)


def _packer(**kw) -> StepMetadataPacker:
    args = dict(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=4, block_size=4)
    args.update(kw)
    return StepMetadataPacker(num_blocks=64, **args)


@pytest.mark.parametrize(
    ("max_num_tokens", "min_num_tokens", "expected"),
    [
        (64, 16, (16, 32, 64)),
        (64, 1, (1, 16, 32, 64)),  # a CPU's one-token bucket, not a ladder 1, 2, 4, 8
        (64, 4, (4, 16, 32, 64)),
        (64, 32, (32, 64)),
        (8, 1, (1, 8)),
        (6, 16, (6,)),
    ],
)
def test_token_buckets_double_from_the_tile_with_one_smaller_bucket(
    max_num_tokens: int, min_num_tokens: int, expected: tuple[int, ...]
) -> None:
    assert token_buckets(max_num_tokens, min_num_tokens) == expected
    packer = _packer(max_num_tokens=max_num_tokens, min_num_tokens=min_num_tokens)
    assert packer.token_buckets == expected


def test_bucket_ladder_is_logarithmic_one_request_bucket_per_token_bucket() -> None:
    packer = _packer(max_num_tokens=1000, max_num_reqs=24)
    assert packer.token_buckets == (16, 32, 64, 128, 256, 512, 1000)
    assert packer.req_buckets == (1, 2, 4, 8, 16, 24)
    shapes = packer.all_shapes()
    assert [(s.num_tokens, s.num_reqs) for s in shapes] == [
        (16, 16),
        (32, 24),
        (64, 24),
        (128, 24),
        (256, 24),
        (512, 24),
        (1000, 24),
    ]
    # A budget under the minimum bucket is its own only bucket.
    small = _packer(max_num_tokens=6, max_num_reqs=8)
    assert [(s.num_tokens, s.num_reqs) for s in small.all_shapes()] == [(6, 8)]
    # Every packed step lands on a shape of the ladder.
    bt = np.array([[3, 9, 0, 0], [5, 0, 0, 0], [7, 8, 11, 0]])
    step = StepInputs(bt, np.array([6, 2, 10]), np.array([3, 1, 2]))
    assert packer.pack(step)[1] == shapes[0]


def test_pack_unpack_round_trip() -> None:
    packer = _packer(min_num_tokens=8)
    bt = np.array([[3, 9, 0, 0], [5, 0, 0, 0], [7, 8, 11, 0]])
    slots = np.array([15, 36, 37, 21, 44, 45])  # positions 3-5 of row 0, 1 of row 1, 8-9 of row 2
    step = StepInputs(bt, np.array([6, 2, 10]), np.array([3, 1, 2]), slots)
    buf, shape = packer.pack(step)
    assert buf.shape == (1, shape.length) and buf.dtype == np.int32
    assert shape == StepShape(num_tokens=8, num_reqs=4, max_blocks_per_req=4)
    md = jax.jit(unpack_step, static_argnums=1)(jnp.asarray(buf[0]), shape)
    assert int(md.num_tokens) == 6 and int(md.num_reqs) == 3
    np.testing.assert_array_equal(md.block_tables, np.vstack([bt, np.zeros((1, 4))]))
    np.testing.assert_array_equal(md.seq_lens, [6, 2, 10, 0])
    np.testing.assert_array_equal(md.query_start_loc, [0, 3, 4, 6, 6])
    np.testing.assert_array_equal(md.slot_mapping, [*slots, 256, 256])
    np.testing.assert_array_equal(md.positions, [3, 4, 5, 1, 8, 9, 0, 0])


def test_pack_derives_the_slots_it_is_not_given() -> None:
    packer = _packer()
    bt = np.array([[3, 9, 0, 0], [5, 0, 0, 0], [7, 8, 11, 0]])
    given = StepInputs(bt, np.array([6, 2, 10]), np.array([3, 1, 2]), [15, 36, 37, 21, 44, 45])
    derived = StepInputs(bt, given.seq_lens, given.query_lens)
    np.testing.assert_array_equal(packer.pack(derived)[0], packer.pack(given)[0])
    with pytest.raises(ValueError, match="position 4 of request 0 lies in the null block"):
        packer.pack(StepInputs(np.array([[3, 0, 0, 0]]), [5], [1]))


def test_pack_names_what_it_wants_for_no_steps_or_not_steps() -> None:
    packer = _packer()
    step = StepInputs(np.array([[3, 9, 0, 0]]), np.array([6]), np.array([3]))
    with pytest.raises(ValueError, match="steps is empty; give a StepInputs or a sequence"):
        packer.pack([])
    with pytest.raises(TypeError, match="steps must be a StepInputs or a sequence .*got int"):
        packer.pack(5)
    with pytest.raises(TypeError, match=r"steps\[1\] must be a StepInputs, got dict"):
        packer.pack([step, {"seq_lens": [6]}])
    shape = packer.pack(step)[1]
    out = np.zeros((0, shape.length), np.int32)
    with pytest.raises(ValueError, match="steps is empty"):
        packer.pack_rows_into([], shape, out)


def test_pack_rows_into_a_view_of_a_larger_buffer_equals_pack() -> None:
    """The runner's path: `pack_rows_into` takes each rank's rows of a persistent table
    (ids trusted: their table checked them) straight into a zeroed view (as the runner's
    step buffer holds the metadata among its other fields), exactly as `pack` fills a
    buffer of its own with those rows; the rest of the larger buffer is untouched, and
    the lengths are still checked."""
    packer = _packer()
    table = np.array([[7, 8, 11, 0], [0, 0, 0, 0], [3, 9, 0, 0], [5, 0, 0, 0]], np.int32)
    rows, seq, ql = np.array([2, 3]), np.array([6, 2]), np.array([3, 1])
    steps = [StepRows(table, rows, seq, ql), StepRows(table, np.array([0]), [10], [1])]
    packed, shape = packer.pack(
        [StepInputs(table[s.rows], s.seq_lens, s.query_lens) for s in steps]
    )
    outer = StepLayout((StepField("before", 2), StepField("metadata", shape.length)))
    buffer = np.zeros((2, outer.length), np.int32)
    buffer[:, :2] = 5
    packer.pack_rows_into(steps, shape, outer.unpack(buffer)["metadata"])
    np.testing.assert_array_equal(buffer[:, 2:], packed)
    assert (buffer[:, :2] == 5).all()
    with pytest.raises(ValueError, match=rf"need \(2, {shape.length}\) int32"):
        packer.pack_rows_into(steps, shape, np.zeros((2, 1), np.int32))
    out = np.zeros((1, shape.length), np.int32)
    with pytest.raises(ValueError, match=r"query_lens\[1\] = 3 exceeds seq_lens\[1\] = 2"):
        packer.pack_rows_into([StepRows(table, rows, seq, [3, 3])], shape, out)
    with pytest.raises(ValueError, match="position 4 of request 1 lies in the null block"):
        packer.pack_rows_into([StepRows(table, rows, [6, 5], ql)], shape, out)


def test_metadata_layout_names_every_field_once() -> None:
    layout = StepShape(num_tokens=4, num_reqs=2, max_blocks_per_req=3).layout
    assert [(f.name, f.length) for f in layout.fields] == [
        ("num_tokens", 1), ("num_reqs", 1), ("block_tables", 6), ("seq_lens", 2),
        ("query_start_loc", 3), ("slot_mapping", 4), ("positions", 4),
    ]  # fmt: skip
    assert layout.length == StepShape(4, 2, 3).length == 21
    assert layout.bounds["slot_mapping"] == (13, 17)


_LAYOUT = StepLayout(
    (StepField("ids", 3), StepField("scale", 2, np.dtype(np.float32)), StepField("count", 1))
)


def test_step_layout_pack_unpack_round_trip() -> None:
    values = {
        "ids": np.array([[1, 2, 3], [4, 5, 6]]),  # per rank
        "scale": np.array([0.5, -2.25], np.float32),  # the same for both ranks
        "count": np.array([[7], [2**31 - 1]], np.int64),
    }
    buf = _LAYOUT.pack(values, num_ranks=2)
    assert buf.shape == (2, 6) and buf.dtype == np.int32
    for unpacked in (
        _LAYOUT.unpack(buf),
        jax.jit(_LAYOUT.unpack)(jnp.asarray(buf)),
    ):
        np.testing.assert_array_equal(unpacked["ids"], values["ids"])
        np.testing.assert_array_equal(unpacked["scale"], np.tile(values["scale"], (2, 1)))
        assert unpacked["scale"].dtype == np.float32
        np.testing.assert_array_equal(unpacked["count"], values["count"])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"ids": np.arange(4)}, ValueError, r"'ids' has shape \(4,\); the layout holds \(3,\)"),
        ({"ids": np.zeros((3, 3), int)}, ValueError, r"'ids' has shape \(3, 3\)"),
        ({"scale": np.zeros(2)}, TypeError, "'scale' holds float32, got float64"),
        ({"ids": np.zeros(3, np.float32)}, TypeError, "'ids' holds integers, got float32"),
        ({"ids": np.zeros(3, bool)}, TypeError, "'ids' holds integers, got bool"),
        ({"count": np.array([2**31])}, ValueError, "'count' holds values outside the int32"),
        ({"extra": np.zeros(1, int)}, ValueError, r"missing: \[\], unknown: \['extra'\]"),
        ({"count": None}, ValueError, r"missing: \['count'\]"),
    ],
)
def test_step_layout_refuses_a_field_that_does_not_fit(change, error, match) -> None:
    values = {"ids": np.arange(3), "scale": np.ones(2, np.float32), "count": np.ones(1, int)}
    values.update(change)
    values = {name: v for name, v in values.items() if v is not None}
    with pytest.raises(error, match=match):
        _LAYOUT.pack(values, num_ranks=2)


def test_step_layout_checks_itself_and_the_buffers_it_slices() -> None:
    with pytest.raises(ValueError, match="must be unique"):
        StepLayout((StepField("a", 1), StepField("a", 2)))
    with pytest.raises(ValueError, match=r"length of step field 'a' must be >= 0"):
        StepLayout((StepField("a", -1),))
    with pytest.raises(ValueError, match="dtype\\('int64'\\); allowed: np.dtype int32"):
        StepLayout((StepField("a", 1, np.dtype(np.int64)),))
    with pytest.raises(ValueError, match="has dtype <class 'numpy.float32'>"):
        StepLayout((StepField("a", 1, np.float32),))
    with pytest.raises(ValueError, match=r"shape \(2, 7\) dtype int32; the layout holds"):
        _LAYOUT.unpack(np.zeros((2, 7), np.int32))
    with pytest.raises(ValueError, match="dtype float32"):
        _LAYOUT.unpack(np.zeros((2, 6), np.float32))


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (StepInputs(np.zeros((1, 3)), [4], [1], [4]), r"block_tables shape \(1, 3\)"),
        (StepInputs(np.array([[64, 0, 0, 0]]), [4], [1], [4]), r"block id value 64 .*\[0, 64\)"),
        (StepInputs(np.zeros((1, 4), int), [17], [1], [4]), r"seq_len value 17 .*\[1, 17\)"),
        (StepInputs(np.zeros((1, 4), int), [2], [3], [4, 5, 6]), r"query_lens\[0\] = 3"),
        (StepInputs(np.zeros((1, 4), int), [4], [2], [4]), r"slot_mapping shape \(1,\)"),
        (StepInputs(np.zeros((1, 4), int), [4], [1], [2]), r"slot value 2 .*\[4, 256\)"),
        (StepInputs(np.zeros((1, 4), int), [4], [0], []), r"query_len value 0 .*\[1, 17\)"),
        (StepInputs(np.zeros((5, 4), int), [4] * 5, [1] * 5, [4] * 5), r"size 5 .*\[0, 4\]"),
        (  # block 5 belongs to no request of this step: position 1 of row 0 is in block 3
            StepInputs(np.array([[3, 0, 0, 0]]), [2], [1], [21]),
            r"slot_mapping\[0\] = 21 is not position 1 of request 0: .* slot 13 \(block 3\)",
        ),
        (  # the right block, the wrong offset
            StepInputs(np.array([[3, 7, 0, 0]]), [6], [2], [28, 28]),
            r"slot_mapping\[1\] = 28 is not position 5 of request 0: .* slot 29",
        ),
    ],
)
def test_pack_rejects_bad_steps(step: StepInputs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _packer().pack(step)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _packer(block_size=4.0), r"block_size must be an integer, got 4.0"),
        (lambda: _packer(max_num_tokens="16"), r"max_num_tokens must be an integer, got '16'"),
        (lambda: _packer(max_num_reqs=True), r"max_num_reqs must be an integer, got True"),
        (lambda: _packer().pack(StepInputs(np.zeros((1, 4)), [4], [1], [4])), r"dtype float64"),
        (lambda: _packer().pack(StepInputs(np.zeros((1, 4), int), [4.0], [1], [4])), "seq_len"),
        (lambda: PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 8.5), "num_blocks .*8.5"),
        (lambda: PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), True), "num_blocks .*True"),
        (
            lambda: PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 8).allocate_stacked(2.0),
            "num_lay",
        ),
        (lambda: PagedKVCache("spec", 8), "spec must be an AttentionSpec"),
    ],
)
def test_sizes_and_ids_must_be_integers(make, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        make()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_writes_and_attends(dtype: str) -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [12, 7, 9, 1], [4, 1, 9, 1], dtype=dtype, pad_tokens=0)
    cache, n = case.cache, case.num_seqs
    packer = StepMetadataPacker(
        max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=5, block_size=4,
        num_blocks=cache.num_blocks,
    )  # fmt: skip
    step = StepInputs(case.block_tables[:n], case.seq_lens[:n], case.q_lens, case.slots)
    buf, shape = packer.pack(step)
    num_q = int(case.q_lens.sum())
    pad = shape.num_tokens - num_q
    q = np.concatenate([case.q[:num_q], np.full((pad, *case.q.shape[1:]), np.nan, cache.dtype)])
    k, v = query_kv(case)  # the step rewrites the stored values at the query positions
    k = np.concatenate([k, rng.standard_normal((pad, *k.shape[1:])).astype(cache.dtype)])
    v = np.concatenate([v, rng.standard_normal((pad, *v.shape[1:])).astype(cache.dtype)])
    before = np.asarray(case.kv)
    kv, out = cache.step(
        case.kv[None], jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), packer.put(buf), shape,
        AttentionOptions(sm_scale=0.4),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kv)[0], before)  # same values rewritten, pads dropped
    out = np.asarray(out).astype(np.float64)
    want = reference_attention(case, sm_scale=0.4)
    assert np.isfinite(out).all() and not out[num_q:].any()
    assert rel_error(out[:num_q], want[:num_q]) < (1e-5 if dtype == "float32" else 2e-2)


def _packed(case, max_num_tokens: int):
    """`case`'s batch packed on device: (buffer, shape, query rows, queries padded to the
    shape's tokens)."""
    cache, n = case.cache, case.num_seqs
    packer = StepMetadataPacker(
        max_num_tokens=max_num_tokens, max_num_reqs=8,
        max_blocks_per_req=case.block_tables.shape[1], block_size=cache.block_size,
        num_blocks=cache.num_blocks,
    )  # fmt: skip
    buf, shape = packer.pack(
        StepInputs(case.block_tables[:n], case.seq_lens[:n], case.q_lens, case.slots)
    )
    num_q = int(case.q_lens.sum())
    pad = shape.num_tokens - num_q
    q = np.concatenate([case.q[:num_q], np.zeros((pad, *case.q.shape[1:]), cache.dtype)])
    return packer.put(buf), shape, num_q, q


def _run_step(case, rng, span_ends=None, **options) -> np.ndarray:
    """`case`'s batch through `PagedKVCache.step` (same K/V rewritten) with
    `AttentionOptions(sm_scale=0.4, **options)`; output rows."""
    cache = case.cache
    buf, shape, num_q, q = _packed(case, 32)
    pad = shape.num_tokens - num_q
    k, v = (np.concatenate([x, np.zeros((pad, *x.shape[1:]), cache.dtype)]) for x in query_kv(case))
    if span_ends is not None:
        span_ends = jnp.asarray(np.pad(span_ends[:num_q], (0, pad)), jnp.int32)
    stack, out = cache.step(
        case.kv[None], jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), buf, shape,
        AttentionOptions(sm_scale=0.4, **options), span_ends=span_ends,
    )  # fmt: skip
    case.kv = stack[0]
    return np.asarray(out)[:num_q]


@pytest.mark.parametrize(
    ("spec", "mask"),
    [
        (SlidingWindowSpec(4, 2, 8, "float32", sliding_window=5), {"sliding_window": 5}),
        (ChunkedLocalAttentionSpec(4, 2, 8, "float32", attention_chunk_size=8),
         {"attention_chunk": 8}),
    ],
)  # fmt: skip
def test_cache_built_from_a_spec_applies_its_mask(spec, mask) -> None:
    rng = np.random.default_rng()
    cache = PagedKVCache(spec, 40)
    case = random_case(rng, [19, 7, 13], [9, 1, 4], cache=cache, pad_tokens=0)
    num_q = int(case.q_lens.sum())
    want = reference_attention(case, sm_scale=0.4, **mask)[:num_q]
    assert rel_error(_run_step(case, rng), want) < 1e-5  # not told again
    assert rel_error(_run_step(case, rng, **mask), want) < 1e-5  # told the same: fine
    full = reference_attention(case, sm_scale=0.4)[:num_q]
    assert np.abs(full - want).max() > 1e-3, "the mask must matter in this case"
    ((name, value),) = mask.items()
    with pytest.raises(ValueError, match=f"{name}={value + 1} conflicts with this cache's spec"):
        _run_step(case, rng, **{name: value + 1})


def test_step_bidirectional_spans() -> None:
    rng = np.random.default_rng()
    case = random_case(rng, [19, 7, 13], [9, 1, 4], pad_tokens=0)
    ends = random_spans(rng, case)
    num_q = int(case.q_lens.sum())
    want = reference_attention(case, sm_scale=0.4, span_ends=ends)[:num_q]
    assert rel_error(_run_step(case, rng, span_ends=ends), want) < 1e-5
    with pytest.raises(ValueError, match="span_ends has shape"):
        _run_step(case, rng, span_ends=jnp.zeros(3, jnp.int32))


def test_step_rejects_mismatched_inputs() -> None:
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    kv = cache.allocate_stacked(1)
    packer = _packer(max_num_reqs=1, min_num_tokens=4)
    shape = StepShape(4, 1, 4)
    buf = packer.put(packer.empty(shape))
    q = jnp.zeros((4, 4, 8))
    k = jnp.zeros((4, 2, 8))
    with pytest.raises(ValueError, match=r"q has shape \(3, 4, 8\); expected \[4,"):
        cache.step(kv, q[:3], k, k, buf, shape)
    with pytest.raises(ValueError, match=r"metadata has shape \(1, 10\)"):
        cache.step(kv, q, k, k, buf[:, :10], shape)
    with pytest.raises(ValueError, match="not one of this packer's bucket shapes"):
        packer.empty(StepShape(3, 1, 4))
    assert not kv.is_deleted()


def _random_step(
    rng: np.random.Generator, packer: StepMetadataPacker, max_tokens: int = 16
) -> StepInputs:
    """A random step of at most 4 requests and `max_tokens` scheduled tokens."""
    bs, width = packer.block_size, packer.max_blocks_per_req
    n_reqs = int(rng.integers(1, min(4, max_tokens) + 1))
    budget = int(rng.integers(n_reqs, max_tokens + 1))
    q_lens = np.ones(n_reqs, int)
    for _ in range(budget - n_reqs):
        q_lens[rng.integers(n_reqs)] += 1
    seq_lens = np.minimum(q_lens + rng.integers(0, 12, n_reqs), width * bs)
    q_lens = np.minimum(q_lens, seq_lens)
    table = BlockTable(bs, n_reqs, width, num_blocks=packer.num_blocks)
    ids = rng.permutation(np.arange(1, packer.num_blocks))
    for r in range(n_reqs):
        table.add_row(ids[r * width : r * width + -(-int(seq_lens[r]) // bs)], r)
    req = np.repeat(np.arange(n_reqs), q_lens)
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens, strict=True)])
    slots = table.compute_slot_mapping(req, pos)
    return StepInputs(table.get_numpy_array(), seq_lens, q_lens, slots)


def test_no_compilation_after_warmup_over_200_random_steps() -> None:
    rng = np.random.default_rng()
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    kv = cache.allocate_stacked(1)
    packer = _packer(max_num_tokens=64, min_num_tokens=1)
    hq = 4

    def run(kv, buf, shape):
        t = shape.num_tokens
        q = jnp.asarray(rng.standard_normal((t, hq, 8)), jnp.float32)
        k = rng.standard_normal((t, 2, 8)).astype(np.float32)
        v = rng.standard_normal((t, 2, 8)).astype(np.float32)
        kv, out = cache.step(kv, q, jnp.asarray(k), jnp.asarray(v), packer.put(buf), shape)
        return kv, out, k, v

    start = compilation_count()
    for shape in packer.all_shapes():  # warm-up: every bucket pair once
        kv, *_ = run(kv, packer.empty(shape), shape)
    warm = compilation_count()
    assert warm - start >= len(packer.all_shapes()), "the counter must see warm-up compiles"
    assert len(packer.all_shapes()) == 4  # token buckets 1, 16, 32, 64; one request bucket each

    model = np.asarray(kv).reshape(-1, 4, 8).copy()
    seen: set[StepShape] = set()
    with no_compilation("200 random serving steps"):
        for i in range(200):
            # Every fifth step decodes one token, so both small buckets are served.
            step = _random_step(rng, packer, max_tokens=1 if i % 5 == 0 else 16)
            buf, shape = packer.pack(step)
            seen.add(shape)
            kv, out, k, v = run(kv, buf, shape)
            fields = shape.layout.unpack(buf[0])
            n = int(fields["num_tokens"][0])
            slots = fields["slot_mapping"][:n]
            model[slots, 0::2], model[slots, 1::2] = k[:n], v[:n]
            assert np.isfinite(np.asarray(out)).all()
    assert {s.num_tokens for s in seen} == {1, 16}, f"the stream hits buckets 1 and 16, hit {seen}"
    np.testing.assert_array_equal(np.asarray(kv).reshape(-1, 4, 8), model)

    x = jnp.asarray(np.arange(5))
    with pytest.raises(CompilationError, match=r"1 program\(s\) were compiled during probe"):
        with no_compilation("probe"):
            jax.jit(lambda x: x * 3 + 1)(x)


@pytest.mark.parametrize("window", [None, 5])
def test_stacked_layer_step_is_the_layer_step_on_one_layer_of_the_stack(window) -> None:
    """Layer and window traced (as a scanned layer body passes them): the stack's layer
    gets exactly what `step` writes and attends on a cache of its own; the other layers
    are untouched."""
    rng = np.random.default_rng(7)
    case = random_case(rng, [12, 7, 9, 1], [4, 1, 9, 1], pad_tokens=0)
    cache = case.cache
    buf, shape, num_q, q = _packed(case, 16)
    k, v = (rng.standard_normal((shape.num_tokens, 2, 8)).astype(cache.dtype) for _ in "kv")
    layers = [rng.standard_normal(cache.shape).astype(cache.dtype) for _ in range(3)]
    layers[1] = np.asarray(case.kv)
    stack = jax.device_put(np.stack(layers), cache.stacked_sharding)

    @jax.jit
    def stacked_step(stack, layer, window):
        return cache.stacked_layer_step(
            stack, layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), buf, shape,
            AttentionOptions(sm_scale=0.4), window=window,
        )  # fmt: skip

    traced_window = None if window is None else jnp.int32(window)
    stack, out = stacked_step(stack, jnp.int32(1), traced_window)
    kv, want = cache.step(
        case.kv[None], jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), buf, shape,
        AttentionOptions(sm_scale=0.4, sliding_window=window),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out)[:num_q], np.asarray(want)[:num_q], rtol=1e-6)
    got = np.asarray(stack)
    np.testing.assert_array_equal(got[1], np.asarray(kv)[0])
    np.testing.assert_array_equal(got[0], layers[0])
    np.testing.assert_array_equal(got[2], layers[2])
    # Copies and zeroing reach every layer of the stack.
    stack = cache.copy_blocks_stacked(stack, [3], [5])
    stack = cache.zero_blocks_stacked(stack, [2])
    want_stack = got.copy()
    want_stack[:, 5] = got[:, 3]
    want_stack[:, 2] = 0
    np.testing.assert_array_equal(np.asarray(stack), want_stack)
    with pytest.raises(ValueError, match=r"expects \[num_layers, \*shape\]"):
        cache.zero_blocks_stacked(jnp.zeros(cache.shape, cache.storage_dtype), [2])


def test_attention_options_are_validated_once_and_hash_as_a_key() -> None:
    assert AttentionOptions(sm_scale=np.float32(0.5), sliding_window=np.int64(4)) == (
        AttentionOptions(sm_scale=0.5, sliding_window=4)
    )
    assert hash(AttentionOptions(soft_cap=30)) == hash(AttentionOptions(soft_cap=30.0))
    for field, value, error, message in [
        ("sliding_window", 0, ValueError, "sliding_window must be >= 1, got 0"),
        ("attention_chunk", 2.5, TypeError, "attention_chunk must be an integer, got 2.5"),
        ("sliding_window", True, TypeError, "sliding_window must be an integer, got True"),
        ("soft_cap", -1.0, ValueError, "soft_cap must be positive, got -1.0"),
        ("sm_scale", float("nan"), ValueError, "sm_scale must be positive, got nan"),
        ("sm_scale", "0.5", TypeError, "sm_scale must be a number, got '0.5'"),
        ("impl", "fast", ValueError, "impl must be one of"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            AttentionOptions(**{field: value})
    cache = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 64)
    stack = cache.allocate_stacked(2)
    packer = _packer(max_num_reqs=1, min_num_tokens=4)
    shape = StepShape(4, 1, 4)
    buf = packer.put(packer.empty(shape))
    q, k = jnp.zeros((4, 4, 8)), jnp.zeros((4, 2, 8))
    with pytest.raises(ValueError, match="options.sliding_window=3 both given"):
        cache.stacked_layer_step(
            stack, 0, q, k, k, buf, shape, AttentionOptions(sliding_window=3), window=4
        )
    with pytest.raises(ValueError, match=r"layer must be .*got 2"):
        cache.step(stack, q, k, k, buf, shape, layer=2)
    with pytest.raises(TypeError, match="options must be an AttentionOptions, got dict"):
        cache.step(stack, q, k, k, buf, shape, {"sm_scale": 0.5})
