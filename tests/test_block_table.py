"""BlockTable: row operations, null-block padding, vectorized slot mapping, bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.block_table import BlockTable


def _assert_invariants(bt: BlockTable) -> None:
    width = np.arange(bt.max_num_blocks_per_req)[None, :]
    beyond = width >= bt.num_blocks_per_row[:, None]
    assert (bt.block_table[beyond] == 0).all(), "entries past a row's blocks must be null"
    assert bt.block_table.dtype == np.int32 and bt.num_blocks_per_row.dtype == np.int32


def test_add_append_move_swap_clear() -> None:
    bt = BlockTable(block_size=4, max_num_reqs=3, max_num_blocks_per_req=5, num_blocks=32)
    bt.add_row([7, 3], 0)
    bt.append_row([9], 0)
    bt.add_row([4, 5, 6, 8], 1)
    np.testing.assert_array_equal(bt.block_table[0], [7, 3, 9, 0, 0])
    np.testing.assert_array_equal(bt.num_blocks_per_row, [3, 4, 0])
    bt.add_row([11], 1)  # replaces, leaving nulls behind
    np.testing.assert_array_equal(bt.block_table[1], [11, 0, 0, 0, 0])
    bt.swap_row(0, 1)
    np.testing.assert_array_equal(bt.block_table[:2], [[11, 0, 0, 0, 0], [7, 3, 9, 0, 0]])
    np.testing.assert_array_equal(bt.num_blocks_per_row, [1, 3, 0])
    bt.move_row(1, 2)
    np.testing.assert_array_equal(bt.block_table[2], [7, 3, 9, 0, 0])
    assert bt.num_blocks_per_row[2] == 3
    bt.clear_row(1)
    np.testing.assert_array_equal(bt.block_table[1], 0)
    assert bt.num_blocks_per_row[1] == 0
    _assert_invariants(bt)
    bt.clear()
    assert not bt.block_table.any() and not bt.num_blocks_per_row.any()


def test_condense_moves_highest_rows_into_lowest_holes() -> None:
    bt = BlockTable(block_size=2, max_num_reqs=6, max_num_blocks_per_req=2, num_blocks=16)
    for r in range(6):
        bt.add_row([r + 1], r)
    moves = bt.condense([1, 3, 4], num_rows=6)
    assert moves == [(5, 1)]
    np.testing.assert_array_equal(bt.block_table[:, 0], [1, 6, 3, 0, 0, 0])
    np.testing.assert_array_equal(bt.num_blocks_per_row, [1, 1, 1, 0, 0, 0])
    _assert_invariants(bt)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_condense_keeps_live_rows(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 8))
    bt = BlockTable(block_size=2, max_num_reqs=8, max_num_blocks_per_req=3, num_blocks=64)
    for r in range(n):
        bt.add_row(list(range(1 + 3 * r, 1 + 3 * r + data.draw(st.integers(1, 3)))), r)
    holes = data.draw(st.lists(st.integers(0, n - 1), unique=True))
    before = {r: bt.block_table[r].copy() for r in range(n) if r not in holes}
    moves = bt.condense(holes, n)
    live = n - len(holes)
    rows_after = {tuple(bt.block_table[r]) for r in range(live)}
    assert rows_after == {tuple(v) for v in before.values()}
    assert not bt.block_table[live:].any() and not bt.num_blocks_per_row[live:].any()
    assert all(src >= live > tgt for src, tgt in moves)
    _assert_invariants(bt)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_append_rows_equals_append_row_one_by_one(data: st.DataObject) -> None:
    """A batch of appends (some bad on purpose) does what `append_row` does row by row,
    or raises `append_row`'s error for the first bad append and changes nothing."""
    width, num_blocks = 4, 24
    batched = BlockTable(2, 6, width, num_blocks=num_blocks)
    for r in range(6):
        batched.add_row(list(range(1, 1 + data.draw(st.integers(0, width)))), r)
    single = BlockTable(2, 6, width, num_blocks=num_blocks)
    single.block_table[:] = batched.block_table
    single.num_blocks_per_row[:] = batched.num_blocks_per_row
    rows = data.draw(st.lists(st.integers(0, 5), unique=True, max_size=6))
    block_ids = st.lists(st.integers(-1, num_blocks), max_size=3)
    appends = [(row, data.draw(block_ids), data.draw(st.integers(0, 5))) for row in rows]
    table, counts = batched.block_table.copy(), batched.num_blocks_per_row.copy()
    flat = [i for _, ids, _ in appends for i in ids]
    k = 0
    try:
        for row, ids, nulls in appends:
            single.check_row_ids(ids, row, nulls)
            k += 1
    except ValueError as error:
        with pytest.raises(ValueError, match=f"append {k}: .*{re.escape(str(error))}"):
            batched.append_rows(rows, flat, [len(a[1]) for a in appends], [a[2] for a in appends])
        np.testing.assert_array_equal(batched.block_table, table)
        np.testing.assert_array_equal(batched.num_blocks_per_row, counts)
        return
    for row, ids, nulls in appends:
        single.append_row(ids, row, nulls)
    batched.append_rows(rows, flat, [len(a[1]) for a in appends], [a[2] for a in appends])
    np.testing.assert_array_equal(batched.block_table, single.block_table)
    np.testing.assert_array_equal(batched.num_blocks_per_row, single.num_blocks_per_row)
    _assert_invariants(batched)


