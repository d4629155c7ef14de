"""One decoder for Gemma 1/2/3 and Llama, switched by its `DecoderConfig`.

Per layer, as Hugging Face defines them:

    h = input_layernorm(x)
    q, k, v = q_proj(h), k_proj(h), v_proj(h)          # heads of head_dim
    q, k = q_norm(q), k_norm(k)                         # Gemma 3 only
    q, k = rope(q), rope(k)                             # the layer type's RoPE
    a = o_proj(attention(q, k, v))                      # scale query_pre_attn_scalar^-0.5,
                                                        # logit soft-cap, sliding window
    x = x + post_attention_layernorm(a)                 # Gemma 2/3 ("sandwich" norms)
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    # Gemma 1 / Llama: x = x + a; x = x + mlp(post_attention_layernorm(x))

with `mlp(h) = down(act(gate(h)) * up(h))` (GeGLU tanh for Gemma, SwiGLU for Llama),
embeddings times `sqrt(hidden_size)` in the model dtype (Gemma), a final norm, the
(tied) output head and the final-logit soft-cap (Gemma 2/3). The attention itself is
passed in, so the dense reference and the paged step run the same layer code.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkv.device import MODEL_AXIS
from jaxkv.models.checkpoint import CheckpointReader
from jaxkv.models.config import DecoderConfig
from jaxkv.models.layers import Linear, RMSNorm, activation, apply_rope

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, index: int, reader: CheckpointReader, prefix: str):
        hid, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        off = cfg.norm_unit_offset
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        self.index = index
        self.cfg = cfg
        self.inv_freq = tuple(cfg.rope_for(index).inverse_frequencies(hd))
        self.input_layernorm = RMSNorm(reader, f"{prefix}input_layernorm", hid, eps, off)
        bias = cfg.attention_bias
        q = dict(bias=bias, units=hq)
        kv = dict(bias=bias, units=hkv)
        self.q_proj = Linear(reader, f"{attn}q_proj", hq * hd, hid, split="column", **q)
        self.k_proj = Linear(reader, f"{attn}k_proj", hkv * hd, hid, split="column", **kv)
        self.v_proj = Linear(reader, f"{attn}v_proj", hkv * hd, hid, split="column", **kv)
        self.o_proj = Linear(reader, f"{attn}o_proj", hid, hq * hd, split="row", **q)
        self.q_norm = RMSNorm(reader, f"{attn}q_norm", hd, eps, off) if cfg.qk_norm else None
        self.k_norm = RMSNorm(reader, f"{attn}k_norm", hd, eps, off) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(
            reader, f"{prefix}post_attention_layernorm", hid, eps, off
        )
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(
                reader, f"{prefix}pre_feedforward_layernorm", hid, eps, off
            )
            self.post_feedforward_layernorm = RMSNorm(
                reader, f"{prefix}post_feedforward_layernorm", hid, eps, off
            )
        mb = cfg.mlp_bias
        self.gate_proj = Linear(reader, f"{mlp}gate_proj", inter, hid, bias=mb, split="column")
        self.up_proj = Linear(reader, f"{mlp}up_proj", inter, hid, bias=mb, split="column")
        self.down_proj = Linear(reader, f"{mlp}down_proj", hid, inter, bias=mb, split="row")

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
        cfg = self.cfg
        t = x.shape[0]
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(h).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(h).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq)
        a = self.o_proj(attend(self.index, q, k, v).reshape(t, -1))
        if cfg.sandwich_norms:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))

    def mlp(self, h: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.cfg.hidden_act, self.gate_proj(h)) * self.up_proj(h))


class Decoder(nnx.Module):
    """Embeddings, decoder layers, final norm and output head of one `DecoderConfig`.

    `prefix` is where the checkpoint keeps `embed_tokens`, `layers.N.*` and `norm`
    (`model.` for a causal LM); `lm_head` names the output head (unused when tied).
    """

    def __init__(self, cfg: DecoderConfig, reader: CheckpointReader, prefix: str, lm_head: str):
        self.cfg = cfg
        self.dtype = reader.dtype
        vocab, hid = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nnx.Param(
            reader.get(f"{prefix}embed_tokens.weight", (vocab, hid), P(MODEL_AXIS, None))
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, i, reader, f"{prefix}layers.{i}.")
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(reader, f"{prefix}norm", hid, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Param(reader.get(lm_head, (vocab, hid), P(MODEL_AXIS, None)))
        )

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """Token embeddings `[T, hidden]`, times `sqrt(hidden)` in the model dtype (Gemma)."""
        chex.assert_rank(token_ids, 1)
        x = jnp.take(self.embed_tokens[...], token_ids, axis=0)
        if self.cfg.scale_embeddings:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, jnp.float32).astype(x.dtype)
        return x

    def hidden_states(self, x: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
        """The final-normed hidden states `[T, hidden]` of embeddings `x [T, hidden]`."""
        chex.assert_rank(x, 2)
        chex.assert_axis_dimension(x, 1, self.cfg.hidden_size)
        chex.assert_equal_shape_prefix((x, positions), 1)
        for layer in self.layers:
            x = layer(x, positions, attend)
        return self.norm(x)

    def logits(self, h: jax.Array) -> jax.Array:
        """Float32 logits `[R, vocab]` of hidden states `h [R, hidden]`, soft-capped (Gemma 2/3)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = (h @ head[...].T).astype(jnp.float32)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits
