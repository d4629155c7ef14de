"""Block transfers between the device KV cache and the host tier, all data ranks at once.

`BlockTransfers` moves whole blocks (a chosen set of their layers) of the runner's
stacked KV cache: `gather` copies device blocks out towards host memory (the host tier
stores them), `load` scatters host blocks back into device blocks, in place. Each rank
transfers its own blocks; a transfer of every rank goes in chunks of the largest
transfer bucket (`PagedKVCache.transfer_buckets`), one program per chunk, a rank with
fewer blocks padded with ids no gather reads and no scatter writes. The cache array is
the runner's (it is donated by every step): each call takes it and returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxkv.device import PagedKVCache
from jaxkv.engine.scheduler import SchedulerOutput

__all__ = ["BlockTransfers", "GatheredBlocks"]


@dataclass(frozen=True)
class GatheredBlocks:
    """One data rank's blocks on their way to host memory: per transfer, `(gathered
    array, first index of the rank's blocks on its block axis, blocks used)`."""

    parts: list[tuple[jax.Array, int, int]]

    def ready(self) -> bool:
        return all(g.is_ready() for g, _, _ in self.parts)

    def read(self) -> np.ndarray:
        """The blocks `[n, m, *page_shape]` (the `m` layers gathered of each) as stored
        (waits for the copies)."""
        return np.concatenate(
            [np.moveaxis(np.asarray(g)[:, i : i + n], 1, 0) for g, i, n in self.parts]
        )


class BlockTransfers:
    """The host-tier gathers and scatters of a stacked KV cache of `num_layers` layers
    (`paged`'s page shape, block ids in `[0, paged.num_blocks)` per rank) on `dp_size`
    data ranks.

    Invariant: a padding entry (id `num_blocks`, layer `num_layers`) is read as zeros by
    a gather and dropped by a scatter, so no chunk changes a block it was not given."""

    def __init__(self, paged: PagedKVCache, dp_size: int, num_layers: int) -> None:
        self.paged = paged
        self.dp_size = dp_size
        self.num_layers = num_layers

    def _chunk(
        self, block_ids: Sequence[Sequence[int]], layers: Sequence[np.ndarray], start: int,
        chunk: int,
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:  # fmt: skip
        """Transfer chunk `[start, start + chunk)` of each rank's `block_ids[k]` and their
        layer rows `layers[k]` (`[n_k, m]`): ids `[dp * width]` and layers `[dp * width,
        m]` (rank-major), a rank with fewer padded with id `num_blocks` and layer `L` (a
        gather reads zeros there, a scatter drops it); and each rank's count."""
        m = layers[0].shape[1]
        counts = [len(ids[start : start + chunk]) for ids in block_ids]
        width = max(counts)
        ids = np.full((self.dp_size, width), self.paged.num_blocks, np.int32)
        table = np.full((self.dp_size, width, m), self.num_layers, np.int32)
        for rank, n in enumerate(counts):
            ids[rank, :n] = block_ids[rank][start : start + n]
            table[rank, :n] = layers[rank][start : start + n]
        return ids.reshape(-1), table.reshape(-1, m), counts

    def gather(
        self, kv_cache: jax.Array, block_ids: Sequence[Sequence[int]], layers: Sequence[np.ndarray]
    ) -> list[GatheredBlocks]:
        """Read the layers `layers[k][i]` (`[n_k, m]` layer indices, `L`: padding, read as
        zeros) of device block `block_ids[k][i]` of data rank `k` out of `kv_cache`, all
        ranks together: one gather program per transfer bucket, dispatched now, each
        result's copy to host memory started at once; neither waits. What is read is the
        cache as of this call, whatever later steps write. Returns each rank's blocks."""
        paged = self.paged
        chunk = paged.transfer_buckets[-1]
        parts: list[list] = [[] for _ in range(self.dp_size)]
        for start in range(0, max(map(len, block_ids), default=0), chunk):
            ids, table, counts = self._chunk(block_ids, layers, start, chunk)
            gathered = paged.gather_blocks_stacked(kv_cache, ids, table)
            gathered.copy_to_host_async()
            size = gathered.shape[1] // self.dp_size  # the bucket: each rank's share
            for rank, n in enumerate(counts):
                if n:
                    parts[rank].append((gathered, rank * size, n))
        return [GatheredBlocks(p) for p in parts]

    def load(self, kv_cache: jax.Array, outs: Sequence[SchedulerOutput]) -> jax.Array:
        """Scatter the host blocks each rank's output loads (`kv_load_blocks`, their layers
        `kv_load_layers`) into their device blocks of `kv_cache`, in place (donated), all
        ranks together: one program per transfer bucket. Returns the cache."""
        if all(out.kv_load_blocks is None for out in outs):
            return kv_cache
        ids = [out.kv_load_block_ids for out in outs]
        m, *page = next(o.kv_load_blocks for o in outs if o.kv_load_blocks is not None).shape[1:]
        layers = [
            np.zeros((0, m), np.int32) if out.kv_load_layers is None else out.kv_load_layers
            for out in outs
        ]
        paged = self.paged
        chunk = paged.transfer_buckets[-1]
        for start in range(0, max(map(len, ids)), chunk):
            padded, table, counts = self._chunk(ids, layers, start, chunk)
            width = padded.size // self.dp_size
            blocks = np.zeros((self.dp_size, width, m, *page), paged.storage_dtype)
            for rank, (out, n) in enumerate(zip(outs, counts, strict=True)):
                if n:
                    blocks[rank, :n] = out.kv_load_blocks[start : start + n]
            kv_cache = paged.scatter_blocks_stacked(
                kv_cache, padded, np.moveaxis(blocks.reshape(-1, m, *page), 0, 1), table
            )
        return kv_cache

    def warm_up(self, kv_cache: jax.Array, layers_per_block: int) -> jax.Array:
        """Compile the gather and the scatter of `layers_per_block` layers a block for
        every transfer bucket (on padding only: no block changes); waits for them.
        Returns the (donated) cache."""
        kv_cache = self.paged.warmup_transfers(kv_cache, layers_per_block)
        jax.block_until_ready(kv_cache)
        return kv_cache
