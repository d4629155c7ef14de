"""The engine's greedy tokens equal the dense reference's, whatever the scheduler did.

Tiny built-in models (random weights), tiny shapes: chunked prefill, prefix hits,
recurring preemption, images through the encoder cache, async and sync stepping.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv.device import compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from jaxkv.testing.reference import DenseReference, image_offsets
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

MAX_LEN = 184  # 23 blocks of 8: the 23 usable blocks of the pool hold one request
BASE = EngineConfig(
    block_size=8, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_LEN
)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def text_model():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)


@pytest.fixture(scope="module")
def image_model():
    return TinyCausalLM(tiny_configs()["llava-style-tiny"], seed=1)


@pytest.fixture(scope="module")
def text_reference(text_model):
    return DenseReference(text_model, MAX_LEN)


@pytest.fixture(scope="module")
def image_reference(image_model):
    return DenseReference(image_model, MAX_LEN)


def shared_prefix_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts over two shared system prompts (2 and 3 blocks) plus private tails."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 512, 16).tolist(), rng.integers(3, 512, 24).tolist()]
    return [
        systems[i % 2] + rng.integers(3, 512, int(rng.integers(1, 40))).tolist() for i in range(num)
    ]


def assert_dense(reference: DenseReference, outputs, expected_len: int | None = None) -> None:
    for out in outputs:
        assert out.error is None, out.error
        if expected_len is not None:
            assert len(out.output_token_ids) == expected_len, out.request_id
        want = reference.expected(out.prompt_token_ids, out.output_token_ids)
        assert out.output_token_ids == want, out.request_id


def run(model, config: EngineConfig, prompts, sampling=GREEDY, **kwargs):
    engine = LLMEngine(model, config)
    return engine, engine.generate(prompts, sampling, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch_with_shared_prefixes_matches_dense(
    text_model, text_reference, async_scheduling
) -> None:
    config = dataclasses.replace(BASE, async_scheduling=async_scheduling)
    engine, outputs = run(text_model, config, shared_prefix_prompts(8))
    assert_dense(text_reference, outputs, expected_len=GREEDY.max_tokens)
    assert engine.stats.prefix_hit_rate > 0.2
    assert all(o.finish_reason == "length" for o in outputs)
    assert engine.kv_cache_manager.num_free_blocks == BASE.num_blocks - 1


def test_async_and_sync_stepping_give_identical_tokens(text_model) -> None:
    prompts = shared_prefix_prompts(6, seed=3)
    _, a = run(text_model, BASE, prompts)
    _, b = run(text_model, dataclasses.replace(BASE, async_scheduling=False), prompts)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_running_is_the_step_in_flight(text_model, async_scheduling) -> None:
    """Only a step dispatched with async scheduling outlives `step()`, until its tokens
    are ready; an idle engine runs nothing."""
    engine = LLMEngine(text_model, dataclasses.replace(BASE, async_scheduling=async_scheduling))
    assert not engine.step_running()
    engine.add_request([5, 6, 7], sampling=GREEDY)
    engine.step()
    assert engine.step_running() == (async_scheduling and not engine.runner.sampled.is_ready())
    engine.runner.sampled.block_until_ready()
    assert not engine.step_running()


def test_tiny_chunks_match_dense(text_model, text_reference) -> None:
    config = dataclasses.replace(BASE, max_num_batched_tokens=8, long_prefill_token_threshold=3)
    engine, outputs = run(text_model, config, shared_prefix_prompts(4, seed=1))
    assert_dense(text_reference, outputs, expected_len=GREEDY.max_tokens)
    assert max(s.num_scheduled_tokens for s in engine.stats.steps) <= 8


def test_recurring_preemption_loses_nothing(text_model, text_reference) -> None:
    """A pool so small that requests are preempted again and again."""
    config = BASE
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    engine, outputs = run(text_model, config, shared_prefix_prompts(10, seed=2), sampling)
    assert engine.scheduler.num_preemptions >= 5
    assert max(o.num_preemptions for o in outputs) >= 2, "some request preempted repeatedly"
    assert_dense(text_reference, outputs, expected_len=48)
    assert engine.kv_cache_manager.num_free_blocks == config.num_blocks - 1


def test_prefix_hit_and_miss_give_the_same_tokens(text_model, text_reference) -> None:
    prompts = shared_prefix_prompts(6, seed=4)
    on, hit = run(text_model, BASE, prompts)
    off, miss = run(text_model, dataclasses.replace(BASE, enable_prefix_caching=False), prompts)
    assert on.stats.total("prefix_hits") > 0 and off.stats.total("prefix_hits") == 0
    assert on.stats.total("num_scheduled_tokens") < off.stats.total("num_scheduled_tokens")
    assert [o.output_token_ids for o in hit] == [o.output_token_ids for o in miss]
    assert_dense(text_reference, hit)


def test_zeroing_freed_blocks_keeps_outputs(text_model) -> None:
    prompts = shared_prefix_prompts(6, seed=5)
    config = BASE
    plain, a = run(text_model, config, prompts)
    zeroed, b = run(text_model, dataclasses.replace(config, zero_freed_blocks=True), prompts)
    assert zeroed.stats.total("num_freed_blocks") > 0
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


def test_serving_after_warm_up_compiles_nothing(text_model) -> None:
    engine = LLMEngine(text_model, BASE)
    engine.warm_up()
    before = compilation_count()
    engine.generate(shared_prefix_prompts(6, seed=6), GREEDY)
    assert compilation_count() == before
    assert engine.stats.total("compilations") == 0


def test_stop_token_and_eos_finish_with_reason_stop(text_model, text_reference) -> None:
    prompt = shared_prefix_prompts(1, seed=7)[0]
    _, (free,) = run(text_model, BASE, [prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    stop_at = free.output_token_ids[4]
    first = free.output_token_ids.index(stop_at)
    _, (stopped,) = run(
        text_model, BASE, [prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == free.output_token_ids[: first + 1]
    eos_model = TinyCausalLM(dataclasses.replace(text_model.config, eos_token_ids=(stop_at,)))
    _, (eos,) = run(eos_model, BASE, [prompt], SamplingParams(max_tokens=12))
    assert eos.finish_reason == "stop" and eos.output_token_ids[-1] == stop_at


def test_seeded_sampling_is_reproducible_and_batch_independent(text_model) -> None:
    prompts = shared_prefix_prompts(4, seed=8)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    _, alone = run(text_model, BASE, prompts[:1], sampled)
    _, batched = run(text_model, BASE, prompts, [sampled] + [GREEDY] * 3)
    assert alone[0].output_token_ids == batched[0].output_token_ids
    _, other = run(text_model, BASE, prompts[:1], dataclasses.replace(sampled, seed=124))
    _, greedy = run(text_model, BASE, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert other[0].output_token_ids != alone[0].output_token_ids
    assert alone[0].output_token_ids != greedy[0].output_token_ids
    top1 = SamplingParams(max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True, seed=5)
    _, one = run(text_model, BASE, prompts[:1], top1)
    assert one[0].output_token_ids == greedy[0].output_token_ids


class WordDecoder:
    """A tokenizer's `decode`: token `i` is the word `w{i}`, words joined by spaces."""

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_streamed_outputs_follow_each_requests_output_kind(text_model) -> None:
    """One batch mixing vLLM's three output kinds: cumulative outputs carry every token so
    far, delta outputs only the new ones (adding up to the whole), final-only requests
    stream nothing before their one final output; all give the same tokens."""
    engine = LLMEngine(text_model, BASE, tokenizer=WordDecoder())
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
    prompt = shared_prefix_prompts(1, seed=9)[0]
    ids = {
        engine.add_request(prompt, sampling=dataclasses.replace(GREEDY, output_kind=kind)): kind
        for kind in kinds
    }
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    outputs: dict[str, list] = {i: [] for i in ids}
    as_received = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            as_received.append((out, out.new_token_ids, out.output_token_ids, repr(out)))
            outputs[out.request_id].append(out)
            streamed[out.request_id] += out.new_token_ids
            if ids[out.request_id] is RequestOutputKind.DELTA:
                assert out.output_token_ids == out.new_token_ids
            else:
                assert out.output_token_ids == streamed[out.request_id]
    # An output reads the same later, after its request has grown and finished.
    for out, new_token_ids, output_token_ids, text in as_received:
        assert (out.new_token_ids, out.output_token_ids, repr(out)) == (
            new_token_ids,
            output_token_ids,
            text,
        )
        assert out.new_token_ids is not out.new_token_ids  # each read is the caller's own list
    by_kind = {kind: outputs[i] for i, kind in ids.items()}
    assert all(o[-1].finished and not any(x.finished for x in o[:-1]) for o in by_kind.values())
    assert len(by_kind[RequestOutputKind.FINAL_ONLY]) == 1
    assert len(by_kind[RequestOutputKind.DELTA]) == GREEDY.max_tokens
    whole = by_kind[RequestOutputKind.CUMULATIVE][-1].output_token_ids
    assert len(whole) == GREEDY.max_tokens
    assert by_kind[RequestOutputKind.FINAL_ONLY][0].output_token_ids == whole
    assert [t for o in by_kind[RequestOutputKind.DELTA] for t in o.output_token_ids] == whole
    text = by_kind[RequestOutputKind.CUMULATIVE][-1].text
    assert text == WordDecoder().decode(whole)
    assert "".join(o.text for o in by_kind[RequestOutputKind.DELTA]) == text
    assert by_kind[RequestOutputKind.FINAL_ONLY][0].text == text
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=2)


