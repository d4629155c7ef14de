"""LLaVA: paged serving with image features merged in gives the dense reference's tokens;
every tensor layout loads the same model; the feature/placeholder contract."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import load_model, merge_image_features, save_random_checkpoint, tiny_configs
from jaxkv.testing.paged_generate import PagedGenerator, dense_greedy

NUM_NEW = 4
IMAGE = 255  # tiny_configs()["llava-tiny"]["image_token_index"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    save_random_checkpoint(path, tiny_configs()["llava-tiny"], seed=6)
    return load_model(path)


def pixels(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def prompt_embeddings(model, prompt, pixel_values):
    ids = jnp.asarray(prompt, jnp.int32)
    return np.asarray(model.multimodal_embeddings(ids, jnp.asarray(pixel_values)))


def test_placeholders_expand_to_one_token_per_feature(model):
    assert model.num_image_tokens == 16  # (16 / 4)^2 patches, CLS dropped
    assert model.image_input_shape == (3, 16, 16)
    expanded = model.expand_image_tokens([1, IMAGE, 7, IMAGE])
    assert expanded == [1] + [IMAGE] * 16 + [7] + [IMAGE] * 16
    features = model.encode_images(jnp.asarray(pixels(0, 2)))
    assert features.shape == (2, 16, 64) and features.dtype == jnp.float32


def test_images_encode_independently_of_their_batch(model):
    both = np.asarray(model.encode_images(jnp.asarray(pixels(1, 2))))
    alone = np.asarray(model.encode_images(jnp.asarray(pixels(1, 2)[1:])))
    np.testing.assert_allclose(both[1], alone[0], rtol=1e-5, atol=1e-5)


def test_merge_puts_features_into_placeholder_rows_in_order():
    ids = jnp.asarray([3, IMAGE, IMAGE, 4, IMAGE], jnp.int32)
    embeds = jnp.zeros((5, 2))
    features = jnp.asarray([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    merged = np.asarray(merge_image_features(ids, embeds, features, IMAGE))
    np.testing.assert_array_equal(merged[:, 0], [0, 1, 2, 0, 3])
    with pytest.raises(ValueError, match="3 image placeholder tokens but only 2 feature rows"):
        merge_image_features(ids, embeds, features[:2], IMAGE)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_paged_with_images_matches_dense(model, chunk_size):
    """Two requests with different images; tiny chunks cut through the image rows."""
    prompts = [
        model.expand_image_tokens([1, 5, IMAGE, 9, 10]),
        model.expand_image_tokens([1, IMAGE, 42, 43, 44, 45, 46]),
    ]
    embeds = [prompt_embeddings(model, p, pixels(10 + i)) for i, p in enumerate(prompts)]
    gen = PagedGenerator(model, block_size=4, max_num_tokens=64)
    outputs = gen.generate(prompts, NUM_NEW, chunk_size=chunk_size, prompt_embeds=embeds)
    dense = model.dense_fn()
    for prompt, emb, out, logits in zip(prompts, embeds, outputs, gen.last_logits, strict=True):
        expected, expected_logits = dense_greedy(dense, prompt, NUM_NEW, prompt_embeds=emb)
        assert out == expected
        np.testing.assert_allclose(
            np.stack(logits), np.stack(expected_logits), rtol=1e-4, atol=1e-4
        )
    # The image matters: the same tokens with another image give other logits.
    other = prompt_embeddings(model, prompts[0], pixels(99))
    assert not np.allclose(dense(jnp.asarray(prompts[0]), jnp.asarray(other)),
                           dense(jnp.asarray(prompts[0]), jnp.asarray(embeds[0])))  # fmt: skip


def test_every_layout_loads_the_same_model(tmp_path):
    """transformers 5.x module names, 4.x save_pretrained (sharded) and 5.x save_pretrained."""
    cfg = tiny_configs()["llava-tiny"]
    saved = {
        "model": save_random_checkpoint(tmp_path / "model", cfg, seed=8),
        "4.x": save_random_checkpoint(tmp_path / "4.x", cfg, seed=8, layout="4.x", num_shards=2),
        "5.x": save_random_checkpoint(tmp_path / "5.x", cfg, seed=8, layout="5.x"),
    }
    assert "lm_head.weight" in saved["model"]
    assert "language_model.model.embed_tokens.weight" in saved["4.x"]
    assert "language_model.lm_head.weight" in saved["4.x"]
    assert "vision_tower.vision_model.embeddings.class_embedding" in saved["4.x"]
    assert "vision_tower.embeddings.class_embedding" in saved["5.x"]
    models = {layout: load_model(tmp_path / layout) for layout in saved}
    px = jnp.asarray(pixels(3))
    for model in models.values():
        np.testing.assert_array_equal(model.encode_images(px), models["model"].encode_images(px))
        np.testing.assert_array_equal(model.decoder.lm_head[...], saved["model"]["lm_head.weight"])


def test_llava_bad_config(tmp_path):
    cfg = tiny_configs()["llava-tiny"]
    cfg["vision_feature_layer"] = [-2, -1]
    with pytest.raises(ValueError, match=r"vision_feature_layer \[-2, -1\] must be one layer"):
        save_random_checkpoint(tmp_path, cfg)
    cfg = tiny_configs()["llava-tiny"]
    cfg["vision_config"]["model_type"] = "dinov2"
    with pytest.raises(ValueError, match="vision model_type 'dinov2' is not supported"):
        save_random_checkpoint(tmp_path, cfg)
