"""The host-memory KV tier wired into the engine (`EngineConfig(kv_offloading_size=...)`).

A multi-turn chat whose working set is several times the device pool: the tokens with
the tier equal the tokens without it and the dense reference's, and the host tier
serves hits; a corrupt host entry or a simulated hash collision is caught by the
verification and recomputed; aborting a request right after its load leaks nothing;
`reset_prefix_cache` clears both tiers; bad settings are refused clearly. Plus the
device side: the block gather and the in-place scatter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_engine_correctness import BASE, text_model, text_reference

from jaxkv.device import PagedKVCache
from jaxkv.engine import LLMEngine, SamplingParams
from jaxkv.engine.offload import block_digest
from jaxkv.kv_cache_interface import FullAttentionSpec
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from jaxkv.testing.reference import DenseReference

# BASE: 23 usable blocks of 8 tokens. One conversation's history is up to 12 of them,
# six conversations' about 60: the pool holds about a third of the working set.
TIER = dataclasses.replace(BASE, kv_offloading_size=1 << 20)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
__all__ = ["text_model", "text_reference"]  # the fixtures, shared with the correctness tests


def chat(engine: LLMEngine, turns: int = 3, num_convs: int = 6, between=None):
    """`num_convs` conversations of `turns` turns (each turn: the history, the model's
    reply, a new user message); returns every turn's outputs. `between(turn)` runs
    before each turn after the first."""
    rng = np.random.default_rng(0)
    history = [rng.integers(3, 512, 30).tolist() for _ in range(num_convs)]
    turns_out = []
    for turn in range(turns):
        if turn and between is not None:
            between(turn)
        outputs = engine.generate(history, GREEDY)
        turns_out.append(outputs)
        for h, o in zip(history, outputs, strict=True):
            h += o.output_token_ids + rng.integers(3, 512, 5).tolist()
    return turns_out


def tokens(turns_out):
    return [[o.output_token_ids for o in outputs] for outputs in turns_out]


def assert_dense(reference: DenseReference, turns_out) -> None:
    for outputs in turns_out:
        for o in outputs:
            assert o.error is None, o.error
            assert o.output_token_ids == reference.expected(o.prompt_token_ids, o.output_token_ids)


def assert_nothing_held(engine: LLMEngine) -> None:
    assert engine.kv_cache_manager.num_free_blocks == engine.config.num_blocks - 1
    tier = engine.offload.tier
    assert all(tier.ref_count(k) == 0 for k in tier._entries)  # no pin left behind


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_multi_turn_tokens_equal_without_tier_and_dense_with_host_hits(
    text_model, text_reference, async_scheduling
):
    without = chat(
        LLMEngine(text_model, dataclasses.replace(BASE, async_scheduling=async_scheduling))
    )
    engine = LLMEngine(text_model, dataclasses.replace(TIER, async_scheduling=async_scheduling))
    with_tier = chat(engine)
    assert tokens(with_tier) == tokens(without)
    assert_dense(text_reference, with_tier)
    later = [o for outputs in with_tier[1:] for o in outputs]
    # Most of each returning conversation comes back from host memory.
    assert (
        sum(o.num_host_cached_tokens for o in later)
        > sum(len(o.prompt_token_ids) for o in later) / 2
    )
    assert all(o.num_cached_tokens >= o.num_host_cached_tokens for o in later)
    assert all(o.num_host_cached_tokens % BASE.block_size == 0 for o in later)
    summary = engine.stats.summary()
    assert summary["host_hit_tokens"] >= sum(o.num_host_cached_tokens for o in later)
    assert summary["host_loaded_bytes"] > 0 and summary["host_stored_bytes"] > 0
    assert 0.5 < engine.stats.host_hit_rate <= 1
    assert sum(o.num_cached_tokens for outputs in without[1:] for o in outputs) < sum(
        o.num_cached_tokens for o in later
    )
    assert_nothing_held(engine)


def _stored(engine: LLMEngine) -> list[bytes]:
    return [
        k for k in engine.offload.tier._entries if engine.offload.tier.block_state(k) == "ready"
    ]


def test_corrupt_entry_and_hash_collision_are_recomputed_not_served(text_model, text_reference):
    engine = LLMEngine(text_model, TIER)
    tier = engine.offload.tier

    def corrupt(turn: int) -> None:
        keys = _stored(engine)
        # Flip one KV value of a stored block, in host memory.
        engine.offload.buffer[tier._entries[keys[0]].slot].flat[7] += 1.0
        # Two stored blocks swap places, each with the checksum of what it now holds:
        # as if block A's hash had collided with block B's (A's key, B's content).
        a, b = tier._entries[keys[3]], tier._entries[keys[10]]
        a.slot, b.slot = b.slot, a.slot
        a.checksum, b.checksum = b.checksum, a.checksum

    turns_out = chat(engine, turns=2, between=corrupt)
    assert_dense(text_reference, turns_out)
    stats = tier.stats()
    assert stats.verify_mismatches >= 2
    assert engine.stats.total("host_failed_loads") >= 2
    assert engine.stats.total("host_hit_tokens") > 0  # the sound blocks still served
    assert_nothing_held(engine)


def test_abort_right_after_a_load_and_preemption_leak_nothing(text_model, text_reference):
    engine = LLMEngine(text_model, TIER)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, 62).tolist() for _ in range(4)]
    first = engine.generate(prompts, GREEDY)
    assert engine.stats.total("num_preemptions") > 0  # the small pool preempts
    engine.step()  # lands the last stores
    # Each returning prompt loads from host memory; abort two after their first step.
    ids = [
        engine.add_request(p + o.output_token_ids + [5, 6, 7], sampling=GREEDY)
        for p, o in zip(prompts, first, strict=True)
    ]
    engine.step()
    assert engine.stats.steps[-1].host_hit_tokens > 0
    for rid in ids[:2]:
        engine.abort(rid)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[r].finish_reason for r in ids] == ["abort", "abort", "length", "length"]
    assert_dense(text_reference, [[first[i] for i in range(4)], [done[r] for r in ids[2:]]])
    assert_nothing_held(engine)


class _Recorder:
    def __init__(self) -> None:
        self.events = []

    def publish(self, events) -> None:
        self.events += events

    def shutdown(self) -> None:
        pass


def test_reset_prefix_cache_clears_both_tiers_with_cpu_events(text_model, text_reference):
    engine = LLMEngine(text_model, TIER)
    recorder = _Recorder()
    engine.kv_event_publishers = [recorder]
    chat(engine, turns=1)
    engine.step()  # lands the stores
    stored = [e for e in recorder.events if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "CPU" for e in stored)
    assert engine.offload.tier.bytes_used > 0
    assert engine.reset_prefix_cache()
    assert engine.offload.tier.bytes_used == 0
    assert recorder.events[-1] == AllBlocksCleared()
    # After the reset nothing is served from either tier, and tokens stay right.
    outputs = chat(engine, turns=1)
    assert all(o.num_cached_tokens == 0 for o in outputs[0])
    assert_dense(text_reference, outputs)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"kv_offloading_size": 100}, ValueError, "at least one block"),
        ({"kv_offloading_size": -1}, ValueError, "at least one block"),
        ({"kv_offloading_size": 2.5e6}, TypeError, "must be an int"),
        ({"kv_offloading_size": True}, TypeError, "must be an int"),
        ({"kv_offloading_policy": "fifo"}, ValueError, "policy must be one of"),
        ({"kv_offloading_tenant_quotas": {"a": 1 << 21}}, ValueError, r"quota_bytes\['a'\]"),
        ({"kv_offloading_tenant_quotas": {"a": 10}}, ValueError, r"quota_bytes\['a'\]"),
        ({"kv_offloading_tenant_quotas": [1]}, TypeError, "must map cache_salt"),
    ],
)
def test_bad_settings_are_refused_clearly(text_model, changes, error, match):
    with pytest.raises(error, match=match):
        LLMEngine(text_model, dataclasses.replace(TIER, **changes))


def test_device_gather_and_in_place_scatter_round_trip():
    paged = PagedKVCache(FullAttentionSpec(4, 2, 8, "float32"), 256)
    kv = paged.allocate_stacked(3)
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((3, 3, *paged.shape[1:])).astype(np.float32)
    kv = paged.scatter_blocks_stacked(kv, [5, 9, 2], blocks)
    out = np.asarray(paged.gather_blocks_stacked(kv, [9, 2, 5, 7]))
    np.testing.assert_array_equal(out[:, :3], blocks[:, [1, 2, 0]])
    assert not out[:, 3:].any()  # block 7 was never written; bucket padding reads zeros
    assert np.asarray(kv)[:, [0, 1, 3, 4, 6, 8]].sum() == 0  # nothing else written
    for bad, match in (([0], "block id"), ([5, 5], "more than once"), ([256], "block id")):
        with pytest.raises(ValueError, match=match):
            paged.scatter_blocks_stacked(kv, bad, blocks[:, : len(bad)])
    with pytest.raises(ValueError, match="expected shape"):
        paged.scatter_blocks_stacked(kv, [5], blocks)
    with pytest.raises(ValueError, match="at most 64"):
        paged.gather_blocks_stacked(kv, list(range(1, 70)))


def test_block_digest_commits_to_tokens_and_salt():
    from jaxkv.request import Request

    a = Request("a", list(range(16)), SamplingParams())
    b = Request("b", list(range(16)), SamplingParams(), cache_salt="t")
    c = Request("c", [*range(8), 9, 9, 9, 9, 9, 9, 9, 9], SamplingParams())
    assert block_digest(a, 0, 8) != block_digest(b, 0, 8)  # the salt keys block 0
    assert block_digest(a, 1, 8) == block_digest(b, 1, 8)
    assert block_digest(a, 1, 8) != block_digest(c, 1, 8)


def test_tenant_quota_caps_a_salts_host_bytes_and_spares_the_others(text_model, text_reference):
    block_bytes = 2 * 8 * 4 * 32 * 4  # layers x tokens x (K, V) heads x head size x f32
    engine = LLMEngine(
        text_model, dataclasses.replace(TIER, kv_offloading_tenant_quotas={"a": 3 * block_bytes})
    )
    assert engine.offload.block_bytes == block_bytes
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, 40).tolist() for _ in range(4)]
    plain = engine.generate(prompts[:2], GREEDY)
    salted = []
    for prompt in prompts[2:]:  # one after the other: the second evicts the first
        salted += engine.generate([prompt], GREEDY, cache_salt="a")
        engine.step()  # lands its stores
    tier = engine.offload.tier
    assert tier.tenant_bytes_used("a") == 3 * block_bytes  # capped, its own LRU evicted
    assert tier.tenant_bytes_used(None) == 2 * (40 // 8) * block_bytes  # untouched
    assert tier.stats().tenants["a"].blocks_evicted > 0
    assert_dense(text_reference, [plain, salted])


def test_tier_events_without_an_endpoint(text_model, text_reference):
    """`enable_kv_cache_events` keeps both tiers' events for `take_kv_events` with no
    endpoint; without it nothing is kept (the host tier's events do not pile up)."""
    engine = LLMEngine(text_model, dataclasses.replace(TIER, enable_kv_cache_events=True))
    assert engine.kv_event_publishers == []
    chat(engine, turns=1)
    engine.step()  # lands the stores
    events = engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    assert engine.take_kv_events() == []  # taken
    assert engine.reset_prefix_cache()
    cleared = engine.take_kv_events()
    assert cleared == [AllBlocksCleared(), AllBlocksCleared()]  # the pool's, the tier's
    # A host-tier eviction shows up as a CPU BlockRemoved: a tier of three blocks.
    small = dataclasses.replace(
        TIER, enable_kv_cache_events=True, kv_offloading_size=3 * engine.offload.block_bytes
    )
    engine = LLMEngine(text_model, small)
    chat(engine, turns=1)
    engine.step()
    removed = [e for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
    assert any(e.medium == "CPU" for e in removed)
    with pytest.raises(ValueError, match="data_rank"):
        engine.take_kv_events(1)
    off = LLMEngine(text_model, TIER)
    chat(off, turns=1)
    off.step()
    assert off.offload.tier._events == []  # drained each step, not kept
    with pytest.raises(ValueError, match="enable_kv_cache_events=True"):
        off.take_kv_events()


def test_device_tenant_cap_and_per_tenant_stats_of_both_tiers(text_model, text_reference):
    block_bytes = 2 * 8 * 4 * 32 * 4
    config = dataclasses.replace(
        TIER,
        device_tenant_block_quotas={"a": 3},
        kv_offloading_tenant_quotas={"a": 6 * block_bytes},
        enable_kv_cache_events=True,
    )
    engine = LLMEngine(text_model, config)
    pool = engine.kv_cache_manager.block_pool
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, 40).tolist() for _ in range(4)]
    plain = engine.generate(prompts[:1], GREEDY)
    salted = []
    for prompt in prompts[1:3]:
        salted += engine.generate([prompt], GREEDY, cache_salt="a")
        assert pool.tenant_cached_blocks()["a"] <= 3
    salted += engine.generate(prompts[3:], GREEDY, cache_salt="b")
    engine.step()  # lands the stores
    again = engine.generate(prompts[:1], GREEDY)  # "a"'s cap evicted nothing of it
    assert again[0].num_cached_tokens == 32  # all a hit can take: the last token is computed
    assert_dense(text_reference, [plain, salted, again])
    tenants = engine.stats.tenants()
    a, b, none = tenants["a"], tenants["b"], tenants[None]
    assert a.device_cached_blocks == 3 and a.device_block_quota == 3
    assert b.device_cached_blocks == 40 // 8 and b.device_block_quota is None
    assert none.device_cached_blocks is None  # unsalted blocks are not counted
    tier = engine.offload.tier
    # The host tier holds what the device cached of each of "a"'s prompts: 3 blocks each.
    assert a.host.bytes_used == tier.tenant_bytes_used("a") == 6 * block_bytes
    assert a.host.quota_bytes == 6 * block_bytes and a.host.blocks_stored == 6
    assert b.host.bytes_used == 40 // 8 * block_bytes and b.host.quota_bytes is None
    assert a.prefix.requests == 2 and none.prefix.requests == 2
    assert none.prefix.cached_tokens == 32 and none.prefix.host_cached_tokens == 0
    # "a"'s first prompt comes back from the host tier (its device blocks were evicted
    # for its second prompt): host-served tokens are counted for the salt.
    back = engine.generate(prompts[1:2], GREEDY, cache_salt="a")
    assert back[0].num_cached_tokens == back[0].num_host_cached_tokens == 24
    assert engine.stats.tenants()["a"].prefix.host_cached_tokens == 24
    assert_dense(text_reference, [back])
    assert_nothing_held(engine)
    # Off: nothing counted, the host figures stay.
    off = LLMEngine(text_model, TIER)
    off.generate(prompts[:1], GREEDY, cache_salt="a")
    assert off.stats.tenants()["a"].device_cached_blocks is None
    assert off.stats.tenants()["a"].host is not None


@pytest.mark.parametrize(
    ("quotas", "error", "match"),
    [
        ({"a": -1}, ValueError, r"device_tenant_block_quotas\['a'\] must be >= 0"),
        ({"a": "3"}, TypeError, r"device_tenant_block_quotas\['a'\] must be an integer"),
        ({None: 3}, TypeError, "device_tenant_block_quotas key"),
        (3, TypeError, "device_tenant_block_quotas must map cache_salt"),
    ],
)
def test_bad_device_tenant_block_quotas_are_refused_clearly(text_model, quotas, error, match):
    with pytest.raises(error, match=match):
        LLMEngine(text_model, dataclasses.replace(BASE, device_tenant_block_quotas=quotas))
