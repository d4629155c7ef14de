"""The host-memory KV tier wired into the engine (`EngineConfig(kv_offloading_size=...)`).

A multi-turn chat whose working set is several times the device pool: the tokens with
the tier equal the tokens without it and the dense reference's, and the host tier
serves hits -- on a one-group model, on a Gemma-3-style model with sliding-window and
full-attention groups, and (8 simulated devices, in a subprocess) on that model over
two data ranks; a corrupt host entry or a simulated hash collision is caught by the
verification and its request recomputed, the others loaded;
`reset_prefix_cache` clears both tiers; bad settings and group kinds the tier does not
serve are refused clearly. Plus the device side: the block gather and the in-place
scatter.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import wait
from types import SimpleNamespace

import numpy as np
import pytest
from eight_devices import call_on_8_devices
from test_engine_correctness import BASE, text_model, text_reference

from jaxkv import models
from jaxkv.blocks import KVCacheBlock
from jaxkv.device import PagedKVCache
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.offload import (
    HostOffload,
    LoadBatch,
    PendingStore,
    block_digest,
    host_offloads,
)
from jaxkv.hashing import get_group_id, make_block_hash_with_group_id
from jaxkv.host_tier import HostKVTier
from jaxkv.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, build_events
from jaxkv.kv_events_publisher import EventPublisher
from jaxkv.testing.reference import DenseReference

# BASE: 23 usable blocks of 8 tokens. One conversation's history is up to 12 of them,
# six conversations' about 60: the pool holds about a third of the working set.
TIER = dataclasses.replace(BASE, kv_offloading_size=1 << 20)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
__all__ = ["text_model", "text_reference"]  # the fixtures, shared with the correctness tests


def chat(engine: LLMEngine, turns: int = 3, num_convs: int = 6, between=None, vocab=512):
    """`num_convs` conversations of `turns` turns (each turn: the history, the model's
    reply, a new user message; token ids below `vocab`); returns every turn's outputs.
    `between(turn)` runs before each turn after the first."""
    rng = np.random.default_rng(0)
    history = [rng.integers(3, vocab, 30).tolist() for _ in range(num_convs)]
    turns_out = []
    for turn in range(turns):
        if turn and between is not None:
            between(turn)
        outputs = engine.generate(history, GREEDY)
        turns_out.append(outputs)
        for h, o in zip(history, outputs, strict=True):
            h += o.output_token_ids + rng.integers(3, vocab, 5).tolist()
    return turns_out


def tokens(turns_out):
    return [[o.output_token_ids for o in outputs] for outputs in turns_out]


def assert_dense(reference: DenseReference, turns_out) -> None:
    for outputs in turns_out:
        for o in outputs:
            assert o.error is None, o.error
            assert o.output_token_ids == reference.expected(o.prompt_token_ids, o.output_token_ids)


def assert_nothing_held(engine: LLMEngine) -> None:
    for manager, offload in zip(engine.kv_cache_managers, engine.offloads, strict=True):
        assert manager.num_free_blocks == engine.config.num_blocks - 1
        tier = offload.tier
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
    # Some request waited for its load (admitted, computing nothing) through a step that
    # ran others.
    assert any(s.num_loading and s.num_scheduled_requests for s in engine.stats.steps)
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


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_store_at_eviction_multi_turn_tokens_equal_and_only_evicted_blocks_stored(
    text_model, text_reference, async_scheduling
):
    """`kv_offloading_store="evicted"`: a block goes to the host tier when the device pool
    evicts it for reuse, not when its request ends; tokens stay those without the tier
    and the dense reference's, and returning conversations are served from host memory."""
    base = dataclasses.replace(BASE, async_scheduling=async_scheduling)
    without = chat(LLMEngine(text_model, base))
    config = dataclasses.replace(TIER, async_scheduling=async_scheduling)
    engine = LLMEngine(text_model, dataclasses.replace(config, kv_offloading_store="evicted"))
    pool = engine.kv_cache_manager.block_pool
    assert pool.on_evict == engine.offload.blocks_evicted
    evicted = []  # per engine step: the keys the device pool evicted

    def on_evict(blocks, listener=pool.on_evict):
        evicted[-1].update(block.block_hash for block in blocks)
        listener(blocks)

    pool.on_evict = on_evict
    step = engine.step

    def counted_step():
        evicted.append(set())
        return step()

    engine.step = counted_step
    taken = []  # (engine step, the keys queued stores were taken for there)

    def take_stores(take=engine.offload.take_stores):
        out = take()
        taken.append((len(evicted) - 1, set(out.keys)))
        return out

    engine.offload.take_stores = take_stores
    # Each turn starts with every store landed: hits do not depend on copy timing.
    with_tier = chat(engine, between=lambda turn: engine.offload.complete_stores())
    engine.step()  # lands the last stores
    assert tokens(with_tier) == tokens(without)
    assert_dense(text_reference, with_tier)
    # Only evicted blocks reach the tier, each gathered in the step that evicted it
    # (before that step runs), and the tier's stored bytes grow only in steps where
    # the pool evicted.
    stored = set(_stored(engine))
    assert stored and stored <= set().union(*evicted)
    assert all(keys <= evicted[n] for n, keys in taken)
    assert set().union(*(keys for _, keys in taken)) >= stored
    stats = engine.stats.steps_since(engine.num_steps - len(evicted))
    grew = [n for n, s in enumerate(stats) if s.host_stored_bytes]
    assert grew and all(evicted[n] or evicted[n - 1] or evicted[n - 2] for n in grew)
    later = [o for outputs in with_tier[1:] for o in outputs]
    assert sum(o.num_host_cached_tokens for o in later) > 0
    assert engine.stats.total("host_hit_tokens") >= sum(o.num_host_cached_tokens for o in later)
    assert_nothing_held(engine)
    # Why "finished" is the default (EngineConfig): "evicted" serves fewer cached tokens
    # here (a block evicted for a request admitted earlier in a step is in neither tier
    # when a later one of that step is looked up).
    other = LLMEngine(text_model, config)
    finished = chat(other, between=lambda turn: other.offload.complete_stores())
    assert tokens(finished) == tokens(without)

    def cached(turns_out) -> int:
        return sum(o.num_cached_tokens for outputs in turns_out[1:] for o in outputs)

    assert cached(with_tier) < cached(finished)
    # A request ending stores nothing while the pool evicts nothing ("finished" does).
    for store, num_stored in (("evicted", 0), ("finished", 5)):
        fresh = LLMEngine(text_model, dataclasses.replace(config, kv_offloading_store=store))
        fresh.generate([list(range(3, 43))], GREEDY)
        fresh.offload.complete_stores()  # lands every gather
        assert fresh.offload.tier.stats().blocks_stored == num_stored


