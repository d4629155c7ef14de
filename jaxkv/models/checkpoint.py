"""Reading Hugging Face safetensors checkpoints onto a mesh, tensor by tensor, shard by shard.

`CheckpointReader` opens `model.safetensors` or the shards a `model.safetensors.index.json`
names (with the `safetensors` library, numpy framework) and hands out each tensor as a
`jax.Array` placed with a `PartitionSpec` over the mesh: every device's block is read
from the file on its own (`jax.make_array_from_callback` + `get_slice`), so a sharded
weight never exists whole in host memory. A missing tensor or one of the wrong shape is
a `ValueError` naming it; the reader also knows which names were taken.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from jaxkv.device import MODEL_AXIS, make_mesh

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the file(s) present."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.exists():
                raise ValueError(f"{index} names shard {file.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    files = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                files[name] = shard
    return files


class CheckpointReader:
    """Tensors of one checkpoint by name, placed on `mesh` in `dtype`.

    `get(name, shape, spec)` checks the stored shape against `shape` and returns the
    tensor sharded as `spec` says (axes naming `MODEL_AXIS` are split over it when the
    size divides, else replicated). `taken` holds the names handed out so far.
    """

    def __init__(self, path: str | Path, dtype: jnp.dtype, mesh: Mesh | None = None) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh if mesh is not None else make_mesh(1, 1, jax.local_devices()[:1])
        self.taken: set[str] = set()
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, framework="numpy").__enter__()
        return handle

    def spec_for(self, shape: Sequence[int], spec: P, units: int | None = None) -> P:
        """`spec` with its `MODEL_AXIS` entry dropped unless the model axis divides the
        split axis into whole `units` (e.g. attention heads; default: the axis size)."""
        model_size = self.mesh.shape[MODEL_AXIS]
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        return P(
            *(
                axis if axis != MODEL_AXIS or (units or size) % model_size == 0 else None
                for axis, size in zip(entries, shape, strict=True)
            )
        )

    def get(
        self, name: str, shape: Sequence[int], spec: P | None = None, *, units: int | None = None
    ) -> jax.Array:
        """Tensor `name` of shape `shape`, sharded by `spec` over the mesh, in `self.dtype`.

        The split axis is split only into whole `units` (see `spec_for`).
        """
        if name not in self.files:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} is missing")
        tensor = self._open(self.files[name]).get_slice(name)
        stored = tuple(tensor.get_shape())
        if stored != tuple(shape):
            raise ValueError(
                f"checkpoint {self.path}: tensor {name!r} has shape {stored}, "
                f"expected {tuple(shape)}"
            )
        self.taken.add(name)
        sharding = NamedSharding(self.mesh, self.spec_for(shape, spec or P(), units))
        dtype = self.dtype
        blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block share one read

        def block(index: tuple[slice, ...]) -> np.ndarray:
            # Each device's block, read from the file on its own.
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in blocks:
                blocks[key] = np.asarray(tensor[index] if index else tensor[:]).astype(dtype)
            return blocks[key]

        return jax.make_array_from_callback(tuple(shape), sharding, block)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def read_config(path: str | Path) -> dict:
    """`config.json` of a checkpoint directory (ValueError when absent or not an object)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise ValueError(f"{path}: no config.json")
    cfg = json.loads(file.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    return cfg
