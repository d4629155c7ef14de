"""Checkpoints load memory-mapped: each device's block is read from the file's mapped pages,
never first copied whole into host memory (a real-shaped Llama: SmolLM2-135M's widths,
fewer layers, small vocab)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxkv import models
from jaxkv.models import checkpoint as checkpoint_module
from jaxkv.models.checkpoint import MappedSafetensors

SMOLLM2_WIDTHS = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 3,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def mapped_ranges(file: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `file` (from /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(file.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2-widths")
    # Written by another process, so its arrays are not in this process's memory.
    code = (
        "import json, sys; from jaxkv import models; "
        "models.save_random_checkpoint(sys.argv[1], json.loads(sys.argv[2]), seed=0)"
    )
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(SMOLLM2_WIDTHS)], check=True)
    return path


def layer_weight(model, module: str, layer: int) -> np.ndarray:
    """Layer `layer`'s weight of `module` (`up_proj`, ...), whatever the stacks' layout."""
    first = 0
    for run in model.decoder.layers:
        weight = np.asarray(getattr(run, module).weight[...])
        if layer < first + weight.shape[0]:
            return weight[layer - first]
        first += weight.shape[0]
    raise IndexError(layer)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scan_layers", [False, True])
def test_blocks_are_read_from_the_mapped_file(checkpoint, monkeypatch, scan_layers):
    """No host copy of a shard before placement: what JAX is handed for a tensor placed
    as stored (embeddings, norms, one layer's weights) is the file's mapped pages; a
    weight stacked over several layers is built straight from the mapped tensors (the
    one copy stacking needs)."""
    file = checkpoint / "model.safetensors"
    handed: list[tuple[tuple[int, ...], np.ndarray]] = []
    make_array = checkpoint_module.jax.make_array_from_callback

    def recording(shape, sharding, callback):
        def block(index):
            handed.append((tuple(shape), callback(index)))
            return handed[-1][1]

        return make_array(shape, sharding, block)

    monkeypatch.setattr(checkpoint_module.jax, "make_array_from_callback", recording)
    model = models.load_model(checkpoint, scan_layers=scan_layers)
    ranges = mapped_ranges(file)
    assert ranges, "the checkpoint file is not mapped"
    layers = SMOLLM2_WIDTHS["num_hidden_layers"]
    views = [block for shape, block in handed if not scan_layers or shape[0] != layers]
    assert len(views) == (2 if scan_layers else len(MappedSafetensors(file).names))
    for block in views:
        start = block.ctypes.data
        assert any(lo <= start and start + block.nbytes <= hi for lo, hi in ranges), (
            "a float32 tensor of a float32 model was copied before placement"
        )
    mapped = MappedSafetensors(file)
    for i in range(layers):
        stored = mapped.array(f"model.layers.{i}.mlp.down_proj.weight")
        np.testing.assert_array_equal(layer_weight(model, "down_proj", i), stored)


def test_a_converted_dtype_is_read_from_the_mapping(checkpoint):
    """bfloat16 weights are converted from the mapped float32 ones, values equal."""
    mapped = MappedSafetensors(checkpoint / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    stored = mapped.array(name)
    assert isinstance(stored.base, np.memmap) or isinstance(stored, np.memmap)
    model = models.load_model(checkpoint, dtype="bfloat16")
    placed = layer_weight(model, "up_proj", 1).astype(np.float32)
    np.testing.assert_array_equal(placed, stored.astype(model.decoder.dtype).astype(np.float32))
