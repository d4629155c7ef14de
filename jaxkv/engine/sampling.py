"""The batched sampler (device, inside the jitted step), and `SamplingParams` (host).

`SamplingParams` is jaxkv's one class (`jaxkv.sampling_params`), re-exported here for the
engine's users. Every request of a step is sampled at once from per-row parameter arrays
(no host loop, no parameter is static), in vLLM v1's order:

1. the raw log-probabilities or logits (vLLM's `logprobs_mode` "raw_logprobs", the
   default, or "raw_logits"), when asked for;
2. the stop tokens of a request short of its `min_tokens` are banned;
3. the repetition, frequency and presence penalties (`apply_penalties`), from the row's
   token counts kept on the device (`update_penalty_state`);
4. greedy rows (`temperature == 0`) take the argmax; the others are scaled by their
   temperature, filtered by min-p, top-k and top-p, and drawn.

The "processed" modes return the logits a row was sampled from (`processed_logits`) or
their log-softmax (`processed_logprobs`), as vLLM's sampler does: a sampled row's after
step 4's temperature and filters (the filtered tokens at -inf), a greedy row's after step
3 (vLLM's in an all-greedy batch; in a batch mixing both, vLLM also passes its greedy
rows through their filters at temperature 1, which changes nothing unless the greedy
request sets one, so a row's values here never depend on its batch).

A seeded request draws its `i`-th output token with the key `fold_in(key(seed), i)`, so
its tokens do not depend on the batch it ran in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.sampling_params import (
    LOGPROBS_MODES,
    MAX_LOGPROBS,
    MAX_MIN_TOKENS_STOPS,
    PROCESSED_LOGPROBS_MODES,
    RequestOutputKind,
    SamplingParams,
)

__all__ = [
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "MAX_MIN_TOKENS_STOPS",
    "PROCESSED_LOGPROBS_MODES",
    "RequestOutputKind",
    "SamplingParams",
    "apply_penalties",
    "gather_logprobs",
    "logprob_scores",
    "sample_and_score",
    "sample_tokens",
    "update_penalty_state",
]


def sample_tokens(
    logits, temperature, top_k, top_p, seeds, counters, min_p=None, stop_ids=None, penalties=None
):
    """Sample one token per row of `logits [R, V]` (inside jit).

    Per row: `temperature [R] f32` (0 = greedy), `top_k [R] i32` (0 = off), `top_p [R] f32`,
    `seeds [R] i32`, `counters [R] i32` (the output index the token will have), `min_p [R]
    f32` (0 = off), `stop_ids [R, S] i32` (tokens banned now, -1 = none) and `penalties`
    (`apply_penalties`' arguments after the logits, or None). Steps whose rows are all
    greedy skip the sort; steps banning nothing skip the ban.
    """
    args = (temperature, top_k, top_p, seeds, counters, min_p, stop_ids, penalties)
    return sample_and_score(logits, *args)[0]


def sample_and_score(
    logits, temperature, top_k, top_p, seeds, counters, min_p=None, stop_ids=None,
    penalties=None, logprobs_mode: str | None = None,
):  # fmt: skip
    """`sample_tokens`' tokens `[R]` and what the rows' logprobs hold under
    `logprobs_mode` (`[R, V]` f32: `logprob_scores` of the raw logits, or of the
    processed ones the module docstring defines), None when `logprobs_mode` is None."""
    processed = logprobs_mode in PROCESSED_LOGPROBS_MODES
    args = (temperature, top_k, top_p, seeds, counters, min_p, stop_ids, penalties)
    tokens, kept = _sample(logits, *args, keep_processed=processed)
    if logprobs_mode is None:
        return tokens, None
    return tokens, logprob_scores(kept if processed else logits, logprobs_mode)


def _sample(
    logits, temperature, top_k, top_p, seeds, counters, min_p, stop_ids, penalties, *,
    keep_processed: bool,
):  # fmt: skip
    """(tokens `[R]`, processed logits `[R, V]` or None unless `keep_processed`)."""
    logits = logits.astype(jnp.float32)
    if stop_ids is not None:
        logits = jax.lax.cond(jnp.any(stop_ids >= 0), _ban, lambda x, _: x, logits, stop_ids)
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if min_p is None:
        min_p = jnp.zeros_like(top_p)

    def draw(_):
        rows, vocab = logits.shape
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        probs = jax.nn.softmax(scaled, axis=-1)
        floor = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs < floor, -jnp.inf, scaled)
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
        sampled = temperature > 0
        if not keep_processed:
            return jnp.where(sampled, drawn, greedy), None
        filtered = jnp.zeros_like(ranked).at[jnp.arange(rows)[:, None], order].set(ranked)
        return jnp.where(sampled, drawn, greedy), jnp.where(sampled[:, None], filtered, logits)

    def all_greedy(_):
        return greedy, logits if keep_processed else None

    return jax.lax.cond(jnp.any(temperature > 0), draw, all_greedy, None)


def logprob_scores(logits, logprobs_mode: str):
    """What logprobs report for `logits [N, V]` under `logprobs_mode` (`LOGPROBS_MODES`):
    their float32 log-softmax for the "*_logprobs" modes, the float32 logits themselves
    for the "*_logits" ones (the caller passes raw or processed logits)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    return logits if logprobs_mode.endswith("_logits") else jax.nn.log_softmax(logits, axis=-1)


def _ban(logits, stop_ids):
    """`logits` with `stop_ids [R, S]` (-1: none) of each row set to -inf."""
    rows, vocab = logits.shape
    ids = jnp.where(stop_ids >= 0, stop_ids, vocab)  # out of range: dropped
    banned = jnp.zeros(logits.shape, bool).at[jnp.arange(rows)[:, None], ids].set(True, mode="drop")
    return jnp.where(banned, -jnp.inf, logits)


def apply_penalties(logits, counts, prompt_seen, presence, frequency, repetition):
    """vLLM's penalties on `logits [R, V]` f32, given each row's output token counts
    `counts [R, V]` and prompt tokens `prompt_seen [R, V]` (bool): a token in the prompt or
    the output has its positive logit divided by `repetition [R]` and its other logit
    multiplied by it; then `frequency [R]` times its output count and `presence [R]` (once
    it was output) are subtracted. Neutral values (1, 0, 0) change nothing."""
    seen = prompt_seen | (counts > 0)
    factor = jnp.where(seen, repetition[:, None], 1.0)
    logits = logits * jnp.where(logits > 0, 1.0 / factor, factor)
    logits = logits - frequency[:, None] * counts.astype(jnp.float32)
    return logits - presence[:, None] * (counts > 0).astype(jnp.float32)


def update_penalty_state(counts, prompt_seen, slots, token_ids, positions):
    """The penalty state (`counts [N, V]` i32 output token counts, `prompt_seen [N, V]`
    bool prompt tokens, one row per request row) after the step's tokens: token `j`
    (`token_ids [T]` at `positions [T]`) goes to state row `slots[j]` as a prompt token,
    to row `slots[j] - N` as an output token, nowhere when negative. A row fed its
    position 0 starts afresh (a new or recomputed request), so the state always counts
    exactly the tokens the request has fed."""
    num_rows = counts.shape[0]
    valid = slots >= 0
    is_output = slots >= num_rows
    row = jnp.where(is_output, slots - num_rows, slots)
    fresh = jnp.where(valid & (positions == 0), row, num_rows)  # out of range: dropped
    counts = counts.at[fresh].set(0, mode="drop")
    prompt_seen = prompt_seen.at[fresh].set(False, mode="drop")
    counts = counts.at[jnp.where(valid & is_output, row, num_rows), token_ids].add(1, mode="drop")
    prompt_seen = prompt_seen.at[jnp.where(valid & ~is_output, row, num_rows), token_ids].set(
        True, mode="drop"
    )
    return counts, prompt_seen


def gather_logprobs(scores, token_ids, k: int):
    """Of `scores [N, V]` (`logprob_scores`' values): the top `k` (ids `[N, k]`, values
    `[N, k]`, best first), and of `token_ids [N]` its value `[N]` and rank `[N]` (vLLM's:
    how many tokens score at least as high, so 1 for the best)."""
    top_values, top_ids = jax.lax.top_k(scores, k)
    token = jnp.take_along_axis(scores, jnp.maximum(token_ids, 0)[:, None], axis=-1)
    rank = jnp.sum(scores >= token, axis=-1).astype(jnp.int32)
    return top_ids.astype(jnp.int32), top_values, token[:, 0], rank
