"""The host-memory KV tier manager (`jaxkv.host_tier`): exact scenarios and a random
state machine checked against a model after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.hashing import make_block_hash_with_group_id
from jaxkv.host_tier import HostKVTier
from jaxkv.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from jaxkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

FULL = FullAttentionSpec(4, 2, 8, "float32")
SWA = SlidingWindowSpec(4, 2, 8, "float32", sliding_window=6)
MAMBA = MambaSpec(4, shapes=((4, 8),), dtypes=("float32",))
B = 100  # block bytes


def key(i: int, group: int = 0) -> bytes:
    return make_block_hash_with_group_id(i.to_bytes(8, "big"), group)


def tier(blocks: int, policy: str = "lru", quotas=None, groups=(FULL,)) -> HostKVTier:
    return HostKVTier(B, blocks * B, policy, quotas, group_specs=list(groups))


def store(t: HostKVTier, ids, tenant=None, checksum=b"ok"):
    keys = [key(i) for i in ids]
    out = t.prepare_store(keys, tenant)
    assert out is not None
    t.complete_store(out.keys_to_store, True, [checksum] * len(out.keys_to_store))
    return out


def held(t: HostKVTier, ids) -> list[int]:
    return [i for i in ids if t.block_state(key(i)) == "ready"]


def test_lru_evicts_least_recently_touched_and_lookup_counts_the_prefix():
    t = tier(3)
    store(t, [1, 2, 3])
    assert t.lookup([key(1), key(2), key(3), key(4)]) == 3
    t.touch([key(1)])
    out = store(t, [4])
    assert out.evicted_keys == [key(2)]
    assert t.lookup([key(1), key(2), key(3)]) == 1
    assert held(t, [1, 2, 3, 4]) == [1, 3, 4]
    # touching a prefix leaves its first block most recent
    t.touch([key(3), key(4)])
    assert store(t, [5, 6]).evicted_keys == [key(1), key(4)]


def test_pinned_and_pending_blocks_are_never_evicted():
    t = tier(2)
    store(t, [1])
    assert t.prepare_load([key(1)]) == [0]
    pending = t.prepare_store([key(2)])
    assert pending is not None and pending.slots == [1]
    assert t.prepare_store([key(3)]) is None  # 1 is loading, 2 pending
    assert t.stats().store_refusals == 1
    assert t.complete_load([key(1)], [b"ok"]) == []
    assert t.prepare_store([key(3)]).evicted_keys == [key(1)]
    t.complete_store([key(2)], success=False)
    assert t.block_state(key(2)) is None and t.bytes_used == B


def test_arc_keeps_a_reused_set_through_a_scan_that_lru_loses():
    for policy, survivors in (("lru", []), ("arc", [1, 2])):
        t = tier(4, policy)
        store(t, [1, 2])
        t.touch([key(1), key(2)])  # reused: ARC moves them to its frequent list
        for i in range(10, 20):  # a one-pass scan
            store(t, [i])
        assert held(t, [1, 2]) == survivors, policy


def test_arc_ghost_hit_grows_the_recent_list_target():
    t = tier(2, "arc")
    store(t, [1, 2])
    store(t, [3])  # evicts 1 into ghost list B1
    store(t, [1])  # a ghost hit: back as frequent
    assert t.block_state(key(1)) == "ready"
    assert t._target_t1 >= 1


def test_quotas_isolate_tenants():
    t = tier(6, quotas={"a": 2 * B, "b": 2 * B})
    store(t, [1, 2], tenant="a")
    store(t, [3, 4], tenant="b")
    t.touch([key(3)])
    out = store(t, [5], tenant="b")  # over b's quota: evicts b's own LRU block, never a's
    assert out.evicted_keys == [key(4)]
    assert store(t, [6], tenant="b").evicted_keys == [key(3)]
    assert t.prepare_store([key(8), key(9), key(10)], "b") is None  # more than b's quota
    assert (t.max_store_blocks("b"), t.max_store_blocks(None), t.max_store_blocks("c")) == (2, 6, 6)
    assert held(t, [1, 2]) == [1, 2]
    s = t.stats()
    assert s.tenants["a"].bytes_used == 2 * B and s.tenants["b"].bytes_used == 2 * B
    assert s.tenants["b"].blocks_evicted == 2 and s.tenants["a"].blocks_evicted == 0
    store(t, [20, 21], tenant=None)  # no quota: only the budget
    assert t.tenant_bytes_used(None) == 2 * B and t.bytes_used == 6 * B


def test_the_default_quota_covers_unlisted_salts_and_not_unsalted_blocks():
    t = tier(8, quotas={"*": 1 * B, "a": 3 * B})
    assert [t.max_store_blocks(s) for s in ("a", "c", "*", None)] == [3, 1, 1, 8]
    store(t, [1], tenant="c")
    assert store(t, [2], tenant="c").evicted_keys == [key(1)]  # c's own block, capped at 1
    store(t, [3, 4, 5], tenant="a")
    store(t, [6, 7], tenant=None)
    s = t.stats()
    assert s.tenants["c"].quota_bytes == B and s.tenants["a"].quota_bytes == 3 * B
    assert "*" not in s.tenants and s.tenants[None].quota_bytes is None
    assert held(t, [2, 3, 4, 5, 6, 7]) == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"tenant_quota_bytes has the key ''"):
        tier(8, quotas={"": B})


def test_verified_hit_mismatch_is_dropped_counted_and_never_served():
    t = tier(4, quotas={"a": 4 * B})
    store(t, [1, 2], tenant="a", checksum=b"good")
    t.take_events()
    t.prepare_load([key(1), key(2)])
    t.prepare_load([key(1)])
    assert t.complete_load([key(1), key(2)], [b"bad", b"good"]) == [key(1)]
    assert t.block_state(key(1)) == "dropped" and t.lookup([key(1)]) == 0
    with pytest.raises(ValueError, match="dropped"):
        t.prepare_load([key(1)])
    assert t.complete_load([key(1)]) == []  # the last load: its slot is freed
    assert t.block_state(key(1)) is None and t.bytes_used == B
    s = t.stats()
    assert s.verify_mismatches == 1 and s.tenants["a"].verify_mismatches == 1
    assert t.take_events() == [BlockRemoved([key(1)[:-4]], medium="CPU", group_idx=0)]
    # a block stored without a checksum never passes verification
    t.prepare_store([key(3)])
    t.complete_store([key(3)])
    t.prepare_load([key(3)])
    assert t.complete_load([key(3)], [b"x"]) == [key(3)]


def test_events_carry_medium_cpu_and_reset_clears():
    t = tier(2, groups=(FULL, SWA))
    out = t.prepare_store([key(1), key(2, group=1)])
    t.complete_store(out.keys_to_store, True, [b"c", b"c"])
    store(t, [3])
    events = t.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert all(e.medium == "CPU" for e in events)
    assert events[1].group_idx == 1 and events[1].kv_cache_spec_kind == "sliding_window"
    assert events[1].kv_cache_spec_sliding_window == 6
    assert events[2].block_hashes == [key(1)[:-4]]
    t.prepare_load([key(3)])
    assert t.reset() is False and t.take_events() == []  # a load in flight
    t.complete_load([key(3)])
    assert t.reset() is True and t.bytes_used == 0 and t.lookup([key(3)]) == 0
    assert t.take_events() == [AllBlocksCleared()]


def test_sliding_window_stores_only_blocks_inside_the_window():
    t = tier(4, groups=(FULL, SWA))
    assert t.storable_block_range(0, 17) == range(0, 4)
    # window 6, block 4: the next token (position 17) attends to 12..17 -> block 3
    assert t.storable_block_range(1, 17) == range(3, 4)
    assert t.storable_block_range(1, 16) == range(2, 4)
    assert t.storable_block_range(1, 3) == range(0, 0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_bytes=0, capacity_bytes=100), ValueError, "block_bytes"),
        (dict(block_bytes=100, capacity_bytes=99), ValueError, "capacity_bytes"),
        (dict(block_bytes=100, capacity_bytes=-1), ValueError, "capacity_bytes"),
        (dict(block_bytes=100, capacity_bytes=200, policy="fifo"), ValueError, "policy"),
        (dict(block_bytes=1.5, capacity_bytes=200), TypeError, "block_bytes"),
        (
            dict(block_bytes=100, capacity_bytes=200, tenant_quota_bytes={"a": 300}),
            ValueError,
            r"tenant_quota_bytes\['a'\]",
        ),
        (
            dict(block_bytes=100, capacity_bytes=200, tenant_quota_bytes={"a": -5}),
            ValueError,
            "tenant_quota_bytes",
        ),
        (
            dict(
                block_bytes=100,
                capacity_bytes=200,
                group_specs=[FULL, MAMBA],
            ),
            ValueError,
            r"group_specs\[1\] is a 'mamba' group",
        ),
        (dict(block_bytes=100, capacity_bytes=200, group_specs=[]), ValueError, "group_specs"),
    ],
)
def test_bad_construction_is_refused_clearly(kwargs, error, match):
    kwargs.setdefault("group_specs", [FULL])
    with pytest.raises(error, match=match):
        HostKVTier(**kwargs)


def test_refused_calls_change_nothing():
    t = tier(2, groups=(FULL, SWA))
    store(t, [1])
    t.take_events()
    with pytest.raises(ValueError, match="groups 0..1"):
        t.prepare_store([key(2), key(3, group=2)])
    with pytest.raises(TypeError, match="keys"):
        t.lookup(key(1))
    with pytest.raises(ValueError, match="pinned by prepare_load"):
        t.complete_load([key(1)])
    with pytest.raises(ValueError, match="absent"):
        t.prepare_load([key(1), key(9)])
    with pytest.raises(ValueError, match="one entry per key"):
        t.complete_store([key(1)], True, [])
    with pytest.raises(TypeError, match="tenant"):
        t.prepare_store([key(2)], tenant=7)
    assert t.ref_count(key(1)) == 0 and t.bytes_used == B and t.take_events() == []
    assert held(t, [1, 2, 3]) == [1]


class HostTierMachine(RuleBasedStateMachine):
    """Random stores, loads, touches, verifications and resets against a model of what
    the tier holds; the invariants of `HostKVTier`'s docstring after every step."""

    SLOTS = 6
    QUOTAS = {"a": 2 * B, "b": 4 * B}
    TENANTS = (None, "a", "b")

    def __init__(self) -> None:
        super().__init__()
        self.tier: HostKVTier | None = None
        self.pins: dict[bytes, int] = {}  # loads in flight, per key
        self.pending: set[bytes] = set()
        self.tenant_of: dict[bytes, str | None] = {}
        self.removed_seen: set[bytes] = set()

    @rule(policy=st.sampled_from(["lru", "arc"]))
    @precondition(lambda self: self.tier is None)
    def build(self, policy: str) -> None:
        self.tier = tier(self.SLOTS, policy, self.QUOTAS, groups=(FULL, SWA))

    def _keys(self, ids, groups):
        return [key(i, g) for i, g in zip(ids, groups, strict=False)]

    @rule(
        ids=st.lists(st.integers(0, 12), min_size=1, max_size=4),
        groups=st.lists(st.integers(0, 1), min_size=4, max_size=4),
        tenant=st.sampled_from(TENANTS),
    )
    @precondition(lambda self: self.tier is not None)
    def prepare_store(self, ids, groups, tenant) -> None:
        keys = self._keys(ids, groups)
        before = {k: self.tier.block_state(k) for k in keys}
        out = self.tier.prepare_store(keys, tenant)
        if out is None:
            return
        for k in out.evicted_keys:
            assert self.pins.get(k, 0) == 0 and k not in self.pending and k not in keys
            self.tenant_of.pop(k)
        for k in out.keys_to_store:
            assert before[k] is None
            self.pending.add(k)
            self.tenant_of[k] = tenant
        assert len(set(out.slots)) == len(out.slots)

    @rule(data=st.data(), success=st.booleans(), good=st.booleans())
    @precondition(lambda self: self.tier is not None and self.pending)
    def complete_store(self, data, success, good) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        self.tier.complete_store(keys, success, [b"ok" if good else b"??"] * len(keys))
        for k in keys:
            self.pending.discard(k)
            if not success:
                self.tenant_of.pop(k)

    @rule(data=st.data())
    @precondition(lambda self: self.tier is not None and self.tenant_of)
    def lookup_and_load(self, data) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.tenant_of)), min_size=1))
        hits = self.tier.lookup(keys)
        assert all(self.tier.block_state(k) == "ready" for k in keys[:hits])
        assert hits == len(keys) or self.tier.block_state(keys[hits]) != "ready"
        self.tier.touch(keys[:hits])
        self.tier.prepare_load(keys[:hits])
        for k in keys[:hits]:
            self.pins[k] = self.pins.get(k, 0) + 1

    @rule(data=st.data(), verify=st.booleans())
    @precondition(lambda self: self.tier is not None and self.pins)
    def complete_load(self, data, verify) -> None:
        k = data.draw(st.sampled_from(sorted(self.pins)))
        rejected = self.tier.complete_load([k], [b"ok"] if verify else None)
        assert rejected == [] or verify
        self.pins[k] -= 1
        if not self.pins[k]:
            del self.pins[k]
            if self.tier.block_state(k) is None:
                self.tenant_of.pop(k)

    @rule()
    @precondition(lambda self: self.tier is not None)
    def reset(self) -> None:
        busy = bool(self.pins or self.pending)
        assert self.tier.reset() is not busy
        if not busy:
            self.tenant_of.clear()

    @rule()
    @precondition(lambda self: self.tier is not None)
    def drain_events(self) -> None:
        for event in self.tier.take_events():
            assert getattr(event, "medium", "CPU") == "CPU"

    @invariant()
    def matches_the_model(self) -> None:
        t = self.tier
        if t is None:
            return
        assert t.bytes_used == len(self.tenant_of) * B <= t.capacity_bytes
        for tenant in self.TENANTS:
            used = sum(1 for v in self.tenant_of.values() if v == tenant) * B
            assert t.tenant_bytes_used(tenant) == used
            assert used <= self.QUOTAS.get(tenant, t.capacity_bytes)
        for k in self.tenant_of:
            state = t.block_state(k)
            assert state == "pending" if k in self.pending else state in ("ready", "dropped")
            assert t.ref_count(k) == self.pins.get(k, 0)
            assert state != "dropped" or t.ref_count(k) > 0
        assert set(self.pins) <= set(self.tenant_of)

    def teardown(self) -> None:
        # Once every load and store completes nothing is left pinned or dropped.
        t = self.tier
        if t is None:
            return
        for k, n in list(self.pins.items()):
            t.complete_load([k] * n)
        t.complete_store(sorted(self.pending), True, [b"ok"] * len(self.pending))
        for k in self.tenant_of:
            assert t.ref_count(k) == 0 and t.block_state(k) in (None, "ready")
        assert t.reset() is True and t.bytes_used == 0


TestHostTier = HostTierMachine.TestCase
TestHostTier.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_combined_stats_sum_every_tier_and_tenant() -> None:
    from jaxkv.host_tier import HostTierStats, TenantStats, combined_stats

    a = HostTierStats(100, bytes_used=10, blocks_stored=2, tenants={
        "x": TenantStats(40, bytes_used=10, blocks_stored=2), None: TenantStats(None)})  # fmt: skip
    b = HostTierStats(100, bytes_used=5, blocks_evicted=1, verify_mismatches=1, tenants={
        "x": TenantStats(40, bytes_used=5, blocks_evicted=1)})  # fmt: skip
    total = combined_stats([a, b])
    assert (total.capacity_bytes, total.bytes_used, total.blocks_stored) == (200, 15, 2)
    assert (total.blocks_evicted, total.verify_mismatches) == (1, 1)
    assert total.tenants["x"] == TenantStats(80, bytes_used=15, blocks_stored=2, blocks_evicted=1)
    assert total.tenants[None] == TenantStats(None)
    assert a.tenants["x"].bytes_used == 10  # the inputs are unchanged
