"""Sampling parameters (host) and the batched sampler (device, inside the jitted step).

`SamplingParams` is validated when built: a bad value raises ValueError naming the field,
the value and what is allowed, before any request state exists. Sampling is greedy when
`temperature == 0`; otherwise tokens are drawn from the temperature-scaled distribution
restricted by top-k and top-p. A seeded request draws its `i`-th output token with the key
`fold_in(key(seed), i)`, so its tokens do not depend on the batch it ran in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SamplingParams", "sample_tokens"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `top_k=0` and `top_p=1.0` disable those filters; `seed=None` draws from the engine's
    seed and the request's arrival number. The request stops after `max_tokens` outputs,
    on an EOS token of the model (unless `ignore_eos`), or on any of `stop_token_ids`
    (the stop token is kept in the output, as vLLM does for stop token ids).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}"
            )

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int | np.integer):
            raise bad("max_tokens", "an int >= 1")
        if self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.temperature, int | float) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise bad("temperature", "a finite float >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 disables top-k)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a float in (0, 1] (1 disables top-p)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise bad("seed", "None or an int >= 0")
        stop = self.stop_token_ids
        if isinstance(stop, int | str | bytes) or not isinstance(stop, Sequence | set | frozenset):
            raise bad("stop_token_ids", "a sequence of token ids >= 0")
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 0 for t in stop):
            raise bad("stop_token_ids", "a sequence of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
