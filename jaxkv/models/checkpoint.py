"""Reading Hugging Face safetensors checkpoints onto a mesh, tensor by tensor, shard by shard.

`CheckpointReader` opens `model.safetensors` or the shards a `model.safetensors.index.json`
names and hands out each tensor as a `jax.Array` placed with a `PartitionSpec` over the
mesh. Files are memory-mapped (`MappedSafetensors`): every device's block is a view of
the mapping (`jax.make_array_from_callback`), so a sharded weight never exists whole in
host memory, and a block already in the model dtype is not copied at all where the
backend can use host memory in place (XLA's CPU client does, for aligned blocks).

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
# safetensors dtypes a weight may have (-> numpy dtype): it is cast to the model dtype when read.
FLOAT_DTYPES = {"F16": np.float16, "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64}


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


class MappedSafetensors:
    """One safetensors file, memory-mapped read-only: `array(name)` is a numpy view of the
    tensor's bytes in the mapping, never a copy.

    The file is checked by the `safetensors` library when opened (a truncated or foreign
    file is a `ValueError` naming it); `names`, `shape(name)` and `dtype(name)` (the
    safetensors dtype string) come from its header. The mapping lives as long as any
    view of it, so arrays placed from it stay valid after the reader is closed; a file
    rewritten in place while mapped changes them (as with any memory-mapped weights).
    """

    def __init__(self, file: Path) -> None:
        open_safetensors(file).__exit__(None, None, None)  # validates header and sizes
        with open(file, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
        header.pop("__metadata__", None)
        self.file = file
        self._header: dict[str, dict] = header
        self._data_start = 8 + header_len
        self._mapping = np.memmap(file, dtype=np.uint8, mode="r")
        self.names = frozenset(header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._header[name]["dtype"]

    def array(self, name: str) -> np.ndarray:
        """The view of floating-point tensor `name` (its dtype one of `FLOAT_DTYPES`)."""
        info = self._header[name]
        start, end = (self._data_start + offset for offset in info["data_offsets"])
        dtype = FLOAT_DTYPES[info["dtype"]]
        return self._mapping[start:end].view(dtype).reshape(info["shape"])


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


def checkpoint_index(path: str | Path) -> str:
    """A digest of what a checkpoint directory holds, without reading any weight: its
    `config.json` and, for every safetensors file, its name, size and header (the names,
    dtypes, shapes and offsets of its tensors). Equal digests: the same checkpoint, as
    far as a file's size and header tell (processes of one job compare them)."""
    import hashlib

    path = Path(path)
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for file in sorted(set(checkpoint_files(path).values())):
        with open(file, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            h.update(f"{file.name}:{file.stat().st_size}:".encode() + handle.read(header_len))
    return h.hexdigest()[:16]


class MeshPlacement:
    """How a reader places a tensor on its `mesh` (a `(data, model)` mesh): `spec_for`."""

    mesh: Mesh

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


class CheckpointReader(MeshPlacement):
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
        self._mapped: dict[Path, MappedSafetensors] = {}

    def _mapped_file(self, name: str) -> MappedSafetensors:
        """The mapped file that holds tensor `name`, as the checkpoint maps it."""
        if name not in self.files:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} is missing")
        file = self.files[name]
        if file not in self._mapped:
            self._mapped[file] = MappedSafetensors(file)
        mapped = self._mapped[file]
        if name not in mapped.names:
            raise ValueError(
                f"{self.path / INDEX_FILE} maps tensor {name!r} to shard {file.name}, "
                "which does not hold it"
            )
        return mapped

    def _checked(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """The mapped view of tensor `name`, checked to have `shape` and a float dtype."""
        mapped = self._mapped_file(name)
        file, stored, stored_dtype = self.files[name], mapped.shape(name), mapped.dtype(name)
        if stored != tuple(shape):
            raise ValueError(f"{file}: tensor {name!r} has shape {stored}, expected {tuple(shape)}")
        if stored_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {stored_dtype}; weights must be "
                f"floating point ({', '.join(FLOAT_DTYPES)})"
            )
        self.taken.add(name)
        return mapped.array(name)

    def get(
        self, name: str, shape: Sequence[int], spec: P | None = None, *, units: int | None = None
    ) -> jax.Array:
        """Tensor `name` of shape `shape`, sharded by `spec` over the mesh, in `self.dtype`.

        The split axis is split only into whole `units` (see `spec_for`).
        """
        stored = self._checked(name, shape)
        return self._place(shape, spec, units, lambda index: stored[index])

    def get_stacked(
        self,
        names: Sequence[str],
        shape: Sequence[int],
        spec: P | None = None,
        *,
        units: int | None = None,
    ) -> jax.Array:
        """Tensors `names` (each of `shape`) stacked on a new leading axis, which no device
        splits; the other axes sharded as `get` shards one of them."""
        stored = [self._checked(name, shape) for name in names]

        def read(index: tuple[slice, ...]) -> np.ndarray:
            selected = stored[index[0]]
            if len(selected) == 1:  # a stack of one layer: a view of the mapping
                return selected[0][index[1:]][None]
            return np.stack([x[index[1:]] for x in selected], dtype=self.dtype)

        layer_spec = self.spec_for(shape, spec or P(), units)
        return self._place((len(names), *shape), P(None, *layer_spec), None, read)

    def _place(self, shape: Sequence[int], spec: P | None, units: int | None, read) -> jax.Array:
        """The array of `shape` sharded by `spec` whose device blocks `read(index)` returns
        (views of the mapping, converted only if the dtype differs)."""
        sharding = NamedSharding(self.mesh, self.spec_for(shape, spec or P(), units))
        dtype = self.dtype
        blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block share one read

        def block(index: tuple[slice, ...]) -> np.ndarray:
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in blocks:
                blocks[key] = read(index).astype(dtype, copy=False)
            return blocks[key]

        return jax.make_array_from_callback(tuple(shape), sharding, block)

    def close(self) -> None:
        """Forgets the mapped files (arrays already placed keep their mappings alive)."""
        self._mapped.clear()


