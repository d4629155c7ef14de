"""`LLMEngine.update_weights`: new weights written into the running model's buffers.

On the tiny Llama checkpoint (random weights A, B): each input form (the model's nnx
state, a mapping of Hugging Face tensor names, a checkpoint directory) makes the engine
serve exactly what a fresh engine built on B serves, in the same device buffers (their
pointers and the live bytes unchanged; the compiled write aliases every written byte);
prefix hits after an update never reach a block computed before it, nor an image
embedding encoded before it (tiny LLaVA, the vision tower updated); each
`weight_update_policy` handles a request running across the update; every refused
update (shape, dtype, missing or unknown tensor, another model's config or state, a
used version) changes nothing; ten updates of a warm engine compile nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import models
from jaxkv.device import compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, TinyConfig

CONFIG = EngineConfig(
    block_size=4, num_blocks=48, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=48
)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 16))  # 13 tokens: 3 full blocks
SHARED = PROMPT[:8] + [40, 41, 42, 43, 44]  # shares 2 full blocks with PROMPT


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints A and B of llama-tiny (B's tensors by HF name too), B's greedy tokens."""
    root = tmp_path_factory.mktemp("weights")
    config = models.tiny_configs()["llama-tiny"]
    models.save_random_checkpoint(root / "a", config, seed=0)
    tensors_b = models.save_random_checkpoint(root / "b", config, seed=1)
    fresh_b = LLMEngine(models.load_model(root / "b"), CONFIG)
    want_b = [o.output_token_ids for o in fresh_b.generate([PROMPT, SHARED], GREEDY)]
    return root, tensors_b, want_b


def _weights_b(form: str, ckpts):
    root, tensors_b, _ = ckpts
    if form == "state":
        return nnx.state(models.load_model(root / "b"))
    if form == "mapping":
        return dict(tensors_b)  # numpy arrays, the checkpoint's names
    return root / "b"


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("form", ["state", "mapping", "checkpoint"])
def test_update_serves_b_in_the_same_buffers_and_misses_old_blocks(form, ckpts) -> None:
    root, _, want_b = ckpts
    engine = LLMEngine(models.load_model(root / "a"), CONFIG)
    before = engine.generate([PROMPT], GREEDY)[0]
    assert before.weight_versions == (0,) and engine.weight_version == 0
    assert before.output_token_ids != want_b[0], "A and B differ"
    weights = _weights_b(form, ckpts)
    pointers = [leaf.unsafe_buffer_pointer() for leaf in engine.runner.weight_leaves]
    live = _live_bytes()
    assert engine.update_weights(weights) == 1 and engine.weight_version == 1
    del weights
    assert _live_bytes() <= live  # the form's own arrays (gone now) were counted before
    assert [leaf.unsafe_buffer_pointer() for leaf in engine.runner.weight_leaves] == pointers
    program = engine._weights.programs["state" if form == "state" else "hf"]
    written = sum(leaf.nbytes for leaf in engine.runner.weight_leaves)
    alias = program.memory_analysis().alias_size_in_bytes
    assert alias == written or (form != "state" and written - alias < 1024)  # rotary table
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.output_token_ids == want_b[0]
    assert again.num_cached_tokens == 0, "the blocks cached under A are never hit"
    assert again.weight_versions == (1,)
    shared = engine.generate([SHARED], GREEDY)[0]
    assert shared.output_token_ids == want_b[1]
    assert shared.num_cached_tokens == 8, "blocks computed under B are hit"
    assert engine.num_free_blocks == CONFIG.num_blocks - 1


def test_prefix_cache_keys_carry_the_version_only_after_an_update(ckpts) -> None:
    root = ckpts[0]
    engine = LLMEngine(models.load_model(root / "a"), CONFIG)
    engine.add_request(PROMPT, sampling=GREEDY, request_id="r0")
    unkeyed = list(engine.scheduler.get_request("r0").block_hashes)
    fresh = LLMEngine(models.load_model(root / "a"), CONFIG)
    fresh.add_request(PROMPT, sampling=GREEDY, request_id="r0")
    assert unkeyed == fresh.scheduler.get_request("r0").block_hashes  # vLLM's hashes
    engine.update_weights(root / "b", weight_version="step-7")
    assert engine.weight_version == "step-7"
    keyed = engine.scheduler.get_request("r0").block_hashes  # waiting: re-keyed
    assert len(keyed) == len(unkeyed) and not set(keyed) & set(unkeyed)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[-1].weight_versions == ("step-7",)
    assert engine.update_weights(root / "a") == 1  # ints go on counting


