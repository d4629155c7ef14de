"""New weights for a running model, written into its device buffers (`LLMEngine.update_weights`).

`WeightUpdater.prepare` takes new weights in one of three forms and checks all of them
before anything changes (a ValueError/TypeError naming the tensor, the expected and the
given shape and dtype):

* the model's own state (`nnx.state` of a model of the same structure): every array
  leaf, with the running model's shape and dtype, placed on an equivalent sharding;
* a mapping of Hugging Face tensor names to arrays (numpy or JAX; what a trainer holds):
  every tensor the model reads from a checkpoint, under any name layout `load_model`
  accepts, each with the tensor's shape and the model's dtype (a JAX array placed as
  `load_model` places that tensor; a numpy array is placed so). No other name is
  taken: an unknown name is refused rather than silently not applied;
* a checkpoint directory (HF safetensors and `config.json`), read as `load_model` reads
  it (cast to the model's dtype); its config must equal the running model's.

`WeightUpdater.apply` then runs one compiled program per form whose inputs are the old
weights, donated, and whose outputs are aliased to them: the new values are copied into
the existing buffers, so the device holds the same bytes after an update as before
(the arrays given stay the caller's). The layers of a stacked run are stacked inside
that program. `warm_up` compiles both programs, so an update compiles nothing.

`WeightVersions` numbers the updates: versions are ints by default (0: the initial
weights), or any new int or str the caller gives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.engine.build import model_mesh
from jaxkv.models.base import CausalLM
from jaxkv.models.checkpoint import AbstractTensors, CheckpointReader, read_config
from jaxkv.models.config import parse_model_config
from jaxkv.models.loading import PARTS, architecture_of, build_model, find_prefixes

__all__ = ["TensorSource", "WeightUpdater", "WeightVersions", "Weights"]

# What `update_weights` takes: a checkpoint directory, HF tensor name -> array, or a state.
Weights = str | os.PathLike | Mapping[str, Any] | nnx.State


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one leaf of the model's state comes from in a checkpoint: the tensors
    `names` (several: stacked on a new leading axis, `stacked`), each of `shape`, read
    with `spec` and `units` and placed with `sharding` (`CheckpointReader.get`'s)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    spec: P | None
    units: int | None
    sharding: NamedSharding
    stacked: bool


class _SourceRecorder(AbstractTensors):
    """An `AbstractTensors` that remembers which tensors each abstract leaf stands for."""

    def __init__(self, dtype, mesh) -> None:
        super().__init__(dtype, mesh)
        self.sources: dict[int, TensorSource] = {}
        self._structs: list[jax.ShapeDtypeStruct] = []  # alive, so their ids stay unique

    def _record(self, struct, names, shape, spec, units, stacked: bool):
        sharding = NamedSharding(self.mesh, self.spec_for(shape, spec or P(), units))
        source = TensorSource(tuple(names), tuple(shape), spec, units, sharding, stacked)
        self.sources[id(struct)] = source
        self._structs.append(struct)
        return struct

    def get(self, name, shape, spec=None, *, units=None):
        struct = super().get(name, shape, spec, units=units)
        return self._record(struct, (name,), shape, spec, units, False)

    def get_stacked(self, names, shape, spec=None, *, units=None):
        struct = super().get_stacked(names, shape, spec, units=units)
        return self._record(struct, names, shape, spec, units, True)


def _write(old: list[jax.Array], new: list[tuple[jax.Array, ...]]) -> list[jax.Array]:
    """Each leaf's new value: its one part (reshaped: a run of one layer), or its parts
    stacked. `old` is donated: the outputs take its buffers."""
    return [
        parts[0].reshape(leaf.shape) if len(parts) == 1 else jnp.stack(parts)
        for leaf, parts in zip(old, new, strict=True)
    ]


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@dataclasses.dataclass
class _Update:
    """Checked new weights: `parts[j]` (placed arrays) become state leaf `indices[j]`."""

    kind: str  # "state" or "hf": which compiled program writes them
    indices: list[int]
    parts: list[tuple[jax.Array, ...]]


class WeightUpdater:
    """Checks and writes new weights into a `ModelRunner`'s model (module docstring).

    Invariants: a refused update changes nothing; an applied one leaves every state leaf
    with its shape, dtype, sharding and device buffer, and compiles nothing once
    `warm_up` ran. `programs[kind]` is the compiled write ("state", "hf").
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        model = runner.model
        self.hf_config = None
        if isinstance(model, CausalLM):
            self.hf_config = getattr(model, "llava_config", None) or model.config
            self.dtype = jnp.dtype(model.decoder.dtype)
            self.scan_layers = len(model.decoder.layers) == 1
        self.programs: dict[str, jax.stages.Compiled] = {}
        self._sources: dict[tuple, list[TensorSource | None]] = {}
        # A written leaf comes back committed to its device, and a jitted step's cache
        # tells committed inputs from uncommitted ones: commit them now, so the steps
        # compile the same programs before and after an update. An uncommitted leaf (a
        # table the model computed, e.g. RoPE frequencies) sits on the default device:
        # on a mesh it is committed replicated over the mesh, not to that one device.
        leaves = runner.weight_leaves
        if any(isinstance(leaf, jax.Array) and not leaf.committed for leaf in leaves):
            replicated = NamedSharding(runner.mesh, P())
            runner.set_weight_leaves(
                [
                    jax.device_put(leaf, replicated)
                    if isinstance(leaf, jax.Array) and not leaf.committed
                    else leaf
                    for leaf in leaves
                ]
            )

    # -- checking -------------------------------------------------------------------------

    def prepare(self, weights: Weights) -> _Update:
        """`weights` checked and placed as the running model's (nothing changes)."""
        if isinstance(weights, str | os.PathLike):
            return self._from_checkpoint(Path(weights))
        if isinstance(weights, nnx.State):
            return self._from_state(weights)
        if isinstance(weights, Mapping):
            return self._from_mapping(weights)
        raise TypeError(
            "weights must be a checkpoint directory, a mapping of Hugging Face tensor names "
            f"to arrays, or the model's nnx.State; got {type(weights).__name__}"
        )

    def _from_state(self, state: nnx.State) -> _Update:
        runner = self.runner
        given = jax.tree_util.tree_flatten_with_path(state)[0]
        if jax.tree.structure(state) != runner.weight_treedef:
            mine = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
                runner._state)[0]}  # fmt: skip
            theirs = {jax.tree_util.keystr(p) for p, _ in given}
            raise ValueError(
                "weights: the state's structure is not the running model's (missing "
                f"{sorted(mine - theirs)[:5]}, unknown {sorted(theirs - mine)[:5]})"
            )
        current = runner.weight_leaves
        indices = [i for i, leaf in enumerate(current) if isinstance(leaf, jax.Array)]
        parts = [
            (self._placed(f"weights{jax.tree_util.keystr(given[i][0])}", given[i][1],
                          current[i], _struct(current[i])),)
            for i in indices
        ]  # fmt: skip
        return _Update("state", indices, parts)

    def _hf(self) -> Any:
        if self.hf_config is None:
            raise TypeError(
                f"the running model ({type(self.runner.model).__name__}) has no Hugging Face "
                "tensor names (not a jaxkv.models model): pass its nnx.State instead"
            )
        return self.hf_config

    def _from_mapping(self, weights: Mapping[str, Any]) -> _Update:
        names = [n for n in weights if isinstance(n, str)]
        sources = self._sources_for(find_prefixes(self._hf(), names, "weights"))
        wanted = {name for s in sources if s is not None for name in s.names}
        missing = sorted(wanted - set(names))
        unknown = sorted(map(repr, set(weights) - wanted))
        if missing or unknown:
            raise ValueError(
                f"weights: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                f"names the model does not take {unknown[:5]}"
                f"{'...' if len(unknown) > 5 else ''} (nothing was changed)"
            )
        current = self.runner.weight_leaves
        indices = [i for i, s in enumerate(sources) if s is not None]
        parts = []
        for i in indices:
            s = sources[i]
            want = jax.ShapeDtypeStruct(s.shape, self.dtype, sharding=s.sharding)
            parts.append(
                tuple(
                    self._placed(f"weights[{n!r}]", weights[n], current[i], want) for n in s.names
                )  # fmt: skip
            )
        return _Update("hf", indices, parts)

    def _from_checkpoint(self, path: Path) -> _Update:
        running = self._hf()
        config = parse_model_config(read_config(path), f"{path / 'config.json'}")
        if config != running:
            differ = [
                f.name
                for f in dataclasses.fields(running)
                if getattr(config, f.name, None) != getattr(running, f.name)
            ]
            raise ValueError(
                f"{path / 'config.json'} describes another model than the running one "
                f"(fields {differ or type(config).__name__} differ); nothing was changed"
            )
        reader = CheckpointReader(path, self.dtype, self._mesh())
        try:
            sources = self._sources_for(find_prefixes(config, reader.files.keys(), str(path)))
            indices = [i for i, s in enumerate(sources) if s is not None]
            parts = [
                tuple(reader.get(n, sources[i].shape, sources[i].spec, units=sources[i].units)
                      for n in sources[i].names)
                for i in indices
            ]  # fmt: skip
        finally:
            reader.close()
        return _Update("hf", indices, parts)

    @staticmethod
    def _placed(what: str, given, leaf, want: jax.ShapeDtypeStruct) -> jax.Array:
        """`given` placed as `want` (ValueError naming `what` on another shape, dtype or a
        placement that is not equivalent; the running model's own buffer is refused)."""
        if not hasattr(given, "shape") or not hasattr(given, "dtype"):
            raise TypeError(f"{what}: expected an array, got {type(given).__name__}")
        shape, dtype = tuple(given.shape), jnp.dtype(given.dtype)
        if shape != tuple(want.shape) or dtype != want.dtype:
            raise ValueError(
                f"{what}: expected shape {tuple(want.shape)} and dtype {want.dtype}, got "
                f"shape {shape} and dtype {dtype}; nothing was changed"
            )
        if not isinstance(given, jax.Array):
            return jax.device_put(np.asarray(given), want.sharding)
        if given is leaf:
            raise ValueError(f"{what} is the running model's own buffer; pass new arrays")
        if not given.sharding.is_equivalent_to(want.sharding, len(shape)):
            raise ValueError(
                f"{what}: placed as {given.sharding}, expected {want.sharding} (the running "
                "model's placement); nothing was changed"
            )
        return given if given.sharding == want.sharding else jax.device_put(given, want.sharding)

    # -- sources and programs -------------------------------------------------------------

    def _mesh(self):
        return model_mesh(self.runner.model) or self.runner.mesh

    def _sources_for(self, prefixes: Mapping[str, str]) -> list[TensorSource | None]:
        """Per state leaf, the checkpoint tensors it is read from under `prefixes` (None:
        a leaf no tensor gives, e.g. rotary frequencies): an abstract twin of the model
        is built over a recording reader."""
        key = tuple(sorted(prefixes.items()))
        sources = self._sources.get(key)
        if sources is None:
            recorder = _SourceRecorder(self.dtype, self._mesh())
            twin = build_model(self._hf(), recorder, prefixes, scan_layers=self.scan_layers)
            leaves = jax.tree.leaves(nnx.state(twin))
            if len(leaves) != len(self.runner.weight_leaves):
                raise RuntimeError("the model's twin has another state structure")
            sources = [recorder.sources.get(id(leaf)) for leaf in leaves]
            self._sources[key] = sources
        return sources

    def _program(self, kind: str, indices: Sequence[int], parts) -> jax.stages.Compiled:
        """The compiled write of `kind`, compiled for these structs on first use."""
        program = self.programs.get(kind)
        if program is None:
            current = self.runner.weight_leaves
            old = [_struct(current[i]) for i in indices]
            new = [tuple(_struct(p) for p in group) for group in parts]
            jitted = jax.jit(
                _write, donate_argnums=0, keep_unused=True, out_shardings=[s.sharding for s in old]
            )
            program = self.programs[kind] = jitted.lower(old, new).compile()
        return program

    def warm_up(self) -> None:
        """Compile the write of every form the model takes."""
        current = self.runner.weight_leaves
        indices = [i for i, leaf in enumerate(current) if isinstance(leaf, jax.Array)]
        self._program("state", indices, [(current[i],) for i in indices])
        if self.hf_config is not None:
            prefixes = {k: p.prefixes[0] for k, p in PARTS[architecture_of(self.hf_config)].items()}
            sources = self._sources_for(prefixes)
            indices = [i for i, s in enumerate(sources) if s is not None]
            structs = [
                tuple(jax.ShapeDtypeStruct(sources[i].shape, self.dtype,
                                           sharding=sources[i].sharding)
                      for _ in sources[i].names)
                for i in indices
            ]  # fmt: skip
            self._program("hf", indices, structs)

    def apply(self, update: _Update) -> None:
        """Write checked weights into the model's buffers (donated, aliased)."""
        leaves = list(self.runner.weight_leaves)
        program = self._program(update.kind, update.indices, update.parts)
        written = program([leaves[i] for i in update.indices], update.parts)
        for i, leaf in zip(update.indices, written, strict=True):
            leaves[i] = leaf
        self.runner.set_weight_leaves(leaves)


class WeightVersions:
    """The weight version now (`current`; 0: the initial weights) and those used before.

    Invariant: `current` is never a version used before it; `key` is None exactly while
    the initial weights serve (block hashes then carry no version: vLLM's)."""

    def __init__(self) -> None:
        self.current: int | str = 0
        self._used: set[int | str] = {0}
        self._next_int = 1

    @property
    def key(self) -> int | str | None:
        return None if self.current == 0 and type(self.current) is int else self.current

    def check_new(self, version: int | str | None) -> int | str:
        """`version` (None: the next int), or ValueError/TypeError naming it."""
        if version is None:
            return self._next_int
        if type(version) not in (int, str):
            raise TypeError(f"weight_version must be an int or str, got {version!r}")
        if version in self._used:
            raise ValueError(f"weight_version {version!r} was used before: a version must be new")
        return version

    def advance(self, version: int | str) -> None:
        self.current = version
        self._used.add(version)
        if type(version) is int:
            self._next_int = max(self._next_int, version + 1)
