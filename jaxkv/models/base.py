"""The model interface the engine codes to: `CausalLM`, `PagedContext`.

Final form of the models/engine contract (/work/notes/model_contract.md, refined):

- `jaxkv.models.load_model(path, *, dtype="float32", mesh=None) -> CausalLM` reads a
  local Hugging Face checkpoint (`config.json` + `*.safetensors`, sharded through
  `model.safetensors.index.json`), dispatching on `architectures[0]` (else `model_type`):
  `GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, `LlamaForCausalLM`,
  `LlavaForConditionalGeneration`; transformers 4.x and 5.x config fields and every
  tensor layout transformers' `from_pretrained` accepts (`jaxkv.models.loading.PARTS`).
  Bad input (unknown architecture, config field out of range, unreadable file, missing,
  misshapen or non-float tensor): a one-line `ValueError` naming the file and the field
  or tensor, config fields checked before any tensor is read. Weights go onto `mesh`
  (`jaxkv.device.make_mesh`): attention projections split over the model axis in whole
  heads, MLP/vocab rows in whole units, where the axis size divides them, else
  replicated; replicated over data.
- `CausalLM.config` is the text decoder's `DecoderConfig` (family, vocab_size,
  hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
  layer_types, sliding_window, window_of(i), sm_scale, attn/final soft-caps,
  eos_token_ids, bos_token_id, max_position_embeddings, image_token_id (LLaVA, else None)).
- `kv_cache_specs(block_size, dtype="float32") -> {"layers.{i}": FullAttentionSpec |
  SlidingWindowSpec}`, one per decoder layer, in layer order. Layers with equal specs
  may share a KV-cache group; `PagedContext.layer_to_group[i]` names layer i's group.
  A group's `PagedKVCache` may be built from a `SlidingWindowSpec` (it then applies the
  window itself) or, for a single-group layout, a `FullAttentionSpec` for every layer
  (the sliding layers pass their window to the step).
- `forward_paged(token_ids [N] int32, kv_cache, ctx, inputs_embeds=None)
  -> (logits [R, vocab] float32, new kv_cache)`, traceable: call it inside a jit
  that donates `kv_cache`, or use `paged_step_fn()`, which is that jit (parameters are
  arguments, not constants). `kv_cache` holds every layer's cache stacked
  (`PagedKVCache.allocate_stacked(num_layers)`; every group's cache has one page shape).
  `N = dp * shape.num_tokens`: each data rank's token rows
  in the order `StepMetadataPacker.pack` lays them out, rank-major (padding rows carry
  any id). One layer body, scanned, calls `ctx.caches[0].stacked_layer_step(...)` with
  the layer's number, its group's metadata, the model's `AttentionOptions` (`sm_scale`,
  attention soft-cap; built once) and the layer's sliding window (data). Token positions
  come from group 0's packed metadata (or `ctx.positions` when given).
  `ctx.logits_indices [R]` picks the row (into the N rows) whose logits each request
  needs; padding entries may point anywhere. Its parts, for a caller that runs the
  layers itself (the engine, for a model with one stack per layer): `input_embeddings`,
  `paged_attend(config, ctx)` (the attention each layer calls) with
  `jaxkv.models.decoder.apply_layers` over `decoder.layers`, and `paged_logits`.
- `forward_dense(token_ids [S], inputs_embeds=None) -> logits [S, vocab]` float32: the
  reference, positions `0..S-1`, plain JAX, whole sequence, no cache; `dense_fn()` jits
  it. Trailing padding changes no earlier row (causal).
- `embed_tokens(token_ids) -> [T, hidden]`, scaled as the model scales embeddings; row
  `i` of `inputs_embeds` replaces that embedding of token `i`.
- LLaVA (`LlavaForConditionalGeneration`, `llava_config`): `num_image_tokens` features
  per image of `image_input_shape` `(C, H, W)`; `expand_image_tokens(ids)` repeats each
  `image_token_id` that many times (as HF's processor does);
  `encode_images(pixel_values [N, C, H, W]) -> [N, num_image_tokens, hidden]` (vision
  tower + projector; the encoder output to cache);
  `merge_image_features(token_ids, embeds, features [M, hidden], image_token_id)` puts
  features into the placeholder rows in order; `multimodal_embeddings(ids, pixels)` does
  both for one prompt.
- `jaxkv.models.preprocess_image(pil_image, preprocessor_config) -> [C, H, W]` float32;
  `jaxkv.models.load_image(path)` reads an image file (ValueError naming a bad one).
- `jaxkv.models.load_tokenizer(path)`: `tokenizers.Tokenizer` of `tokenizer.json` or None.
- Tests and examples: `jaxkv.models.tiny_configs()` ("gemma3-tiny", "llama-tiny",
  "llava-tiny": HF config dicts), `save_random_checkpoint(path, config, seed,
  num_shards=1, layout="model")`, `jaxkv.testing.paged_generate.PagedGenerator` (the
  models' paged-vs-dense logits harness; serving is `jaxkv.engine`) and `dense_greedy`.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.device import AttentionOptions, PagedKVCache, StepShape, unpack_step
from jaxkv.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from jaxkv.models.config import DecoderConfig
from jaxkv.models.decoder import Attend, Decoder, layer_windows


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["metadata", "logits_indices", "positions"],
    meta_fields=["caches", "shapes", "layer_to_group"],
)
@dataclasses.dataclass(frozen=True)
class PagedContext:
    """One paged step's device inputs, per KV-cache group `g` (a pytree).

    Static (part of the jit cache key): `caches[g]` (the group's `PagedKVCache`),
    `shapes[g]` (its `StepShape`), `layer_to_group[i]` (decoder layer -> group).
    On device: `metadata[g]` (the packed `[dp, length]` int32 step buffer),
    `logits_indices [R]` int32 (the token row whose logits each request needs),
    `positions [N]` int32 or None (then taken from group 0's metadata).
    All groups pack the same tokens in the same order; only block tables differ.
    """

    caches: tuple[PagedKVCache, ...]
    shapes: tuple[StepShape, ...]
    layer_to_group: tuple[int, ...]
    metadata: tuple[jax.Array, ...]
    logits_indices: jax.Array
    positions: jax.Array | None = None

    def token_positions(self) -> jax.Array:
        if self.positions is not None:
            return self.positions
        shape = self.shapes[0]
        return jax.vmap(lambda buf: unpack_step(buf, shape).positions)(self.metadata[0]).reshape(-1)


def paged_attend(cfg: DecoderConfig, ctx: PagedContext) -> Attend:
    """The paged step's attention for the decoder layers of `cfg`: one body for every
    layer, its group's metadata and its window rows of tables indexed by the layer number;
    the carry is every layer's KV cache, stacked."""
    metadata = jnp.stack(ctx.metadata)
    group_of = jnp.asarray(ctx.layer_to_group, jnp.int32)
    windows = layer_windows(cfg)
    options = AttentionOptions(sm_scale=cfg.sm_scale, soft_cap=cfg.attn_logit_softcapping)

    def attend(kv, layer, q, k, v):
        return ctx.caches[0].stacked_layer_step(
            kv, layer, q, k, v, metadata[group_of[layer]], ctx.shapes[0], options,
            window=windows[layer],
        )  # fmt: skip

    return attend


class CausalLM(nnx.Module):
    """A text decoder served paged or run dense (see the module docstring)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    @property
    def config(self) -> DecoderConfig:
        return self.decoder.cfg

    def kv_cache_specs(self, block_size: int, dtype: str = "float32") -> dict[str, KVCacheSpec]:
        cfg = self.config
        specs: dict[str, KVCacheSpec] = {}
        for i in range(cfg.num_hidden_layers):
            common = dict(
                block_size=block_size,
                num_kv_heads=cfg.num_key_value_heads,
                head_size=cfg.head_dim,
                dtype=dtype,
            )
            window = cfg.window_of(i)
            specs[f"layers.{i}"] = (
                FullAttentionSpec(**common)
                if window is None
                else SlidingWindowSpec(**common, sliding_window=window)
            )
        return specs

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        return self.decoder.embed(token_ids)

    def input_embeddings(
        self, token_ids: jax.Array, inputs_embeds: jax.Array | None = None
    ) -> jax.Array:
        """The first layer's input `[T, hidden]`: `inputs_embeds` (in the model's dtype)
        when given, else the token embeddings."""
        chex.assert_rank(token_ids, 1)
        chex.assert_type(token_ids, jnp.int32)
        if inputs_embeds is None:
            return self.decoder.embed(token_ids)
        chex.assert_shape(inputs_embeds, (token_ids.shape[0], self.config.hidden_size))
        return inputs_embeds.astype(self.decoder.dtype)

    def forward_dense(
        self, token_ids: jax.Array, inputs_embeds: jax.Array | None = None
    ) -> jax.Array:
        from jaxkv.models.layers import dense_attention

        cfg = self.config
        x = self.input_embeddings(token_ids, inputs_embeds)

        windows = self.decoder.layer_windows()

        def attend(carry, layer, q, k, v):
            return carry, dense_attention(
                q, k, v, sm_scale=cfg.sm_scale, sliding_window=windows[layer],
                soft_cap=cfg.attn_logit_softcapping,
            )  # fmt: skip

        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        h, _ = self.decoder.hidden_states(x, positions, attend)
        logits = self.decoder.logits(self.decoder.norm(h))
        chex.assert_shape(logits, (token_ids.shape[0], cfg.vocab_size))
        return logits

    def forward_paged(
        self,
        token_ids: jax.Array,
        kv_cache: jax.Array,
        ctx: PagedContext,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        if kv_cache.ndim != 5 or kv_cache.shape[0] != cfg.num_hidden_layers:
            raise ValueError(
                f"kv_cache has shape {kv_cache.shape}; expected every layer's cache stacked, "
                f"[{cfg.num_hidden_layers}, blocks, block_size, 2 * kv_heads, head_size] "
                "(PagedKVCache.allocate_stacked)"
            )
        if len(ctx.layer_to_group) != cfg.num_hidden_layers:
            raise ValueError(
                f"ctx.layer_to_group has {len(ctx.layer_to_group)} entries; expected "
                f"{cfg.num_hidden_layers}"
            )
        if len(set(ctx.shapes)) != 1:
            raise ValueError(f"every KV-cache group must pack one step shape, got {ctx.shapes}")
        x = self.input_embeddings(token_ids, inputs_embeds)
        positions = ctx.token_positions()
        chex.assert_shape(positions, token_ids.shape)
        h, kv_cache = self.decoder.hidden_states(x, positions, paged_attend(cfg, ctx), kv_cache)
        return self.paged_logits(h, ctx), kv_cache

    def paged_logits(self, h: jax.Array, ctx: PagedContext) -> jax.Array:
        """Float32 logits `[R, vocab]` of the rows `ctx.logits_indices` of the last layer's
        hidden states `h [N, hidden]`."""
        logits = self.decoder.logits(self.decoder.norm(h[ctx.logits_indices]))
        chex.assert_shape(logits, (ctx.logits_indices.shape[0], self.config.vocab_size))
        return logits

    # --- jitted entry points ---------------------------------------------------------
    def paged_step_fn(self):
        """`fn(token_ids, kv_cache, ctx, inputs_embeds=None) -> (logits, kv_cache)`, jitted,
        `kv_cache` (stacked) donated; parameters are passed as arguments (not baked in)."""
        graphdef, state = nnx.split(self)

        @functools.partial(jax.jit, donate_argnums=2)
        def step(state, token_ids, kv_cache, ctx, inputs_embeds):
            model = nnx.merge(graphdef, state)
            return model.forward_paged(token_ids, kv_cache, ctx, inputs_embeds)

        def call(token_ids, kv_cache, ctx, inputs_embeds=None):
            return step(state, token_ids, kv_cache, ctx, inputs_embeds)

        return call

    def dense_fn(self):
        """`fn(token_ids, inputs_embeds=None) -> logits`: `forward_dense`, jitted
        (`fn.model` is this model)."""
        graphdef, state = nnx.split(self)

        @jax.jit
        def dense(state, token_ids, inputs_embeds):
            return nnx.merge(graphdef, state).forward_dense(token_ids, inputs_embeds)

        def call(token_ids, inputs_embeds=None):
            return dense(state, token_ids, inputs_embeds)

        call.model = self
        return call
