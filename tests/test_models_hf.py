"""Equivalence with transformers: the same tiny random checkpoint gives the same logits and
greedy tokens in transformers' own model (Gemma, Gemma2, Gemma3ForCausalLM, Llama, LLaVA)
and in ours.

transformers + torch live only in the peer env `REPO_ROOT/.venv-vllm` (no JAX there): a
subprocess under its python runs `tests/hf_reference.py` and writes the logits and greedy
tokens to a file. Skipped when that env is absent.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from models_util import HF_PYTHON, dense_greedy, family_configs, run_hf
from test_models_checkpoint import gemma3_v4_config

from jaxkv.models import load_model, save_random_checkpoint

pytestmark = pytest.mark.skipif(not HF_PYTHON.exists(), reason="no .venv-vllm with transformers")

NUM_NEW = 6


def hf_configs() -> dict[str, dict]:
    return {**family_configs(), "gemma3-4.x-config": gemma3_v4_config()}


def check_equivalent(path, prompt, hf, ours_dense) -> None:
    assert list(hf["missing"]) == [] and list(hf["unexpected"]) == []
    logits = np.asarray(ours_dense(jnp.asarray(prompt, jnp.int32)))
    np.testing.assert_allclose(logits, hf["logits"], rtol=1e-4, atol=1e-4)
    tokens, _ = dense_greedy(ours_dense, prompt, NUM_NEW)
    assert tokens == hf["generated"].tolist()


@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_decoder_matches_transformers(tmp_path, name):
    save_random_checkpoint(tmp_path, hf_configs()[name], seed=4)
    prompt = np.random.default_rng(0).integers(3, 256, 21).tolist()  # > the window (8)
    hf = run_hf(tmp_path, prompt, NUM_NEW)
    check_equivalent(tmp_path, prompt, hf, load_model(tmp_path).dense_fn())
