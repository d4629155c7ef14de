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
from jaxkv.sampling_params import MAX_MIN_TOKENS_STOPS

if TYPE_CHECKING:
    from jaxkv.engine.scheduler import ScheduledRequest

__all__ = [
    "RequestRows",
    "RequestStepError",
    "RowAppends",
    "RowChanges",
    "RowReset",
    "RowSampling",
    "StepSampling",
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
    """Sampling parameters of one scheduled request row: the sampler's per-row values
    (`jaxkv.engine.sampling`), the tokens banned before `min_tokens` outputs (at most
    `MAX_MIN_TOKENS_STOPS`), whether it asks for logprobs of its outputs and of its
    prompt. Penalties at their neutral values (0, 0, 1) are off."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float = 0.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    logprobs: bool = False
    prompt_logprobs: bool = False

    @property
    def penalized(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1)


# The per-row arrays of `RequestRows` set from a `RowSampling` field, with their dtypes.
_ROW_VALUES = {
    "temperature": ("temperature", np.float32), "top_k": ("top_k", np.int32),
    "top_p": ("top_p", np.float32), "seeds": ("seed", np.int32),
    "min_p": ("min_p", np.float32), "presence": ("presence", np.float32),
    "frequency": ("frequency", np.float32), "repetition": ("repetition", np.float32),
    "min_tokens": ("min_tokens", np.int32), "logprobs": ("logprobs", np.bool_),
    "penalized": ("penalized", np.bool_),
}  # fmt: skip


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
        for name, (_, dtype) in _ROW_VALUES.items():
            setattr(self, name, np.zeros(max_num_seqs, dtype))
        self.stop_ids = np.full((max_num_seqs, MAX_MIN_TOKENS_STOPS), -1, np.int32)
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
            for name, value in zip(_ROW_VALUES, u.sampling, strict=True):
                getattr(self, name)[row] = value
            self.stop_ids[row] = u.stop_ids
            self.num_prompt_tokens[row] = u.num_prompt_tokens
        changes.appends.apply(self.tables)

    def pack_sampling(
        self, fields: Mapping[str, np.ndarray], k: int, step: StepSampling, state_offset: int
    ) -> tuple[bool, bool]:
        """Write rank `k`'s sampling rows of `step` into the step buffer's `fields`
        (`step_layout`; the padding already neutral: -1 ids, `top_p` and `repetition`
        1); returns whether the step uses penalties and logprobs. A penalized request's
        penalty-state row is `state_offset` + its row; its tokens go there as prompt or
        output tokens (`update_penalty_state`, `num_state_rows` rows in all)."""
        rows, n = step.rows, len(step.rows)
        for name in _ROW_VALUES:
            if name in fields:
                fields[name][k, :n] = getattr(self, name)[rows]
        counters = step.seq_lens - self.num_prompt_tokens[rows]
        fields["counters"][k, :n] = counters
        banned = counters < self.min_tokens[rows]
        if banned.any():
            stops = np.where(banned[:, None], self.stop_ids[rows], -1)
            fields["stop_ids"][k, : stops.size] = stops.reshape(-1)
        penalized = self.penalized[rows]
        if penalized.any():
            fields["penalty_rows"][k, :n] = np.where(penalized, state_offset + rows, -1)
            starts = np.cumsum(step.query_lens) - step.query_lens
            for i in np.flatnonzero(penalized):
                q, row = step.query_lens[i], rows[i]
                positions = step.seq_lens[i] - q + np.arange(q)
                is_output = positions >= self.num_prompt_tokens[row]
                slots = state_offset + row + np.where(is_output, step.num_state_rows, 0)
                fields["penalty_slots"][k, starts[i] : starts[i] + q] = slots
        return bool(penalized.any()), bool(self.logprobs[rows].any())


@dataclass(frozen=True)
class StepSampling:
    """What `RequestRows.pack_sampling` reads of one rank's step: the requests' rows, their
    lengths after the step and their tokens in it; the penalty state's row count."""

    rows: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    num_state_rows: int


@dataclass(frozen=True)
class RowReset:
    """A new or resumed request's row: its whole block lists (int32, per group), its
    typed sampling row (`_ROW_VALUES`' order), banned stop ids and prompt length."""

    request_id: str
    block_ids: tuple[np.ndarray, ...]
    sampling: tuple
    stop_ids: np.ndarray
    num_prompt_tokens: np.int32

    @classmethod
    def of(cls, tables: Sequence[BlockTable], s: ScheduledRequest, p: RowSampling) -> RowReset:
        """`s`'s row set to its whole block lists, with its sampling row `p` (a value no
        int32/float32 holds raises here)."""
        typed = tuple(dtype(getattr(p, name)) for name, dtype in _ROW_VALUES.values())
        if len(p.stop_ids) > MAX_MIN_TOKENS_STOPS:
            raise ValueError(
                f"bans {len(p.stop_ids)} stop tokens before min_tokens; at most "
                f"{MAX_MIN_TOKENS_STOPS} fit a row"
            )
        stop_ids = np.full(MAX_MIN_TOKENS_STOPS, -1, np.int32)
        stop_ids[: len(p.stop_ids)] = np.asarray(p.stop_ids, np.int32)
        block_ids = tuple(
            table.check_row_ids(ids) for table, ids in zip(tables, s.new_block_ids, strict=True)
        )
        num_prompt = np.int32(s.request.num_prompt_tokens)
        return cls(s.request.request_id, block_ids, typed, stop_ids, num_prompt)


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
