"""Replay random scheduling traces through jaxkv and vLLM in lockstep.

Run under the vLLM peer environment with the repository on PYTHONPATH:

    .venv-vllm/bin/python tests/vllm_differential_driver.py TRACES.json RESULTS.json

Each trace (made by `tests/test_vllm_differential.py`) names a pool and a list of
operations: admit a request (prefix hits, chunked prefill, lookahead; empty or
real salts, LoRA, multimodal keys), run a step (chunked prefill or decode with
speculative tokens and lookahead; a request that gets no blocks is preempted),
finish, reset the prefix cache. After every operation the two implementations'
answers (returned block ids, hit lengths, each request's blocks), free-queue
order, ref counts and KV events must be equal; the first difference ends the
trace and is reported. jaxkv's side never imports JAX.
"""

from __future__ import annotations

import json
import sys
from typing import Any


class Side:
    """One implementation behind the calls the traces make."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.requests: dict[str, Any] = {}
        bs, num_blocks = config["block_size"], config["num_blocks"]
        if name == "jaxkv":
            import jaxkv

            self.lib = jaxkv
            fn = jaxkv.get_hash_fn_by_name(config["hash_fn"])
            jaxkv.init_none_hash(fn)
            self.hasher = jaxkv.get_request_block_hasher(bs, fn)
            self.manager = jaxkv.KVCacheManager(
                jaxkv.KVCacheConfig.single_group(jaxkv.FullAttentionSpec(bs), num_blocks),
                config["max_model_len"],
                bs,
                bs,
                enable_kv_cache_events=True,
            )
        else:
            import torch
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            from vllm.v1.kv_cache_interface import (
                FullAttentionSpec,
                KVCacheConfig,
                KVCacheGroupSpec,
            )

            fn = get_hash_fn_by_name(config["hash_fn"])
            init_none_hash(fn)
            self.hasher = get_request_block_hasher(bs, fn)
            spec = FullAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32
            )
            kv_config = KVCacheConfig(
                num_blocks=num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
            )
            self.manager = KVCacheManager(
                kv_config, config["max_model_len"], bs, bs, enable_kv_cache_events=True
            )

    def make_request(self, spec: dict[str, Any]) -> Any:
        features, lora = [], None
        if self.name == "jaxkv":
            lib = self.lib
            for ident, offset, length in spec["mm"]:
                features.append(lib.MultiModalFeatureSpec(ident, offset, length))
            if spec["lora"]:
                lora = lib.LoRARequest(*spec["lora"])
            params = lib.SamplingParams(max_tokens=spec["max_tokens"])
            request_cls = lib.Request
        else:
            from vllm.lora.request import LoRARequest
            from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
            from vllm.sampling_params import SamplingParams
            from vllm.v1.request import Request as request_cls

            for ident, offset, length in spec["mm"]:
                features.append(
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=ident,
                        mm_position=PlaceholderRange(offset=offset, length=length),
                    )
                )
            if spec["lora"]:
                lora = LoRARequest(*spec["lora"])
            params = SamplingParams(max_tokens=spec["max_tokens"])
        request = request_cls(
            spec["id"],
            list(spec["prompt"]),
            params,
            None,
            mm_features=features or None,
            lora_request=lora,
            cache_salt=spec["salt"],
            block_hasher=self.hasher,
        )
        self.requests[spec["id"]] = request
        return request

    def observe(self) -> dict[str, Any]:
        pool = self.manager.block_pool
        events = []
        for event in self.manager.take_events():
            kind = type(event).__name__
            item: dict[str, Any] = {"kind": kind}
            if kind in ("BlockStored", "BlockRemoved"):
                item["hashes"] = [bytes(h).hex() for h in event.block_hashes]
            if kind == "BlockStored":
                parent = event.parent_block_hash
                item.update(
                    parent=None if parent is None else bytes(parent).hex(),
                    tokens=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=event.lora_id,
                )
            events.append(item)
        return {
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref_cnt": [b.ref_cnt for b in pool.blocks],
            "held": {rid: self.manager.get_block_ids(rid)[0] for rid in sorted(self.requests)},
            "events": events,
        }


def ids(blocks: Any) -> list[int] | None:
    return None if blocks is None else list(blocks.get_block_ids()[0])


def run_trace(trace: dict[str, Any], side_cls: type[Side] = Side) -> dict[str, Any]:
    """Replay `trace` through both sides (`side_cls`: what each observes after an op)."""
    config = trace["config"]
    sides = [side_cls("jaxkv", config), side_cls("vllm", config)]
    # Scheduler state, identical for both sides while their answers agree.
    waiting: list[str] = []
    running: list[str] = []
    max_tokens: dict[str, int] = {}
    chunk = config["chunk"]

    def step_both(call) -> list[Any]:
        return [call(side) for side in sides]

    for index, op in enumerate(trace["ops"]):
        kind = op["op"]
        answers: list[Any]
        if kind == "add":
            for side in sides:
                side.make_request(op["request"])
            waiting.append(op["request"]["id"])
            max_tokens[op["request"]["id"]] = op["request"]["max_tokens"]
            answers = [None, None]
        elif kind == "admit":
            if not waiting:
                continue
            rid = waiting[0]
            lookahead = op["lookahead"]

            def admit(side, rid=rid, lookahead=lookahead, token=op["token"]):
                request = side.requests[rid]
                hits, num_hits = side.manager.get_computed_blocks(request)[:2]
                num_new = min(request.num_tokens - num_hits, chunk)
                new = side.manager.allocate_slots(request, num_new, num_hits, hits, lookahead)
                if new is not None:
                    request.num_computed_tokens = num_hits + num_new
                    if request.num_computed_tokens == request.num_tokens:
                        request.append_output_token_ids(token)
                return num_hits, ids(hits), ids(new)

            answers = step_both(admit)
            if answers[0] == answers[1] and answers[0][2] is not None:
                waiting.pop(0)
                running.append(rid)
        elif kind == "step":
            if not running:
                continue
            rid = running[op["which"] % len(running)]
            spec, accepted, lookahead = op["spec"], op["accepted"], op["lookahead"]

            def step(
                side, rid=rid, spec=spec, accepted=accepted, lookahead=lookahead, token=op["token"]
            ):
                request = side.requests[rid]
                remaining = request.num_tokens - request.num_computed_tokens
                if remaining > 1:  # chunked prefill
                    num_new = min(remaining, chunk)
                    new = side.manager.allocate_slots(request, num_new, 0, None, lookahead)
                    if new is not None:
                        request.num_computed_tokens += num_new
                        if request.num_computed_tokens == request.num_tokens:
                            request.append_output_token_ids(token)
                    return "prefill", ids(new)
                num_new = 1 + spec
                if request.num_computed_tokens + num_new + lookahead > config["max_model_len"]:
                    return "full", None
                new = side.manager.allocate_slots(request, num_new, 0, None, lookahead)
                if new is not None:
                    tokens = [(token + i) % 50 for i in range(1 + min(accepted, spec))]
                    request.num_computed_tokens += len(tokens)
                    request.append_output_token_ids(tokens)
                return "decode", ids(new)

            answers = step_both(step)
            if answers[0] == answers[1]:
                request = sides[0].requests[rid]
                if answers[0][1] is None and answers[0][0] != "full":  # preempt it
                    for side in sides:
                        side.manager.free(side.requests[rid])
                        side.requests[rid].num_computed_tokens = 0
                        side.requests[rid].num_preemptions += 1
                    running.remove(rid)
                    waiting.insert(0, rid)
                elif answers[0][0] == "full" or request.num_output_tokens >= max_tokens[rid]:
                    for side in sides:
                        side.manager.free(side.requests[rid])
                    running.remove(rid)
        elif kind == "finish":
            if not running:
                continue
            rid = running.pop(op["which"] % len(running))
            answers = step_both(lambda side, rid=rid: side.manager.free(side.requests[rid]))
        elif kind == "reset":
            answers = step_both(lambda side: side.manager.reset_prefix_cache())
        else:
            raise ValueError(f"unknown op {kind!r}")
        observed = [side.observe() for side in sides]
        if answers[0] != answers[1] or observed[0] != observed[1]:
            return {
                "ok": False,
                "op_index": index,
                "op": op,
                "answers": {"jaxkv": answers[0], "vllm": answers[1]},
                "observed": {"jaxkv": observed[0], "vllm": observed[1]},
            }
    return {"ok": True, "ops": len(trace["ops"])}


def main() -> None:
    traces = json.loads(open(sys.argv[1]).read())
    results = [run_trace(trace) for trace in traces]
    with open(sys.argv[2], "w") as out:
        json.dump(results, out, default=repr)
    assert "jax" not in sys.modules, "import jaxkv must not import JAX"


if __name__ == "__main__":
    main()
