"""`n > 1`: the samples of one prompt share its prefill (issue 39 item 2)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import models
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams

PROMPT_LEN, N, MAX_TOKENS, BLOCK = 1000, 8, 16, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-long")
    config = {**models.tiny_configs()["llama-tiny"], "max_position_embeddings": 2048}
    models.save_random_checkpoint(path, config, seed=0)
    return models.load_model(path)


def run(model, prefix_caching: bool) -> tuple[dict, int, list]:
    config = EngineConfig(block_size=BLOCK, num_blocks=600, max_num_seqs=N,
                          max_num_batched_tokens=256, max_model_len=1100,
                          enable_prefix_caching=prefix_caching)  # fmt: skip
    engine = LLMEngine(model, config)
    prompt = np.random.default_rng(0).integers(5, 256, PROMPT_LEN).tolist()
    params = SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                            ignore_eos=True)  # fmt: skip
    engine.add_request(prompt, sampling=params, request_id="p")
    held, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held = max(held, engine.kv_cache_manager.block_pool.num_gpu_blocks - 1
                   - engine.num_free_blocks)  # fmt: skip
    summary = engine.stats.summary()
    assert engine.num_free_blocks == config.num_blocks - 1, "every block came back"
    engine.shutdown()
    return summary, held, outputs


def test_n_samples_compute_the_prompt_about_once_and_share_its_blocks(model) -> None:
    summary, held, outputs = run(model, prefix_caching=True)
    prompt_computed = summary["num_scheduled_tokens"] - summary["num_generated_tokens"]
    assert PROMPT_LEN - N <= prompt_computed <= 1.1 * PROMPT_LEN, prompt_computed
    prompt_blocks = -(-PROMPT_LEN // BLOCK)
    assert held <= prompt_blocks + N * (-(-MAX_TOKENS // BLOCK) + 1), held
    assert [o.request_id for o in outputs if o.finished] == ["p"]
    last = {}  # sample index -> its tokens (CUMULATIVE: each output has all so far)
    for output in outputs:
        for completion in output.outputs:
            last[completion.index] = completion.token_ids
    assert sorted(last) == list(range(N)) and all(len(t) == MAX_TOKENS for t in last.values())
    assert len({tuple(t) for t in last.values()}) > 1, "seeded seed + i, the samples differ"
    assert summary["prefix_hits"] >= (N - 1) * (PROMPT_LEN // BLOCK) * BLOCK


def test_without_prefix_caching_every_sample_computes_its_prompt(model) -> None:
    summary, _, _ = run(model, prefix_caching=False)
    prompt_computed = summary["num_scheduled_tokens"] - summary["num_generated_tokens"]
    # Each sample's first token comes with its prefill, not from a scheduled token.
    assert prompt_computed == N * PROMPT_LEN - N
