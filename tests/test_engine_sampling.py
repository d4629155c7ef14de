"""vLLM's sampling surface in the engine: in-jit penalties and min-p, seeded batch
invariance, raw logprobs against the teacher-forced prompt logprobs, stop strings,
`min_tokens`, `max_tokens=None`, `n > 1` fan-out, and no new programs for requests that
use none of it.

The engine tests compile a program per step shape and feature set: slow (CI's second
pass); the sampler's own checks on a logits row are quick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_util import family_configs

from jaxkv.device import compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from jaxkv.engine.sampling import apply_penalties, sample_tokens
from jaxkv.models import load_model, save_random_checkpoint
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

CONFIG = EngineConfig(
    block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96
)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
RICH = SamplingParams(
    max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.8, seed=3, presence_penalty=0.5,
    frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05,
)  # fmt: skip


class LetterTokenizer:
    """Token `t` is the letter `chr(97 + t % 26)`."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


@pytest.fixture(scope="module")
def model():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)


@pytest.fixture(scope="module", params=["gemma-style-tiny", "llama"])
def family_model(request, tmp_path_factory):
    if request.param == "llama":
        path = tmp_path_factory.mktemp("llama")
        save_random_checkpoint(path, family_configs()["llama"], seed=3)
        return load_model(path)
    return TinyCausalLM(tiny_configs()[request.param], seed=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_decode_logprobs_equal_the_teacher_forced_prompt_logprobs(family_model) -> None:
    engine = LLMEngine(family_model, CONFIG)
    (sampled,) = engine.generate([PROMPT], RICH)
    full = PROMPT + sampled.output_token_ids
    forced = SamplingParams(max_tokens=1, prompt_logprobs=2, ignore_eos=True)
    (teacher,) = engine.generate([full], forced)
    assert teacher.prompt_logprobs[0] is None and len(teacher.prompt_logprobs) == len(full)
    for i, token in enumerate(sampled.output_token_ids):
        decode, prompt = sampled.logprobs[i][token], teacher.prompt_logprobs[len(PROMPT) + i][token]
        assert abs(decode.logprob - prompt.logprob) < 1e-5 and decode.rank == prompt.rank
    pairs = zip(sampled.logprobs, sampled.output_token_ids, strict=True)
    total = sum(lp[t].logprob for lp, t in pairs)
    assert sampled.cumulative_logprob == pytest.approx(total)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_seeded_request_samples_the_same_however_batched(model) -> None:
    (alone,) = LLMEngine(model, CONFIG).generate([PROMPT], RICH)
    others = [
        SamplingParams(max_tokens=9, temperature=1.0, seed=i, ignore_eos=True) for i in (7, 8)
    ]
    batch = LLMEngine(model, CONFIG).generate(
        [[3, 4] * 9, PROMPT, list(range(20, 45))], [others[0], RICH, others[1]]
    )
    assert batch[1].output_token_ids == alone.output_token_ids
    for got, want in zip(batch[1].logprobs, alone.logprobs, strict=True):
        assert got.keys() == want.keys()
        for token, lp in got.items():  # the batch's kernels round differently
            assert abs(lp.logprob - want[token].logprob) < 1e-5 and lp.rank == want[token].rank


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_logprobs_are_top_k_plus_the_sampled_token_with_ranks(model) -> None:
    greedy = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4)
    (out,) = LLMEngine(model, CONFIG).generate([PROMPT], greedy)
    assert len(out.logprobs) == len(out.output_token_ids) == 5
    for position, token in zip(out.logprobs, out.output_token_ids, strict=True):
        top = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4] and position[token].rank == 1  # greedy
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
        assert sum(np.exp(lp.logprob) for lp in top) <= 1 + 1e-6
    (none,) = LLMEngine(model, CONFIG).generate([PROMPT], SamplingParams(max_tokens=2, logprobs=0))
    assert all(len(position) == 1 for position in none.logprobs)