def test_append_rows_refuses_a_row_twice_and_mismatched_counts() -> None:
    bt = BlockTable(block_size=2, max_num_reqs=2, max_num_blocks_per_req=3, num_blocks=16)
    with pytest.raises(ValueError, match="append 1: row 0 is appended to twice"):
        bt.append_rows([0, 0], [1, 2], [1, 1], [0, 0])
    with pytest.raises(ValueError, match=r"sum\(counts\) = 2 entries, got shape \(3,\)"):
        bt.append_rows([0, 1], [1, 2, 3], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="must be 1-D of equal length"):
        bt.append_rows([0, 1], [1], [1], [0, 0])
    assert not bt.block_table.any() and not bt.num_blocks_per_row.any()


def test_slot_mapping_matches_per_token_formula() -> None:
    rng = np.random.default_rng()
    bs, reqs, width, nb = 4, 5, 6, 64
    bt = BlockTable(bs, reqs, width, num_blocks=nb)
    ids = rng.permutation(np.arange(1, nb))
    lens = rng.integers(1, width * bs + 1, size=reqs)
    used = 0
    for r, n in enumerate(lens):
        k = -(-int(n) // bs)
        bt.add_row(ids[used : used + k], r)
        used += k
    req = np.repeat(np.arange(reqs), lens)
    pos = np.concatenate([rng.permutation(int(n)) for n in lens])
    slots = bt.compute_slot_mapping(req, pos)
    expected = [bt.block_table[r, p // bs] * bs + p % bs for r, p in zip(req, pos, strict=True)]
    np.testing.assert_array_equal(slots, expected)
    assert slots.dtype == np.int32
    assert len(set(slots.tolist())) == slots.size  # distinct tokens, distinct slots


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda bt: bt.add_row([1, 2, 3, 4], 0), r"4 blocks exceed the table width"),
        (lambda bt: bt.append_row([1, 2, 3], 1), r"would hold 4 blocks.*\[0, 3\]"),
        (lambda bt: bt.add_row([16], 0), r"block id 16 is out of range \[0, 16\)"),
        (lambda bt: bt.add_row([-1], 0), r"block id -1 is out of range"),
        (lambda bt: bt.add_row([1], 2), r"row_idx must be in \[0, 1\], got 2"),
        (lambda bt: bt.move_row(0, -1), r"tgt must be in \[0, 1\], got -1"),
        (lambda bt: bt.swap_row(5, 0), r"src must be in \[0, 1\], got 5"),
        (lambda bt: bt.compute_slot_mapping([0], [12]), r"positions\[0\] = 12 .*\[0, 12\)"),
        (lambda bt: bt.compute_slot_mapping([0], [-1]), r"positions\[0\] = -1"),
        (lambda bt: bt.compute_slot_mapping([0, 3], [0, 0]), r"req_indices\[1\] = 3"),
        (lambda bt: bt.compute_slot_mapping([1], [5]), r"beyond the row's 1 blocks"),
        (lambda bt: bt.condense([3], 2), r"empty_rows\[i\] must be in \[0, 1\], got 3"),
        (lambda bt: bt.condense([0, 0], 2), r"duplicates"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, match) -> None:
    bt = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=3, num_blocks=16)
    bt.add_row([5], 0)
    bt.add_row([6], 1)
    table, counts = bt.block_table.copy(), bt.num_blocks_per_row.copy()
    with pytest.raises(ValueError, match=match):
        call(bt)
    np.testing.assert_array_equal(bt.block_table, table)
    np.testing.assert_array_equal(bt.num_blocks_per_row, counts)


def test_slot_in_null_block_is_rejected() -> None:
    bt = BlockTable(block_size=4, max_num_reqs=1, max_num_blocks_per_req=3, num_blocks=16)
    bt.add_row([0, 7], 0)  # sliding-window style: first block released to null
    np.testing.assert_array_equal(bt.compute_slot_mapping([0], [5]), [29])
    with pytest.raises(ValueError, match="maps to the null block 0"):
        bt.compute_slot_mapping([0], [1])


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockTable(0, 1, 1)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockTable(4, 1, 1, num_blocks=1)
    with pytest.raises(ValueError, match="exceeds the int32 range"):
        BlockTable(1 << 16, 1, 1, num_blocks=1 << 16)
