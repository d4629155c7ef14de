"""Helpers shared by the tests/test_models_*.py files and the deviceless compile tests."""

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


def real_shaped_two_layer_configs() -> dict[str, dict]:
    """Two-layer models with real widths, heads and head sizes (compile time stays small):
    Llama-3.2-1B (head 64), Gemma-3-270M (head 256, a sliding and a global layer) and a
    LLaVA-style model (a Llama text model of head 128 behind the tiny vision tower)."""
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    gemma = dict(tiny_configs()["gemma3-tiny"])
    gemma.update(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=8192,
    )  # fmt: skip
    llava = json.loads(json.dumps(tiny_configs()["llava-tiny"]))
    llava["text_config"].update(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    return {"llama-3.2-1b-2l": llama, "gemma-3-270m-2l": gemma, "llava-style-2l": llava}
