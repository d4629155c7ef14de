"""Equivalence with transformers: the same tiny random checkpoint gives the same logits and
greedy tokens in transformers' own model (Gemma, Gemma2, Gemma3ForCausalLM, Llama, LLaVA)
and in ours, whether jaxkv wrote it (every tensor layout) or transformers' own
`save_pretrained` did.

transformers + torch live only in the peer env `REPO_ROOT/.venv-vllm` (no JAX there): a
subprocess under its python runs `tests/hf_reference.py` and writes the logits and greedy
tokens to a file. Skipped when that env is absent.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from models_util import HF_PYTHON, family_configs, run_hf, save_with_transformers
from test_models_checkpoint import gemma3_v4_config

from jaxkv.models import load_model, save_random_checkpoint, tiny_configs
from jaxkv.testing.paged_generate import dense_greedy

pytestmark = pytest.mark.skipif(not HF_PYTHON.exists(), reason="no .venv-vllm with transformers")

NUM_NEW = 6


def hf_configs() -> dict[str, dict]:
    llama3_rope = {
        **family_configs()["llama"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
    }  # fmt: skip
    return {
        **family_configs(),
        "gemma3-4.x-config": gemma3_v4_config(),
        "llama-llama3-rope-tied": llama3_rope,
    }


def check_equivalent(prompt, hf, dense, prompt_embeds=None) -> None:
    assert list(hf["missing"]) == [] and list(hf["unexpected"]) == []
    logits = np.asarray(dense(jnp.asarray(prompt, jnp.int32), prompt_embeds))
    np.testing.assert_allclose(logits, hf["logits"], rtol=1e-4, atol=1e-4)
    tokens, _ = dense_greedy(dense, prompt, NUM_NEW, prompt_embeds)
    assert tokens == hf["generated"].tolist()


def check_decoder(path) -> None:
    prompt = np.random.default_rng(0).integers(3, 256, 21).tolist()  # > the window (8)
    hf = run_hf(path, prompt, NUM_NEW)
    check_equivalent(prompt, hf, load_model(path).dense_fn())


@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_decoder_matches_transformers(tmp_path, name):
    save_random_checkpoint(tmp_path, hf_configs()[name], seed=4)
    check_decoder(tmp_path)


def llava_configs() -> dict[str, tuple[dict, str]]:
    """(config, tensor layout) of the LLaVA variants: CLIP + Llama, and SigLIP + Gemma 3."""
    clip_llama = tiny_configs()["llava-tiny"]
    siglip_gemma = {
        **clip_llama,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "text_config": {
            k: v for k, v in family_configs()["gemma3"].items() if k != "architectures"
        },
        "vision_config": {
            **clip_llama["vision_config"],
            "model_type": "siglip_vision_model",
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "vision_use_head": False,
        },
    }
    return {
        "clip-llama": (clip_llama, "model"),
        "clip-llama-4.x-names": (clip_llama, "4.x"),
        "clip-llama-5.x-names": (clip_llama, "5.x"),
        "siglip-gemma3": (siglip_gemma, "model"),
    }


def check_llava(path) -> None:
    model = load_model(path)
    prompt = model.expand_image_tokens([2, 17, 255, 30, 31, 32, 33, 34, 35])
    px = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    hf = run_hf(path, prompt, NUM_NEW, px)
    embeds = model.multimodal_embeddings(jnp.asarray(prompt, jnp.int32), jnp.asarray(px))
    check_equivalent(prompt, hf, model.dense_fn(), embeds)


@pytest.mark.parametrize("name", sorted(llava_configs()))
def test_llava_matches_transformers(tmp_path, name):
    config, layout = llava_configs()[name]
    save_random_checkpoint(tmp_path, config, seed=9, layout=layout)
    check_llava(tmp_path)


@pytest.mark.parametrize("name", ["llama", "llava"])
def test_checkpoints_saved_by_transformers_load(tmp_path, name):
    """The tensor names and config.json this transformers' own `save_pretrained` writes
    (for LLaVA in 5.x: `language_model.model.`, `vision_tower.` with no `vision_model.`)."""
    config = llava_configs()["clip-llama"][0] if name == "llava" else family_configs()[name]
    save_with_transformers(config, tmp_path / "ckpt", seed=3)
    (check_llava if name == "llava" else check_decoder)(tmp_path / "ckpt")
