"""Device meshes and the placement of KV heads on them.

A mesh has two named axes: `data` (independent replicas of the serving batch,
each owning its own block pool with local block ids) and `model` (tensor
parallelism: KV heads are split across it).

When the number of KV heads is not divisible by the model-axis size, heads
cannot simply be split. The policies (`KVLayout.plan(..., policy=...)`):

* ``"attention_data_parallel"`` — **the default** (attention data parallelism,
  as tpu-inference does): the mesh is unchanged, but the cache's block axis is
  split over both mesh axes, so every device is its own data rank with its own
  block pool and holds all KV heads of its own blocks only. Queries are routed
  to their request's rank (token rows rank-major over `data * model` ranks); the
  weights stay split over the model axis as they are. No KV is stored twice:
  the fewest bytes per device for a given token capacity.
* ``"replicate"`` — the old default (what vLLM does under tensor parallelism):
  every model rank holds all KV heads of one shared block pool; query heads stay
  split when that keeps each rank inside one KV head. Memory per device is
  `replication` (the model-axis size) times the unreplicated share.
* ``"data_parallel"`` — the spare model parallelism becomes data parallelism on
  a reshaped mesh: the model axis shrinks to the largest size `g` dividing both
  the model-axis size and `num_kv_heads`, and the data axis grows by
  `model // g`. No head is stored twice, but the weights must be laid out for
  the smaller model axis (the cache's mesh differs from the caller's).

Whatever the policy, a device holds `replication / num_devices` of all data
ranks' blocks (`KVLayout.device_share`), which `PagedKVCache.bytes_per_device`
reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._checks import check_int

DATA_AXIS = "data"
MODEL_AXIS = "model"

HeadPolicy = Literal["auto", "shard", "replicate", "data_parallel", "attention_data_parallel"]
_POLICIES = ("auto", "shard", "replicate", "data_parallel", "attention_data_parallel")


def make_mesh(
    data: int = 1,
    model: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: all devices, all on the model axis).

    With explicit `devices`, uses exactly `data * model` of them, the first ones in
    `devices` order. By default, a mesh over all devices is laid out by
    `jax.make_mesh`, which orders devices for the physical topology (TPU slices:
    model-axis neighbours on fast links); a smaller one takes the first devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    data = check_int("data", data)
    if model is not None:
        model = check_int("model", model)
    if data <= 0:
        raise ValueError(f"data axis size must be positive, got {data}")
    if model is None:
        if len(devs) % data:
            raise ValueError(
                f"data axis size {data} does not divide the {len(devs)} available devices"
            )
        model = len(devs) // data
    if model <= 0 or data * model > len(devs):
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices; "
            f"allowed: 1 to {len(devs)} available"
        )
    if devices is None and data * model == len(devs):
        auto = (jax.sharding.AxisType.Auto,) * 2
        return jax.make_mesh((data, model), (DATA_AXIS, MODEL_AXIS), axis_types=auto)
    grid = np.array(devs[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


@dataclass(frozen=True)
class KVLayout:
    """Where the KV heads and blocks of one cache live on a `(data, model)` mesh.

    Invariant: `mesh` has exactly the axes `(data, model)`. With `heads_sharded`
    the model-axis size divides `num_kv_heads`; with `blocks_over_model` every
    device of the mesh is a data rank holding all heads of its own blocks;
    otherwise every model rank holds all heads of the data rank's blocks and
    `replication` equals the model-axis size. Never both flags.
    """

    mesh: Mesh
    num_kv_heads: int
    heads_sharded: bool
    policy: str
    blocks_over_model: bool = False

    @classmethod
    def plan(cls, mesh: Mesh, num_kv_heads: int, policy: HeadPolicy = "auto") -> KVLayout:
        """Place `num_kv_heads` on `mesh`: "auto" shards heads when the model axis divides
        them, else chooses attention data parallelism (no KV stored twice)."""
        if policy not in _POLICIES:
            raise ValueError(f"unknown KV head policy {policy!r}; choose one of {_POLICIES}")
        if tuple(mesh.axis_names) != (DATA_AXIS, MODEL_AXIS):
            raise ValueError(
                f"mesh axes must be {(DATA_AXIS, MODEL_AXIS)}, got {tuple(mesh.axis_names)}"
            )
        if check_int("num_kv_heads", num_kv_heads) <= 0:
            raise ValueError(f"num_kv_heads must be positive, got {num_kv_heads}")
        model = mesh.shape[MODEL_AXIS]
        divisible = num_kv_heads % model == 0
        if policy == "shard" and not divisible:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} cannot be sharded over a model axis of size "
                f"{model}; it must be a multiple of {model} (or choose 'attention_data_parallel'"
                f" / 'replicate' / 'data_parallel')"
            )
        if policy == "replicate":
            return cls(mesh, num_kv_heads, heads_sharded=model == 1, policy=policy)
        if divisible and policy != "attention_data_parallel":
            return cls(mesh, num_kv_heads, heads_sharded=True, policy=policy)
        if policy == "data_parallel":
            g = math.gcd(model, num_kv_heads)
            grid = mesh.devices.reshape(mesh.shape[DATA_AXIS] * (model // g), g)
            return cls(Mesh(grid, (DATA_AXIS, MODEL_AXIS)), num_kv_heads, True, policy)
        return cls(
            mesh, num_kv_heads, heads_sharded=model == 1, policy="attention_data_parallel",
            blocks_over_model=model > 1,
        )  # fmt: skip

    @property
    def rank_axis(self) -> str | tuple[str, str]:
        """Mesh axis (or axes) the block axis and token rows are split over: one data rank each."""
        return (DATA_AXIS, MODEL_AXIS) if self.blocks_over_model else DATA_AXIS

    @property
    def dp_size(self) -> int:
        """Number of data ranks, each with its own block pool."""
        model = self.model_size if self.blocks_over_model else 1
        return int(self.mesh.shape[DATA_AXIS]) * model

    @property
    def model_size(self) -> int:
        return int(self.mesh.shape[MODEL_AXIS])

    @property
    def num_devices(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def replication(self) -> int:
        """How many devices hold each KV head of a block (1: no KV is stored twice)."""
        return 1 if self.heads_sharded or self.blocks_over_model else self.model_size

    @property
    def device_share(self) -> float:
        """The fraction of all data ranks' blocks (all heads) one device holds:
        `replication / num_devices`; the smallest possible is `1 / num_devices`."""
        return self.replication / self.num_devices

    @property
    def kv_heads_per_device(self) -> int:
        return self.num_kv_heads // self.model_size if self.heads_sharded else self.num_kv_heads

    @property
    def head_axis(self) -> str | None:
        """Mesh axis the KV-head dimension is split over (None: whole on each device)."""
        return MODEL_AXIS if self.heads_sharded and self.model_size > 1 else None

    @property
    def cache_spec(self) -> P:
        """Spec of a `[dp * num_blocks, block_size, 2 * kv_heads, head_size]` cache."""
        return P(self.rank_axis, None, self.head_axis, None)

    def cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.cache_spec)

    def q_head_axis(self, num_q_heads: int) -> str | None:
        """Mesh axis query heads are split over in attention (None: whole on each device).

        Sharded KV heads take their query groups along. With replicated KV heads,
        query heads are split only when each model rank's slice lies inside one
        KV head's group; otherwise every rank computes all heads. Under attention
        data parallelism each device computes all heads of its own rank's tokens.
        """
        if num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.model_size == 1 or self.blocks_over_model:
            return None
        if self.heads_sharded:
            return MODEL_AXIS
        group = num_q_heads // self.num_kv_heads
        per_rank = num_q_heads // self.model_size
        if num_q_heads % self.model_size == 0 and group % per_rank == 0:
            return MODEL_AXIS
        return None
