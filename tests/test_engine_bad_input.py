"""Bad input fails that request (or call) only, with a clear error, before any change."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.reference import DenseReference
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

CONFIG = EngineConfig(
    block_size=8, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=184
)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return TinyCausalLM(tiny_configs()["llava-style-tiny"], seed=2)


@pytest.fixture
def engine(model):
    return LLMEngine(model, CONFIG)


def state(engine: LLMEngine) -> tuple:
    s, requests = engine.scheduler, engine._requests
    return (
        len(s.waiting), len(s.running), s.num_unfinished_requests,
        engine.kv_cache_manager.num_free_blocks, len(requests.sampling), len(requests.images),
    )  # fmt: skip


PICTURE = np.zeros((3, 32, 32), np.float32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(prompt=[]), ValueError, "prompt is empty"),
        (dict(prompt=list(range(3, 196))), ValueError, "max_model_len=184"),
        (dict(prompt=[3, 600]), ValueError, r"token id 600 is out of range \[0, 512\)"),
        (dict(prompt=[3, 4.5]), TypeError, "must be ints"),
        (dict(prompt="hello"), TypeError, "no tokenizer"),
        (
            dict(prompt=b"\x05\x06"),
            TypeError,
            "text \\(str\\) or a sequence of token ids, got bytes",
        ),
        (dict(prompt=bytearray(b"\x05")), TypeError, "got bytearray"),
        (dict(prompt=[3, 4], images=[PICTURE]), ValueError, "0 image tokens"),
        (dict(prompt=[3, 2], images=[np.zeros((3, 16, 16))]), ValueError, "shape"),
        (dict(prompt=[3], sampling=SamplingParams), TypeError, "SamplingParams"),
    ],
)
def test_bad_request_raises_and_changes_nothing(engine, kwargs, error, match) -> None:
    engine.add_request([5, 6, 7], sampling=GREEDY, request_id="good")
    before = state(engine)
    with pytest.raises(error, match=match):
        engine.add_request(**kwargs)
    assert state(engine) == before
    (out,) = engine.generate([[8, 9, 10]], GREEDY)
    assert len(out.output_token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_tokens", 0, "max_tokens must be None \\(up to the model length\\) or an int >= 1"),
        ("max_tokens", 2.5, "max_tokens"),
        ("temperature", -1.0, "temperature must be a float in \\[0, 2\\]"),
        ("temperature", float("nan"), "temperature"),
        ("top_k", -2, r"top_k must be an int >= -1 \(0 and -1 disable top-k\)"),
        ("top_p", 0.0, r"top_p must be a float in \(0, 1\]"),
        ("top_p", 1.5, "top_p"),
        ("seed", 2.5, r"seed must be None or an int \(-1 means None\)"),
        ("stop_token_ids", 7, "stop_token_ids"),
        ("stop_token_ids", [1, -2], "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_duplicate_request_id_is_refused(engine) -> None:
    engine.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request([5, 6], request_id="a")


def test_unknown_request_id_on_abort(engine) -> None:
    engine.add_request([3, 4, 5], sampling=GREEDY, request_id="kept")
    before = state(engine)
    with pytest.raises(KeyError, match="no unfinished request with id 'nope'"):
        engine.abort("nope")
    assert state(engine) == before


def test_image_larger_than_the_encoder_cache_fails_that_request_only(model) -> None:
    """The image needs 16 embeddings; the cache holds 8. Other requests are served."""
    config = dataclasses.replace(CONFIG, encoder_cache_size=8, encoder_compute_budget=32)
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(0)
    picture = rng.standard_normal((3, 32, 32)).astype(np.float32)
    outputs = engine.generate(
        [[3, 4, 5], [3, 2, 6], [7, 8, 9]], GREEDY, images=[None, [picture], None]
    )
    assert "needs 16 encoder embeddings, more than the encoder cache size" in outputs[1].error
    reference = DenseReference(model, CONFIG.max_model_len)
    for out in (outputs[0], outputs[2]):
        assert out.error is None and out.finish_reason == "length"
        assert out.output_token_ids == reference.expected(
            out.prompt_token_ids, out.output_token_ids
        )
    assert engine.kv_cache_manager.num_free_blocks == CONFIG.num_blocks - 1


def test_image_over_the_compute_budget_is_refused(model) -> None:
    engine = LLMEngine(model, dataclasses.replace(CONFIG, encoder_compute_budget=4))
    with pytest.raises(ValueError, match="compute budget"):
        engine.add_request([3, 2], images=[PICTURE])


def test_images_to_a_text_model_are_refused() -> None:
    engine = LLMEngine(TinyCausalLM(tiny_configs()["gemma-style-tiny"]), CONFIG)
    with pytest.raises(ValueError, match="text only"):
        engine.add_request([3, 2], images=[PICTURE])


def test_bytes_prompt_in_generate_is_rejected_not_served(engine) -> None:
    """vLLM refuses bytes; served as ids they would be a prompt nobody meant."""
    bad, good = engine.generate([b"\x05\x06", [5, 6]], GREEDY)
    assert "got bytes" in bad.error and bad.prompt_token_ids == [] and not bad.output_token_ids
    assert good.error is None and len(good.output_token_ids) == 6


@pytest.mark.parametrize(
    ("field", "endpoint", "match"),
    [
        ("kv_events_endpoint", "tcp://127.0.0.1:99999", "integer in 1..65535 .*got port '99999'"),
        ("kv_events_replay_endpoint", "tcp://*:0", "got port '0'"),
    ],
)
def test_kv_events_endpoint_port_is_checked_at_construction(model, field, endpoint, match):
    fields = {"kv_events_endpoint": "tcp://*:5557", field: endpoint}
    config = dataclasses.replace(CONFIG, **fields)
    with pytest.raises(ValueError, match=f"EngineConfig.{field} '.*{match}"):
        LLMEngine(model, config)
