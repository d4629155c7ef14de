"""The engine sizes its KV cache from a memory budget (jaxkv.engine.sizing)."""

from __future__ import annotations

import pytest

from jaxkv import models
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

# The tiny engine model: 2 layers, 2 KV heads of 32, float32: one block of 16 tokens is
# 16 * 2 * 2 * 32 * 4 = 8 KiB per layer.
BLOCK_BYTES = 2 * 16 * 2 * 2 * 32 * 4


@pytest.fixture(scope="module")
def model():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"])


def test_budget_sets_num_blocks_and_the_caches_fit_it(model) -> None:
    budget = 100 * BLOCK_BYTES + 123
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=budget, max_model_len=512))
    assert engine.config.num_blocks == 100
    assert engine.kv_cache_sizing.bytes_per_block == BLOCK_BYTES
    on_device = engine.runner.kv_cache.nbytes
    assert on_device <= budget < on_device + BLOCK_BYTES
    assert "100 blocks" in engine.kv_cache_sizing.describe()
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.output_token_ids) == 3


def test_max_model_len_none_takes_the_longest_request_the_pool_holds(model) -> None:
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=41 * BLOCK_BYTES, max_model_len=None))
    assert engine.config.max_model_len == 40 * 16  # 40 usable blocks of 16 tokens
    assert engine.kv_cache_manager.max_model_len == 640


def test_max_model_len_none_is_capped_by_the_checkpoint(tmp_path) -> None:
    config = models.tiny_configs()["llama-tiny"]
    models.save_random_checkpoint(tmp_path, config)
    llama = models.load_model(tmp_path)
    engine = LLMEngine(llama, EngineConfig(kv_cache_memory=2**30, max_model_len=None))
    assert engine.config.max_model_len == config["max_position_embeddings"]


def test_a_budget_too_small_names_budget_block_bytes_and_longest_fit(model) -> None:
    with pytest.raises(ValueError) as info:
        LLMEngine(model, EngineConfig(kv_cache_memory=10 * BLOCK_BYTES, max_model_len=512))
    message = str(info.value)
    assert f"kv_cache_memory={10 * BLOCK_BYTES:,} bytes" in message
    assert f"blocks of {BLOCK_BYTES:,} bytes" in message
    assert "the longest max_model_len that fits is 144" in message  # 9 usable blocks
    with pytest.raises(ValueError, match="at least 2 are needed"):
        LLMEngine(model, EngineConfig(kv_cache_memory=BLOCK_BYTES))


def test_hybrid_model_counts_every_group(tmp_path) -> None:
    """Gemma 3 tiny: sliding (window 8) and full layers in separate groups, one pool."""
    models.save_random_checkpoint(tmp_path, models.tiny_configs()["gemma3-tiny"])
    gemma = models.load_model(tmp_path)
    engine = LLMEngine(gemma, EngineConfig(block_size=4, kv_cache_memory=2**20, max_model_len=None))
    groups = engine.runner.kv_cache_config.kv_cache_groups
    assert len(groups) > 1
    c = engine.config
    per_request = sum(
        g.kv_cache_spec.max_num_blocks_per_req(c.max_model_len, c.max_num_batched_tokens)
        for g in groups
    )
    assert per_request <= c.num_blocks - 1


def test_memory_utilization_needs_a_device_that_reports_its_memory(model) -> None:
    with pytest.raises(ValueError, match="give kv_cache_memory"):
        LLMEngine(model, EngineConfig(memory_utilization=0.9))
    with pytest.raises(ValueError, match=r"memory_utilization must be in \(0, 1\]"):
        LLMEngine(model, EngineConfig(memory_utilization=1.5))
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive int"):
        LLMEngine(model, EngineConfig(kv_cache_memory=0))


@pytest.mark.parametrize("name", ["encoder_cache_size", "encoder_compute_budget", "num_blocks"])
def test_zero_sizes_are_refused_not_replaced_by_defaults(model, name) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{name} must be a positive int or None"):
        LLMEngine(model, EngineConfig(**{name: 0}))
