"""Runs under the vLLM peer env: one workload through `jaxkv.engine.scheduler.Scheduler`
over jaxkv's `KVCacheManager` and over vLLM's, printing both per-step traces as JSON.

Used by tests/test_scheduler_vllm.py. The scheduler module must not import JAX (this
environment has none).
"""

from __future__ import annotations

import json
import sys

import numpy as np

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96


def workload(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50, int(n)).tolist() for n in (13, 24, 8)]
    prompts, max_tokens = [], []
    for i in range(40):
        prompts.append(systems[i % 3] + rng.integers(0, 50, int(rng.integers(1, 30))).tolist())
        max_tokens.append(int(rng.integers(1, 24)))
    return prompts, max_tokens


def jaxkv_backend(num_blocks: int):
    import jaxkv

    fn = jaxkv.get_hash_fn_by_name("sha256_cbor")
    jaxkv.init_none_hash(fn)
    hasher = jaxkv.get_request_block_hasher(BLOCK_SIZE, fn)
    manager = jaxkv.KVCacheManager.from_spec(
        jaxkv.FullAttentionSpec(block_size=BLOCK_SIZE), num_blocks, MAX_MODEL_LEN
    )

    def make(request_id: str, prompt: list[int], max_tokens: int):
        return jaxkv.Request(request_id, prompt, max_tokens=max_tokens, block_hasher=hasher)

    return manager, make


def vllm_backend(num_blocks: int):
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, fn)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(
        config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE, enable_caching=True,
    )  # fmt: skip

    def make(request_id: str, prompt: list[int], max_tokens: int):
        sampling = SamplingParams(max_tokens=max_tokens)
        return Request(request_id, prompt, sampling, None, block_hasher=hasher)

    return manager, make


def apply_block_changes(rows: dict, manager, out) -> None:
    """Keep one row per request from the step's block-id changes, as a model runner does;
    each scheduled request's row must then be the manager's block ids."""
    for request_id in out.preempted_request_ids + out.finished_request_ids:
        rows.pop(request_id, None)
    for s in out.scheduled:
        request_id = s.request.request_id
        if s.resets_row:
            rows[request_id] = [list(ids) for ids in s.new_block_ids]
        else:
            for row, ids in zip(rows[request_id], s.new_block_ids, strict=False):
                row += ids
            for row, num_nulls in zip(rows[request_id], s.num_null_blocks, strict=False):
                row[:num_nulls] = [0] * num_nulls
        assert rows[request_id] == [list(ids) for ids in manager.get_block_ids(request_id)]


def trace(backend, seed: int, num_blocks: int, overlap: bool) -> dict:
    """Serve the workload; per step: (request id, first position, tokens, the block-id
    changes and the row they make) scheduled, preempted ids, finished ids."""
    from jaxkv.engine.scheduler import Scheduler, SchedulerConfig

    manager, make = backend(num_blocks)
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=48, max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=20,
    )  # fmt: skip
    scheduler = Scheduler(manager, config)
    prompts, max_tokens = workload(seed)
    for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
        scheduler.add_request(make(f"r{i}", prompt, limit))
    steps, outputs, in_flight, rows = [], {}, None, {}
    while scheduler.has_unfinished_requests() or in_flight is not None:
        out = scheduler.schedule()
        apply_block_changes(rows, manager, out)
        if overlap:  # the step in flight finishes after the next one is scheduled
            done, in_flight = in_flight, None if out.is_empty else out
        else:
            done = out
        finished = []
        if done is not None:
            tokens = [(s.request.num_tokens * 31 + 7) % 50 for s in done.scheduled]
            updates = scheduler.update_from_output(done, tokens)
            for request in updates.requests:
                if request.request_id in updates.finish_reasons:
                    finished.append(request.request_id)
                    outputs[request.request_id] = list(request.output_token_ids)
        steps.append(
            {
                "scheduled": [
                    [
                        s.request.request_id,
                        s.num_computed_tokens,
                        s.num_new_tokens,
                        s.resets_row,
                        [list(ids) for ids in s.new_block_ids],
                        list(s.num_null_blocks),
                        rows[s.request.request_id],
                    ]
                    for s in out.scheduled
                ],  # fmt: skip
                "preempted": out.preempted_request_ids,
                "finished": finished,
            }
        )
        assert len(steps) < 5000, "no progress"
    return {
        "steps": steps,
        "outputs": outputs,
        "preemptions": scheduler.num_preemptions,
        "hit_tokens": scheduler.num_admitted_hit_tokens,
        "free_blocks": manager.block_pool.get_num_free_blocks(),
    }


def main() -> None:
    seed, num_blocks, overlap = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    result = {
        "jaxkv": trace(jaxkv_backend, seed, num_blocks, overlap),
        "vllm": trace(vllm_backend, seed, num_blocks, overlap),
        "jax_imported": "jax" in sys.modules,
    }
    print("RESULT" + json.dumps(result))


if __name__ == "__main__":
    main()
