"""Per-step attention metadata: packed on the host into one int32 buffer, unpacked in jit.

Every step the host sends block tables, sequence lengths, query start offsets,
slot mapping, positions and the live counts. Packing them into a single int32
array makes the hand-off one `device_put`; the jitted step slices it back apart
with static offsets. Token counts are padded to a ladder of powers of two from 16, as
TPU serving stacks pad (`token_buckets`; the maximum always included; on a CPU one
more bucket of 1 token, `default_min_num_tokens`)
and the request count to the power of two at `min(token bucket, max_num_reqs)`, so
every token bucket has one request bucket: a serving run compiles at most
`len(token_buckets)` step programs, about `log2(max_num_tokens)`. (Padding request
rows costs block-table entries, not attention work: padded rows hold no queries.)

A `StepLayout` names the fields of a packed row and their lengths once: the host
packs with it (`StepLayout.pack`) and the jitted step unpacks with the same object
(`StepLayout.unpack`), so the two cannot disagree on an offset, and a field of the
wrong length or kind is an error rather than shifted data. `StepShape.layout` is the
metadata's layout for bucket sizes `T` (tokens), `R` (requests), width `W`::

    [num_tokens 1 | num_reqs 1 | block_tables R*W | seq_lens R | query_start_loc R+1
     | slot_mapping T | positions T]

Padding: request rows beyond `num_reqs` are all null blocks with length 0 and
start offset `num_tokens` (no queries); token entries beyond `num_tokens` carry
`padding_slot` (a positive out-of-range slot the cache scatter drops) and
position 0.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from jaxkv._checks import check_int
from jaxkv.device.host_inputs import check_ids, place


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


TILE_TOKENS = 16  # rows matrix units and the attention kernels work in


def token_buckets(max_num_tokens: int, min_num_tokens: int = TILE_TOKENS) -> tuple[int, ...]:
    """Token-count buckets: powers of two from `max(min_num_tokens, TILE_TOKENS)` (fewer
    tokens cost a tile's time on an accelerator) up to `max_num_tokens`, which is always
    the last; a `min_num_tokens` below the tile adds that one smaller bucket (one
    request's decode step on a CPU), not a ladder of them: each bucket is one more
    compiled step program."""
    start = min(max(min_num_tokens, TILE_TOKENS), max_num_tokens)
    ladder = padding_buckets(max_num_tokens, max_num_tokens, start)
    return tuple(sorted({min(min_num_tokens, max_num_tokens), *ladder}))


def default_min_num_tokens(platform: str) -> int:
    """The smallest token bucket on `platform`: 16 on a TPU or GPU, where matrix units
    and the attention kernels work in tiles of 8-16 rows (a smaller step costs the same),
    1 elsewhere. On a CPU a dot's time grows with its rows: a one-request decode step
    padded to 16 tokens reads every weight through a 16-row matrix product, several
    times the time of the matrix-vector product the one token needs."""
    return TILE_TOKENS if platform in ("tpu", "gpu") else 1


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket `>= n`; ValueError when `n` exceeds the largest."""
    if n < 0 or n > buckets[-1]:
        raise ValueError(f"size {n} is out of range [0, {buckets[-1]}]")
    return buckets[bisect.bisect_left(buckets, n)]


_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)
_INT32_RANGE = np.iinfo(np.int32)


class StepField(NamedTuple):
    """One field of a packed step row: `length` int32 entries holding `dtype` values
    (int32, or float32 carried as its bit pattern)."""

    name: str
    length: int
    dtype: np.dtype = _INT32


@dataclass(frozen=True)
class StepLayout:
    """The named fields of one data rank's packed int32 step row, in order.

    Both sides of the hand-off read this one object: the host packs with `pack`, the
    jitted step slices with `unpack` (static offsets). Invariants: names are unique,
    lengths are non-negative ints, each dtype is int32 or float32, and a row is
    `length` (the sum of the field lengths) entries long.
    """

    fields: tuple[StepField, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"step layout field names must be unique, got {names}")
        for f in self.fields:
            check_int(f"length of step field {f.name!r}", f.length, min_value=0)
            if not isinstance(f.dtype, np.dtype) or f.dtype not in (_INT32, _FLOAT32):
                allowed = "np.dtype int32 or float32"
                raise ValueError(f"step field {f.name!r} has dtype {f.dtype!r}; allowed: {allowed}")

    @functools.cached_property
    def bounds(self) -> dict[str, tuple[int, int]]:
        """Field name -> its `[start, stop)` within a row."""
        ends = np.cumsum([0] + [f.length for f in self.fields]).tolist()
        return {f.name: (ends[i], ends[i + 1]) for i, f in enumerate(self.fields)}

    @functools.cached_property
    def length(self) -> int:
        return sum(f.length for f in self.fields)

    def pack(self, values: Mapping[str, np.ndarray], num_ranks: int = 1) -> np.ndarray:
        """`[num_ranks, length]` int32 rows holding `values[name]` in each field.

        A value is `(length,)` (the same for every rank) or `(num_ranks, length)` (one
        per rank); int32 fields take integers within int32, float32 fields
        float32. A missing or unknown name, another length, dtype or an out-of-range
        integer raises ValueError/TypeError naming the field; nothing is padded.
        """
        names = {f.name for f in self.fields}
        if values.keys() != names:
            missing, unknown = sorted(names - values.keys()), sorted(values.keys() - names)
            raise ValueError(
                f"step fields missing: {missing}, unknown: {unknown} (layout: {sorted(names)})"
            )
        out = np.empty((num_ranks, self.length), np.int32)
        bounds = self.bounds
        for f in self.fields:
            value = np.asarray(values[f.name])
            if value.shape not in ((f.length,), (num_ranks, f.length)):
                raise ValueError(
                    f"step field {f.name!r} has shape {value.shape}; the layout holds "
                    f"({f.length},) or ({num_ranks}, {f.length}) for {num_ranks} rank(s)"
                )
            if f.dtype == _FLOAT32:
                if value.dtype != _FLOAT32:
                    raise TypeError(f"step field {f.name!r} holds float32, got {value.dtype}")
                value = value.view(np.int32)
            elif value.dtype != _INT32:
                if value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
                    raise TypeError(f"step field {f.name!r} holds integers, got {value.dtype}")
                if value.size and (
                    value.min() < _INT32_RANGE.min or value.max() > _INT32_RANGE.max
                ):
                    raise ValueError(
                        f"step field {f.name!r} holds values outside the int32 range "
                        f"[{value.min()}, {value.max()}]"
                    )
            start, stop = bounds[f.name]
            out[:, start:stop] = value
        return out

    def unpack(self, buffer: np.ndarray | jax.Array) -> dict[str, np.ndarray | jax.Array]:
        """Field name -> its slice of `buffer` (`[..., length]` int32, numpy or traced),
        float32 fields bitcast back; ValueError when the row length or dtype differs. Of
        a numpy buffer the slices are writable views: a packer fills a step through them
        (`StepMetadataPacker.pack_rows_into`), unchecked (`pack` checks what it is given)."""
        if buffer.shape[-1:] != (self.length,) or buffer.dtype != _INT32:
            raise ValueError(
                f"step buffer has shape {buffer.shape} dtype {buffer.dtype}; the layout "
                f"holds [..., {self.length}] int32"
            )
        out = {}
        for f in self.fields:
            start, stop = self.bounds[f.name]
            part = buffer[..., start:stop]
            if f.dtype == _FLOAT32:
                part = (
                    part.view(np.float32)
                    if isinstance(part, np.ndarray)
                    else jax.lax.bitcast_convert_type(part, jnp.float32)
                )
            out[f.name] = part
        return out


@dataclass(frozen=True)
class StepShape:
    """Static shape of one packed step: bucketed token/request counts and table width."""

    num_tokens: int
    num_reqs: int
    max_blocks_per_req: int

    @functools.cached_property
    def layout(self) -> StepLayout:
        """The metadata's fields for this shape (see the module docstring)."""
        return _metadata_layout(self)

    @property
    def length(self) -> int:
        return self.layout.length


@functools.cache
def _metadata_layout(shape: StepShape) -> StepLayout:
    t, r, w = shape.num_tokens, shape.num_reqs, shape.max_blocks_per_req
    return StepLayout(
        (
            StepField("num_tokens", 1),
            StepField("num_reqs", 1),
            StepField("block_tables", r * w),
            StepField("seq_lens", r),
            StepField("query_start_loc", r + 1),
            StepField("slot_mapping", t),
            StepField("positions", t),
        )
    )


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
    fields = shape.layout.unpack(buffer)
    return StepMetadata(
        num_tokens=fields["num_tokens"][0],
        num_reqs=fields["num_reqs"][0],
        block_tables=fields["block_tables"].reshape(shape.num_reqs, shape.max_blocks_per_req),
        seq_lens=fields["seq_lens"],
        query_start_loc=fields["query_start_loc"],
        slot_mapping=fields["slot_mapping"],
        positions=fields["positions"],
    )


@dataclass(frozen=True)
class StepInputs:
    """One data rank's host-side step: per-request rows, optionally per-token slots.

    `slot_mapping` None: the packer derives each token's slot from the block table
    (its own position in a block its request holds); given, it must equal that.
    """

    block_tables: np.ndarray  # [n_reqs, W] int
    seq_lens: np.ndarray  # [n_reqs] context length after this step
    query_lens: np.ndarray  # [n_reqs] tokens scheduled this step
    slot_mapping: np.ndarray | None = None  # [n_tokens]


@dataclass(frozen=True)
class StepRows:
    """One data rank's step on rows of a persistent block table: request `i`'s block
    ids are row `rows[i]` of `table` (`[max_num_reqs, W]` int32, e.g. a `BlockTable`'s),
    ids already checked where they entered the table (`pack_rows_into` trusts them)."""

    table: np.ndarray  # [max_num_reqs, W] int32
    rows: np.ndarray  # [n_reqs] row of each request
    seq_lens: np.ndarray  # [n_reqs] context length after this step
    query_lens: np.ndarray  # [n_reqs] tokens scheduled this step


class _Derived(NamedTuple):
    """One rank's checked step with its per-token rows, each computed once."""

    block_tables: np.ndarray  # [n_reqs, W] int32
    seq_lens: np.ndarray  # [n_reqs] int32
    query_start_loc: np.ndarray  # [n_reqs + 1] int32
    slot_mapping: np.ndarray  # [n_tokens] int32
    positions: np.ndarray  # [n_tokens] int32


def _ranks(steps: StepInputs | Sequence[StepInputs]) -> list[StepInputs]:
    """`steps` as a list of one `StepInputs` per data rank (at least one rank: a step
    of no ranks has no rows to pack, and its bucket would be empty); TypeError naming
    what was given otherwise."""
    if isinstance(steps, StepInputs):
        return [steps]
    expected = "a StepInputs or a sequence of them, one per data rank"
    try:
        ranks = list(steps)
    except TypeError:
        raise TypeError(f"steps must be {expected}, got {type(steps).__name__}") from None
    if not ranks:
        raise ValueError(f"steps is empty; give {expected} (at least one)")
    for rank, step in enumerate(ranks):
        if not isinstance(step, StepInputs):
            raise TypeError(f"steps[{rank}] must be a StepInputs, got {type(step).__name__}")
    return ranks


class StepMetadataPacker:
    """Packs steps for a cache of `num_blocks` blocks of `block_size`, table width `W`.

    Invariant: every buffer it fills passed validation (block ids in
    `[0, num_blocks)`, slots outside the null block, lengths within the table),
    is laid out by its `StepShape.layout`, and uses bucket sizes from
    `token_buckets` / `req_buckets` only. `pack` checks the block ids it is given;
    `pack_rows_into` takes them from a table whose owner checked them as they entered
    (`BlockTable`), once, and checks the rest.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        num_blocks: int,
        min_num_tokens: int = TILE_TOKENS,
    ) -> None:
        max_num_tokens = check_int("max_num_tokens", max_num_tokens, min_value=1)
        max_num_reqs = check_int("max_num_reqs", max_num_reqs, min_value=1)
        max_blocks_per_req = check_int("max_blocks_per_req", max_blocks_per_req, min_value=1)
        block_size = check_int("block_size", block_size, min_value=1)
        min_num_tokens = check_int("min_num_tokens", min_num_tokens, min_value=1)
        num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (null block + 1), got {num_blocks}")
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.padding_slot = num_blocks * block_size
        self.token_buckets = token_buckets(max_num_tokens, min_num_tokens)
        self.req_buckets = padding_buckets(max_num_reqs, max_num_reqs)
        # Each token bucket's one request bucket (every packed request has a token).
        self._req_bucket_of = {
            t: pick_bucket(min(t, max_num_reqs), self.req_buckets) for t in self.token_buckets
        }
        self._all_shapes = tuple(self._shape_for(t) for t in self.token_buckets)

    def all_shapes(self) -> list[StepShape]:
        """Every shape `pack` can produce (for warm-up): one per token bucket."""
        return list(self._all_shapes)

    def shape_for(self, num_tokens: int) -> StepShape:
        """The bucket shape `pack` chooses for a step of `num_tokens` tokens (per rank)."""
        return self._shape_for(pick_bucket(num_tokens, self.token_buckets))

    def _shape_for(self, token_bucket: int) -> StepShape:
        return StepShape(token_bucket, self._req_bucket_of[token_bucket], self.max_blocks_per_req)

    def empty(self, shape: StepShape, num_ranks: int = 1) -> np.ndarray:
        """A step with no requests and no tokens (all padding), e.g. to warm up `shape`."""
        nothing = np.zeros(0, np.int32)
        step = StepInputs(np.zeros((0, self.max_blocks_per_req), np.int32), nothing, nothing)
        return self.pack([step] * num_ranks, shape)[0]

    def _derive(self, s: StepInputs, rank: int) -> _Derived:
        """Check one rank's step; its token positions and slots, computed once."""
        where = f" (data rank {rank})"
        bt = np.asarray(s.block_tables)
        n_reqs = bt.shape[0] if bt.ndim == 2 else -1
        if bt.ndim != 2 or bt.shape[1] != self.max_blocks_per_req:
            raise ValueError(
                f"block_tables shape {bt.shape} must be [n_reqs, {self.max_blocks_per_req}]" + where
            )
        seq, ql = self._check_lens(s.seq_lens, s.query_lens, n_reqs, where)
        bt = check_ids("block id", bt, 0, self.num_blocks, ndim=2, where=where)
        return self._slots(bt, seq, ql, s.slot_mapping, where)

    def _check_lens(
        self, seq_lens: np.ndarray, query_lens: np.ndarray, n_reqs: int, where: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """`seq_lens` and `query_lens` of `n_reqs` requests as int32, each query within
        its sequence and every sequence within the table width."""
        for name, arr in (("seq_lens", seq_lens), ("query_lens", query_lens)):
            if np.shape(arr) != (n_reqs,):
                raise ValueError(f"{name} shape {np.shape(arr)} must be ({n_reqs},){where}")
        max_len = self.max_blocks_per_req * self.block_size
        seq = check_ids("seq_len", seq_lens, 1, max_len + 1, where=where)
        ql = check_ids("query_len", query_lens, 1, max_len + 1, where=where)
        too_long = ql > seq
        if too_long.any():
            i = int(np.argmax(too_long))
            raise ValueError(
                f"query_lens[{i}] = {int(ql[i])} exceeds seq_lens[{i}] = "
                f"{int(seq_lens[i])} (allowed [1, seq_len]){where}"
            )
        pick_bucket(int(ql.sum()), self.token_buckets)
        pick_bucket(n_reqs, self.req_buckets)
        return seq, ql

    def _slots(
        self, bt: np.ndarray, seq: np.ndarray, ql: np.ndarray, slots: np.ndarray | None,
        where: str,
    ) -> _Derived:  # fmt: skip
        """The step of checked block table rows `bt` and lengths: its query offsets, and
        each token's position and slot (its own position in a block its request holds;
        `slots` given: checked to equal that)."""
        n_reqs = seq.size
        cu = np.zeros(n_reqs + 1, np.int32)
        cu[1:] = ql.cumsum()
        n_tokens = int(cu[-1])
        if slots is not None:
            slots = np.asarray(slots)
            if slots.shape != (n_tokens,):
                raise ValueError(
                    f"slot_mapping shape {slots.shape} must be ({n_tokens},), the sum of "
                    f"query_lens{where}"
                )
            slots = check_ids("slot", slots, self.block_size, self.padding_slot, where=where)
        if n_tokens == n_reqs:  # one token per request (a decode step): its last position
            req, pos = np.arange(n_reqs), seq - 1
        else:
            req = np.repeat(np.arange(n_reqs), ql)
            pos = np.repeat(seq - ql, ql) + (np.arange(n_tokens, dtype=np.int32) - cu[req])
        blocks = bt[req, pos // self.block_size]
        held = blocks * self.block_size + pos % self.block_size
        wrong = (held != slots) if slots is not None else (blocks == 0)
        if wrong.any():
            i = int(np.argmax(wrong))
            target = f"position {int(pos[i])} of request {int(req[i])}"
            if slots is None:
                raise ValueError(f"{target} lies in the null block: its table holds none{where}")
            raise ValueError(
                f"slot_mapping[{i}] = {int(slots[i])} is not {target}: its block table puts "
                f"that position at slot {int(held[i])} (block {int(blocks[i])}){where}"
            )
        return _Derived(bt, seq, cu, held, pos)

    def pack(
        self, steps: StepInputs | Sequence[StepInputs], shape: StepShape | None = None
    ) -> tuple[np.ndarray, StepShape]:
        """Validate and pack one step (or one per data rank) into `[dp, length]` int32.

        `shape`: the bucket shape to pack into (one of `all_shapes()`, holding every
        rank's tokens and requests); None: the smallest that does.
        """
        derived = [self._derive(s, i) for i, s in enumerate(_ranks(steps))]
        shape = self._check_shape(
            max(d.slot_mapping.size for d in derived), max(d.seq_lens.size for d in derived), shape
        )
        out = np.zeros((len(derived), shape.length), np.int32)
        fields = self._fields_of(out, shape, len(derived))
        for k, d in enumerate(derived):
            fields["block_tables"][k, : d.seq_lens.size] = d.block_tables
        self._write(derived, self.padding_slot, fields)
        return out, shape

    def pack_rows_into(self, steps: Sequence[StepRows], shape: StepShape, out: np.ndarray) -> None:
        """Pack one `StepRows` per data rank into `out`, zero-filled `[dp, shape.length]`
        int32 (e.g. a view of a larger step buffer), for `shape` chosen by the caller
        (`shape_for`). The block ids are trusted (their `BlockTable` checked them when they
        entered it) and each rank's table rows are taken straight into `out`; the lengths
        are checked as `pack` checks them, every token's block too (never the null one)."""
        if not steps:
            raise ValueError("steps is empty; give one StepRows per data rank (at least one)")
        lens = [
            self._check_lens(s.seq_lens, s.query_lens, len(s.rows), f" (data rank {k})")
            for k, s in enumerate(steps)
        ]
        n_tokens = max((int(ql.sum()) for _, ql in lens), default=0)
        shape = self._check_shape(n_tokens, max((seq.size for seq, _ in lens), default=0), shape)
        fields = self._fields_of(out, shape, len(steps))
        derived = []
        for k, (s, (seq, ql)) in enumerate(zip(steps, lens, strict=True)):
            bt = fields["block_tables"][k, : seq.size]
            # "clip": numpy buffers a take into `out` in its default mode (a copy); the
            # rows are the table owner's own row indices, in range.
            np.take(s.table, s.rows, axis=0, out=bt, mode="clip")
            derived.append(self._slots(bt, seq, ql, None, f" (data rank {k})"))
        self._write(derived, self.padding_slot, fields)

    def _check_shape(self, n_tokens: int, n_reqs: int, shape: StepShape | None) -> StepShape:
        """`shape`, or the smallest holding every rank's step (`n_tokens` tokens and
        `n_reqs` requests at most); ValueError when it is not one of this packer's shapes
        or does not hold them."""
        if shape is None:
            return self.shape_for(n_tokens)
        if shape not in self._all_shapes:
            raise ValueError(f"{shape} is not one of this packer's bucket shapes")
        if n_tokens > shape.num_tokens or n_reqs > shape.num_reqs:
            raise ValueError(f"{n_tokens} tokens and {n_reqs} requests do not fit {shape}")
        return shape

    @staticmethod
    def _fields_of(out: np.ndarray, shape: StepShape, dp: int) -> dict[str, np.ndarray]:
        """The fields of the rows `out` (views; `block_tables` as `[dp, R, W]`), which
        must be `[dp, shape.length]` int32."""
        if out.shape != (dp, shape.length) or out.dtype != _INT32:
            raise ValueError(
                f"out has shape {out.shape} dtype {out.dtype}; {dp} rank(s) of {shape} need "
                f"({dp}, {shape.length}) int32"
            )
        fields = shape.layout.unpack(out)
        fields["block_tables"] = fields["block_tables"].reshape(dp, shape.num_reqs, -1)
        return fields

    @staticmethod
    def _write(
        derived: Sequence[_Derived], padding_slot: int, fields: dict[str, np.ndarray]
    ) -> None:
        """Fill the zeroed rows' `fields` (`_fields_of`, block tables already written)
        with the rest of the checked steps: the padding rows are zero but for the
        queries' ends (the token count) and the slots (`padding_slot`)."""
        for k, d in enumerate(derived):
            n, m = d.seq_lens.size, d.slot_mapping.size
            fields["num_tokens"][k] = m
            fields["num_reqs"][k] = n
            fields["seq_lens"][k, :n] = d.seq_lens
            fields["query_start_loc"][k, : n + 1] = d.query_start_loc
            fields["query_start_loc"][k, n + 1 :] = m
            fields["slot_mapping"][k, :m] = d.slot_mapping
            fields["slot_mapping"][k, m:] = padding_slot
            fields["positions"][k, :m] = d.positions

    @staticmethod
    def put(buffer: np.ndarray, sharding: Sharding | None = None) -> jax.Array:
        """The step's single host-to-device transfer."""
        return place(buffer, sharding)
