"""One data rank's persistent request rows: the step's block tables and sampling rows.

Host-only numpy (no JAX, directly or through what this module imports): the rows are
the runner's copy of the scheduler's view of each running request (its block ids per
KV-cache group, its sampling parameters, its prompt length), built from the block-id
changes each `SchedulerOutput` reports. A step's changes are first recorded and checked
(`RequestRows.record`, `RequestRows.check`), then applied (`RequestRows.apply`, which
cannot fail and checks nothing again): a request whose change is refused fails alone
(`RequestStepError`) and no row changes. The block ids these checks accept are the ones
the step packer trusts (`StepMetadataPacker.pack_rows_into` checks them no more).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxkv.block_table import BlockTable

if TYPE_CHECKING:
    from jaxkv.engine.scheduler import ScheduledRequest

__all__ = [
    "RequestRows",
    "RequestStepError",
    "RowAppends",
    "RowChanges",
    "RowReset",
    "RowSampling",
]


class RequestStepError(Exception):
    """Preparing one request's part of a step failed on the host (`cause`); nothing of the
    step has run on the device yet beyond idempotent page zeroing, copies and encoding,
    and no request row has changed, so the step can be packed again without that
    request."""

    def __init__(self, request_id: str, cause: Exception) -> None:
        super().__init__(f"request {request_id!r}: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of one scheduled request row."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


class RequestRows:
    """One data rank's persistent request rows (vLLM's input batch, reduced to the step).

    A request takes a row when the scheduler first sends it (`resets_row`) and keeps it
    until it is reported preempted or finished; the row is then reused. Row
    `index[request_id]` holds the request's block ids per KV-cache group (row of
    `tables[g]`), its sampling parameters and its prompt length.

    Invariants: `index` maps each request holding a row to a distinct row in
    `[0, max_num_seqs)` and `free` lists the others; after each step every row in use
    holds exactly the scheduler's view of its request's blocks
    (`kv_cache_manager.get_block_ids(request_id)`), built from the reported changes.
    """

    def __init__(self, tables: list[BlockTable]) -> None:
        self.tables = tables
        max_num_seqs = tables[0].max_num_reqs
        self.index: dict[str, int] = {}
        self.free = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: low first
        self.temperature = np.zeros(max_num_seqs, np.float32)
        self.top_k = np.zeros(max_num_seqs, np.int32)
        self.top_p = np.ones(max_num_seqs, np.float32)
        self.seeds = np.zeros(max_num_seqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the rows of `request_ids` (those holding none are skipped)."""
        for request_id in request_ids:
            row = self.index.pop(request_id, None)
            if row is not None:
                self.free.append(row)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group as its row holds them."""
        row = self.index[request_id]
        return tuple(t.block_table[row, : t.num_blocks_per_row[row]].tolist() for t in self.tables)

    def record(
        self, changes: RowChanges, s: ScheduledRequest, sampling: Mapping[str, RowSampling]
    ) -> None:
        """Add `s`'s row change to `changes` (a reset's block ids checked now, its
        sampling row `sampling[request_id]` typed now); changes no row. Raises what is
        wrong with it: a reset with no free row left, a change to a request holding no
        row, ids or a sampling value a row cannot hold."""
        request_id = s.request.request_id
        row = self.index.get(request_id)
        if s.resets_row:
            if row is None:
                changes.num_new_rows += 1
                if changes.num_new_rows > len(self.free):
                    raise RuntimeError(f"no free row: all {len(self.temperature)} are taken")
            changes.resets.append(RowReset.of(self.tables, s, sampling[request_id]))
        elif row is None:
            raise RuntimeError("has no row: its first step did not send its blocks")
        elif s.new_block_ids or s.num_null_blocks:
            changes.appends.add(s, row)

    def check(self, changes: RowChanges) -> None:
        """Check the recorded appends as a batch against the tables as they are now
        (`RowAppends.check`: `RequestStepError` naming the first request refused)."""
        changes.appends.check(self.tables)

    def apply(self, changes: RowChanges) -> None:
        """Apply a step's row changes, every one recorded and checked (`record`, `check`)
        against the rows as they still are; cannot fail, checks nothing again."""
        for u in changes.resets:
            row = self.index.get(u.request_id)
            if row is None:
                row = self.index[u.request_id] = self.free.pop()
            for table, ids in zip(self.tables, u.block_ids, strict=True):
                table.write_checked_row(ids, row)
            (
                self.temperature[row], self.top_k[row], self.top_p[row], self.seeds[row],
                self.num_prompt_tokens[row],
            ) = u.sampling  # fmt: skip
        changes.appends.apply(self.tables)


@dataclass(frozen=True)
class RowReset:
    """A new or resumed request's row: its whole block lists (int32, per group) and its
    typed sampling row and prompt length."""

    request_id: str
    block_ids: tuple[np.ndarray, ...]
    sampling: tuple[np.float32, np.int32, np.float32, np.int32, np.int32]

    @classmethod
    def of(cls, tables: Sequence[BlockTable], s: ScheduledRequest, p: RowSampling) -> RowReset:
        """`s`'s row set to its whole block lists, with its sampling row `p` (a value no
        int32/float32 holds raises here)."""
        typed = (
            np.float32(p.temperature), np.int32(p.top_k), np.float32(p.top_p),
            np.int32(p.seed), np.int32(s.request.num_prompt_tokens),
        )  # fmt: skip
        block_ids = tuple(
            table.check_row_ids(ids) for table, ids in zip(tables, s.new_block_ids, strict=True)
        )
        return cls(s.request.request_id, block_ids, typed)


class RowAppends:
    """The block-id changes of a step's requests that keep their rows, gathered per
    group so that each group's table checks and applies them in one batch
    (`BlockTable.append_rows`): append `i` adds `scheduled[i].new_block_ids[g]` to row
    `rows[i]` of group `g`, then nulls its first `num_null_blocks[g]` blocks. Rows are
    distinct (one request, one row)."""

    def __init__(self, num_groups: int) -> None:
        self.rows: list[int] = []
        self.scheduled: list[ScheduledRequest] = []
        self.block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.checked_ids: list[np.ndarray] = []  # per group, once `check` passed
        self.counts: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_null_blocks: list[list[int]] = [[] for _ in range(num_groups)]

    def add(self, s: ScheduledRequest, row: int) -> None:
        groups = range(len(self.counts))
        new_block_ids = s.new_block_ids or [()] * len(groups)
        nulls = s.num_null_blocks or [0] * len(groups)
        self.rows.append(row)
        self.scheduled.append(s)
        for g, ids, k in zip(groups, new_block_ids, nulls, strict=True):
            self.block_ids[g] += ids
            self.counts[g].append(len(ids))
            self.num_null_blocks[g].append(k)

    def check(self, tables: Sequence[BlockTable]) -> None:
        """`RequestStepError` naming the first request whose change a table refuses."""
        if not self.rows:
            return
        try:
            self.checked_ids = [
                table.check_appends(
                    self.rows, self.block_ids[g], self.counts[g], self.num_null_blocks[g]
                )
                for g, table in enumerate(tables)
            ]
        except (TypeError, ValueError):  # whose change is it: the first any group refuses
            index, error = min(
                (
                    table.first_bad_append(
                        self.rows, self.block_ids[g], self.counts[g], self.num_null_blocks[g]
                    )
                    for g, table in enumerate(tables)
                ),
                key=lambda found: len(self.rows) if found[0] is None else found[0],
            )
            if index is None:
                raise
            raise RequestStepError(self.scheduled[index].request.request_id, error) from error

    def apply(self, tables: Sequence[BlockTable]) -> None:
        """Write the changes `check` accepted (the tables unchanged since)."""
        if self.rows:
            for g, table in enumerate(tables):
                table.write_checked_appends(
                    self.rows, self.checked_ids[g], self.counts[g], self.num_null_blocks[g]
                )


@dataclass
class RowChanges:
    """One step's row changes on one rank: the resets (new and resumed requests), the
    appends (requests keeping their rows) and how many resets need a free row."""

    resets: list[RowReset] = field(default_factory=list)
    appends: RowAppends = field(default_factory=lambda: RowAppends(0))
    num_new_rows: int = 0

    @classmethod
    def empty(cls, rows: RequestRows) -> RowChanges:
        """No changes yet, for `rows`' groups."""
        return cls(appends=RowAppends(len(rows.tables)))
