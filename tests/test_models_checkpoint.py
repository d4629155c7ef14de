"""Checkpoints: HF-format round trip (single file, sharded index), 4.x and 5.x config
fields, and bad checkpoints failing with a ValueError that names the problem."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from models_util import family_configs
from safetensors.numpy import load_file, save_file

from jaxkv.models import (
    PagedContext,
    load_model,
    load_tokenizer,
    parse_decoder_config,
    save_random_checkpoint,
    tiny_configs,
)
from jaxkv.models.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointReader
from jaxkv.models.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig
from jaxkv.models.testing import save_word_tokenizer


def gemma3_v4_config() -> dict:
    """The tiny Gemma 3 config as transformers 4.x writes it (no layer_types/rope_parameters)."""
    cfg = tiny_configs()["gemma3-tiny"]
    del cfg["layer_types"], cfg["rope_parameters"]
    cfg.update(
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=4,
    )
    return cfg


def test_gemma3_config_reads_the_same_from_4x_and_5x_fields():
    v5 = parse_decoder_config(tiny_configs()["gemma3-tiny"])
    v4 = parse_decoder_config(gemma3_v4_config())
    assert v4 == v5
    assert v5.layer_types == (SLIDING_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert v5.rope_for(0) == RopeConfig(theta=10000.0)
    assert v5.rope_for(3) == RopeConfig(theta=1000000.0, kind="linear", factor=2.0)
    assert v5.sm_scale == 16**-0.5 and v5.qk_norm and v5.sandwich_norms


def test_default_layer_patterns():
    g3 = {**gemma3_v4_config(), "num_hidden_layers": 12}
    del g3["sliding_window_pattern"]  # Gemma 3 default: 5 local, 1 global
    types = parse_decoder_config(g3).layer_types
    assert [i for i, t in enumerate(types) if t == FULL_ATTENTION] == [5, 11]
    g2 = parse_decoder_config(family_configs()["gemma2"])
    assert g2.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (5.0, 3.0)
    g1 = parse_decoder_config(family_configs()["gemma"])
    assert g1.sliding_window is None and not g1.sandwich_norms and g1.sm_scale == 16**-0.5
    llama = parse_decoder_config(family_configs()["llama"])
    assert not llama.norm_unit_offset and not llama.scale_embeddings and llama.hidden_act == "silu"


def test_llama3_rope_scaling():
    rope = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=64)  # fmt: skip
    base = RopeConfig(theta=500000.0).inverse_frequencies(16)
    scaled = rope.inverse_frequencies(16)
    wavelen = 2 * np.pi / np.array(base)
    assert np.allclose(np.array(scaled)[wavelen < 16], np.array(base)[wavelen < 16])
    assert np.allclose(np.array(scaled)[wavelen > 64], np.array(base)[wavelen > 64] / 8)


def test_round_trip_single_file_and_sharded_index(tmp_path):
    cfg = tiny_configs()["gemma3-tiny"]
    saved = save_random_checkpoint(tmp_path / "one", cfg, seed=5)
    save_random_checkpoint(tmp_path / "sharded", cfg, seed=5, num_shards=3)
    assert (tmp_path / "sharded" / INDEX_FILE).exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    reader = CheckpointReader(tmp_path / "sharded", jnp.float32)
    assert set(reader.files) == set(saved)
    one, sharded = load_model(tmp_path / "one"), load_model(tmp_path / "sharded")
    # Every layer's q_proj, whatever the stacks' layout (one scanned stack or one per layer).
    q_proj = np.concatenate([np.asarray(run.q_proj.weight[...]) for run in sharded.decoder.layers])
    np.testing.assert_array_equal(q_proj[2], saved["model.layers.2.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(
        np.asarray(sharded.decoder.embed_tokens[...]), saved["model.embed_tokens.weight"]
    )
    assert sharded.decoder.lm_head is None  # tied: no lm_head.weight in the checkpoint
    ids = jnp.arange(1, 12, dtype=jnp.int32)
    np.testing.assert_array_equal(one.dense_fn()(ids), sharded.dense_fn()(ids))


def test_bfloat16_load(tmp_path):
    save_random_checkpoint(tmp_path, tiny_configs()["gemma3-tiny"], seed=1)
    model = load_model(tmp_path, dtype="bfloat16")
    assert model.decoder.layers[0].q_proj.weight[...].dtype == jnp.bfloat16


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def checkpoint(tmp_path):
    save_random_checkpoint(tmp_path, tiny_configs()["gemma3-tiny"], seed=2)
    return tmp_path


def rewrite_tensors(path, edit) -> None:
    tensors = load_file(path / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, path / SINGLE_FILE)


def rewrite_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor(checkpoint):
    name = "model.layers.1.self_attn.k_norm.weight"
    rewrite_tensors(checkpoint, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        load_model(checkpoint)


def test_misshapen_tensor(checkpoint):
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(checkpoint, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(64, 64\), expected \(128, 64\)"):
        load_model(checkpoint)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(architectures=["MistralForCausalLM"]),
         "architecture 'MistralForCausalLM' is not supported"),
        (lambda c: (c.pop("architectures"), c.update(model_type="gpt2")),
         "model_type 'gpt2' is not supported"),
        (lambda c: c.pop("hidden_size"), "config field 'hidden_size' is missing"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
        (lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
         "rope_type 'yarn' is not supported"),
        (lambda c: c.update(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    ],
)  # fmt: skip
def test_bad_config(checkpoint, edit, message):
    rewrite_config(checkpoint, edit)
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint)


def test_missing_files(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path / "nowhere")
    (checkpoint / SINGLE_FILE).unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(checkpoint)
    (checkpoint / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="names shard gone.safetensors, which does not exist"):
        load_model(checkpoint)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(checkpoint, dtype="int8")


def test_decoder_config_is_frozen():
    cfg = parse_decoder_config(tiny_configs()["gemma3-tiny"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 1


def test_tokenizer_beside_the_checkpoint(checkpoint):
    assert load_tokenizer(checkpoint) is None
    save_word_tokenizer(checkpoint, 256, {0: "<pad>", 1: "<eos>", 2: "<bos>"})
    tokenizer = load_tokenizer(checkpoint)
    assert tokenizer.encode("<bos> w7 w200").ids == [2, 7, 200]
    assert tokenizer.decode([2, 7, 200, 1], skip_special_tokens=True) == "w7 w200"


def test_forward_paged_rejects_mismatched_caches(checkpoint):
    model = load_model(checkpoint)
    ids = jnp.zeros(4, jnp.int32)
    ctx = PagedContext((), (), (0,) * 4, (), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match=r"kv_cache has shape \(3, 8, 4, 2, 16\); expected"):
        model.forward_paged(ids, jnp.zeros((3, 8, 4, 2, 16)), ctx)
    with pytest.raises(ValueError, match=r"kv_cache has shape \(8, 4, 2, 16\); expected"):
        model.forward_paged(ids, jnp.zeros((8, 4, 2, 16)), ctx)
    ctx = PagedContext((), (), (0,) * 3, (), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="ctx.layer_to_group has 3 entries; expected 4"):
        model.forward_paged(ids, jnp.zeros((4, 8, 4, 2, 16)), ctx)