def _run_across_update(engine, weights, steps_before: int):
    """One request, `steps_before` steps, then the update; its outputs in order."""
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(PROMPT, sampling=sampling, request_id="r")
    outputs = []
    for _ in range(steps_before):
        outputs += engine.step()
    engine.update_weights(weights)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("policy", ["keep", "recompute", "abort"])
def test_policy_for_a_request_running_across_the_update(policy, ckpts) -> None:
    root = ckpts[0]
    config = dataclasses.replace(CONFIG, weight_update_policy=policy)
    engine = LLMEngine(models.load_model(root / "a"), config)
    outputs = _run_across_update(engine, root / "b", steps_before=4)
    last = outputs[-1]
    assert last.finished
    before = [o for o in outputs if o.weight_versions == (0,)]
    assert before, "tokens were sampled under A before the update"
    tokens_a = before[-1].output_token_ids
    if policy == "abort":
        assert last.finish_reason == "abort"
        assert last.output_token_ids == tokens_a
    else:
        assert last.finish_reason == "length" and len(last.output_token_ids) == 8
        assert last.weight_versions == (0, 1)
        assert last.output_token_ids[: len(tokens_a)] == tokens_a
        assert last.num_preemptions == (1 if policy == "recompute" else 0)
        if policy == "recompute":  # the rest as B serves the prompt and A's tokens
            fresh_b = LLMEngine(models.load_model(root / "b"), CONFIG)
            rest = SamplingParams(max_tokens=8 - len(tokens_a), ignore_eos=True)
            want = fresh_b.generate([PROMPT + tokens_a], rest)[0].output_token_ids
            assert last.output_token_ids[len(tokens_a) :] == want
    late = engine.generate([PROMPT], GREEDY)[0]
    assert late.output_token_ids == ckpts[2][0]  # B's, whatever it hit
    # Recomputed under B, the request's prompt blocks are B's; kept, they stay A's lineage.
    assert late.num_cached_tokens == (12 if policy == "recompute" else 0)
    assert engine.num_free_blocks == CONFIG.num_blocks - 1


def _bad_config_checkpoint(root, tmp_path):
    path = tmp_path / "other"
    shutil.copytree(root / "b", path)
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = 500.0
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_refused_updates_change_nothing(ckpts, tmp_path) -> None:
    root, tensors_b, _ = ckpts
    engine = LLMEngine(models.load_model(root / "a"), CONFIG)
    want_a = engine.generate([PROMPT], GREEDY)[0].output_token_ids
    leaves = engine.runner.weight_leaves
    name = "model.layers.0.self_attn.q_proj.weight"
    shape = tensors_b[name].shape
    state_b = nnx.state(models.load_model(root / "b"))
    cases = [
        ({**tensors_b, name: np.zeros((shape[0], shape[1] + 1), np.float32)}, "shape"),
        ({**tensors_b, name: tensors_b[name].astype(np.float16)}, "dtype"),
        ({k: v for k, v in tensors_b.items() if k != name}, "missing"),
        ({**tensors_b, "model.extra.weight": tensors_b[name]}, "extra"),
        (_bad_config_checkpoint(root, tmp_path), "rope"),
        (nnx.state(TinyCausalLM(TinyConfig())), "structure"),
        (nnx.state(engine.model), "own buffer"),
        ([1, 2], "must be a checkpoint directory"),
    ]
    for weights, match in cases:
        with pytest.raises((ValueError, TypeError)) as error:
            engine.update_weights(weights)
        text = str(error.value)
        if match == "shape":
            assert name in text and f"{shape}" in text and "expected shape" in text
        elif match == "dtype":
            assert name in text and "float16" in text and "float32" in text
        elif match == "missing":
            assert name in text
        elif match == "extra":
            assert "model.extra.weight" in text
        else:
            assert match in text, text
        assert engine.weight_version == 0
        assert all(a is b for a, b in zip(engine.runner.weight_leaves, leaves, strict=True))
    with pytest.raises(ValueError, match="used before"):
        engine.update_weights(state_b, weight_version=0)
    with pytest.raises(TypeError, match="int or str"):
        engine.update_weights(state_b, weight_version=True)
    assert engine.generate([PROMPT], GREEDY)[0].output_token_ids == want_a
    assert engine.weight_version == 0


