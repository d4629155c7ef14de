"""Reading Hugging Face safetensors checkpoints onto a mesh, tensor by tensor, shard by shard.

`CheckpointReader` opens `model.safetensors` or the shards a `model.safetensors.index.json`
names (with the `safetensors` library, numpy framework) and hands out each tensor as a
`jax.Array` placed with a `PartitionSpec` over the mesh: every device's block is read
from the file on its own (`jax.make_array_from_callback` + `get_slice`), so a sharded
weight never exists whole in host memory.

Bad input is a one-line `ValueError` naming the file: a JSON file that does not parse, a
safetensors file that is truncated or not one, an index naming a missing shard or
mapping a tensor to a shard that lacks it, a missing tensor, one of the wrong shape or
one that is not floating point. The reader also knows which names were taken.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open

from jaxkv.device import MODEL_AXIS, make_mesh

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtypes a weight may have: it is cast to the model dtype when read.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def read_json(file: Path) -> Any:
    """The JSON value in `file` (ValueError naming the file when unreadable or not JSON)."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: cannot read it ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None


def open_safetensors(file: Path):
    """An open `safe_open` handle of `file` (numpy framework); close it with
    `handle.__exit__(None, None, None)`. ValueError naming the file when it is not a
    complete safetensors file."""
    try:
        return safe_open(file, framework="numpy").__enter__()
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from None


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the file(s) present."""
    index = path / INDEX_FILE
    if index.exists():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) for file in weight_map.values()
        ):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ValueError(f"{index} names shard {file.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    files = {}
    for shard in shards:
        handle = open_safetensors(shard)
        files.update(dict.fromkeys(handle.keys(), shard))
        handle.__exit__(None, None, None)
    return files


class CheckpointReader:
    """Tensors of one checkpoint by name, placed on `mesh` in `dtype`.

    `get(name, shape, spec)` checks the stored shape and dtype (floating point, see
    `FLOAT_DTYPES`) and returns the tensor sharded as `spec` says (axes naming
    `MODEL_AXIS` are split over it when the size divides, else replicated). `files`
    maps every tensor name to its file; `taken` holds the names handed out so far.
    """

    def __init__(self, path: str | Path, dtype: jnp.dtype, mesh: Mesh | None = None) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh if mesh is not None else make_mesh(1, 1, jax.local_devices()[:1])
        self.taken: set[str] = set()
        self._handles: dict[Path, tuple[object, frozenset[str]]] = {}  # file -> (handle, names)

    def _slice(self, name: str):
        """The lazy `get_slice` of tensor `name`, from the file the checkpoint maps it to."""
        if name not in self.files:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} is missing")
        file = self.files[name]
        if file not in self._handles:
            handle = open_safetensors(file)
            self._handles[file] = (handle, frozenset(handle.keys()))
        handle, names = self._handles[file]
        if name not in names:
            raise ValueError(
                f"{self.path / INDEX_FILE} maps tensor {name!r} to shard {file.name}, "
                "which does not hold it"
            )
        return handle.get_slice(name)

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
        tensor = self._slice(name)
        file, stored, stored_dtype = self.files[name], tuple(tensor.get_shape()), tensor.get_dtype()
        if stored != tuple(shape):
            raise ValueError(f"{file}: tensor {name!r} has shape {stored}, expected {tuple(shape)}")
        if stored_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {stored_dtype}; weights must be "
                f"floating point ({', '.join(FLOAT_DTYPES)})"
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
        for handle, _ in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def read_config(path: str | Path) -> dict:
    """`config.json` of a checkpoint directory (ValueError naming the file when it is
    absent, not JSON or not an object)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise ValueError(f"{path}: no config.json")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object")
    return cfg
