"""Per-step attention metadata: packed on the host into one int32 buffer, unpacked in jit.

Every step the host sends block tables, sequence lengths, query start offsets,
slot mapping, positions and the live counts. Packing them into a single int32
array makes the hand-off one `device_put`; the jitted step slices it back apart
with static offsets. Token and request counts are padded to buckets (powers of
two, then linear steps, the maximum always included), the block-table width is
fixed, so a serving run compiles at most `len(token_buckets) * len(req_buckets)`
step programs.

Buffer layout for bucket sizes `T` (tokens), `R` (requests), width `W`::

    [num_tokens, num_reqs | block_tables R*W | seq_lens R | query_start_loc R+1
     | slot_mapping T | positions T]

Padding: request rows beyond `num_reqs` are all null blocks with length 0 and
start offset `num_tokens` (no queries); token entries beyond `num_tokens` carry
`padding_slot` (a positive out-of-range slot the cache scatter drops) and
position 0.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Sharding

from jaxkv.device.host_inputs import check_ids, check_int, place


def padding_buckets(max_size: int, linear_start: int = 256, min_size: int = 1) -> tuple[int, ...]:
    """Sizes `min_size, 2*min_size, ...` doubling up to `linear_start`, then `+linear_start`.

    The list is capped at `max_size`, which is always its last entry.
    """
    if max_size <= 0 or linear_start <= 0 or min_size <= 0:
        raise ValueError(
            f"max_size, linear_start and min_size must be positive, got "
            f"{max_size}, {linear_start}, {min_size}"
        )
    sizes: list[int] = []
    size = min_size
    while size < max_size and size < linear_start:
        sizes.append(size)
        size *= 2
    while size < max_size:
        sizes.append(size)
        size += linear_start
    sizes.append(max_size)
    return tuple(sorted(set(sizes)))


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket `>= n`; ValueError when `n` exceeds the largest."""
    if n < 0 or n > buckets[-1]:
        raise ValueError(f"size {n} is out of range [0, {buckets[-1]}]")
    return buckets[bisect.bisect_left(buckets, n)]


@dataclass(frozen=True)
class StepShape:
    """Static shape of one packed step: bucketed token/request counts and table width."""

    num_tokens: int
    num_reqs: int
    max_blocks_per_req: int

    @property
    def length(self) -> int:
        t, r, w = self.num_tokens, self.num_reqs, self.max_blocks_per_req
        return 2 + r * w + r + (r + 1) + 2 * t


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepMetadata:
    """Unpacked device view of one step (int32 arrays; shapes from a `StepShape`)."""

    num_tokens: jax.Array  # scalar
    num_reqs: jax.Array  # scalar
    block_tables: jax.Array  # [R, W]
    seq_lens: jax.Array  # [R]
    query_start_loc: jax.Array  # [R + 1]
    slot_mapping: jax.Array  # [T]
    positions: jax.Array  # [T]


def unpack_step(buffer: jax.Array, shape: StepShape) -> StepMetadata:
    """Slice a packed 1-D buffer (inside jit) back into its fields."""
    if buffer.shape != (shape.length,):
        raise ValueError(f"buffer shape {buffer.shape} does not match {shape} ({shape.length},)")
    t, r, w = shape.num_tokens, shape.num_reqs, shape.max_blocks_per_req
    offsets = np.cumsum([0, 2, r * w, r, r + 1, t, t])
    part = [buffer[offsets[i] : offsets[i + 1]] for i in range(6)]
    return StepMetadata(
        num_tokens=part[0][0],
        num_reqs=part[0][1],
        block_tables=part[1].reshape(r, w),
        seq_lens=part[2],
        query_start_loc=part[3],
        slot_mapping=part[4],
        positions=part[5],
    )


@dataclass(frozen=True)
class StepInputs:
    """One data rank's host-side step: per-request rows and per-token slots."""

    block_tables: np.ndarray  # [n_reqs, W] int
    seq_lens: np.ndarray  # [n_reqs] context length after this step
    query_lens: np.ndarray  # [n_reqs] tokens scheduled this step
    slot_mapping: np.ndarray  # [n_tokens]


