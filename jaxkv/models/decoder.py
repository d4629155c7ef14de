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

The layers run as ONE layer body under `jax.lax.scan` over parameters stacked on a
leading layer axis (read stacked from the checkpoint, `LayerStack`), so a program's
compile time and size do not grow with depth. What differs between layers is data
the body indexes by the layer number: each layer's RoPE frequencies, and in the
attention its sliding window and KV-cache group.

`scan_layers=False` keeps one stack per layer instead, so no step slices a layer's
weights out of a stack: on XLA's CPU and GPU backends that slice is a copy of the
layer's weights per step (which every decode step pays for); the TPU compiler reads
the slice in place. `load_model` picks by platform (`default_scan_layers`).
Inside one program the per-layer runs unroll (compile time grows with depth), so the
engine runs such a model a few layers at a time: one program for every group of
consecutive layers (`apply_layers` on each run, the first layer number as data),
dispatched once per group from the host.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkv.device import MODEL_AXIS
from jaxkv.models.checkpoint import CheckpointReader, LayerStack
from jaxkv.models.config import DecoderConfig
from jaxkv.models.layers import Linear, RMSNorm, activation, apply_rope

# attend(carry, layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> (carry, [T, Hq, D]):
# `layer` is the layer's index (an int32 scalar, traced under the scan), `carry` whatever
# the attention threads through the layers (the paged step: the stacked KV cache).
Attend = Callable[[object, jax.Array, jax.Array, jax.Array, jax.Array], tuple[object, jax.Array]]


# The window of a full-attention layer in a layer table: `pos - window + 1 < 0` always.
FULL_ATTENTION_WINDOW = np.iinfo(np.int32).max // 2


class RopeFrequencies(nnx.Variable):
    """A layer's RoPE inverse frequencies (computed from the config, not trained)."""


class DecoderLayer(nnx.Module):
    """The parameters of a run of decoder layers, stacked on a leading axis (built over
    a `LayerStack`, names with `{i}` for the layer); `Decoder` scans them and calls the
    layer body on one layer's slice."""

    def __init__(self, cfg: DecoderConfig, reader: LayerStack, prefix: str):
        hid, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        off = cfg.norm_unit_offset
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        self.cfg = cfg
        self.num_layers = len(reader.layers)
        self.inv_freq = RopeFrequencies(
            jnp.asarray(
                np.stack([cfg.rope_for(i).inverse_frequencies(hd) for i in reader.layers]),
                jnp.float32,
            )
        )
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

    def __call__(
        self, x: jax.Array, positions: jax.Array, layer: jax.Array, attend: Attend, carry
    ) -> tuple[jax.Array, object]:
        """One layer (this module holding ONE layer's slice of the stacked parameters)."""
        cfg = self.cfg
        t = x.shape[0]
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(h).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(h).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = self.inv_freq[...]
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        carry, out = attend(carry, layer, q, k, v)
        a = self.o_proj(out.reshape(t, -1))
        if cfg.sandwich_norms:
            x = x + self.post_attention_layernorm(a)
            mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + mlp, carry
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), carry

    def mlp(self, h: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.cfg.hidden_act, self.gate_proj(h)) * self.up_proj(h))


class Decoder(nnx.Module):
    """Embeddings, decoder layers, final norm and output head of one `DecoderConfig`.

    `prefix` is where the checkpoint keeps `embed_tokens`, `layers.N.*` and `norm`
    (`model.` for a causal LM); `lm_head` names the output head (unused when tied).
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        reader: CheckpointReader,
        prefix: str,
        lm_head: str,
        *,
        scan_layers: bool = True,
    ):
        self.cfg = cfg
        self.dtype = reader.dtype
        vocab, hid = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nnx.Param(
            reader.get(f"{prefix}embed_tokens.weight", (vocab, hid), P(MODEL_AXIS, None))
        )
        runs = (
            [range(cfg.num_hidden_layers)]
            if scan_layers
            else [range(i, i + 1) for i in range(cfg.num_hidden_layers)]
        )
        # Runs of consecutive layers, each stacked: one run of all layers (scanned), or
        # one per layer.
        self.layers = nnx.List(
            [DecoderLayer(cfg, LayerStack(reader, run), f"{prefix}layers.{{i}}.") for run in runs]
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

    def hidden_states(
        self, x: jax.Array, positions: jax.Array, attend: Attend, carry=None
    ) -> tuple[jax.Array, object]:
        """The hidden states `[T, hidden]` after the last layer (not final-normed: `norm`)
        of embeddings `x [T, hidden]`, and the attention's `carry` after the last layer."""
        chex.assert_rank(x, 2)
        chex.assert_axis_dimension(x, 1, self.cfg.hidden_size)
        chex.assert_equal_shape_prefix((x, positions), 1)
        layer = jnp.int32(0)
        for run in self.layers:
            x, carry = apply_layers(run, x, positions, layer, attend, carry)
            layer = layer + run.num_layers
        return x, carry

    def layer_windows(self) -> jax.Array:
        """Each layer's sliding window `[L]` int32 (`layer_windows`)."""
        return layer_windows(self.cfg)

    def logits(self, h: jax.Array) -> jax.Array:
        """Float32 logits `[R, vocab]` of hidden states `h [R, hidden]`, soft-capped (Gemma 2/3)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = (h @ head[...].T).astype(jnp.float32)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits


def apply_layers(
    run: DecoderLayer, x: jax.Array, positions: jax.Array, first_layer, attend: Attend, carry
) -> tuple[jax.Array, object]:
    """Decoder layers `first_layer, first_layer + 1, ...` (the run's stacked parameters,
    one layer body scanned over them) on hidden states `x [T, hidden]`; returns the
    hidden states and the attention's `carry` after the run's last layer."""
    graphdef, stacked = nnx.split(run)

    def body(state, layer_params):
        x, carry, layer = state
        x, carry = nnx.merge(graphdef, layer_params)(x, positions, layer, attend, carry)
        return (x, carry, layer + 1), None

    (x, carry, _), _ = jax.lax.scan(body, (x, carry, jnp.asarray(first_layer, jnp.int32)), stacked)
    return x, carry


def layer_windows(cfg: DecoderConfig) -> jax.Array:
    """Each layer's sliding window `[L]` int32; a full-attention layer's is larger than
    any sequence (`FULL_ATTENTION_WINDOW`)."""
    windows = [cfg.window_of(i) for i in range(cfg.num_hidden_layers)]
    return jnp.asarray([FULL_ATTENTION_WINDOW if w is None else w for w in windows], jnp.int32)
