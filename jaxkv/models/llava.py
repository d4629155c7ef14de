"""LLaVA: a CLIP/SigLIP-style ViT, a two-layer GELU projector and a decoder.

As Hugging Face defines it: the vision tower embeds `pixel_values [N, C, H, W]` as
patches (a stride-`patch` convolution), prepends the CLS embedding (CLIP), adds position
embeddings and applies the pre-layernorm (CLIP); pre-LN encoder layers follow
(`x + attn(layer_norm1(x))`, `x + fc2(act(fc1(layer_norm2(x))))`, bidirectional
attention). Hidden state `vision_feature_layer` (index into [embeddings, layer 1, ...,
layer L]) is selected, its CLS row dropped under the "default" strategy, and
`multi_modal_projector` (`linear_2(act(linear_1(x)))`) maps it to the decoder width.
Those features replace the embeddings of the image placeholder tokens (one per
feature, in order); the decoder then runs on the merged embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.models.base import CausalLM
from jaxkv.models.config import LlavaConfig, VisionConfig
from jaxkv.models.decoder import Decoder
from jaxkv.models.layers import LayerNorm, Linear, activation, dense_attention


class VisionLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig, reader, prefix: str) -> None:
        hid, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps
        heads = cfg.num_attention_heads
        self.cfg = cfg
        self.layer_norm1 = LayerNorm(reader, f"{prefix}layer_norm1", hid, eps)
        self.q_proj = Linear(
            reader, f"{prefix}self_attn.q_proj", hid, hid, bias=True, split="column", units=heads
        )
        self.k_proj = Linear(
            reader, f"{prefix}self_attn.k_proj", hid, hid, bias=True, split="column", units=heads
        )
        self.v_proj = Linear(
            reader, f"{prefix}self_attn.v_proj", hid, hid, bias=True, split="column", units=heads
        )
        self.out_proj = Linear(
            reader, f"{prefix}self_attn.out_proj", hid, hid, bias=True, split="row", units=heads
        )
        self.layer_norm2 = LayerNorm(reader, f"{prefix}layer_norm2", hid, eps)
        self.fc1 = Linear(reader, f"{prefix}mlp.fc1", inter, hid, bias=True, split="column")
        self.fc2 = Linear(reader, f"{prefix}mlp.fc2", hid, inter, bias=True, split="row")

    def __call__(self, x: jax.Array) -> jax.Array:
        """One image's tokens `x [S, hidden]`."""
        cfg = self.cfg
        s, heads = x.shape[0], cfg.num_attention_heads
        h = self.layer_norm1(x)
        q, k, v = (
            proj(h).reshape(s, heads, cfg.head_dim)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = dense_attention(q, k, v, sm_scale=cfg.head_dim**-0.5, causal=False)
        x = x + self.out_proj(a.reshape(s, -1))
        return x + self.fc2(activation(cfg.hidden_act, self.fc1(self.layer_norm2(x))))


class VisionTower(nnx.Module):
    """The ViT up to the layer LLaVA reads (`num_layers` encoder layers are loaded)."""

    def __init__(self, cfg: VisionConfig, reader, prefix: str, num_layers: int) -> None:
        self.cfg = cfg
        hid, p = cfg.hidden_size, cfg.patch_size
        emb = f"{prefix}embeddings."
        self.patch_embedding = nnx.Param(
            reader.get(f"{emb}patch_embedding.weight", (hid, cfg.num_channels, p, p))
        )
        self.patch_bias = (
            nnx.Param(reader.get(f"{emb}patch_embedding.bias", (hid,)))
            if cfg.kind == "siglip"
            else None
        )
        self.class_embedding = (
            nnx.Param(reader.get(f"{emb}class_embedding", (hid,))) if cfg.kind == "clip" else None
        )
        self.position_embedding = nnx.Param(
            reader.get(f"{emb}position_embedding.weight", (cfg.num_positions, hid))
        )
        self.pre_layrnorm = (
            LayerNorm(reader, f"{prefix}pre_layrnorm", hid, cfg.layer_norm_eps)
            if cfg.kind == "clip"
            else None
        )
        self.layers = nnx.List(
            [VisionLayer(cfg, reader, f"{prefix}encoder.layers.{i}.") for i in range(num_layers)]
        )

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """Hidden state after the loaded layers, `[N, num_positions, hidden]`."""
        cfg = self.cfg
        n, c, size, p = pixel_values.shape[0], cfg.num_channels, cfg.image_size, cfg.patch_size
        chex.assert_shape(pixel_values, (n, c, size, size))
        g = size // p
        patches = pixel_values.astype(self.position_embedding[...].dtype)
        patches = patches.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        weight = self.patch_embedding[...].reshape(cfg.hidden_size, c * p * p)
        x = patches.reshape(n, g * g, c * p * p) @ weight.T
        if self.patch_bias is not None:
            x = x + self.patch_bias[...]
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding[...], (n, 1, cfg.hidden_size))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + self.position_embedding[...][None]
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = jax.vmap(layer)(x)
        return x