def test_generate_without_on_step_streams_nothing_and_returns_everything(text_model) -> None:
    """`generate` with nobody watching the stream asks for final outputs only (as vLLM's
    `LLM`), whatever kind the params name; the final outputs are complete."""
    prompts = shared_prefix_prompts(2, seed=11)
    delta = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA)
    engine, outputs = run(text_model, BASE, prompts, delta)
    _, streamed = run(text_model, BASE, prompts, GREEDY, on_step=lambda outs: None)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in streamed]
    assert all(len(o.output_token_ids) == GREEDY.max_tokens for o in outputs)
    assert engine.stats.steps  # the engine ran; nothing but the finals was returned


def test_abort_frees_the_request_and_others_finish(text_model, text_reference) -> None:
    engine = LLMEngine(text_model, BASE)
    prompts = shared_prefix_prompts(3, seed=10)
    ids = [engine.add_request(p, sampling=GREEDY) for p in prompts]
    engine.step()
    engine.step()
    engine.abort(ids[1])
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finals) == set(ids)
    aborted = finals.pop(ids[1])
    assert aborted.finish_reason == "abort" and aborted.finished
    assert len(aborted.output_token_ids) < GREEDY.max_tokens
    assert_dense(text_reference, finals.values(), expected_len=GREEDY.max_tokens)
    assert engine.kv_cache_manager.num_free_blocks == BASE.num_blocks - 1


