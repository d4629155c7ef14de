"""Replays seeded random scheduling traces through jaxkv or vLLM and logs every result.

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
        elif kind == "mamba":
            specs.append(
                jaxkv.MambaSpec(
                    block_size,
                    shapes=((2, 4),),
                    dtypes=("float32",),
                    mamba_cache_mode="align",
                    num_prefill_checkpoint_blocks=1 if case.get("checkpoint_alignment") else 0,
                    prefill_checkpoint_alignment=case.get("checkpoint_alignment"),
                )
            )
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
        config,
        case["max_model_len"],
        hash_block_size=case.get("hash_block_size"),
        use_eagle=case.get("use_eagle", False),
        enable_mamba_shared_prefix_checkpoint=case.get("shared_prefix_checkpoint", False),
        enable_kv_cache_events=case.get("events", False),
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
        MambaSpec,
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
        elif kind == "mamba":
            spec = MambaSpec(
                block_size=block_size,
                shapes=((2, 4),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1 if case.get("checkpoint_alignment") else 0,
                prefill_checkpoint_alignment=case.get("checkpoint_alignment"),
            )
        elif kind == "sw":
            spec = SlidingWindowSpec(**common, sliding_window=param)
        elif kind == "rswa":
            spec = RSWASpec(**common, rswa_window=param)
        elif kind == "sink":
            # vLLM's coordinator cannot build its SinkFullAttentionManager (its
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
    hash_block_size = case.get("hash_block_size") or (
        sizes[0] if len(sizes) == 1 else math.gcd(*(cacheable_sizes or sizes))
    )
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
        enable_mamba_shared_prefix_checkpoint=case.get("shared_prefix_checkpoint", False),
        enable_kv_cache_events=case.get("events", False),
    )
    hasher = get_request_block_hasher(hash_block_size, fn)

    def make_request(rid: str, tokens: list[int]):
        return Request(rid, tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher)

    return manager, make_request


def _new_ids(new) -> list | None:
    """The ids of newly allocated blocks per group (vLLM also lists a Mamba table's null
    padding among them, jaxkv does not: the null block is left out)."""
    if new is None:
        return None
    return [[i for i in group if i != 0] for group in new.get_block_ids()]


def _checkpoint_position(num_tokens: int, unit: int, eagle: bool) -> int:
    """vLLM's `get_mamba_prefill_checkpoint_position` (no hash lookahead)."""
    position = (num_tokens if eagle else num_tokens - 1) // unit * unit
    return max(position - unit if eagle else position, 0)