def test_corrupt_entry_and_hash_collision_fall_back_to_recompute_for_their_requests_only(
    text_model, text_reference
):
    engine = LLMEngine(text_model, TIER)
    tier = engine.offload.tier

    def corrupt(turn: int) -> None:
        engine.offload.complete_stores()
        # The device pool forgets everything: every returning conversation loads.
        assert engine.kv_cache_manager.reset_prefix_cache()
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
    assert tier.stats().verify_mismatches == 3  # each caught when loaded
    # A request whose load failed was recomputed, taking nothing from the host tier; the
    # others were served from it.
    failed = engine.stats.total("host_failed_loads")
    recomputed = [o for o in turns_out[1] if o.num_host_cached_tokens == 0]
    assert 1 <= len(recomputed) == failed <= 3
    assert all(o.num_cached_tokens == 0 for o in recomputed)
    assert all(o.num_host_cached_tokens == 32 for o in turns_out[1] if o not in recomputed)
    assert_nothing_held(engine)


class _Recorder(EventPublisher):
    """Keeps what the engine publishes, built."""

    def __init__(self) -> None:
        super().__init__()
        self.events = []

    def publish(self, events, ts=None, in_background=True) -> None:
        self.events += build_events(events)


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
        (
            {"kv_offloading_store": "computed"},
            ValueError,
            r"kv_offloading_store must be one of \('evicted', 'finished'\).*'computed'",
        ),
        (  # refused with the tier off too
            {"kv_offloading_size": None, "kv_offloading_store": "Evicted"},
            ValueError,
            "kv_offloading_store must be one of",
        ),
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
    for bad, match in (([0], "block id"), ([5, 5], "more than once"), ([257], "block id")):
        with pytest.raises(ValueError, match=match):
            paged.scatter_blocks_stacked(kv, bad, blocks[:, : len(bad)])
    with pytest.raises(ValueError, match="expected shape"):
        paged.scatter_blocks_stacked(kv, [5], blocks)
    with pytest.raises(ValueError, match="at most 64"):
        paged.gather_blocks_stacked(kv, list(range(1, 70)))
    # Chosen layers: block 5's layers 2 and 0, block 9's layer 1 (then padding, 3).
    layers = np.array([[2, 0], [1, 3]])
    two = rng.standard_normal((2, 2, *paged.shape[1:])).astype(np.float32)
    before = np.asarray(kv)
    kv = paged.scatter_blocks_stacked(kv, [5, 9], two, layers)
    after = np.asarray(kv)
    np.testing.assert_array_equal(after[2, 5], two[0, 0])
    np.testing.assert_array_equal(after[0, 5], two[1, 0])
    np.testing.assert_array_equal(after[1, 9], two[0, 1])
    untouched = np.ones(after.shape[:2], bool)
    untouched[[2, 0, 1], [5, 5, 9]] = False
    np.testing.assert_array_equal(after[untouched], before[untouched])  # the padding too
    out = np.asarray(paged.gather_blocks_stacked(kv, [5, 9], layers))
    assert out.shape == (2, 2, *paged.shape[1:])  # [m, the bucket of 2 ids, ...]
    expected = two.copy()
    expected[1, 1] = 0  # block 9's padding layer: dropped by the scatter, zeros when read
    np.testing.assert_array_equal(out[:, :2], expected)
    for bad in (np.array([[4, 0], [1, 3]]), np.array([[-1, 0], [1, 3]]), np.array([2, 0])):
        with pytest.raises(ValueError, match="layers must be"):
            paged.gather_blocks_stacked(kv, [5, 9], bad)


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