class LlavaForConditionalGeneration(CausalLM):
    """LLaVA (see the module docstring); `config` is the language model's `DecoderConfig`.

    `prefixes` name where each part's tensors are ("model", "lm_head", "vision_tower",
    "projector"; see `jaxkv.models.loading.PARTS`).
    """

    def __init__(
        self, cfg: LlavaConfig, reader, prefixes: Mapping[str, str], *, scan_layers: bool = True
    ) -> None:
        lm_head = f"{prefixes['lm_head']}weight"
        super().__init__(
            Decoder(cfg.text, reader, prefixes["model"], lm_head, scan_layers=scan_layers)
        )
        self.llava_config = cfg
        vision = cfg.vision
        layer = cfg.vision_feature_layer
        num_layers = layer if layer >= 0 else vision.num_hidden_layers + 1 + layer
        self.vision_tower = VisionTower(vision, reader, prefixes["vision_tower"], num_layers)
        proj, text_hid, bias = (
            prefixes["projector"],
            cfg.text.hidden_size,
            cfg.multimodal_projector_bias,
        )
        self.linear_1 = Linear(
            reader, f"{proj}linear_1", text_hid, vision.hidden_size, bias=bias, split="column"
        )
        self.linear_2 = Linear(
            reader, f"{proj}linear_2", text_hid, text_hid, bias=bias, split="row"
        )

    @property
    def num_image_tokens(self) -> int:
        return self.llava_config.num_image_tokens

    @property
    def image_input_shape(self) -> tuple[int, int, int]:
        """`(C, H, W)` of one image's `pixel_values` (what `preprocess_image` must produce)."""
        vision = self.llava_config.vision
        return (vision.num_channels, vision.image_size, vision.image_size)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """Projected features `[N, num_image_tokens, hidden]` of `pixel_values [N, C, H, W]`."""
        x = self.vision_tower(pixel_values)
        if self.llava_config.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        x = self.linear_2(activation(self.llava_config.projector_hidden_act, self.linear_1(x)))
        chex.assert_shape(
            x, (pixel_values.shape[0], self.num_image_tokens, self.config.hidden_size)
        )
        return x

    def expand_image_tokens(self, token_ids: list[int]) -> list[int]:
        """Each image placeholder token repeated once per image feature (as the processor does)."""
        image = self.llava_config.image_token_id
        out: list[int] = []
        for t in token_ids:
            out.extend([t] * self.num_image_tokens if t == image else [t])
        return out

    def multimodal_embeddings(self, token_ids: jax.Array, pixel_values: jax.Array) -> jax.Array:
        """Input embeddings of `token_ids` with the features of `pixel_values` merged in."""
        features = self.encode_images(pixel_values).reshape(-1, self.config.hidden_size)
        return merge_image_features(
            token_ids, self.embed_tokens(token_ids), features, self.llava_config.image_token_id
        )


def merge_image_features(
    token_ids: jax.Array, embeds: jax.Array, features: jax.Array, image_token_id: int
) -> jax.Array:
    """`embeds [T, hidden]` with the i-th `image_token_id` row replaced by `features[i]`.

    `features [M, hidden]` must hold at least as many rows as there are placeholders
    (checked when the counts are concrete); rows beyond them are ignored.
    """
    chex.assert_rank([token_ids, embeds, features], [1, 2, 2])
    is_image = token_ids == image_token_id
    if not isinstance(is_image, jax.core.Tracer):
        count = int(is_image.sum())
        if count > features.shape[0]:
            raise ValueError(
                f"{count} image placeholder tokens but only {features.shape[0]} feature rows"
            )
    index = jnp.clip(jnp.cumsum(is_image) - 1, 0, max(features.shape[0] - 1, 0))
    return jnp.where(is_image[:, None], features[index].astype(embeds.dtype), embeds)