def test_min_p_one_and_a_huge_penalty_on_a_logits_row() -> None:
    logits = jnp.asarray([[1.0, 3.0, 2.0, -1.0]] * 2)
    rows = dict(temperature=jnp.ones(2), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2),
                seeds=jnp.arange(2), counters=jnp.zeros(2, jnp.int32))  # fmt: skip
    sample = jax.jit(sample_tokens)  # inside jit, as the step runs it: one program, 5 seeds
    for seed in range(5):
        rows["seeds"] = jnp.full(2, seed)
        assert sample(logits, **rows, min_p=jnp.ones(2)).tolist() == [1, 1]
    counts = jnp.asarray([[0, 2, 0, 0], [0, 0, 0, 0]])
    seen = jnp.asarray([[False] * 4, [False, True, False, True]])
    out = apply_penalties(logits, counts, seen, jnp.asarray([0.5, 0.0]), jnp.asarray([0.25, 0.0]),
                          jnp.asarray([2.0, 4.0]))  # fmt: skip
    np.testing.assert_allclose(out, [[1.0, 1.5 - 0.5 - 0.5, 2.0, -1.0], [1.0, 0.75, 2.0, -4.0]])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_penalties_keep_a_greedy_request_off_repeats(model) -> None:
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=50.0,
                               presence_penalty=2.0, frequency_penalty=2.0)  # fmt: skip
    outs = LLMEngine(model, CONFIG).generate([PROMPT, PROMPT], [plain, penalized])
    assert len(set(outs[0].output_token_ids)) < 24  # the tiny model repeats itself
    assert len(set(outs[1].output_token_ids) | set(PROMPT)) == 24 + len(PROMPT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_min_tokens_bans_the_stop_tokens_until_then(model) -> None:
    (free,) = LLMEngine(model, CONFIG).generate([PROMPT], SamplingParams(max_tokens=8))
    stop = free.output_token_ids[0]
    engine = LLMEngine(model, CONFIG)
    stopped, held = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=8, stop_token_ids=[stop]),
         SamplingParams(max_tokens=8, stop_token_ids=[stop], min_tokens=3)],
    )  # fmt: skip
    assert stopped.output_token_ids == [stop] and stopped.stop_reason == stop
    assert len(held.output_token_ids) >= 3 and stop not in held.output_token_ids[:3]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stop_strings_cut_the_text_and_stop(model) -> None:
    tokenizer = LetterTokenizer()
    engine = LLMEngine(model, CONFIG, tokenizer=tokenizer)
    (free,) = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))
    text = tokenizer.decode(free.output_token_ids)
    stop = text[2:4]
    first = text.find(stop)
    cut, kept, late = engine.generate(
        [PROMPT] * 3,
        [SamplingParams(max_tokens=8, ignore_eos=True, stop=stop),
         SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop],
                        include_stop_str_in_output=True),
         SamplingParams(max_tokens=8, ignore_eos=True, stop=stop, min_tokens=first + 2)],
    )  # fmt: skip
    assert cut.text == text[:first] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.output_token_ids == free.output_token_ids[: first + 2]
    assert kept.text == text[: first + 2]
    assert late.finish_reason == "stop" or late.output_token_ids == free.output_token_ids


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_tokens_none_runs_to_the_model_length(model) -> None:
    (out,) = LLMEngine(model, CONFIG).generate(
        [PROMPT], SamplingParams(max_tokens=None, ignore_eos=True)
    )
    assert len(PROMPT) + len(out.output_token_ids) == CONFIG.max_model_len
    assert out.finish_reason == "length"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_n_fans_out_into_seeded_children(model, kind) -> None:
    params = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=11, ignore_eos=True,
                            output_kind=kind)  # fmt: skip
    engine = LLMEngine(model, CONFIG)
    parent = engine.add_request(PROMPT, sampling=params, request_id="p")
    seen: list = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert parent == "p" and all(o.request_id == "p" for o in seen)
    assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished
    finals = {c.index: c for o in seen for c in o.outputs if c.finished()}
    assert sorted(finals) == [0, 1, 2]
    for i in range(3):
        single = SamplingParams(max_tokens=5, temperature=1.0, seed=11 + i, ignore_eos=True)
        (alone,) = LLMEngine(model, CONFIG).generate([PROMPT], single)
        assert finals[i].token_ids == alone.output_token_ids
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(seen) == 1 and len(seen[0].outputs) == 3
    with pytest.raises(ValueError, match="n must be 1 when sampling greedily"):
        SamplingParams(n=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_requests_compile_nothing_new_and_logprobs_one_variant(model) -> None:
    engine = LLMEngine(model, CONFIG)
    engine.warm_up()
    before = compilation_count()
    engine.generate([PROMPT, [3] * 40], SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    assert compilation_count() == before
    engine.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=2))
    assert compilation_count() - before <= len(engine.runner.packers[0].all_shapes()) * 2