# Gemma-3-style: 3 sliding-window layers (window 8) and 1 full-attention layer, one
# KV-cache group each, blocks of 4 tokens. One conversation's history is up to 16 full
# blocks plus the windows' 3 x 2, six conversations' about 130: the pool's 45 usable
# blocks hold about a third of the working set.
HYBRID = EngineConfig(
    block_size=4, num_blocks=46, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=72
)
HYBRID_VOCAB = 256


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    models.save_random_checkpoint(path, models.tiny_configs()["gemma3-tiny"], seed=0)
    return models.load_model(path)


@pytest.mark.parametrize(
    ("async_scheduling", "store"), [(True, "finished"), (False, "finished"), (True, "evicted")]
)
def test_sliding_window_hybrid_multi_turn_tokens_equal_without_tier_and_dense(
    hybrid_model, async_scheduling, store
):
    config = dataclasses.replace(HYBRID, async_scheduling=async_scheduling)
    without = chat(LLMEngine(hybrid_model, config), vocab=HYBRID_VOCAB)
    engine = LLMEngine(
        hybrid_model,
        dataclasses.replace(config, kv_offloading_size=1 << 20, kv_offloading_store=store),
    )
    groups = engine.runner.kv_cache_config.kv_cache_groups
    windowed = [isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups]
    assert windowed == [True, True, True, False], "sliding-window and full-attention groups"
    with_tier = chat(engine, vocab=HYBRID_VOCAB)
    assert tokens(with_tier) == tokens(without)
    assert_dense(DenseReference(hybrid_model, HYBRID.max_model_len), with_tier)
    assert engine.num_preemptions > 0  # the small pool preempts
    # Every returning conversation loads its history's blocks from host memory.
    later = [o for outputs in with_tier[1:] for o in outputs]
    assert all(o.num_host_cached_tokens > 0 for o in later)
    assert engine.stats.total("host_hit_tokens") >= sum(o.num_host_cached_tokens for o in later)
    assert sum(o.num_cached_tokens for outputs in without[1:] for o in outputs) < sum(
        o.num_cached_tokens for o in later
    )
    # The tier holds every full block of the full-attention group, of a sliding-window
    # group only the 2 blocks of the window at each request's end (18 requests, plus
    # the preempted ones each time); a block is its group's one layer.
    held = Counter(get_group_id(k) for k in _stored(engine))
    bound = 2 * (18 + engine.num_preemptions)
    assert all(0 < held[g] <= bound < held[3] for g in range(3)), held
    assert engine.offload.block_bytes == 4 * 2 * 2 * 16 * 4  # tokens x (K, V) heads x size x f32
    assert_nothing_held(engine)


