"""`EngineConfig.logprobs_mode`: vLLM's four kinds of logprobs.

On fixed logits rows, each mode against values computed here in numpy: the raw
modes report the model's logits or their log-softmax whatever the sampling; the
processed ones what each row was sampled from: a greedy row's logits after the
stop-token ban and the penalties, a sampled row's after temperature, min-p, top-k and
top-p (the filtered tokens at -inf), or their log-softmax. On a tiny engine (slow):
the processed log-probabilities of a top-k request are the log-softmax of its top k raw
logits at its temperature (as a "raw_logits" engine reports them), the sampled tokens
do not depend on the mode, and `prompt_logprobs` are the raw logits in "raw_logits"
mode, at decode and teacher-forced alike. A bad mode is refused naming the values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.sampling import LOGPROBS_MODES, gather_logprobs, sample_and_score
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

LOGITS = np.array(
    [[1.0, 3.0, 2.0, -1.0, 0.5], [1.0, 3.0, 2.0, -1.0, 0.5], [0.2, 2.5, 2.0, 1.0, -0.5]],
    np.float32,
)
# Row 0 greedy (token 1 banned, token 2 seen: a repetition penalty of 2), row 1 at
# temperature 0.5 with top-k 2, row 2 at temperature 1 with top-p 0.7 and min-p 0.2.
ROWS = dict(
    temperature=jnp.asarray([0.0, 0.5, 1.0]), top_k=jnp.asarray([0, 2, 0]),
    top_p=jnp.asarray([1.0, 1.0, 0.7]), seeds=jnp.arange(3), counters=jnp.zeros(3, jnp.int32),
    min_p=jnp.asarray([0.0, 0.0, 0.2]), stop_ids=jnp.asarray([[1], [-1], [-1]]),
    penalties=(
        jnp.zeros((3, 5), jnp.int32), jnp.asarray([[False, False, True, False, False]] * 3),
        jnp.zeros(3), jnp.zeros(3), jnp.asarray([2.0, 1.0, 1.0]),
    ),
)  # fmt: skip


def _log_softmax(x: np.ndarray) -> np.ndarray:
    top = np.max(x, axis=-1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def _processed_logits() -> np.ndarray:
    """`ROWS`' processed logits, by hand: min-p first, then top-p over what it left."""
    inf = np.inf
    greedy = [1.0, -inf, 1.0, -1.0, 0.5]  # token 1 banned, token 2's 2.0 halved
    top_k = [-inf, 6.0, 4.0, -inf, -inf]  # over 0.5, the best two
    probs = np.exp(_log_softmax(LOGITS[2]))
    min_p = np.where(probs >= 0.2 * probs.max(), LOGITS[2], -inf)
    probs = np.exp(_log_softmax(min_p))
    order = np.argsort(-min_p)
    before = np.cumsum(probs[order]) - probs[order]  # mass of the better tokens
    kept = order[(before < 0.7) & np.isfinite(min_p[order])]
    top_p = np.where(np.isin(np.arange(5), kept), LOGITS[2], -inf)
    assert np.isfinite(min_p).sum() == 3 and len(kept) == 2, "each filter drops tokens"
    return np.array([greedy, top_k, top_p], np.float32)


# Each mode compiles its own sampler (a few seconds): the quick part keeps the one that
# goes through every filter.
MODES = [
    mode if mode == "processed_logprobs" else pytest.param(mode, marks=pytest.mark.slow)
    for mode in LOGPROBS_MODES
]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_on_fixed_logits_rows(mode: str) -> None:
    score = jax.jit(sample_and_score, static_argnames="logprobs_mode")  # as the step runs it
    tokens, scores = score(jnp.asarray(LOGITS), **ROWS, logprobs_mode=mode)
    plain, none = score(jnp.asarray(LOGITS), **ROWS)
    assert none is None and tokens.tolist() == plain.tolist(), "the mode never changes tokens"
    assert tokens[0] == 0  # greedy: token 1 banned, token 2 penalized below token 0's tie
    source = _processed_logits() if mode.startswith("processed") else LOGITS
    want = source if mode.endswith("_logits") else _log_softmax(source)
    np.testing.assert_allclose(np.asarray(scores), want, rtol=1e-6, atol=1e-6)
    top_ids, top_values, token_values, ranks = gather_logprobs(scores, tokens, 2)
    for row, token in enumerate(tokens.tolist()):
        order = np.argsort(-want[row], kind="stable")
        assert top_ids[row].tolist() == order[:2].tolist()
        np.testing.assert_allclose(top_values[row], want[row][order[:2]], rtol=1e-6)
        assert token_values[row] == pytest.approx(want[row][token], rel=1e-6)
        assert ranks[row] == np.sum(want[row] >= want[row][token])
    assert np.isfinite(np.asarray(token_values)).all(), "a sampled token is never filtered"


def test_bad_mode_is_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of .*'raw_logprobs'.*'x'"):
        LLMEngine(TinyCausalLM(tiny_configs()["gemma-style-tiny"]), EngineConfig(logprobs_mode="x"))


CONFIG = EngineConfig(
    block_size=8, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64
)
PROMPT = list(range(5, 18))
TOP_K, TEMPERATURE = 3, 0.7
SAMPLED = SamplingParams(
    max_tokens=6, ignore_eos=True, logprobs=20, temperature=TEMPERATURE, top_k=TOP_K, seed=5
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_processed_logprobs_are_the_top_k_raw_logits_at_the_temperature() -> None:
    model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
    engines = {
        mode: LLMEngine(model, dataclasses.replace(CONFIG, logprobs_mode=mode))
        for mode in ("raw_logits", "processed_logprobs")
    }
    (raw,) = engines["raw_logits"].generate([PROMPT], SAMPLED)
    (processed,) = engines["processed_logprobs"].generate([PROMPT], SAMPLED)
    assert processed.output_token_ids == raw.output_token_ids
    for token, logits, logprobs in zip(
        raw.output_token_ids, raw.logprobs, processed.logprobs, strict=True
    ):
        best = sorted(logits, key=lambda t: logits[t].rank)[:TOP_K]
        want = _log_softmax(np.array([logits[t].logprob for t in best]) / TEMPERATURE)
        got = sorted(logprobs.values(), key=lambda lp: lp.rank)
        assert {t for t in logprobs if logprobs[t].rank <= TOP_K} == set(best)
        np.testing.assert_allclose([lp.logprob for lp in got[:TOP_K]], want, atol=1e-5)
        assert all(lp.logprob == -np.inf for lp in got[TOP_K:20]), "the rest are filtered"
        assert logprobs[token].rank <= TOP_K
    forced = SamplingParams(max_tokens=1, prompt_logprobs=20, ignore_eos=True)
    (teacher,) = engines["raw_logits"].generate([PROMPT + raw.output_token_ids], forced)
    for i, logits in enumerate(raw.logprobs):
        prompt = teacher.prompt_logprobs[len(PROMPT) + i]
        for t in logits.keys() & prompt.keys():
            assert prompt[t].logprob == pytest.approx(logits[t].logprob, abs=1e-5)
            assert prompt[t].rank == logits[t].rank
