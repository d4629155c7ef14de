"""Host-side checks and bucket padding of a `PagedKVCache`'s ids, data rank by data rank.

Ids come rank-major (`jaxkv.device.kv_cache`): with `dp_size` data ranks, each rank's
ids are an equal share, local to that rank. Every check raises `ValueError` naming the
value and what is allowed before anything is sent; padding fills each rank's ids up to
a bucket (few programs compiled) with a positive out-of-range id the programs drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.device.host_inputs import check_ids, pad_to_bucket
from jaxkv.device.step_metadata import pick_bucket


@dataclass(frozen=True)
class RankIds:
    """The id checks of a cache with `num_blocks` blocks per data rank; `id_buckets` pad
    zeroing and copies, `transfer_buckets` the host-tier transfers."""

    dp_size: int
    num_blocks: int
    id_buckets: tuple[int, ...]
    transfer_buckets: tuple[int, ...]

    def check(
        self, name: str, ids: np.ndarray | Sequence[int], lo: int, hi: int, pad: int | None = None
    ) -> np.ndarray:
        """`ids` as int32, 1-D, an equal share per rank, each in `[lo, hi)` or `pad`."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D integer array, got {arr.dtype}{arr.shape}")
        if arr.size % self.dp_size:
            raise ValueError(
                f"{name} has {arr.size} entries, not a multiple of the {self.dp_size} data ranks"
            )
        return check_ids(name, arr, lo, hi, pad=pad)

    def distinct(self, name: str, ids: np.ndarray, skip: int | None = None) -> None:
        """Each data rank's ids (other than `skip`) distinct: a scatter's order is undefined."""
        for rank, row in enumerate(ids.reshape(self.dp_size, -1)):
            uniq, counts = np.unique(
                row[row != skip] if skip is not None else row, return_counts=True
            )
            if (counts > 1).any():
                raise ValueError(
                    f"{name} {int(uniq[np.argmax(counts > 1)])} appears more than once "
                    f"(data rank {rank}); each destination may be written once per call"
                )

    def pad(self, arr: np.ndarray, fill: int) -> np.ndarray:
        """Pad each rank's ids to a bucket so few programs are compiled."""
        per_rank = arr.reshape(self.dp_size, -1)
        size = pick_bucket(max(per_rank.shape[1], 1), self.id_buckets)
        return pad_to_bucket(per_rank, size, fill).reshape(-1)

    def copies(
        self,
        src: np.ndarray | Sequence[int],
        dst: np.ndarray | Sequence[int],
        allow_padding: bool = False,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Checked, bucket-padded (src, dst) ids; None when there is nothing to copy."""
        src_pad, dst_pad = (0, self.num_blocks) if allow_padding else (None, None)
        src_ids = self.check("src block id", src, 1, self.num_blocks, pad=src_pad)
        dst_ids = self.check("dst block id", dst, 1, self.num_blocks, pad=dst_pad)
        if src_ids.shape != dst_ids.shape:
            raise ValueError(f"src has {src_ids.size} ids but dst has {dst_ids.size}")
        self.distinct("dst block id", dst_ids, skip=dst_pad)
        for rank, (s_row, d_row) in enumerate(
            zip(src_ids.reshape(self.dp_size, -1), dst_ids.reshape(self.dp_size, -1), strict=True)
        ):
            both = np.intersect1d(s_row[d_row != dst_pad], d_row[d_row != dst_pad])
            if both.size:
                raise ValueError(
                    f"block {int(both[0])} is both a copy source and a destination (data rank "
                    f"{rank}); sources and destinations of one call must be disjoint"
                )
        if src_ids.size == 0:
            return None
        # A positive out-of-range destination pads (a negative index would wrap).
        return self.pad(src_ids, 0), self.pad(dst_ids, self.num_blocks)

    def layer_table(
        self, layers: np.ndarray | None, num_ids: int, num_layers: int, padded_size: int
    ) -> np.ndarray:
        """The checked layers of each transferred block, `[padded_size, m]` int32 (rank-
        major as the padded ids; the padding rows, and padding entries given, `num_layers`)."""
        if layers is None:
            table = np.broadcast_to(np.arange(num_layers, dtype=np.int32), (num_ids, num_layers))
        else:
            table = np.asarray(layers)
            if (
                table.ndim != 2
                or table.shape[0] != num_ids
                or table.dtype.kind not in "iu"
                or (table.size and (table.min() < 0 or table.max() > num_layers))
            ):
                raise ValueError(
                    f"layers must be [{num_ids}, m] ints in [0, {num_layers}] (one row of layer "
                    f"indices per block id; {num_layers}: padding), got shape {table.shape} "
                    f"dtype {table.dtype}"
                )
        per_rank = table.reshape(self.dp_size, -1, table.shape[1])
        out = np.full(
            (self.dp_size, padded_size // self.dp_size, table.shape[1]), num_layers, np.int32
        )
        out[:, : per_rank.shape[1]] = per_rank
        return out.reshape(padded_size, -1)

    def transfer(self, arr: np.ndarray) -> np.ndarray:
        """Checked transfer ids (distinct per rank, at most `transfer_buckets[-1]` per
        rank) padded to their bucket with `num_blocks` (a negative pad would wrap)."""
        self.distinct("block id", arr, skip=self.num_blocks)
        per_rank = arr.size // self.dp_size
        if per_rank > self.transfer_buckets[-1]:
            raise ValueError(
                f"{per_rank} block ids per data rank; a transfer moves at most "
                f"{self.transfer_buckets[-1]} (split the batch)"
            )
        size = pick_bucket(max(per_rank, 1), self.transfer_buckets)
        return pad_to_bucket(arr.reshape(self.dp_size, -1), size, self.num_blocks).reshape(-1)
