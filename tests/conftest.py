"""Shared fixtures (the module-level NONE_HASH is put back after every test) and the split
of the suite: `python -m pytest` runs the quick suite (5 minutes on 2 cores is its budget);
`python -m pytest -m slow` runs the rest, which CI runs too: the suites on 8 simulated
devices (a fresh JAX process each), the differential tests against vLLM and transformers
(skipped without `.venv-vllm`), the deep random profiles, and the TPU kernel compiled
deviceless for v5e/v6e/v5p by libtpu (`test_tpu_aot.py`; it builds `.venv-tpu-ci`).
`-m "slow or not slow"` runs everything at once."""

from __future__ import annotations

import os

# XLA compiles the tests' many small programs with LLVM's cheapest pipeline and the CPU
# backend's elemental emitters (its MLIR fusion emitters build a pass pipeline per fusion,
# about half the compile time of a tiny model's step): together about 60% less compile
# time, the same HLO (donation, aliasing, fusion are decided before code generation), so
# what the tests check is unchanged. Inherited by the processes tests spawn.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import pytest  # noqa: E402

import jaxkv.hashing as hashing  # noqa: E402

# Whole modules in the slow part (single tests carry `@pytest.mark.slow` themselves).
SLOW_MODULES = {
    # 8 simulated devices, each test in its own JAX process
    "test_device_sharding", "test_engine_sharding", "test_models_sharding",
    "test_device_distributed", "test_engine_multihost",
    # against vLLM / transformers in the peer environment
    "test_vllm_differential", "test_hybrid_vllm_diff", "test_vllm_yardstick", "test_models_hf",
    "test_sampling_vllm_diff",
    # n > 1 over a 1,000-token prompt (the quick part serves n through tests/test_serving.py)
    "test_engine_parallel_sampling",
    "test_scheduler_vllm", "test_fanout_vllm_diff",
}  # fmt: skip


