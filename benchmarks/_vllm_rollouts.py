"""vLLM 0.33's side of bench_rollouts: its `n` fan-out through its own host scheduler.

    .venv-vllm/bin/python benchmarks/_vllm_rollouts.py SPECS_JSON

Runs under the peer environment (vLLM, torch, no JAX, no model). SPECS_JSON: a file of a list of
{"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
"groups": [[layers, sliding_window or null], ...] (the KV-cache groups of the jaxkv
engine's model, in its order), "cases": [{"n", "prompt_len", "max_tokens", "seed"}]}.

Per case, a fresh `vllm.v1.core.sched.scheduler.Scheduler` (prefix caching and chunked
prefill on, synchronous scheduling) over a `KVCacheConfig` of those groups; one parent
request fanned out as `LLMEngine.add_request` does (`ParentRequest.get_child_info`, the
children added to the scheduler one after another before any step); then steps: each
`schedule()`, the blocks held sampled (the pool's blocks less the free ones and the
null block), a fake model samples one token for every request whose prompt is done
(none for a partial prefill, as vLLM's runner discards it), `update_from_output`.
The prompt is random tokens from the case's seed; `ignore_eos` with `max_tokens`.

Prints one JSON line: vLLM's version and ("runs"), per spec and case, the prompt tokens
computed (scheduled tokens less the decode tokens fed back: generated less one per
sample), the most blocks held, each child's prefix-hit tokens and the step it was
first scheduled in.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from copy import copy
from pathlib import Path

import numpy as np
import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

VOCAB = 256  # the fake model's tokens; the scheduler never reads them (ignore_eos)
# The scheduler reads only its limits from the model config: a local config.json of a
# small Llama stands in for a model (vLLM reads no weights for it).
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
}  # fmt: skip


def make_scheduler(spec: dict, model_dir: str) -> Scheduler:
    """vLLM's scheduler over a pool of `spec`'s KV-cache groups (no model behind it)."""
    block = spec["block_size"]
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32",
        max_model_len=spec["max_model_len"],
    )  # fmt: skip
    scheduler = SchedulerConfig(
        max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"], enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=False,
    )  # fmt: skip
    cache = CacheConfig(block_size=block, enable_prefix_caching=True)
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"), model_config=model,
        scheduler_config=scheduler, cache_config=cache,
    )  # fmt: skip
    groups = []
    for index, (layers, window) in enumerate(spec["groups"]):
        shape = {"block_size": block, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
        kind = FullAttentionSpec(**shape) if window is None else SlidingWindowSpec(
            **shape, sliding_window=window
        )  # fmt: skip
        groups.append(KVCacheGroupSpec([f"group{index}.layer{i}" for i in range(layers)], kind))
    kv_config = KVCacheConfig(num_blocks=spec["num_blocks"], kv_cache_tensors=[],
                              kv_cache_groups=groups)  # fmt: skip
    cache.num_gpu_blocks = spec["num_blocks"]
    return Scheduler(
        vllm_config=config, kv_cache_config=kv_config, block_size=block, log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )  # fmt: skip


def children(case: dict, block_size: int) -> list[Request]:
    """The parent's `n` children, made as vLLM's `LLMEngine.add_request` makes them."""
    prompt = np.random.default_rng(case["seed"]).integers(3, VOCAB, case["prompt_len"]).tolist()
    params = SamplingParams(
        n=case["n"], temperature=1.0, seed=case["seed"], max_tokens=case["max_tokens"],
        ignore_eos=True,
    )  # fmt: skip
    parent = EngineCoreRequest(
        request_id="rollout", prompt_token_ids=prompt, mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
        data_parallel_rank=None, external_req_id="rollout",
    )  # fmt: skip
    fan_out = ParentRequest(parent)
    hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256"))
    made = []
    for index in range(case["n"]):
        child_id, child_params = fan_out.get_child_info(index)
        child = copy(parent)
        child.request_id, child.sampling_params = child_id, child_params
        made.append(Request.from_engine_core_request(child, hasher))
    return made


def fake_model(scheduler_output, requests: dict[str, Request]) -> ModelRunnerOutput:
    """One token for each scheduled request past its prompt; none for a partial prefill."""
    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        request = requests[request_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([request.num_tokens * 7919 % VOCAB] if done else [])
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
    )  # fmt: skip


def run_case(spec: dict, case: dict, model_dir: str) -> dict:
    scheduler = make_scheduler(spec, model_dir)
    pool = scheduler.kv_cache_manager.block_pool
    requests = {child.request_id: child for child in children(case, spec["block_size"])}
    for child in requests.values():  # one after another, before any step (vLLM's order)
        scheduler.add_request(child)
    first_step: dict[str, int] = {}
    hits: dict[str, int] = {}  # at its first step: computed (hits + scheduled) less scheduled
    scheduled = held = steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps += 1
        for request_id, count in out.num_scheduled_tokens.items():
            if request_id not in first_step:
                first_step[request_id] = steps
                hits[request_id] = requests[request_id].num_computed_tokens - count
        scheduled += out.total_num_scheduled_tokens
        held = max(held, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        scheduler.update_from_output(out, fake_model(out, requests))
    generated = sum(r.num_output_tokens for r in requests.values())
    assert generated == case["n"] * case["max_tokens"], generated
    return {
        **case,
        "prompt_computed": scheduled - (generated - case["n"]),
        "blocks_held": held,
        "steps": steps,
        "hit_tokens": [hits[r] for r in requests],
        "first_step": [first_step[r] for r in requests],
    }


def run_spec(spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as model_dir:
        config = dict(MODEL_CONFIG, max_position_embeddings=spec["max_model_len"])
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        return [run_case(spec, case, model_dir) for case in spec["cases"]]


def main() -> None:
    init_none_hash(get_hash_fn_by_name("sha256"))
    runs = [run_spec(spec) for spec in json.loads(Path(sys.argv[1]).read_text())]
    print(json.dumps({"vllm": vllm.__version__, "runs": runs}))


if __name__ == "__main__":
    main()