class AbstractTensors(MeshPlacement):
    """A stand-in `CheckpointReader` that reads nothing and allocates nothing: every
    tensor is a `jax.ShapeDtypeStruct` of `dtype`, with the `NamedSharding` on `mesh`
    that `CheckpointReader` would give it (a stacked one: the layer axis unsplit). A
    model built over it has abstract parameters: it can be lowered and compiled
    ahead of time (`jit(...).lower(...)`), not run."""

    def __init__(self, dtype: jnp.dtype, mesh: Mesh) -> None:
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh

    def get(
        self, name: str, shape: Sequence[int], spec: P | None = None, *, units: int | None = None
    ) -> jax.ShapeDtypeStruct:
        sharding = NamedSharding(self.mesh, self.spec_for(shape, spec or P(), units))
        return jax.ShapeDtypeStruct(tuple(shape), self.dtype, sharding=sharding)

    def get_stacked(
        self,
        names: Sequence[str],
        shape: Sequence[int],
        spec: P | None = None,
        *,
        units: int | None = None,
    ) -> jax.ShapeDtypeStruct:
        layer_spec = self.spec_for(shape, spec or P(), units)
        sharding = NamedSharding(self.mesh, P(None, *layer_spec))
        return jax.ShapeDtypeStruct((len(names), *shape), self.dtype, sharding=sharding)


class LayerStack:
    """Reads one tensor of every decoder layer as a single stacked array.

    A stand-in reader for the modules of one layer: `get(name, shape, spec)` with `{i}`
    in `name` for the layer index returns `[len(layers), *shape]` (the tensors of
    `layers`) from `reader.get_stacked`, so modules built over it hold those layers'
    parameters on a leading axis (what `jax.lax.scan` over the layers takes).
    """

    def __init__(self, reader, layers: range) -> None:
        self.reader = reader
        self.dtype = reader.dtype
        self.layers = layers

    def get(
        self, name: str, shape: Sequence[int], spec: P | None = None, *, units: int | None = None
    ) -> jax.Array:
        names = [name.format(i=i) for i in self.layers]
        return self.reader.get_stacked(names, shape, spec, units=units)


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
