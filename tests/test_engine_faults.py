"""One request never harms another: faults contained, capacity counted right, tenants
isolated (issue: engine faults).

Tiny built-in model (random weights). Every greedy output is checked against the dense
reference, so a fault that leaked into another request's tokens fails here.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.intake import fold_seed
from jaxkv.engine.model_runner import RowSampling
from jaxkv.testing.reference import DenseReference
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

CONFIG = EngineConfig(
    block_size=8, num_blocks=25, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=192
)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)


@pytest.fixture(scope="module")
def reference(model):
    return DenseReference(model, CONFIG.max_model_len)


def prompts(num: int, seed: int = 0, length: tuple[int, int] = (4, 30)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, int(rng.integers(*length))).tolist() for _ in range(num)]


def assert_greedy_matches(reference: DenseReference, outputs) -> None:
    for out in outputs:
        assert out.error is None, out.error
        want = reference.expected(out.prompt_token_ids, out.output_token_ids)
        assert out.output_token_ids == want, out.request_id


def run_all(engine: LLMEngine) -> dict:
    finals = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return finals
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("the engine did not finish its requests")


# -- 1. whatever add_request accepts, step() serves -------------------------------------


@pytest.mark.parametrize("seed", [2**31, 2**40, 2**63 + 5])
def test_any_int_seed_is_served_beside_greedy_requests(model, reference, seed) -> None:
    engine = LLMEngine(model, CONFIG)
    greedy = [engine.add_request(p, sampling=GREEDY) for p in prompts(3)]
    sampled = engine.add_request(
        prompts(1, seed=9)[0],
        sampling=SamplingParams(max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True),
    )
    finals = run_all(engine)
    assert finals[sampled].finish_reason == "length" and finals[sampled].error is None
    assert_greedy_matches(reference, [finals[r] for r in greedy])
    assert engine.num_free_blocks == CONFIG.num_blocks - 1


def test_seed_folding_keeps_int32_seeds_and_is_deterministic(model) -> None:
    assert fold_seed(0) == 0 and fold_seed(2**31 - 1) == 2**31 - 1
    big = [2**31, 2**40, -1, 2**64 + 3]
    folded = [fold_seed(s) for s in big]
    assert all(0 <= f < 2**31 for f in folded)
    assert folded == [fold_seed(s) for s in big]
    assert len(set(folded)) == len(folded)

    def tokens(seed: int) -> list[int]:
        engine = LLMEngine(model, CONFIG)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate([prompts(1, seed=3)[0]], params)[0].output_token_ids

    assert tokens(2**40) == tokens(2**40), "a large seed samples reproducibly"


@pytest.mark.parametrize("top_k", [2**31, 2**40, 512, 10**6])
def test_any_top_k_is_served(model, reference, top_k) -> None:
    """A top-k covering the vocabulary disables the filter (as 0 does)."""
    engine = LLMEngine(model, CONFIG)
    greedy = engine.add_request(prompts(1)[0], sampling=GREEDY)
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=top_k, seed=1, ignore_eos=True)
    wide = engine.add_request(prompts(1, seed=4)[0], sampling=params)
    off = engine.add_request(prompts(1, seed=4)[0], sampling=dataclasses.replace(params, top_k=0))
    finals = run_all(engine)
    assert finals[wide].output_token_ids == finals[off].output_token_ids
    assert_greedy_matches(reference, [finals[greedy]])


def test_a_request_whose_step_rows_cannot_be_prepared_fails_alone(model, reference) -> None:
    """The rule, not a list of cases: a request whose part of a step fails on the host
    (here a sampling row no int32 buffer holds, planted behind the engine's checks)
    finishes with finish_reason="error"; its blocks are freed, the others are served."""
    engine = LLMEngine(model, CONFIG)
    good = [engine.add_request(p, sampling=GREEDY) for p in prompts(3, seed=5)]
    bad = engine.add_request(prompts(1, seed=6)[0], sampling=GREEDY)
    engine._requests.sampling[bad] = RowSampling(0.5, 0, 1.0, 2**40)
    finals = run_all(engine)
    assert finals[bad].finish_reason == "error"
    assert "OverflowError" in finals[bad].error and repr(bad) in finals[bad].error
    assert_greedy_matches(reference, [finals[r] for r in good])
    assert engine.num_free_blocks == CONFIG.num_blocks - 1
    assert not engine.has_unfinished_requests()


# -- 2. capacity counted right ------------------------------------------------------------


def test_pool_check_counts_usable_blocks_and_advises_the_right_size(model) -> None:
    small = dataclasses.replace(CONFIG, num_blocks=24)  # 23 usable blocks, 24 needed
    with pytest.raises(ValueError, match=r"num_blocks >= 25,"):
        LLMEngine(model, small)
    LLMEngine(model, CONFIG)  # the advised size is accepted


def test_longest_prompt_and_an_output_to_max_model_len_never_stall(model, reference) -> None:
    engine = LLMEngine(model, CONFIG)
    longest = prompts(1, seed=7, length=(191, 192))[0]
    first = engine.add_request(longest, sampling=GREEDY)
    grows = engine.add_request(
        prompts(1, seed=8, length=(150, 151))[0],
        sampling=SamplingParams(max_tokens=500, ignore_eos=True),
    )
    finals = run_all(engine)
    assert finals[first].finish_reason == "length"
    assert len(finals[first].output_token_ids) == 1
    assert finals[grows].finish_reason == "length"
    assert len(finals[grows].prompt_token_ids) + len(finals[grows].output_token_ids) == 192
    assert_greedy_matches(reference, finals.values())
    assert engine.num_free_blocks == CONFIG.num_blocks - 1


# -- 4. tenants ---------------------------------------------------------------------------


def test_cache_salts_isolate_tenants_through_the_public_api(model, reference) -> None:
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 512, 40).tolist()

    def second_sees(first_salt, second_salt) -> int:
        engine = LLMEngine(model, CONFIG)
        engine.generate([prefix + [5]], GREEDY, cache_salt=first_salt)
        (out,) = engine.generate([prefix + [6]], GREEDY, cache_salt=second_salt)
        assert_greedy_matches(reference, [out])
        return out.num_cached_tokens

    assert second_sees("tenant-a", "tenant-b") == 0
    assert second_sees("tenant-a", None) == 0
    assert second_sees(None, "tenant-b") == 0
    assert second_sees("tenant-a", "tenant-a") == 40
    assert second_sees("", None) == 40, '"" is no salt, as in vLLM'
    assert second_sees(None, None) == 40


def test_per_salt_prefix_counters(model) -> None:
    engine = LLMEngine(model, CONFIG)
    prefix = list(range(10, 50))
    for salt, tail in [("a", 1), ("a", 2), ("b", 3), (None, 4)]:
        engine.generate([prefix + [tail]], GREEDY, cache_salt=salt)
    by_salt = engine.stats.by_salt
    assert by_salt["a"].requests == 2 and by_salt["a"].cached_tokens == 40
    assert by_salt["a"].prompt_tokens == 82
    assert by_salt["b"].cached_tokens == 0 and by_salt[None].cached_tokens == 0
    assert by_salt["a"].prefix_hit_rate == pytest.approx(40 / 82)


# -- 6. nothing accepted and ignored ----------------------------------------------------------


def test_sampling_eos_token_id_stops_the_request(model, reference) -> None:
    engine = LLMEngine(model, CONFIG)
    prompt = prompts(1, seed=12)[0]
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=8))
    stop_at = free.output_token_ids[2]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=8, eos_token_id=stop_at))
    assert out.finish_reason == "stop"
    assert out.output_token_ids == free.output_token_ids[: free.output_token_ids.index(stop_at) + 1]
    (ignored,) = engine.generate(
        [prompt], SamplingParams(max_tokens=8, eos_token_id=stop_at, ignore_eos=True)
    )
    assert ignored.output_token_ids == free.output_token_ids


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sampling=SamplingParams(prompt_logprobs=21)), ValueError, "prompt_logprobs=21"),
        (dict(sampling=SamplingParams(stop="x")), ValueError, "no tokenizer"),
        (dict(lora_request=object()), ValueError, "no LoRA adapters"),
        (dict(request_id=123), TypeError, "request_id must be a str"),
        (dict(cache_salt=5), TypeError, "cache_salt must be a str"),
    ],
)
def test_unsupported_request_fields_are_refused_not_ignored(model, kwargs, error, match) -> None:
    engine = LLMEngine(model, CONFIG)
    with pytest.raises(error, match=match):
        engine.add_request([5, 6, 7], **kwargs)
    assert not engine.has_unfinished_requests()


def test_abort_yields_one_final_output(model) -> None:
    engine = LLMEngine(model, CONFIG)
    rid = engine.add_request([5, 6, 7], sampling=SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(rid)
    assert engine.has_unfinished_requests()
    (final,) = engine.step()
    assert (final.request_id, final.finished, final.finish_reason) == (rid, True, "abort")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    with pytest.raises(KeyError, match=rid):
        engine.abort(rid)


# -- the public engine API under random valid and invalid requests --------------------------

SMALL = EngineConfig(
    block_size=4, num_blocks=13, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=48
)
INT_TYPES = (int, np.int32, np.int64, np.uint32, np.int16)


class EngineMachine(RuleBasedStateMachine):
    """Random adds (valid and invalid), aborts and steps on a tiny pool; after every step
    nothing escaped, and at the end every accepted request finished, the greedy ones as a
    run of the request alone would, and every block is free."""

    model = None
    reference = None

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLMEngine(self.model, SMALL)
        self.accepted: dict[str, SamplingParams] = {}
        self.finals: dict[str, object] = {}
        self.aborted: set[str] = set()

    @rule(
        length=st.integers(1, 60),
        token=st.integers(0, 600),
        max_tokens=st.integers(1, 70),
        temperature=st.sampled_from([0.0, 0.0, 0.9]),
        seed=st.one_of(st.none(), st.integers(0, 2**70)),
        top_k=st.one_of(st.just(0), st.integers(1, 2**40)),
        int_type=st.sampled_from(INT_TYPES),
        salt=st.sampled_from([None, "", "a", "b"]),
    )
    def add(self, length, token, max_tokens, temperature, seed, top_k, int_type, salt):
        prompt = [int_type(min(token + i, 2**15 - 1) % 700) for i in range(length)]
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed, top_k=top_k,
                ignore_eos=True,
            )  # fmt: skip
            rid = self.engine.add_request(prompt, sampling=params, cache_salt=salt)
        except (ValueError, TypeError) as error:
            assert str(error)
            too_long = length >= SMALL.max_model_len
            out_of_vocab = any(int(t) >= 512 for t in prompt)
            assert too_long or out_of_vocab, error
            return
        self.accepted[rid] = params

    @precondition(lambda self: any(r not in self.finals for r in self.accepted))
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r for r in self.accepted if r not in self.finals and r not in self.aborted)
        if live:
            rid = data.draw(st.sampled_from(live))
            self.engine.abort(rid)
            self.aborted.add(rid)

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished:
                assert out.request_id not in self.finals, "finished twice"
                self.finals[out.request_id] = out

    @invariant()
    def blocks_are_accounted_for(self):
        assert 0 <= self.engine.num_free_blocks <= SMALL.num_blocks - 1

    def teardown(self):
        for _ in range(3000):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert set(self.finals) == set(self.accepted)
        for rid, out in self.finals.items():
            if rid in self.aborted:
                assert out.finish_reason in ("abort", "length")
                continue
            assert out.finish_reason == "length" and out.error is None, (rid, out)
            if self.accepted[rid].temperature == 0:
                want = self.reference.expected(out.prompt_token_ids, out.output_token_ids)
                assert out.output_token_ids == want, rid
        assert self.engine.num_free_blocks == SMALL.num_blocks - 1


def test_engine_state_machine(model) -> None:
    EngineMachine.model = model
    EngineMachine.reference = DenseReference(model, SMALL.max_model_len)
    EngineMachine.TestCase.settings = settings(
        max_examples=12, stateful_step_count=25, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    EngineMachine.TestCase().runTest()