# -- images -----------------------------------------------------------------------------


def image_prompt(rng, num_images: int) -> list[int]:
    prompt = rng.integers(3, 512, 5).tolist()
    for _ in range(num_images):
        prompt += [2] + rng.integers(3, 512, int(rng.integers(1, 6))).tolist()
    return prompt


def check_images(reference, outputs, images, cfg) -> None:
    for out, imgs in zip(outputs, images, strict=True):
        offsets = image_offsets(out.prompt_token_ids, cfg.image_token_id, cfg.num_image_tokens)
        assert len(offsets) == len(imgs)
        want = reference.expected(
            out.prompt_token_ids, out.output_token_ids, list(zip(offsets, imgs, strict=True))
        )
        assert out.output_token_ids == want, out.request_id


def test_images_match_dense_and_repeats_hit_the_encoder_cache(image_model, image_reference):
    cfg = image_model.config
    rng = np.random.default_rng(11)
    pictures = [rng.standard_normal((3, 32, 32)).astype(np.float32) for _ in range(2)]
    images = [[pictures[0]], [pictures[0], pictures[1]], [pictures[1]], [pictures[0]]]
    prompts = [image_prompt(rng, len(imgs)) for imgs in images]
    engine, outputs = run(image_model, BASE, prompts, images=images)
    check_images(image_reference, outputs, images, cfg)
    assert engine.runner.num_encoded == 2, "each distinct image encoded once"
    assert engine.stats.total("encoder_hits") >= 1
    assert engine.stats.encoder_hit_rate > 0


def test_image_outputs_same_whether_encoded_or_served_from_cache(image_model) -> None:
    rng = np.random.default_rng(12)
    picture = rng.standard_normal((3, 32, 32)).astype(np.float32)
    prompt, other = image_prompt(rng, 1), image_prompt(rng, 1)
    _, (encoded,) = run(image_model, BASE, [prompt], images=[[picture]])
    engine = LLMEngine(image_model, BASE)
    engine.generate([other], GREEDY, images=[[picture]])  # encodes the picture
    (served,) = engine.generate([prompt], GREEDY, images=[[picture]])
    assert engine.runner.num_encoded == 1 and engine.stats.total("encoder_hits") >= 1
    assert served.output_token_ids == encoded.output_token_ids


def test_images_with_tiny_chunks_and_preemption(image_model, image_reference) -> None:
    """Text cut before images, chunks through placeholders, a small pool."""
    cfg = image_model.config
    config = dataclasses.replace(
        BASE, max_num_batched_tokens=8, encoder_compute_budget=16, encoder_cache_size=32
    )
    rng = np.random.default_rng(13)
    pictures = [rng.standard_normal((3, 32, 32)).astype(np.float32) for _ in range(3)]
    images = [[pictures[i % 3], pictures[(i + 1) % 3]] for i in range(5)]
    prompts = [image_prompt(rng, 2) for _ in images]
    engine, outputs = run(image_model, config, prompts, images=images)
    check_images(image_reference, outputs, images, cfg)
    assert engine.kv_cache_manager.num_free_blocks == config.num_blocks - 1
    encoder_cache = engine.scheduler.encoder_cache_manager
    assert all(not refs for refs in encoder_cache.cached.values()), "no entry still referenced"
    assert encoder_cache.num_freeable_slots == encoder_cache.cache_size
