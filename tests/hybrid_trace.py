"""Replays seeded random scheduling traces through jaxkv or vLLM 0.33 and logs every result.

Both sides run this same code: the decisions come from one seeded RNG and from
the results (a failed allocation changes what happens next), so two managers
that behave identically produce identical logs. Run as a script under the
peer environment it reads cases (JSON) on stdin and writes vLLM's logs on
stdout; it never imports JAX.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

VOCAB = 4


def _build_jaxkv(case: dict[str, Any]):
    import jaxkv

    specs = []
    for kind, block_size, param in case["groups"]:
        common = dict(num_kv_heads=1, head_size=4, dtype="float32")
        if kind == "full":
            specs.append(jaxkv.FullAttentionSpec(block_size, **common))
        elif kind == "sw":
            specs.append(jaxkv.SlidingWindowSpec(block_size, **common, sliding_window=param))
        elif kind == "rswa":
            specs.append(jaxkv.RSWASpec(block_size, **common, rswa_window=param))
        elif kind == "sink":
            specs.append(jaxkv.SinkFullAttentionSpec(block_size, **common, sink_len=param))
        elif kind == "circ":
            specs.append(jaxkv.CircularBufferSpec(block_size, **common))
        else:
            specs.append(
                jaxkv.ChunkedLocalAttentionSpec(block_size, **common, attention_chunk_size=param)
            )
    config = jaxkv.KVCacheConfig.from_groups(
        [(s, (f"l{i}",)) for i, s in enumerate(specs)],
        case["num_blocks"],
        case.get("retention"),
    )
    hash_fn = jaxkv.get_hash_fn_by_name("sha256_cbor")
    jaxkv.init_none_hash(hash_fn)
    manager = jaxkv.KVCacheManager(
        config, case["max_model_len"], use_eagle=case.get("use_eagle", False)
    )
    hasher = jaxkv.get_request_block_hasher(manager.hash_block_size, hash_fn)

    def make_request(rid: str, tokens: list[int]):
        return jaxkv.Request(rid, tokens, block_hasher=hasher)

    return manager, make_request


def _build_vllm(case: dict[str, Any]):
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    groups = []
    sizes = []
    cacheable_sizes = []
    for i, (kind, block_size, param) in enumerate(case["groups"]):
        common = dict(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32)
        if kind == "full":
            spec = FullAttentionSpec(**common)
        elif kind == "sw":
            spec = SlidingWindowSpec(**common, sliding_window=param)
        elif kind == "rswa":
            spec = RSWASpec(**common, rswa_window=param)
        elif kind == "sink":
            # vLLM 0.33's coordinator cannot build its SinkFullAttentionManager (its
            # __init__ refuses `needs_kv_cache_zeroing`: TypeError), which adds nothing
            # to FullAttentionManager but the sink_len check: run the group as the
            # full attention it is on the host side (the spec is still checked).
            assert SinkFullAttentionSpec(**common, sink_len=param).sink_len == param
            spec = FullAttentionSpec(**common)
        elif kind == "circ":
            spec = CircularBufferSpec(**common)
        else:
            spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=param)
        groups.append(KVCacheGroupSpec([f"l{i}"], spec))
        sizes.append(block_size)
        if spec.prefix_cacheable:
            cacheable_sizes.append(block_size)
    import math

    scheduler_block_size = math.lcm(*sizes)
    # vLLM's resolve_kv_cache_block_sizes: one group hashes at its block size, several
    # at the GCD of the prefix-cacheable groups' sizes.
    hash_block_size = sizes[0] if len(sizes) == 1 else math.gcd(*(cacheable_sizes or sizes))
    config = KVCacheConfig(
        num_blocks=case["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=case.get("retention"),
    )
    fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(fn)
    manager = KVCacheManager(
        config,
        max_model_len=case["max_model_len"],
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        enable_caching=True,
        use_eagle=case.get("use_eagle", False),
    )
    hasher = get_request_block_hasher(hash_block_size, fn)

    def make_request(rid: str, tokens: list[int]):
        return Request(rid, tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)

    return manager, make_request


def replay(backend: str, case: dict[str, Any]) -> list:
    """Run one case; the log holds every hit length and every block id returned or held."""
    manager, make_request = (_build_jaxkv if backend == "jaxkv" else _build_vllm)(case)
    rng = random.Random(case["seed"])
    max_len = case["max_model_len"]
    prefixes = [[rng.randrange(VOCAB) for _ in range(max_len)] for _ in range(3)]
    waiting: list = []
    running: list = []
    log: list = []
    counter = 0
    for _ in range(case["num_steps"]):
        action = rng.random()
        if action < 0.25 or not (waiting or running):
            counter += 1
            prefix = prefixes[rng.randrange(3)][: rng.randrange(max_len // 2 + 8)]
            tokens = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
            waiting.append(make_request(f"r{counter}", tokens[: max_len - 8]))
        elif action < 0.5 and waiting:
            req = waiting[0]
            blocks, num_hit, boundary = manager.get_computed_blocks(req)
            req.shared_prefix_boundary = boundary  # as vLLM's scheduler stores it
            log.append(
                (
                    "hit",
                    req.request_id,
                    num_hit,
                    boundary,
                    [list(g) for g in blocks.get_block_ids()],
                )
            )
            chunk = rng.randint(1, req.num_tokens - num_hit)
            new = manager.allocate_slots(req, chunk, num_hit, blocks)
            log.append(("admit", req.request_id, None if new is None else new.get_block_ids()))
            if new is not None:
                req.num_computed_tokens = num_hit + chunk
                running.append(waiting.pop(0))
        elif action < 0.85 and running:
            req = running[rng.randrange(len(running))]
            lookahead = 0
            if req.num_computed_tokens < req.num_tokens:
                n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            elif req.num_tokens < max_len - 1:
                req.append_output_token_ids(rng.randrange(VOCAB))
                n = 1
                lookahead = case.get("lookahead", 0)
            else:
                continue
            new = manager.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            log.append(("step", req.request_id, None if new is None else new.get_block_ids()))
            if new is not None:
                req.num_computed_tokens += n
            elif n == 1 and req.num_computed_tokens == req.num_tokens - 1:
                manager.free(req)  # preempt the decode that did not fit
                running.remove(req)
                log.append(("preempt", req.request_id))
        elif running:
            req = running.pop(rng.randrange(len(running)))
            manager.free(req)
            log.append(("finish", req.request_id))
        for req in running:
            held = manager.get_block_ids(req.request_id)
            log.append(("held", req.request_id, [list(g) for g in held]))
        log.append(("free", manager.block_pool.get_num_free_blocks()))
    return json.loads(json.dumps(log))


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    json.dump([replay("vllm", case) for case in cases], sys.stdout)