def test_tiny_engine_model_takes_its_state_only() -> None:
    engine = LLMEngine(TinyCausalLM(TinyConfig(), seed=0), CONFIG)
    with pytest.raises(TypeError, match="no Hugging Face tensor names"):
        engine.update_weights({"lm_head.weight": np.zeros(3)})
    new = nnx.state(TinyCausalLM(TinyConfig(), seed=1))
    assert engine.update_weights(new, weight_version=5) == 5
    for mine, given in zip(engine.runner.weight_leaves, jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(given))
    assert jax.tree.leaves(nnx.state(engine.model))[0] is engine.runner.weight_leaves[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_updates_of_a_warm_engine_compile_nothing(ckpts) -> None:
    root, tensors_b, want_b = ckpts
    engine = LLMEngine(models.load_model(root / "a"), CONFIG)
    engine.warm_up()
    state_a = nnx.state(models.load_model(root / "a"))
    forms = [lambda: dict(tensors_b), lambda: root / "a", lambda: state_a]
    weights = [form() for form in forms]  # made outside the count (a load compiles)
    count, first_step = compilation_count(), engine.stats.num_steps
    for i in range(10):
        engine.update_weights(weights[i % 3])
        out = engine.generate([PROMPT], GREEDY)[0]
        assert out.weight_versions == (i + 1,)
        if i % 3 == 0:
            assert out.output_token_ids == want_b[0]
    assert compilation_count() == count
    assert sum(s.compilations for s in engine.stats.steps_since(first_step)) == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_update_empties_the_encoder_cache(tmp_path) -> None:
    """An image served before an update of the vision tower is encoded again after it
    (its cached embedding came from the old tower), and the engine then serves what a
    fresh engine on the new weights serves."""
    from safetensors.numpy import save_file

    from jaxkv.models.checkpoint import SINGLE_FILE

    config = models.tiny_configs()["llava-tiny"]
    tensors_a = models.save_random_checkpoint(tmp_path / "a", config, seed=0)
    other = models.save_random_checkpoint(tmp_path / "other", config, seed=1)
    vision = {name for name in tensors_a if "vision_tower" in name}
    assert vision and len(vision) < len(tensors_a)
    tensors_b = {name: other[name] if name in vision else a for name, a in tensors_a.items()}
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    save_file(tensors_b, tmp_path / "b" / SINGLE_FILE, metadata={"format": "pt"})
    llava = models.load_model(tmp_path / "a")
    size = llava.llava_config.vision.image_size
    picture = np.random.default_rng(4).standard_normal((3, size, size)).astype(np.float32)
    prompt = [3, 4, llava.llava_config.image_token_id, 7, 8, 9]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    config = dataclasses.replace(CONFIG, max_num_batched_tokens=16)
    engine = LLMEngine(llava, config)

    def serve(served: LLMEngine):
        return served.generate([prompt], sampling, images=[[picture]])[0]

    before = serve(engine)
    assert engine.runner.num_encoded == 1 and engine.stats.total("encoder_misses") == 1
    engine.update_weights(tmp_path / "b")
    after = serve(engine)
    assert engine.runner.num_encoded == 2, "the image is encoded again by the new tower"
    assert engine.stats.total("encoder_misses") == 2 and engine.stats.total("encoder_hits") == 0
    fresh = serve(LLMEngine(models.load_model(tmp_path / "b"), config))
    assert after.output_token_ids == fresh.output_token_ids != before.output_token_ids
    pairs = zip(after.output_token_ids, after.logprobs, fresh.logprobs, strict=True)
    for token, got, want in pairs:
        assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)


def test_events_queued_before_an_update_keep_the_keys_their_blocks_were_hashed_with(
    ckpts,
) -> None:
    """A block stored before `update_weights` re-keys its request is announced with the
    hash and extra keys it was cached under (no version), however late the event is
    built: a router recomputing hashes from `extra_keys` gets the announced hash."""
    root = ckpts[0]
    config = dataclasses.replace(
        CONFIG, enable_kv_cache_events=True, weight_update_policy="recompute"
    )
    engine = LLMEngine(models.load_model(root / "a"), config)
    engine.add_request(PROMPT[:6], sampling=GREEDY, request_id="r")
    first_hash = engine.scheduler.get_request("r").block_hashes[0]
    engine.step()  # the first block is cached; its BlockStored is queued
    engine.update_weights(root / "b")
    assert engine.scheduler.get_request("r").block_hashes[0] != first_hash  # re-keyed
    stored = [e for e in engine.take_kv_events() if type(e).__name__ == "BlockStored"]
    assert [e.block_hashes for e in stored] == [[first_hash]]
    assert stored[0].extra_keys is None, stored[0].extra_keys
    engine.shutdown()
