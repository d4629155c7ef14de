"""Host-side block tables: the int32 hand-off from the scheduler to the device.

Pure numpy, no JAX: the host never touches device arrays (SPEC §1). One row per
request slot of the running batch; row `r` lists the physical block ids of the
request held in that row, left-aligned. Positions beyond the row's blocks hold
the null block 0 (SPEC §4), so a fixed-width table can be sent as is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv._checks import check_int

NULL_BLOCK_ID = 0
_INT32_MAX = int(np.iinfo(np.int32).max)


class BlockTable:
    """Fixed-shape `[max_num_reqs, max_num_blocks_per_req]` int32 table of block ids.

    Invariants kept by every method (a call that raises changes nothing):
      * `num_blocks_per_row[r]` blocks are stored left-aligned in row `r`;
        every entry at or beyond that count is the null block 0.
      * `0 <= num_blocks_per_row[r] <= max_num_blocks_per_req`.
      * when `num_blocks` is given, every stored id lies in `[0, num_blocks)`.
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        num_blocks: int | None = None,
    ) -> None:
        block_size = check_int("block_size", block_size, min_value=1)
        max_num_reqs = check_int("max_num_reqs", max_num_reqs, min_value=1)
        max_num_blocks_per_req = check_int(
            "max_num_blocks_per_req", max_num_blocks_per_req, min_value=1
        )
        if num_blocks is not None:
            num_blocks = check_int("num_blocks", num_blocks, min_value=2)  # 0 is the null block
            if num_blocks * block_size > _INT32_MAX:
                raise ValueError(
                    f"num_blocks * block_size = {int(num_blocks) * int(block_size)} slots "
                    f"exceeds the int32 range [0, {_INT32_MAX}]"
                )
        self.block_size = int(block_size)
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_blocks_per_req = int(max_num_blocks_per_req)
        self.num_blocks = None if num_blocks is None else int(num_blocks)
        self.block_table = np.zeros((self.max_num_reqs, self.max_num_blocks_per_req), np.int32)
        self.num_blocks_per_row = np.zeros(self.max_num_reqs, np.int32)

    # ------------------------------------------------------------------ checks
    def _check_row(self, row_idx: int, name: str = "row_idx") -> int:
        return check_int(name, row_idx, min_value=0, max_value=self.max_num_reqs - 1)

    def _check_block_ids(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(block_ids)
        if ids.ndim != 1:
            raise ValueError(f"block_ids must be one-dimensional, got shape {ids.shape}")
        if ids.size == 0:
            return ids.astype(np.int32)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"block_ids must be integers, got dtype {ids.dtype}")
        upper = _INT32_MAX + 1 if self.num_blocks is None else self.num_blocks
        bad = (ids < 0) | (ids >= upper)
        if bad.any():
            raise ValueError(f"block id {int(ids[np.argmax(bad)])} is out of range [0, {upper})")
        return ids.astype(np.int32)

    # ----------------------------------------------------------------- updates
    def check_row_ids(
        self,
        block_ids: Sequence[int] | np.ndarray,
        row_idx: int | None = None,
        num_null_blocks: int = 0,
    ) -> np.ndarray:
        """`block_ids` as the int32 ids `add_row` (`row_idx` None: a whole row) or
        `append_row(block_ids, row_idx, num_null_blocks)` would store; the
        ValueError/TypeError they would raise otherwise. Changes nothing (a caller can
        check a batch of row updates before applying any)."""
        ids = self._check_block_ids(block_ids)
        if row_idx is None:
            if ids.size > self.max_num_blocks_per_req:
                raise ValueError(
                    f"{ids.size} blocks exceed the table width max_num_blocks_per_req="
                    f"{self.max_num_blocks_per_req} (allowed [0, {self.max_num_blocks_per_req}])"
                )
            return ids
        row = self._check_row(row_idx)
        end = int(self.num_blocks_per_row[row]) + ids.size
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {end} blocks, more than the table width "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req} (allowed [0, "
                f"{self.max_num_blocks_per_req}])"
            )
        check_int("num_null_blocks", num_null_blocks, min_value=0, max_value=end)
        return ids

    def append_row(
        self, block_ids: Sequence[int] | np.ndarray, row_idx: int, num_null_blocks: int = 0
    ) -> None:
        """Append `block_ids` after the blocks already in row `row_idx`; then its first
        `num_null_blocks` blocks are the null block (blocks that left an attention
        window; at most the row's blocks)."""
        row = self._check_row(row_idx)
        ids = self.check_row_ids(block_ids, row, num_null_blocks)
        start = int(self.num_blocks_per_row[row])
        self.block_table[row, start : start + ids.size] = ids
        self.block_table[row, :num_null_blocks] = NULL_BLOCK_ID
        self.num_blocks_per_row[row] = start + ids.size

    def check_appends(
        self,
        rows: Sequence[int] | np.ndarray,
        block_ids: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        num_null_blocks: Sequence[int] | np.ndarray,
    ) -> np.ndarray:
        """The int32 ids `append_rows` would store, checked for the whole batch at once;
        changes nothing. Append `i` gives the distinct row `rows[i]` the next `counts[i]`
        ids of the flat `block_ids`, then makes its first `num_null_blocks[i]` blocks
        null. ValueError/TypeError as `append_row` would raise for the first bad
        append, prefixed with its index."""
        arrays = [np.asarray(a) for a in (rows, block_ids, counts, num_null_blocks)]
        if self._appends_ok(*arrays):
            return arrays[1].astype(np.int32)
        index, error = self.first_bad_append(*arrays)
        if index is None:
            raise error
        raise type(error)(f"append {index}: {error}") from None

    def _appends_ok(
        self, rows: np.ndarray, ids: np.ndarray, counts: np.ndarray, nulls: np.ndarray
    ) -> bool:
        """Whether every append of the batch passes `append_row`'s checks (vectorized)."""
        n = rows.shape[0] if rows.ndim == 1 else -1
        if counts.shape != (n,) or nulls.shape != (n,) or ids.ndim != 1:
            return False
        if n == 0:
            return ids.size == 0
        if not all(a.dtype.kind in "iu" for a in (rows, counts, nulls)):  # integers
            return False
        if rows.min() < 0 or rows.max() >= self.max_num_reqs:
            return False
        if np.bincount(rows, minlength=self.max_num_reqs).max() > 1:  # a row twice
            return False
        if counts.min() < 0 or nulls.min() < 0 or int(counts.sum()) != ids.size:
            return False
        upper = _INT32_MAX + 1 if self.num_blocks is None else self.num_blocks
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= upper):
            return False
        ends = self.num_blocks_per_row[rows] + counts
        return bool(ends.max() <= self.max_num_blocks_per_req and (nulls <= ends).all())

    def first_bad_append(
        self,
        rows: Sequence[int] | np.ndarray,
        block_ids: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        num_null_blocks: Sequence[int] | np.ndarray,
    ) -> tuple[int | None, Exception]:
        """For a batch `check_appends` refuses: the index of its first bad append and the
        error `append_row` raises for it, or (None, the error) when the batch itself is
        malformed (shapes, counts). Changes nothing."""
        rows, ids, counts, nulls = (
            np.asarray(a) for a in (rows, block_ids, counts, num_null_blocks)
        )
        if rows.ndim != 1 or counts.shape != rows.shape or nulls.shape != rows.shape:
            return None, ValueError(
                f"rows, counts and num_null_blocks must be 1-D of equal length, got shapes "
                f"{rows.shape}, {counts.shape} and {nulls.shape}"
            )
        try:
            counts_list = [check_int("counts[i]", c, min_value=0) for c in counts.tolist()]
        except (TypeError, ValueError) as error:
            return None, error
        if ids.ndim != 1 or sum(counts_list) != ids.size:
            return None, ValueError(
                f"block_ids must be 1-D with sum(counts) = {sum(counts_list)} entries, got "
                f"shape {ids.shape}"
            )
        seen: set[int] = set()
        offset = 0
        for i, (row, count, num_nulls) in enumerate(
            zip(rows.tolist(), counts_list, nulls.tolist(), strict=True)
        ):
            try:
                self.check_row_ids(ids[offset : offset + count], row, num_nulls)
                if row in seen:
                    raise ValueError(f"row {row} is appended to twice in one batch")
            except (TypeError, ValueError) as error:
                return i, error
            seen.add(row)
            offset += count
        return None, RuntimeError("the batch passes append_row's checks one by one")

    def append_rows(
        self,
        rows: Sequence[int] | np.ndarray,
        block_ids: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        num_null_blocks: Sequence[int] | np.ndarray,
    ) -> None:
        """`append_row` for a batch of distinct rows in one pass (see `check_appends`):
        all are checked before any changes."""
        ids = self.check_appends(rows, block_ids, counts, num_null_blocks)
        self.write_checked_appends(rows, ids, counts, num_null_blocks)

    def write_checked_appends(
        self,
        rows: Sequence[int] | np.ndarray,
        block_ids: np.ndarray,
        counts: Sequence[int] | np.ndarray,
        num_null_blocks: Sequence[int] | np.ndarray,
    ) -> None:
        """`append_rows` of a batch whose checks already passed: `block_ids` as
        `check_appends` returned them for this table as it still is (nothing is checked
        again; another batch is the caller's error)."""
        if not block_ids.size and not np.any(num_null_blocks):
            return
        rows_arr, counts_arr = np.asarray(rows, np.intp), np.asarray(counts, np.intp)
        nulls = np.asarray(num_null_blocks, np.intp)
        starts = self.num_blocks_per_row[rows_arr].astype(np.intp)
        # Append i's k-th id goes to column starts[i] + k.
        first = np.cumsum(counts_arr) - counts_arr
        columns = np.arange(block_ids.size) + np.repeat(starts - first, counts_arr)
        self.block_table[np.repeat(rows_arr, counts_arr), columns] = block_ids
        nulled = nulls > 0
        if nulled.any():
            null_rows = rows_arr[nulled]
            leading = np.arange(self.max_num_blocks_per_req) < nulls[nulled, None]
            self.block_table[null_rows] = np.where(
                leading, NULL_BLOCK_ID, self.block_table[null_rows]
            )
        self.num_blocks_per_row[rows_arr] = starts + counts_arr

    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Replace row `row_idx` with exactly `block_ids`."""
        row = self._check_row(row_idx)
        self.write_checked_row(self.check_row_ids(block_ids), row)

    def write_checked_row(self, block_ids: np.ndarray, row: int) -> None:
        """`add_row` of ids `check_row_ids` returned (no row index) and a row index
        in range: nothing is checked again."""
        self.block_table[row] = NULL_BLOCK_ID
        self.block_table[row, : block_ids.size] = block_ids
        self.num_blocks_per_row[row] = block_ids.size

    def clear_row(self, row_idx: int) -> None:
        """Empty row `row_idx` (all null blocks)."""
        row = self._check_row(row_idx)
        self.block_table[row] = NULL_BLOCK_ID
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row `src` onto row `tgt` (the source row is left as it was)."""
        s = self._check_row(src, "src")
        t = self._check_row(tgt, "tgt")
        self.block_table[t] = self.block_table[s]
        self.num_blocks_per_row[t] = self.num_blocks_per_row[s]

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows `src` and `tgt`."""
        s = self._check_row(src, "src")
        t = self._check_row(tgt, "tgt")
        self.block_table[[s, t]] = self.block_table[[t, s]]
        self.num_blocks_per_row[[s, t]] = self.num_blocks_per_row[[t, s]]

    def condense(self, empty_rows: Sequence[int], num_rows: int) -> list[tuple[int, int]]:
        """Close the holes `empty_rows` among rows `[0, num_rows)` (vLLM's `condense`).

        The highest occupied rows move down into the lowest holes, so that the
        `num_rows - len(empty_rows)` live rows end up in `[0, n)`; every row from
        `n` up is cleared. Returns the `(src, tgt)` moves made, in order, so the
        caller can update its request-to-row map.
        """
        num_rows = check_int("num_rows", num_rows, min_value=0, max_value=self.max_num_reqs)
        if isinstance(empty_rows, (str, bytes)):
            raise TypeError(f"empty_rows must be a sequence of row indices, got {empty_rows!r}")
        given = [
            check_int("empty_rows[i]", r, min_value=0, max_value=num_rows - 1) for r in empty_rows
        ]
        holes = sorted(set(given))
        if len(holes) != len(given):
            raise ValueError(f"empty_rows {given} contains duplicates")
        hole_set = set(holes)
        live_high = [r for r in range(num_rows - 1, -1, -1) if r not in hole_set]
        num_live = num_rows - len(holes)
        # The holes below `num_live` and the live rows at or above it are equally many.
        low_holes = [h for h in holes if h < num_live]
        moves = list(zip(live_high[: len(low_holes)], low_holes, strict=True))
        for src, tgt in moves:
            self.move_row(src, tgt)
        self.block_table[num_live:num_rows] = NULL_BLOCK_ID
        self.num_blocks_per_row[num_live:num_rows] = 0
        return moves

    def clear(self) -> None:
        """Empty every row."""
        self.block_table.fill(NULL_BLOCK_ID)
        self.num_blocks_per_row.fill(0)

    # ---------------------------------------------------------------- queries
    def get_numpy_array(self) -> np.ndarray:
        """The live table (a view, not a copy)."""
        return self.block_table

    def compute_slot_mapping(
        self, req_indices: np.ndarray | Sequence[int], positions: np.ndarray | Sequence[int]
    ) -> np.ndarray:
        """Cache slot of each token: `table[req, pos // bs] * bs + pos % bs` (int32).

        `req_indices[i]` is the row of token `i`, `positions[i]` its position in
        its request. Every token must land in a block the row holds (never the
        null block): otherwise ValueError naming the token and the allowed range.
        """
        req = np.asarray(req_indices)
        pos = np.asarray(positions)
        if req.ndim != 1 or pos.shape != req.shape:
            raise ValueError(
                f"req_indices and positions must be 1-D of equal length, got shapes "
                f"{req.shape} and {pos.shape}"
            )
        if req.size == 0:
            return np.zeros(0, np.int32)
        for name, arr in (("req_indices", req), ("positions", pos)):
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
        bad = (req < 0) | (req >= self.max_num_reqs)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"req_indices[{i}] = {int(req[i])} is out of range [0, {self.max_num_reqs})"
            )
        width_tokens = self.max_num_blocks_per_req * self.block_size
        bad = (pos < 0) | (pos >= width_tokens)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"positions[{i}] = {int(pos[i])} is out of range [0, {width_tokens}) "
                f"(table width {self.max_num_blocks_per_req} blocks of {self.block_size})"
            )
        block_idx = pos // self.block_size
        held = self.num_blocks_per_row[req]
        bad = block_idx >= held
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"positions[{i}] = {int(pos[i])} of row {int(req[i])} is beyond the "
                f"row's {int(held[i])} blocks (allowed [0, {int(held[i]) * self.block_size}))"
            )
        block_ids = self.block_table[req, block_idx].astype(np.int64)
        bad = block_ids == NULL_BLOCK_ID
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"positions[{i}] = {int(pos[i])} of row {int(req[i])} maps to the null "
                f"block {NULL_BLOCK_ID}, which is never written"
            )
        slots = block_ids * self.block_size + pos % self.block_size
        return slots.astype(np.int32)