def _checkpoint_valid(start: int, end: int, position: int, unit: int, block: int, align) -> bool:
    """vLLM's `is_mamba_prefill_checkpoint_valid`."""
    if not align:
        return False
    return (
        start % unit == 0
        and -(-end // block) - 2 > (start - 1) // block
        and start + unit <= position
        and start < position < end
        and (position - start) % align == 0
    )


def _chunk(rng: random.Random, case: dict[str, Any], req, start: int) -> int:
    """A prefill chunk from `start`: a random length, clipped with a Mamba "align" group as
    vLLM's scheduler clips it (`Scheduler._mamba_block_aligned_split`: states are
    written at chunk ends, so chunks end on Mamba block boundaries, at the prompt's
    partial tail, at a shared-prefix junction; a backend that exports checkpoints lets
    the last chunk run through). 0: the request is not scheduled this step."""
    n = rng.randint(1, req.num_tokens - start)
    bs = case.get("mamba_block_size")
    prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
    if not bs or start >= prefill_end:
        return n
    unit = case["hash_block_size"]
    eagle = case.get("use_eagle", False)
    partial = unit < bs
    end = start + n
    last_cache_position = _checkpoint_position(req.num_tokens, bs, eagle)
    position = _checkpoint_position(prefill_end, unit if partial else bs, eagle)
    internal = end >= prefill_end and _checkpoint_valid(
        start, end, position, unit, bs, case.get("checkpoint_alignment")
    )
    if internal:
        last_cache_position = 0
    if end < prefill_end:
        end = end // bs * bs
    tail = 0
    if partial and not internal:
        tail = _checkpoint_position(req.num_prompt_tokens, unit, eagle)
    junction = getattr(req, "shared_prefix_boundary", 0) or 0
    if case.get("shared_prefix_checkpoint") and junction <= req.num_prompt_tokens:
        junction_stop = junction
    else:
        junction_stop = start + (junction - start) // bs * bs
    stops = (
        # vLLM lets a chunk exporting a checkpoint run on from inside a block, then keys
        # that block's state (the state at the chunk's start) at the block's end, a stale
        # state jaxkv does not cache (docs/vllm-differences.md). The traces stop there,
        # as a token budget may.
        (start // bs + 1) * bs if start % bs else 0,
        last_cache_position,
        tail if last_cache_position < tail < req.num_prompt_tokens else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((p for p in stops if start < p < end), default=end)
    return max(end - start, 0)


def _evicted_ids(rng: random.Random, case: dict[str, Any], manager, running: list) -> set[int]:
    """Block ids a KV connector hands `evict_blocks` after a failed load: a running request's
    blocks from some token on (the failed block and every later one, as vLLM's
    `_update_requests_with_invalid_blocks` collects them) in one group or in all, or a few
    ids anywhere in the pool (held, free and cached, or never cached). Never the null block
    (jaxkv refuses its id)."""
    if running and rng.random() < 0.75:
        req = running[rng.randrange(len(running))]
        tables = manager.get_block_ids(req.request_id)
        start = rng.randrange(max(req.num_computed_tokens, 1))
        group = rng.randrange(-1, len(tables))  # -1: every group
        ids = {
            block_id
            for i, (_, block_size, _) in enumerate(case["groups"])
            if group in (-1, i)
            for block_id in tables[i][start // block_size :]
        }
    else:
        ids = {rng.randrange(1, case["num_blocks"]) for _ in range(rng.randint(1, 4))}
    ids.discard(0)
    return ids


def _events(manager) -> list:
    """The KV events queued since the last call, in order, as plain values (hashes in hex:
    vLLM must run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    out: list = []
    for event in manager.take_events():
        name = type(event).__name__
        hashes = [bytes(h).hex() for h in getattr(event, "block_hashes", ())]
        if name == "BlockStored":
            if not hashes:
                # vLLM reports a caching step whose blocks were all masked out (sparse
                # hits, retention) with no hashes; jaxkv reports none (as later vLLM does,
                # docs/vllm-differences.md): not compared.
                continue
            parent = event.parent_block_hash
            out.append(
                (
                    name,
                    hashes,
                    None if parent is None else bytes(parent).hex(),
                    list(event.token_ids),
                    event.block_size,
                    event.group_idx,
                    event.lora_id,
                    event.medium,
                    # vLLM lists None per block where no block has extra keys,
                    # jaxkv gives None (docs/vllm-differences.md): compared as equal.
                    event.extra_keys
                    if any(k is not None for k in event.extra_keys or ())
                    else None,
                    event.kv_cache_spec_kind,
                    event.kv_cache_spec_sliding_window,
                )
            )
        elif name == "BlockRemoved":
            out.append((name, hashes, event.group_idx, event.medium))
        else:
            out.append((name,))
    return out


class _Tier:
    """A host tier (`jaxkv.host_tier.HostKVTier`, host-only, runs beside either backend)
    in front of one full-attention group of `block_size`: a freed request's computed
    blocks are stored by their keys, an admission's blocks after the device hit looked
    up; the hits become `num_external_computed_tokens` (whole blocks, the last token
    left to compute), as `jaxkv.engine.offload.HostOffload.lookup` computes them."""

    def __init__(self, block_size: int) -> None:
        from jaxkv.host_tier import HostKVTier
        from jaxkv.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size, 1, 4, "float32")
        self.tier = HostKVTier(1, 12, "lru", group_specs=[spec])  # 12 one-byte blocks
        self.block_size = block_size

    def _keys(self, req, first: int, last: int) -> list:
        from jaxkv.hashing import make_block_hash_with_group_id

        return [make_block_hash_with_group_id(bytes(h), 0) for h in req.block_hashes[first:last]]

    def store(self, req) -> None:
        out = self.tier.prepare_store(
            self._keys(req, 0, req.num_computed_tokens // self.block_size)
        )
        if out is not None:
            self.tier.complete_store(out.keys_to_store)

    def lookup_tokens(self, req, num_hit: int) -> int:
        bs = self.block_size
        first, last = num_hit // bs, (req.num_tokens - 1) // bs
        if num_hit % bs or first >= last:
            return 0
        return self.tier.lookup(self._keys(req, first, last)) * bs


def replay(backend: str, case: dict[str, Any]) -> list:
    """Run one case; the log holds every hit length, every block id returned or held, the
    copies, and after each step the free queue (in eviction order) and the cached blocks.
    With `case["evict"]` a step may first drop blocks from the prefix cache
    (`evict_blocks`, `_evicted_ids`); with `case["events"]` each step also logs its KV
    events in order."""
    manager, make_request = (_build_jaxkv if backend == "jaxkv" else _build_vllm)(case)
    tier = _Tier(case["groups"][0][1]) if case.get("host_tier") else None
    rng = random.Random(case["seed"])
    max_len = case["max_model_len"]
    prefixes = [[rng.randrange(VOCAB) for _ in range(max_len)] for _ in range(3)]
    waiting: list = []
    running: list = []
    log: list = []
    counter = 0
    steps = case.get("report_steps", False)
    for _ in range(case["num_steps"]):
        if steps:
            manager.new_step_starts()
        if case.get("evict") and rng.random() < 0.15:
            ids = _evicted_ids(rng, case, manager, running)
            manager.evict_blocks(ids)
            log.append(("evict", sorted(ids)))
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
            # Tokens after the hit whose KV a connector supplies (`external` cases only).
            external = 0
            if case.get("external") and rng.random() < 0.6:
                external = rng.randrange(req.num_tokens - num_hit)
            elif tier is not None:
                external = tier.lookup_tokens(req, num_hit)
            chunk = _chunk(rng, case, req, num_hit + external)
            if chunk == 0:
                continue  # not admitted this step
            new = manager.allocate_slots(req, chunk, num_hit, blocks, 0, external)
            log.append(("admit", req.request_id, external, _new_ids(new)))
            if new is not None:
                req.num_computed_tokens = num_hit + external + chunk
                running.append(waiting.pop(0))
        elif action < 0.85 and running:
            req = running[rng.randrange(len(running))]
            lookahead = 0
            if req.num_computed_tokens < req.num_tokens:
                n = _chunk(rng, case, req, req.num_computed_tokens)
                if n == 0:
                    continue
            elif req.num_tokens < max_len - 1:
                req.append_output_token_ids(rng.randrange(VOCAB))
                n = 1
                lookahead = case.get("lookahead", 0)
            else:
                continue
            new = manager.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            log.append(("step", req.request_id, _new_ids(new)))
            if new is not None:
                req.num_computed_tokens += n
            elif n == 1 and req.num_computed_tokens == req.num_tokens - 1:
                if tier is not None:
                    tier.store(req)
                manager.free(req)  # preempt the decode that did not fit
                running.remove(req)
                log.append(("preempt", req.request_id))
        elif running:
            req = running.pop(rng.randrange(len(running)))
            if tier is not None:
                tier.store(req)
            manager.free(req)
            log.append(("finish", req.request_id))
        if steps:  # a synchronous engine: the copies run with the step, then release
            copies, retained = manager.take_kv_cache_block_copies()
            if copies:
                log.append(("copies", [list(c) for c in copies]))
            manager.block_pool.free_blocks(retained)
        for req in running:
            held = manager.get_block_ids(req.request_id)
            log.append(("held", req.request_id, [list(g) for g in held]))
        pool = manager.block_pool  # its free queue in eviction order, and what is cached
        log.append(
            (
                "free",
                pool.get_num_free_blocks(),
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                sorted(b.block_id for b in pool.blocks if b.block_hash is not None),
            )
        )
        if case.get("events"):
            log.append(("events", _events(manager)))
    return json.loads(json.dumps(log))


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    json.dump([replay("vllm", case) for case in cases], sys.stdout)
