"""Tiny built-in models with random weights, served through the same contract as
`jaxkv.models` (`kv_cache_specs`, `forward_paged`, `forward_dense`, `embed_tokens`,
`encode_images`): the engine's own test and demo runner, fast on two CPU cores.

`TinyCausalLM` is the demo's model: token embeddings, pre-norm GQA layers with RoPE and a
GELU MLP, an untied output head; the attention output is scaled up so the next token
really depends on the cached context. With `image_size > 0` it gains a LLaVA-style image
path: patches are projected, given position embeddings and sent through a two-layer GELU
projector to `num_image_tokens` embeddings that replace the image placeholder tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from jaxkv.models.base import PagedContext

__all__ = ["TinyConfig", "TinyCausalLM", "tiny_configs"]


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    image_size: int = 0  # 0: text only
    patch_size: int = 8
    num_channels: int = 3

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.image_size else 0


def tiny_configs() -> dict[str, TinyConfig]:
    """The built-in configs `jaxkv demo` serves."""
    return {
        "gemma-style-tiny": TinyConfig(eos_token_ids=(1,)),
        "llava-style-tiny": TinyConfig(
            eos_token_ids=(1,), image_token_id=2, image_size=32, patch_size=8
        ),
    }


def _rms_norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(jnp.float32) * (10000.0 ** (-jnp.arange(half) / half))
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class TinyCausalLM(nnx.Module):
    """A tiny decoder (plus optional image path) with fixed random float32 weights."""

    def __init__(self, config: TinyConfig, seed: int = 0) -> None:
        self.config = config
        rng = np.random.default_rng(seed)

        def weight(fan_in: int, fan_out: int, scale: float = 1.0) -> nnx.Param:
            w = rng.standard_normal((fan_in, fan_out)) * scale / math.sqrt(fan_in)
            return nnx.Param(jnp.asarray(w, jnp.float32))

        c = config
        d, hd, hq, hk = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.embed = nnx.Param(jnp.asarray(rng.standard_normal((c.vocab_size, d)), jnp.float32))
        self.unembed = weight(d, c.vocab_size)
        self.wq = nnx.List([weight(d, hq * hd) for _ in range(c.num_hidden_layers)])
        self.wk = nnx.List([weight(d, hk * hd) for _ in range(c.num_hidden_layers)])
        self.wv = nnx.List([weight(d, hk * hd) for _ in range(c.num_hidden_layers)])
        self.wo = nnx.List([weight(hq * hd, d, 3.0) for _ in range(c.num_hidden_layers)])
        self.w_up = nnx.List([weight(d, 2 * d) for _ in range(c.num_hidden_layers)])
        self.w_down = nnx.List([weight(2 * d, d) for _ in range(c.num_hidden_layers)])
        if c.image_size:
            patch = c.num_channels * c.patch_size**2
            self.patch_proj = weight(patch, d)
            self.patch_pos = nnx.Param(
                jnp.asarray(rng.standard_normal((c.num_image_tokens, d)) * 0.1, jnp.float32)
            )
            self.proj_1 = weight(d, d)
            self.proj_2 = weight(d, d)

    @property
    def num_image_tokens(self) -> int:
        return self.config.num_image_tokens

    @property
    def image_input_shape(self) -> tuple[int, int, int]:
        """Pixel values one image takes: `(channels, height, width)`."""
        c = self.config
        return (c.num_channels, c.image_size, c.image_size)

    def kv_cache_specs(self, block_size: int, dtype: str = "float32") -> dict[str, KVCacheSpec]:
        c = self.config
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=c.num_key_value_heads, head_size=c.head_dim,
            dtype=dtype,
        )  # fmt: skip
        return {f"layers.{i}": spec for i in range(c.num_hidden_layers)}

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        return self.embed[...][token_ids]

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """`[N, C, H, W]` -> `[N, num_image_tokens, hidden]`."""
        c = self.config
        n, ch, h, w = pixel_values.shape
        p = c.patch_size
        patches = pixel_values.reshape(n, ch, h // p, p, w // p, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(n, (h // p) * (w // p), -1)
        x = patches @ self.patch_proj[...] + self.patch_pos[...]
        return jax.nn.gelu(x @ self.proj_1[...]) @ self.proj_2[...]

    def _layer(self, i: int, x: jax.Array, positions: jax.Array, attend) -> jax.Array:
        c, t = self.config, x.shape[0]
        h = _rms_norm(x)
        q = (h @ self.wq[i][...]).reshape(t, c.num_attention_heads, c.head_dim)
        k = (h @ self.wk[i][...]).reshape(t, c.num_key_value_heads, c.head_dim)
        v = (h @ self.wv[i][...]).reshape(t, c.num_key_value_heads, c.head_dim)
        attn = attend(i, _rope(q, positions), _rope(k, positions), v)
        x = x + attn.reshape(t, -1) @ self.wo[i][...]
        return x + jax.nn.gelu(_rms_norm(x) @ self.w_up[i][...]) @ self.w_down[i][...]

    def _logits(self, x: jax.Array) -> jax.Array:
        return _rms_norm(x) @ self.unembed[...]

    def forward_paged(
        self,
        token_ids: jax.Array,
        kv_cache: jax.Array,
        ctx: PagedContext,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        x = self.embed_tokens(token_ids) if inputs_embeds is None else inputs_embeds
        positions = ctx.token_positions()
        caches = [kv_cache]  # the stacked cache, threaded through the (unrolled) layers

        def attend(i, q, k, v):
            g = ctx.layer_to_group[i]
            caches[0], out = ctx.caches[g].stacked_layer_step(
                caches[0], i, q, k, v, ctx.metadata[g], ctx.shapes[g]
            )
            return out

        for i in range(self.config.num_hidden_layers):
            x = self._layer(i, x, positions, attend)
        return self._logits(x[ctx.logits_indices]), caches[0]

    def forward_dense(
        self, token_ids: jax.Array, inputs_embeds: jax.Array | None = None
    ) -> jax.Array:
        c = self.config
        x = self.embed_tokens(token_ids) if inputs_embeds is None else inputs_embeds

        def attend(i, q, k, v):
            t, g = q.shape[0], c.num_attention_heads // c.num_key_value_heads
            q = q.reshape(t, c.num_key_value_heads, g, c.head_dim)
            logits = jnp.einsum("tkgd,skd->kgts", q, k) * c.head_dim**-0.5
            causal = jnp.tril(jnp.ones((t, t), bool))
            probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
            out = jnp.einsum("kgts,skd->tkgd", probs, v)
            return out.reshape(t, c.num_attention_heads, c.head_dim)

        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        for i in range(c.num_hidden_layers):
            x = self._layer(i, x, positions, attend)
        return self._logits(x)