class StepMetadataPacker:
    """Packs steps for a cache of `num_blocks` blocks of `block_size`, table width `W`.

    Invariant: every buffer it returns passed validation (block ids in
    `[0, num_blocks)`, slots outside the null block, lengths within the table),
    has the length of its `StepShape`, and uses bucket sizes from
    `token_buckets` / `req_buckets` only.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        num_blocks: int,
        linear_start: int = 256,
    ) -> None:
        max_num_tokens = check_int("max_num_tokens", max_num_tokens, lo=1)
        max_num_reqs = check_int("max_num_reqs", max_num_reqs, lo=1)
        max_blocks_per_req = check_int("max_blocks_per_req", max_blocks_per_req, lo=1)
        block_size = check_int("block_size", block_size, lo=1)
        linear_start = check_int("linear_start", linear_start, lo=1)
        num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (null block + 1), got {num_blocks}")
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.padding_slot = num_blocks * block_size
        self.token_buckets = padding_buckets(max_num_tokens, linear_start)
        self.req_buckets = padding_buckets(max_num_reqs, linear_start)

    def all_shapes(self) -> list[StepShape]:
        """Every shape `pack` can produce (for warm-up)."""
        return [
            StepShape(t, r, self.max_blocks_per_req)
            for t in self.token_buckets
            for r in self.req_buckets
        ]

    def empty(self, shape: StepShape, num_ranks: int = 1) -> np.ndarray:
        """A step with no requests and no tokens (all padding), e.g. to warm up `shape`."""
        if shape not in self.all_shapes():
            raise ValueError(f"{shape} is not one of this packer's bucket shapes")
        out = np.zeros((num_ranks, shape.length), np.int32)
        start = shape.length - 2 * shape.num_tokens
        out[:, start : start + shape.num_tokens] = self.padding_slot
        return out

    def _validate(self, s: StepInputs, rank: int) -> tuple[int, int]:
        where = f" (data rank {rank})"
        bt = np.asarray(s.block_tables)
        n_reqs = bt.shape[0] if bt.ndim == 2 else -1
        if bt.ndim != 2 or bt.shape[1] != self.max_blocks_per_req:
            raise ValueError(
                f"block_tables shape {bt.shape} must be [n_reqs, {self.max_blocks_per_req}]" + where
            )
        for name, arr, size in (
            ("seq_lens", s.seq_lens, n_reqs),
            ("query_lens", s.query_lens, n_reqs),
        ):
            if np.shape(arr) != (size,):
                raise ValueError(f"{name} shape {np.shape(arr)} must be ({size},){where}")
        bt = check_ids("block id", bt, 0, self.num_blocks, ndim=2, where=where)
        max_len = self.max_blocks_per_req * self.block_size
        seq = check_ids("seq_len", s.seq_lens, 1, max_len + 1, where=where)
        ql = check_ids("query_len", s.query_lens, 1, max_len + 1, where=where)
        too_long = ql > seq
        if too_long.any():
            i = int(np.argmax(too_long))
            raise ValueError(
                f"query_lens[{i}] = {int(ql[i])} exceeds seq_lens[{i}] = "
                f"{int(s.seq_lens[i])} (allowed [1, seq_len]){where}"
            )
        n_tokens = int(ql.sum())
        slots = np.asarray(s.slot_mapping)
        if slots.shape != (n_tokens,):
            raise ValueError(
                f"slot_mapping shape {slots.shape} must be ({n_tokens},), the sum of "
                f"query_lens{where}"
            )
        slots = check_ids("slot", slots, self.block_size, self.padding_slot, where=where)
        pick_bucket(n_tokens, self.token_buckets)
        pick_bucket(n_reqs, self.req_buckets)
        # Each token's slot must be its own position in a block its request holds.
        req = np.repeat(np.arange(n_reqs), ql)
        pos = np.repeat(seq - ql, ql) + (np.arange(n_tokens) - np.repeat(np.cumsum(ql) - ql, ql))
        held = bt[req, pos // self.block_size] * self.block_size + pos % self.block_size
        wrong = slots != held
        if wrong.any():
            i = int(np.argmax(wrong))
            raise ValueError(
                f"slot_mapping[{i}] = {int(slots[i])} is not position {int(pos[i])} of request "
                f"{int(req[i])}: its block table puts that position at slot {int(held[i])} "
                f"(block {int(bt[req[i], pos[i] // self.block_size])}){where}"
            )
        return n_tokens, n_reqs

    def pack(self, steps: StepInputs | Sequence[StepInputs]) -> tuple[np.ndarray, StepShape]:
        """Validate and pack one step (or one per data rank) into `[dp, length]` int32."""
        ranks = [steps] if isinstance(steps, StepInputs) else list(steps)
        counts = [self._validate(s, i) for i, s in enumerate(ranks)]
        shape = StepShape(
            pick_bucket(max(c[0] for c in counts), self.token_buckets),
            pick_bucket(max(c[1] for c in counts), self.req_buckets),
            self.max_blocks_per_req,
        )
        t, r, w = shape.num_tokens, shape.num_reqs, shape.max_blocks_per_req
        out = np.zeros((len(ranks), shape.length), np.int32)
        for row, s, (n_tok, n_req) in zip(out, ranks, counts, strict=True):
            ql = np.asarray(s.query_lens, np.int64)
            seq = np.asarray(s.seq_lens, np.int64)
            row[0], row[1] = n_tok, n_req
            o = 2
            row[o : o + n_req * w] = np.asarray(s.block_tables).reshape(-1)
            o += r * w
            row[o : o + n_req] = seq
            o += r
            qsl = row[o : o + r + 1]
            qsl[1 : n_req + 1] = np.cumsum(ql)
            qsl[n_req + 1 :] = n_tok
            o += r + 1
            row[o : o + t] = self.padding_slot
            row[o : o + n_tok] = s.slot_mapping
            o += t
            starts = np.repeat(seq - ql, ql)
            row[o : o + n_tok] = starts + (np.arange(n_tok) - np.repeat(qsl[:n_req], ql))
        return out, shape

    @staticmethod
    def put(buffer: np.ndarray, sharding: Sharding | None = None) -> jax.Array:
        """The step's single host-to-device transfer."""
        return place(buffer, sharding)
