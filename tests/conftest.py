"""Shared fixtures (the module-level NONE_HASH is put back after every test) and the split
of the suite: `python -m pytest` runs the quick suite (under 5 minutes on 2 cores);
`python -m pytest -m slow` runs the rest, which CI runs too: the suites on 8 simulated
devices (a fresh JAX process each), the differential tests against vLLM and transformers
(skipped without `.venv-vllm`), and the deep random profiles. `-m "slow or not slow"`
runs everything at once."""

from __future__ import annotations

import os

import pytest

import jaxkv.hashing as hashing

# Whole modules in the slow part (single tests carry `@pytest.mark.slow` themselves).
SLOW_MODULES = {
    # 8 simulated devices, each test in its own JAX process
    "test_device_sharding", "test_engine_sharding", "test_models_sharding",
    "test_device_distributed", "test_engine_multihost",
    # against vLLM / transformers in the peer environment
    "test_vllm_differential", "test_hybrid_vllm_diff", "test_vllm_yardstick", "test_models_hf",
    "test_scheduler_vllm",
}  # fmt: skip


# Single tests in the slow part: a subprocess JAX run, a long random profile, a
# compile-everything warm-up, or the costlier variants of a case the quick part covers.
SLOW_TESTS = {
    "test_demo.py::test_quick_demo_serves_everything_correctly",  # the README demo, end to end
    "test_demo.py::test_quick_demo_with_a_host_tier_shows_its_hits",
    "test_compilation_cache.py::test_second_run_compiles_nothing_the_first_compiled",
    "test_engine_faults.py::test_engine_state_machine",
    "test_engine_models.py::test_gemma3_sliding_window_chunked_and_preempted",
    "test_engine_models.py::test_llava_images_encoded_once_and_match_dense",
    "test_device_serving.py::test_no_compilation_after_warmup_over_300_random_steps_two_layers",
    "test_device_step_metadata.py::test_no_compilation_after_warmup_over_200_random_steps",
    "test_engine_correctness.py::test_serving_after_warm_up_compiles_nothing",
    "test_engine_correctness.py::test_images_with_tiny_chunks_and_preemption",
    "test_engine_block_rows.py::test_sliding_window_rows_take_the_null_block_as_the_manager_does",
    "test_models_examples.py::test_example_runs_and_matches_dense[gemma_style]",
    "test_models_examples.py::test_example_runs_and_matches_dense[llava_style]",
    "test_readme.py::test_readme_engine_example_runs",
    "test_kv_events_wire.py::test_engine_publishes_what_its_managers_hold",  # compiles an engine
    "test_pod_plan.py::test_aot_plan_on_16_devices_is_checked_by_the_compiler",  # 16 devices
    "test_pallas_tpu.py::test_dma_timing_does_not_change_the_result",
    # the quick part keeps test_paged_matches_dense[gemma3-64-True] and [llama-2-False]
    "test_models_decoder.py::test_paged_matches_dense[gemma-2-False]",
    "test_models_decoder.py::test_paged_matches_dense[gemma2-2-False]",
    "test_models_decoder.py::test_paged_matches_dense[gemma3-2-False]",
    "test_models_decoder.py::test_paged_matches_dense[gemma-64-True]",
    "test_models_decoder.py::test_paged_matches_dense[gemma2-64-True]",
    "test_models_decoder.py::test_paged_matches_dense[llama-64-True]",
    "test_models_decoder.py::test_prefix_hit_gives_the_same_tokens_as_a_miss[gemma]",
    "test_models_decoder.py::test_prefix_hit_gives_the_same_tokens_as_a_miss[gemma2]",
    "test_models_decoder.py::test_prefix_hit_gives_the_same_tokens_as_a_miss[gemma3]",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        test_id = item.nodeid.rsplit("/", 1)[-1]
        module = item.module.__name__ if item.module is not None else ""
        if module in SLOW_MODULES or test_id in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# The suite counts compilations: programs come from XLA, never from a persistent cache
# a previous run left (tests of the cache give their own directory, in a subprocess).
os.environ["JAXKV_COMPILATION_CACHE"] = "none"


@pytest.fixture(autouse=True)
def restore_none_hash(monkeypatch):
    """Tests may re-initialise NONE_HASH (and must not see PYTHONHASHSEED); undo it after."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    saved = (hashing.NONE_HASH, hashing._none_hash_seed)
    yield
    hashing.NONE_HASH, hashing._none_hash_seed = saved


@pytest.fixture
def fixed_none_hash():
    """NONE_HASH from sha256_cbor with the seed "test-seed"."""
    hashing.init_none_hash(hashing.get_hash_fn_by_name("sha256_cbor"), "test-seed")
