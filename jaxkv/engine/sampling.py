"""The batched sampler (device, inside the jitted step), and `SamplingParams` (host).

`SamplingParams` is jaxkv's one class (`jaxkv.sampling_params`), re-exported here for the
engine's users. Sampling is greedy when `temperature == 0`; otherwise tokens are drawn from
the temperature-scaled distribution restricted by top-k and top-p. A seeded request draws
its `i`-th output token with the key `fold_in(key(seed), i)`, so its tokens do not depend on
the batch it ran in.
"""

from __future__ import annotations

from jaxkv.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams", "sample_tokens"]


def sample_tokens(logits, temperature, top_k, top_p, seeds, counters):
    """Sample one token per row of `logits [R, V]` (inside jit).

    Per row: `temperature [R] f32` (0 = greedy), `top_k [R] i32` (0 = off), `top_p [R] f32`,
    `seeds [R] i32` and `counters [R] i32` (the output index the token will have). Rows
    that are all greedy skip the sort.
    """
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        vocab = logits.shape[-1]
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        order = jnp.argsort(-scaled, axis=-1)
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
        ranked = jnp.where(keep, ranked, -jnp.inf)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        ranked = jnp.where(before < top_p[:, None], ranked, -jnp.inf)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
        picked = jax.vmap(jax.random.categorical)(keys, ranked)
        drawn = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
