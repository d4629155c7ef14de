"""The engine serves jaxkv.models checkpoints (HF format, random weights) token-identical
to their dense reference: Gemma 3 sliding-window layers with prompts longer than the
window, chunked and preempted; LLaVA images through the encoder cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from models_util import deep_gemma3_config

from jaxkv import models
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.step_programs import MAX_LAYER_PROGRAMS, layer_group_sizes
from jaxkv.testing.reference import DenseReference, image_offsets

MAX_LEN = 92  # 23 blocks of 4: the usable blocks of the pool hold one request
CONFIG = EngineConfig(
    block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN
)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def load(tmp_path_factory, name: str):
    path = tmp_path_factory.mktemp(name)
    models.save_random_checkpoint(path, models.tiny_configs()[name], seed=0)
    return models.load_model(path)


def test_gemma3_sliding_window_chunked_and_preempted(tmp_path_factory) -> None:
    model = load(tmp_path_factory, "gemma3-tiny")
    with pytest.raises(ValueError, match="one request of max_model_len=92 tokens takes"):
        LLMEngine(model, CONFIG)  # 24 blocks over 4 KV-cache groups (3 sliding, 1 full)
    window = model.config.sliding_window
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, 12).tolist()
    prompts = [shared + rng.integers(3, 256, int(rng.integers(2, 24))).tolist() for _ in range(6)]
    assert max(len(p) for p in prompts) > 3 * window
    engine = LLMEngine(model, dataclasses.replace(CONFIG, num_blocks=64))
    assert len(engine.runner.kv_cache_config.kv_cache_groups) > 1, "hybrid groups"
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = engine.generate(prompts, sampling)
    assert engine.scheduler.num_preemptions > 0, "the pool is sized to preempt"
    assert engine.stats.prefix_hit_rate > 0
    reference = DenseReference(model, MAX_LEN)
    for out in outputs:
        assert len(out.output_token_ids) == sampling.max_tokens
        want = reference.expected(out.prompt_token_ids, out.output_token_ids)
        assert out.output_token_ids == want


def test_llava_images_encoded_once_and_match_dense(tmp_path_factory) -> None:
    model = load(tmp_path_factory, "llava-tiny")
    image_token = model.llava_config.image_token_id
    vision = model.llava_config.vision
    rng = np.random.default_rng(1)
    picture = rng.standard_normal((3, vision.image_size, vision.image_size)).astype(np.float32)
    prompts = [rng.integers(3, 200, 3).tolist() + [image_token] + [7, 8, 9] for _ in range(3)]
    engine = LLMEngine(model, CONFIG)
    outputs = engine.generate(prompts, GREEDY, images=[[picture]] * 3)
    assert engine.runner.num_encoded == 1 and engine.stats.total("encoder_hits") == 2
    reference = DenseReference(model, MAX_LEN)
    for out in outputs:
        (offset,) = image_offsets(out.prompt_token_ids, image_token, model.num_image_tokens)
        want = reference.expected(out.prompt_token_ids, out.output_token_ids, [(offset, picture)])
        assert out.output_token_ids == want


@pytest.mark.parametrize("name", ["llama-tiny"])
def test_checkpoint_model_rejects_bad_requests_and_serves_others(tmp_path_factory, name):
    model = load(tmp_path_factory, name)
    engine = LLMEngine(model, CONFIG)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([3, 10_000])
    with pytest.raises(ValueError, match="text only"):
        engine.add_request([3, 4], images=[np.zeros((3, 16, 16), np.float32)])
    (out,) = engine.generate([[3, 4, 5]], GREEDY)
    assert len(out.output_token_ids) == GREEDY.max_tokens


def step_program_chars(engine: LLMEngine) -> int:
    """The size of the engine's first step program (the layer program of a model run
    layer by layer), as lowered text."""
    programs = engine.runner.lowered_programs()
    name = next(n for n in programs if n.startswith("step"))
    return len(programs[name][0].as_text())


def test_scanned_and_per_layer_stacks_serve_the_same_tokens(tmp_path_factory) -> None:
    """One scanned layer body (the default off CPU) computes what one stack per layer (the
    CPU default, run a group of layers per program) computes; the scanned step program
    does not grow with depth, a layer program grows with its group's layers only."""
    tiny = models.tiny_configs()["gemma3-tiny"]
    deep = deep_gemma3_config(23)  # deeper than MAX_LAYER_PROGRAMS: groups of 3 and 2
    loaded = {}
    for name, config in (("tiny", tiny), ("deep", deep)):
        path = tmp_path_factory.mktemp(f"gemma3-{name}")
        models.save_random_checkpoint(path, config, seed=3)
        for scan in (True, False):
            loaded[name, scan] = models.load_model(path, scan_layers=scan)
    scanned, per_layer = loaded["tiny", True], loaded["tiny", False]
    num_layers = scanned.config.num_hidden_layers
    assert len(scanned.decoder.layers) == 1 and len(per_layer.decoder.layers) == num_layers
    ids = np.arange(3, 40, dtype=np.int32)
    np.testing.assert_allclose(
        scanned.dense_fn()(ids), per_layer.dense_fn()(ids), rtol=1e-5, atol=1e-5
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 17, 30)]
    config = dataclasses.replace(CONFIG, num_blocks=96)
    engines = {key: LLMEngine(model, config) for key, model in loaded.items()}
    for name in ("tiny", "deep"):
        outputs = [engines[name, scan].generate(prompts, GREEDY) for scan in (True, False)]
        tokens = [[o.output_token_ids for o in outs] for outs in outputs]
        assert tokens[0] == tokens[1], name
    assert engines["tiny", True].runner.programs_per_step == 2
    assert engines["tiny", False].runner.programs_per_step == 4  # placer, inputs, layer, head
    assert engines["deep", False].runner.programs_per_step == 5  # and a second group size
    shallow, deeper = (step_program_chars(engines[name, True]) for name in ("tiny", "deep"))
    assert deeper < 1.05 * shallow, f"scanned: {shallow} -> {deeper} chars"
    one, three = (step_program_chars(engines[name, False]) for name in ("tiny", "deep"))
    assert 2 * one < three < 3.15 * one, f"layer programs of 1 and 3 layers: {one}, {three}"


def test_layer_groups_cover_every_run_in_few_programs() -> None:
    """At most `MAX_LAYER_PROGRAMS` groups, the runs' count in all, of the fewest runs
    per group that allows and at most two sizes; with the inputs and the head, two
    steps' programs fit in the 32 XLA's CPU client keeps in flight."""
    assert 2 * (MAX_LAYER_PROGRAMS + 2) <= 32
    for num_runs in range(1, 130):
        sizes = layer_group_sizes(num_runs)
        assert sum(sizes) == num_runs and min(sizes) >= 1, sizes
        assert len(sizes) <= MAX_LAYER_PROGRAMS, sizes
        assert max(sizes) == -(-num_runs // MAX_LAYER_PROGRAMS), sizes
        assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)