def dp_child(workdir: str) -> dict:
    """Runs under 8 devices: the hybrid multi-turn chat over 2 data ranks, tier off and
    on, with the dense reference's tokens and each rank's tier use."""
    from pathlib import Path

    import jax

    from jaxkv.device import make_mesh

    path = Path(workdir) / "gemma3"
    models.save_random_checkpoint(path, models.tiny_configs()["gemma3-tiny"], seed=0)
    mesh = make_mesh(2, 1, jax.devices()[:2])
    model = models.load_model(path, mesh=mesh)
    without = chat(LLMEngine(model, HYBRID, mesh=mesh), vocab=HYBRID_VOCAB)
    config = dataclasses.replace(HYBRID, kv_offloading_size=1 << 20)
    engine = LLMEngine(model, config, mesh=mesh)
    hits = [0] * len(engine.offloads)  # each rank's host hit tokens
    for rank, offload in enumerate(engine.offloads):

        def take_stats(take=offload.take_stats, rank=rank):
            stats = take()
            hits[rank] += stats["hit_tokens"]
            return stats

        offload.take_stats = take_stats
    with_tier = chat(engine, vocab=HYBRID_VOCAB)
    # Each conversation again, alone, after the device pools forgot everything: routing
    # sends it to the rank whose host tier holds it.
    for manager in engine.kv_cache_managers:
        assert manager.reset_prefix_cache()
    again = [
        engine.generate([o.prompt_token_ids + o.output_token_ids], GREEDY)[0] for o in with_tier[-1]
    ]
    reference = DenseReference(model, HYBRID.max_model_len)
    assert_nothing_held(engine)
    return {
        "ranks": len(engine.offloads),
        "without": tokens(without),
        "with": tokens(with_tier),
        "dense": [
            [reference.expected(o.prompt_token_ids, o.output_token_ids) for o in outputs]
            for outputs in with_tier
        ],
        "hits_per_rank": hits,
        "again": [o.num_host_cached_tokens for o in again],
        "again_dense": [
            o.output_token_ids == reference.expected(o.prompt_token_ids, o.output_token_ids)
            for o in again
        ],
        "stored_per_rank": [o.tier.stats().blocks_stored for o in engine.offloads],
    }


def test_sliding_window_hybrid_over_two_data_ranks(tmp_path):
    result = call_on_8_devices("test_engine_offload", "dp_child", tmp_path)
    assert result["ranks"] == 2
    assert result["with"] == result["without"] == result["dense"]
    # Each rank stores to and loads from its own tier.
    assert all(n > 0 for n in result["hits_per_rank"] + result["stored_per_rank"]), result
    assert all(n > 0 for n in result["again"]) and all(result["again_dense"]), result


def _runner_with(*specs) -> SimpleNamespace:
    """A runner that is also its KV-cache plan (`host_offloads(config, plan, runner)`)."""
    groups = [KVCacheGroupSpec((f"layer{i}",), spec) for i, spec in enumerate(specs)]
    return SimpleNamespace(
        groups=groups,
        layer_to_group=tuple(range(len(specs))),
        page_shape=(4, 4, 16),
        storage_dtype=np.dtype(np.float32),
        kv_cache=np.zeros((len(specs), 8, 4, 4, 16), np.float32),
        dp_size=1,
    )


FULL = FullAttentionSpec(4, 2, 16, "float32")


@pytest.mark.parametrize(
    ("other", "kind"),
    [
        (ChunkedLocalAttentionSpec(4, 2, 16, "float32", attention_chunk_size=8), "chunked_local"),
        (MambaSpec(4, shapes=((4, 8),), dtypes=("float32",)), "mamba"),
    ],
)
def test_group_kinds_the_tier_does_not_serve_are_refused_naming_them(other, kind):
    config = EngineConfig(kv_offloading_size=1 << 20)
    window = SlidingWindowSpec(4, 2, 16, "float32", sliding_window=8)
    runner = _runner_with(FULL, window)
    (offload,) = host_offloads(config, runner, runner)
    assert offload.buffer.shape[1:] == (1, 4, 4, 16)  # a block: its group's one layer
    match = rf"serves KV-cache groups of kinds .*full_attention.*sliding_window.*{kind}"
    with pytest.raises(ValueError, match=match):
        runner = _runner_with(FULL, other)
        host_offloads(config, runner, runner)