# Single tests in the slow part: a subprocess JAX run, a long random profile, a
# compile-everything warm-up, or the costlier variants of a case the quick part covers.
SLOW_TESTS = {
    # engines of their own shapes (each compiles its programs): the quick part keeps the
    # device-level scan check, the prompts-file command, the gemma3 in-place check and the
    # 32-bit seeds
    "test_engine_models.py::test_scanned_and_per_layer_stacks_serve_the_same_tokens",
    "test_cli.py::test_generate_json_matches_the_dense_reference",
    "test_engine_in_place.py::test_every_engine_program_updates_its_caches_in_place[tiny-float32-auto]",
    "test_engine_faults.py::test_any_int_seed_is_served_beside_greedy_requests[2147483648]",
    "test_engine_faults.py::test_any_int_seed_is_served_beside_greedy_requests[1099511627776]",
    "test_engine_faults.py::test_any_int_seed_is_served_beside_greedy_requests[9223372036854775813]",
    "test_pallas_tpu.py::test_head_blocks_lane_columns_and_word_packing"
    "[('float32', 128, 8, 16, 1, 'int8')]",
    "test_pallas_tpu.py::test_head_blocks_lane_columns_and_word_packing"
    "[('bfloat16', 64, 1, 128, 8, None)]",
    "test_demo.py::test_quick_demo_serves_everything_correctly",  # the README demo, end to end
    # the GPU kernels in Pallas interpret mode: their costlier cases (the quick part keeps
    # one of each kind)
    "test_pallas_gpu_prefill_kernel.py::test_min_query_len_leaves_short_requests_to_the_decode_kernel",
    "test_pallas_gpu_prefill_kernel.py::test_prefill_only_batches[long prefill]",
    "test_pallas_gpu_decode_kernel.py::test_merge_of_splits_equals_one_split",
    "test_demo.py::test_quick_demo_with_a_host_tier_and_tenants_shows_their_figures",
    "test_engine_offload.py::test_sliding_window_hybrid_over_two_data_ranks",  # 8 devices
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
    "test_models_decoder.py::test_prefix_hit_gives_the_same_tokens_as_a_miss[llama]",
    # the quick part keeps test_paged_with_images_matches_dense[64]
    "test_models_llava.py::test_paged_with_images_matches_dense[3]",
    # scanned vs per-layer: the quick part keeps test_engine_models' engine-level check
    "test_cli_generate.py::test_scan_layers_on_and_off_give_the_same_tokens",
    "test_cli_generate.py::test_huge_seed_from_the_command_line",  # test_engine_faults: quick
    # the quick part keeps the prompts-file batch through the command
    "test_cli_generate.py::test_chat_template_and_cache_salt",
    "test_cli_generate.py::test_prompt_encoder_matches_transformers",
    "test_engine_in_place.py::test_every_engine_program_updates_its_caches_in_place[gemma3+scan-bfloat16-auto]",
    "test_device_quant.py::test_attention_over_a_quantised_cache[None-None-fp8]",
    "test_device_quant.py::test_attention_over_a_quantised_cache[5-3.0-fp8]",
    # attention variants: the quick part keeps one case per mask family and phase
    "test_device_attention.py::test_tiling_never_changes_the_result",
    "test_device_attention.py::test_span_and_chunk_masks_change_the_result",
    "test_device_attention.py::test_window_and_cap_change_the_result",
    "test_device_attention.py::test_query_chunking_does_not_change_result",
    "test_device_attention.py::test_table_width_does_not_change_the_result",
    "test_device_attention.py::test_matches_dense_float64_reference[1-None-None-mixed]",
    "test_device_attention.py::test_matches_dense_float64_reference[2-3-None-decode]",
    "test_device_attention.py::test_matches_dense_float64_reference[2-3-None-prefill]",
    "test_device_attention.py::test_matches_dense_float64_reference[3-6-2.0-decode]",
    "test_device_attention.py::test_matches_dense_float64_reference[3-6-2.0-prefill]",
    "test_device_attention.py::test_matches_dense_float64_reference[4-None-5.0-decode]",
    "test_device_attention.py::test_matches_dense_float64_reference[4-None-5.0-prefill]",
    "test_device_attention.py::test_blockwise_masks_match_float64_reference[1-None-None-None-True]",
    "test_device_attention.py::test_blockwise_masks_match_float64_reference[3-None-None-None-False]",
    "test_device_attention.py::test_blockwise_masks_match_float64_reference[8-5-12-2.0-True]",
    # the TPU and GPU kernels in interpret mode (no such device here): the quick part keeps
    # one mixed batch with every mask, one quantised cache, one decode case per kernel
    "test_pallas_tpu.py::test_auto_dispatch_by_platform",
    "test_pallas_tpu.py::test_bf16_cache",
    "test_pallas_tpu.py::test_mixed_batch_every_mask_matches_float64_reference[1-None-None-None-False]",
    "test_pallas_tpu.py::test_mixed_batch_every_mask_matches_float64_reference[4-None-8-None-True]",
    "test_pallas_tpu.py::test_mixed_batch_every_mask_matches_float64_reference[8-5-12-2.0-True]",
    "test_pallas_tpu.py::test_prefill_only_and_decode_only[decode]",
    "test_pallas_tpu.py::test_prefill_only_and_decode_only[prefill]",
    "test_pallas_tpu.py::test_quantised_cache[fp8-5-3.0]",
    "test_pallas_tpu.py::test_rows_without_keys_inside_a_request",
    "test_pallas_tpu.py::test_stale_table_tails_and_freed_window_pages",
    "test_pallas_tpu.py::test_step_dispatches_the_kernel_when_forced",
    "test_pallas_gpu_decode.py::test_bf16_stored_as_uint16",
    "test_pallas_gpu_decode.py::test_dispatch_matches_reference_and_zeroes_rows_past_num_seqs",
    "test_pallas_gpu_decode.py::test_rows_kernel_reads_a_stacked_layer_in_place[0]",
    "test_pallas_gpu_decode.py::test_rows_kernel_reads_a_stacked_layer_in_place[1]",
    "test_pallas_gpu_decode.py::test_rows_kernel_reads_a_stacked_layer_in_place[2]",
    "test_pallas_gpu_decode.py::test_matches_dense_float64_reference[2-8-2-5-None]",
    "test_pallas_gpu_decode.py::test_matches_dense_float64_reference[4-4-4-6-2.0]",
    "test_pallas_gpu_decode.py::test_matches_dense_float64_reference[8-16-1-6-2.0]",
    "test_pallas_gpu_decode.py::test_rows_kernel_serves_mixed_steps[2-None-None-None-True]",
    "test_pallas_gpu_decode.py::test_rows_kernel_serves_mixed_steps[4-None-6-None-True]",
    # vLLM's content-format detection in the peer environment (importing vLLM: ~25 s)
    "test_chat_content.py::test_content_format_matches_vllm",
    # checkpoints' chat templates against transformers and vLLM in the peer (~45 s)
    "test_chat_templates.py::test_checkpoints_render_as_transformers_and_vllm_render_them",
    # a LLaVA engine compiled for `generate --chat --image` (~15 s)
    "test_chat_templates.py::test_generate_chat_puts_the_image_where_a_llava_template_does",
}


# Test files that build the same engines (model and EngineConfig, so the same compiled
# step programs, which JAX keeps per process) run on the same worker under the quick
# suite's `--dist loadfile`: the programs compile once, not once per worker. A file here
# goes with the file it names: these build test_engine_correctness's model and BASE
# config (test_offload_waiting alone compiles for 20 s of CPU what it finds compiled
# after test_engine_offload).
SAME_WORKER = {
    "test_engine_offload.py": "test_engine_correctness.py",
    "test_offload_waiting.py": "test_engine_correctness.py",
    "test_engine_bad_input.py": "test_engine_correctness.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedProgramsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            folder, _, name = path.rpartition("/")
            return f"{folder}/{SAME_WORKER[name]}" if name in SAME_WORKER else path

    return SharedProgramsScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    collected = {item.nodeid.rsplit("/", 1)[-1] for item in items}
    for item in items:
        test_id = item.nodeid.rsplit("/", 1)[-1]
        module = item.module.__name__ if item.module is not None else ""
        if module in SLOW_MODULES or test_id in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    if not any("::" in arg for arg in config.args):
        _refuse_stale_slow_tests(collected)


def _refuse_stale_slow_tests(collected: set[str]) -> None:
    """A renamed test would leave its SLOW_TESTS entry behind and run in the quick part
    unnoticed: an entry naming no test of a collected module is an error."""
    modules = {test_id.split("::", 1)[0] for test_id in collected}
    stale = sorted(
        entry for entry in SLOW_TESTS
        if entry.split("::", 1)[0] in modules and entry not in collected
    )  # fmt: skip
    if stale:
        raise pytest.UsageError(f"SLOW_TESTS names tests that do not exist: {stale}")


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
