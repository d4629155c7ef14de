"""Building blocks shared by the decoders and the vision tower (Flax NNX, explicit params).

Parameters keep the Hugging Face layouts (`Linear.weight` is `[out, in]`), so a checkpoint
tensor is placed as stored, shard by shard. Each module is built from a
`CheckpointReader` and the tensor names under a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkv.device import MODEL_AXIS
from jaxkv.models.checkpoint import CheckpointReader

# How a linear layer's weight `[out, in]` splits over the model axis: "column" splits the
# outputs (heads, MLP hidden units), "row" the inputs (the projections back to the residual).
SPLITS = {"column": (P(MODEL_AXIS, None), P(MODEL_AXIS)), "row": (P(None, MODEL_AXIS), P())}


def activation(name: str, x: jax.Array) -> jax.Array:
    """Hugging Face's `ACT2FN[name]` for the supported names."""
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "silu":
        return jax.nn.silu(x)
    raise ValueError(f"activation {name!r} is not supported")


class Linear(nnx.Module):
    """`y = x @ weight.T + bias` with `weight [out, in]` as Hugging Face stores it."""

    def __init__(
        self, reader: CheckpointReader, name: str, out_features: int, in_features: int,
        *, bias: bool, split: str, units: int | None = None,
    ) -> None:  # fmt: skip
        """`split` ("column"/"row") shards the weight over the model axis in whole `units`
        (heads; default: single features) where they divide evenly, else replicates it."""
        weight_spec, bias_spec = SPLITS[split]
        self.weight = nnx.Param(
            reader.get(f"{name}.weight", (out_features, in_features), weight_spec, units=units)
        )
        self.bias = (
            nnx.Param(reader.get(f"{name}.bias", (out_features,), bias_spec, units=units))
            if bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight[...].T
        return y + self.bias[...] if self.bias is not None else y


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32; scale `1 + weight` (Gemma) or `weight` (Llama).

    Gemma casts back to the input dtype after scaling; Llama casts the normalised input
    back first and multiplies by the weight in its dtype, as Hugging Face does.
    """

    def __init__(
        self, reader: CheckpointReader, name: str, dim: int, eps: float, unit_offset: bool
    ):
        self.weight = nnx.Param(reader.get(f"{name}.weight", (dim,)))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.unit_offset:
            return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * normed.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (the vision tower's), statistics in float32."""

    def __init__(self, reader: CheckpointReader, name: str, dim: int, eps: float):
        self.weight = nnx.Param(reader.get(f"{name}.weight", (dim,)))
        self.bias = nnx.Param(reader.get(f"{name}.bias", (dim,)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        normed = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return normed * self.weight[...] + self.bias[...]


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: Sequence[float] | jax.Array
) -> jax.Array:
    """Hugging Face's rotate-half RoPE of `x [T, heads, D]` at `positions [T]`.

    The angles are computed in float32 and cos/sin cast to `x.dtype` before use, as
    Hugging Face does.
    """
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
    causal: bool = True, sliding_window: int | None = None, soft_cap: float | None = None,
) -> jax.Array:  # fmt: skip
    """Plain attention over one whole sequence: `q [S, Hq, D]`, `k, v [S, Hkv, D]`.

    Masks as Hugging Face does: a query at position p sees keys at positions `<= p`
    (causal) and `> p - sliding_window` (sliding layers). Soft-cap before the mask,
    softmax in float32, probabilities cast back to the query dtype.
    """
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(s, hkv, hq // hkv, d)
    logits = jnp.einsum("tkgd,skd->kgts", qg, k).astype(jnp.float32) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    if causal:
        q_pos = jnp.arange(s)[:, None]
        k_pos = jnp.arange(k.shape[0])[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        logits = jnp.where(visible, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("kgts,skd->tkgd", probs, v).reshape(s, hq, d)