def test_a_kv_cache_on_other_processes_devices_is_refused():
    runner = _runner_with(FULL)
    runner.kv_cache = SimpleNamespace(is_fully_addressable=False)
    with pytest.raises(ValueError, match="spans devices of other processes"):
        host_offloads(EngineConfig(kv_offloading_size=1 << 20), runner, runner)


def _blocks(group: int, request, num_blocks: int, cached: range, first_id: int, nulls: int = 0):
    """A group's block list for `request`: `nulls` null blocks, then blocks with ids from
    `first_id`, those in `cached` keyed as the device pool keys them."""
    blocks = []
    for i in range(num_blocks):
        block = KVCacheBlock(0 if i < nulls else first_id + i)
        block.is_null = i < nulls
        if i in cached and not block.is_null:
            block.set_hash(request.block_hashes[i], group)
        blocks.append(block)
    return blocks


def test_a_hit_ends_where_every_group_serves_it_and_loads_each_groups_layers():
    from jaxkv.request import Request

    # Group 0: sliding window 8 (a hit ending at block e needs its blocks e-2 and e-1),
    # layer 0 of the stacked cache; group 1: full attention, layer 1. Blocks of 4 tokens.
    window = SlidingWindowSpec(4, 1, 1, "float32", sliding_window=8)
    tier = HostKVTier(16, 64 * 16, group_specs=[window, FullAttentionSpec(4, 1, 1, "float32")])
    offload = HostOffload(tier, [[0], [1]], (4, 1), np.dtype(np.float32), 4)

    def request(rid: str, num_tokens: int) -> Request:
        r = Request(rid, list(range(3, 3 + num_tokens)), SamplingParams())
        r.block_hashes = [bytes([i]) * 32 for i in range(num_tokens // 4)]
        return r

    def store(lists_of, device_cached=None) -> list[int]:
        """Free requests with these block lists, land their stores (each block's bytes
        its device id, gathered from its group's layer); the ids stored."""
        for r, lists in lists_of:
            offload.request_freed(r, lists, device_cached)
        ids, layers, keys, slots, digests = offload.take_stores()
        assert [list(row) for row in layers] == [[get_group_id(key)] for key in keys]
        device = np.zeros((len(ids), 1, 4, 1), np.float32)  # the group's layer, as gathered
        for n, block_id in enumerate(ids):
            device[n, 0] = block_id
        gathered = SimpleNamespace(ready=lambda: True, read=lambda: device)
        offload.pending_stores.append(PendingStore(keys, slots, digests, gathered, 0))
        offload.complete_stores()
        return sorted(ids)

    # Two requests of the same 11 blocks: one with 8 blocks cached in both groups (the
    # window's 6-7 stored), one with 10 in group 1 but 8 in group 0: the tier holds
    # group 1's blocks 0-9 and group 0's 6-7.
    a, b = request("a", 44), request("b", 44)
    stored = store(
        [
            (a, [_blocks(0, a, 11, range(8), 100, nulls=4), _blocks(1, a, 11, range(8), 200)]),
            (b, [_blocks(0, b, 11, range(8), 100, nulls=4), _blocks(1, b, 11, range(10), 200)]),
        ]
    )
    assert stored == [106, 107, *range(200, 210)]

    def staged() -> LoadBatch:
        """The loads, once every staging has finished."""
        wait([load.staging for load in offload.loading.values()])
        return offload.take_loads()

    # A returning request: group 1 could serve 10 blocks, group 0 a hit ending at 8. Its
    # blocks stay pinned while it loads.
    c = request("c", 60)
    assert offload.lookup(c, 0) == 32
    lists = [_blocks(0, c, 15, range(0), 300, nulls=6), _blocks(1, c, 15, range(0), 400)]
    assert offload.admitted(c, lists)
    pinned = [make_block_hash_with_group_id(c.block_hashes[i], 1) for i in range(8)]
    assert [tier.ref_count(k) for k in pinned] == [1] * 8
    loaded, failed, ids, blocks, layers = staged()
    assert loaded == ["c"] and failed == [] and not offload.loading
    assert [tier.ref_count(k) for k in pinned] == [0] * 8
    assert sorted(ids) == [306, 307, *range(400, 408)]
    for block_id, block, row in zip(ids, blocks, layers, strict=True):
        group = 0 if block_id < 400 else 1  # its source block's id was 200 lower
        assert (block == block_id - 200).all() and list(row) == [group]  # to its layer only
    assert offload.take_loads() == LoadBatch([], [], [], None, None)  # taken once

    # A corrupt window block: found, but its load fails verification; the block is
    # dropped, and then no hit has group 0's window, so nothing is served.
    key = make_block_hash_with_group_id(c.block_hashes[7], 0)
    offload.buffer[tier._entries[key].slot] += 1.0
    d = request("d", 60)
    assert offload.lookup(d, 0) == 32
    assert offload.admitted(d, lists)
    assert staged() == LoadBatch([], ["d"], [], None, None)
    assert offload.take_stats()["failed_loads"] == 1 and tier.block_state(key) is None
    assert offload.lookup(request("d2", 60), 0) == 0
    assert all(tier.ref_count(k) == 0 for k in tier._entries)

    # A request that cached 10 blocks but released group 0's block 8 (outside its
    # window): that block is taken from the device prefix cache, where it still is.
    e = request("e", 44)
    released = KVCacheBlock(150)
    released.set_hash(e.block_hashes[8], 0)
    in_device_cache = {released.block_hash: released}.get
    lists = [_blocks(0, e, 11, range(10), 100, nulls=9), _blocks(1, e, 11, range(10), 200)]
    assert store([(e, lists)], in_device_cache) == [109, 150]
    assert offload.lookup(request("f", 60), 0) == 40


def test_store_at_eviction_keeps_offered_blocks_digests_until_the_pool_evicts_them():
    from jaxkv.request import Request

    # As above: group 0 a sliding window of 8 (2 blocks), group 1 full attention.
    window = SlidingWindowSpec(4, 1, 1, "float32", sliding_window=8)
    tier = HostKVTier(16, 64 * 16, group_specs=[window, FullAttentionSpec(4, 1, 1, "float32")])
    offload = HostOffload(tier, [[0], [1]], (4, 1), np.dtype(np.float32), 4, store_at="evicted")
    r = Request("r", list(range(3, 47)), SamplingParams())
    r.block_hashes = [bytes([i]) * 32 for i in range(11)]
    lists = [_blocks(0, r, 11, range(8), 100, nulls=4), _blocks(1, r, 11, range(8), 200)]
    offload.request_freed(r, lists)
    assert offload.take_stores()[0] == []  # nothing is stored at request end
    # Offered: the window's blocks before the cached end (6, 7), every full-attention one.
    assert sorted(offload._candidates) == [106, 107, *range(200, 208)]
    stale = lists[1][3]  # re-keyed since it was offered: its digest is not its contents'
    stale.reset_hash()
    stale.set_hash(b"x" * 32, 1)
    # The pool evicts a window block outside the window (105), one inside (106), and
    # full-attention blocks 0-3: the offered ones holding the key they were offered under
    # are queued, with the digests taken when they were offered.
    offload.blocks_evicted([lists[0][5], lists[0][6], *lists[1][:4]])
    ids, _, keys, slots, digests = offload.take_stores()
    assert ids == [106, 200, 201, 202]
    assert digests == [block_digest(r, i, 4) for i in (6, 0, 1, 2)]
    assert keys == [lists[0][6].block_hash, *(b.block_hash for b in lists[1][:3])]
    assert sorted(offload._candidates) == [107, *range(204, 208)]  # evicted ones forgotten
    blocks = SimpleNamespace(ready=lambda: True, read=lambda: np.zeros((4, 1, 4, 1), np.float32))
    offload.pending_stores.append(PendingStore(keys, slots, digests, blocks, 0))
    offload.complete_stores()
    # Offered again and evicted again: the tier holds them already, nothing is queued.
    offload.request_freed(r, lists)
    offload.blocks_evicted(lists[1][:3])
    assert offload.take_stores()[0] == []
    assert offload.reset() and not offload._candidates
    with pytest.raises(ValueError, match="store_at must be one of"):
        HostOffload(tier, [[0], [1]], (4, 1), np.dtype(np.float32), 4, store_at="never")
