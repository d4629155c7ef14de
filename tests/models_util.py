"""Helpers shared by the tests/test_models_*.py files."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np

from jaxkv.models import tiny_configs

REPO = Path(__file__).resolve().parent.parent
HF_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
HF_SCRIPT = Path(__file__).resolve().parent / "hf_reference.py"
HF_SAVE_SCRIPT = Path(__file__).resolve().parent / "hf_save.py"


def deep_gemma3_config(num_layers: int) -> dict:
    """The tiny Gemma 3 config with `num_layers` layers (its layer types repeated)."""
    tiny = tiny_configs()["gemma3-tiny"]
    types = tiny["layer_types"] * -(-num_layers // len(tiny["layer_types"]))
    return {**tiny, "num_hidden_layers": num_layers, "layer_types": types[:num_layers]}


def family_configs() -> dict[str, dict]:
    """Tiny HF configs of each decoder family (Gemma 1/2/3, Llama)."""
    tiny = tiny_configs()
    gemma3 = tiny["gemma3-tiny"]
    common = {k: gemma3[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
    )}  # fmt: skip
    gemma = {
        **common, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
        "num_hidden_layers": 2, "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0,
    }  # fmt: skip
    gemma2 = {
        **common, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "num_hidden_layers": 4, "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 10000.0, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
    }  # fmt: skip
    return {
        "gemma": gemma,
        "gemma2": gemma2,
        "gemma3": copy.deepcopy(gemma3),
        "llama": copy.deepcopy(tiny["llama-tiny"]),
    }


def _run_peer(script: Path, *args: object) -> None:
    """Run `script` under the peer env's python (AssertionError with its stderr on failure)."""
    proc = subprocess.run(
        [str(HF_PYTHON), str(script), *map(str, args)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise AssertionError(f"{script.name} failed under {HF_PYTHON}:\n{proc.stderr[-4000:]}")


def run_hf(ckpt: Path, input_ids, num_new: int, pixel_values=None) -> dict | None:
    """transformers' logits and greedy tokens on `ckpt` (None when the peer env is absent)."""
    if not HF_PYTHON.exists():
        return None
    inputs = {"input_ids": np.asarray(input_ids, np.int32), "max_new_tokens": num_new}
    if pixel_values is not None:
        inputs["pixel_values"] = np.asarray(pixel_values, np.float32)
    np.savez(ckpt / "hf_in.npz", **inputs)
    out_file = ckpt / "hf_out.npz"
    _run_peer(HF_SCRIPT, ckpt, ckpt / "hf_in.npz", out_file)
    with np.load(out_file) as out:
        return {k: out[k] for k in out.files}


def save_with_transformers(config: dict, path: Path, seed: int) -> None:
    """A random checkpoint of `config` in directory `path`, written by transformers'
    own `save_pretrained` in the peer env (`tests/hf_save.py`)."""
    path.mkdir(parents=True, exist_ok=True)
    config_file = path.parent / f"{path.name}-config.json"
    config_file.write_text(json.dumps(config))
    _run_peer(HF_SAVE_SCRIPT, config_file, path, seed)
