"""Random add / schedule step / abort / reset / evict sequences.

A hypothesis state machine drives a `KVCacheManager` through the engine's scheduler
(`jaxkv.engine.scheduler`: admission with prefix-cache lookups, chunked prefill, decode
with lookahead slots, preemption when the pool runs out, finishing at `max_tokens`) over
a small pool with prompts from a tiny vocabulary (so prefixes collide and blocks are
shared, cached, evicted and re-hit) and checks the pool's invariants after every step.
Every lookup the scheduler makes is checked against a reference model.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from stateful_depth import quick_and_deep

from jaxkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    KVCacheManager,
    Request,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
)
from jaxkv.engine.scheduler import Scheduler, SchedulerConfig
from jaxkv.hashing import get_block_hash, get_group_id, make_block_hash_with_group_id

MAX_MODEL_LEN = 24
BASE_PREFIXES = ([0, 1, 2, 3] * 5, [1, 1, 0, 0] * 5, [2, 3, 2, 3, 0] * 4)


def _snapshot(manager: KVCacheManager):
    pool = manager.block_pool
    stm = manager.coordinator.single_type_managers[0]
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        pool.get_num_free_blocks(),
        [b.block_hash for b in pool.blocks],
        sorted((k, [b.block_id for b in v]) for k, v in pool.cached_block_hash_to_block.items()),
        {rid: [b.block_id for b in blocks] for rid, blocks in stm.req_to_blocks.items()},
        dict(stm.num_cached_block),
    )


class KVCacheMachine(RuleBasedStateMachine):
    caps: dict[str, int] | None = None  # the pool's tenant_block_quotas

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.scheduler: Scheduler | None = None
        self.unfinished: dict[str, Request] = {}  # added, not finished or aborted
        self.next_id = 0
        # Expected prefix-cache stats: [requests, queries, hits], fresh and preempted.
        self.stats = {False: [0, 0, 0], True: [0, 0, 0]}
        # Blocks whose hashes `evict_blocks` dropped while a request held them: they
        # stay unhashed until freed (the holder never re-caches a cached index).
        self.unhashed_held: set[int] = set()
        # A KV-aware router's view of the cache, rebuilt from the drained KV events
        # alone: how many blocks hold each (hash, group).
        self.router_view: Counter[tuple[bytes, int]] = Counter()
        # The device side's view of page contents: pages never written or reported in a
        # step's `freed_block_ids` since (zeroed there) are clean. Every page a request
        # gets other than by a prefix-cache hit must be clean before the step writes.
        self.clean_pages: set[int] = set()
        self.seen_blocks: dict[str, int] = {}  # request id -> blocks already checked
        self.hit_blocks: dict[str, set[int]] = {}

    @initialize(
        block_size=st.integers(2, 4),
        num_blocks=st.integers(8, 24),
        hash_name=st.sampled_from(["sha256", "sha256_cbor", "xxhash"]),
        enable_caching=st.sampled_from([True, True, True, False]),
        max_num_seqs=st.integers(1, 4),
        token_budget=st.integers(2, 24),
        chunk_cap=st.sampled_from([0, 0, 1, 3, 12]),
        lookahead=st.integers(0, 3),
    )
    def setup(
        self, block_size: int, num_blocks: int, hash_name: str, enable_caching: bool,
        max_num_seqs: int, token_budget: int, chunk_cap: int, lookahead: int,
    ) -> None:  # fmt: skip
        fn = get_hash_fn_by_name(hash_name)
        init_none_hash(fn, "stateful")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hasher = get_request_block_hasher(block_size, fn)
        self.manager = KVCacheManager.from_spec(
            FullAttentionSpec(block_size),
            num_blocks,
            MAX_MODEL_LEN,
            log_stats=True,
            enable_kv_cache_events=True,
            track_freed_block_ids=True,
            enable_caching=enable_caching,
            tenant_block_quotas=self.caps,
        )
        self.enable_caching = enable_caching
        self.clean_pages = set(range(1, num_blocks))
        self.lookup = self.manager.get_computed_blocks
        self.manager.get_computed_blocks = self._checked_lookup  # the scheduler's lookups
        config = SchedulerConfig(
            max_num_seqs, token_budget, MAX_MODEL_LEN, chunk_cap, num_lookahead_tokens=lookahead
        )
        self.scheduler = Scheduler(self.manager, config)

    # -- helpers -----------------------------------------------------------

    @property
    def running(self) -> dict[str, Request]:
        return {r.request_id: r for r in self.scheduler.running}

    def _checked_lookup(self, req: Request):
        """The manager's lookup, checked: it changes nothing and finds the longest hit."""
        assert req.num_computed_tokens == 0
        before = _snapshot(self.manager)
        expected = self._expected_hit(req)
        blocks, num_hit, boundary = self.lookup(req)
        assert _snapshot(self.manager) == before  # lookups change nothing
        assert num_hit == expected
        if self.enable_caching:  # with caching off there are no lookups to count
            counts = self.stats[req.num_preemptions > 0]
            counts[0] += 1
            counts[1] += req.num_tokens
            counts[2] += num_hit
        assert num_hit % self.block_size == 0 and num_hit <= req.num_tokens - 1
        hit_blocks = blocks.blocks[0]
        assert len(hit_blocks) == num_hit // self.block_size
        for i, block in enumerate(hit_blocks):
            assert block.block_hash == make_block_hash_with_group_id(req.block_hashes[i], 0)
        self.hit_blocks[req.request_id] = {b.block_id for b in hit_blocks}
        event(f"lookup: {'hit' if num_hit else 'miss'}{' (preempted)' * (req.num_preemptions > 0)}")
        return blocks, num_hit, boundary

    def _expected_hit(self, req: Request) -> int:
        """Reference model: longest run of cached hashes, at most num_tokens - 1 tokens."""
        cache_map = self.manager.block_pool.cached_block_hash_to_block
        num = 0
        for block_hash in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            if cache_map.get_one_block(block_hash, 0) is None:
                break
            num += 1
        return num * self.block_size

    # -- rules -------------------------------------------------------------

    @precondition(lambda self: self.manager is not None and len(self.unfinished) < 8)
    @rule(
        base=st.integers(0, len(BASE_PREFIXES) - 1),
        prefix_len=st.integers(0, 14),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from([None, None, None, "tenant"]),
        max_tokens=st.integers(1, 8),
    )
    def add_request(self, base: int, prefix_len: int, suffix: list[int], salt, max_tokens) -> None:
        tokens = BASE_PREFIXES[base][:prefix_len] + suffix
        if not tokens:
            tokens = [0]
        req = Request(
            f"r{self.next_id}", tokens, cache_salt=salt, block_hasher=self.hasher,
            max_tokens=max_tokens,
        )  # fmt: skip
        self.next_id += 1
        self.scheduler.add_request(req)
        self.unfinished[req.request_id] = req

    @precondition(lambda self: self.unfinished)
    @rule(tokens=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def schedule_step(self, tokens: list[int]) -> None:
        """One step: admission with prefix hits, chunked prefill, decode, preemption;
        then the model's sampled tokens (which may finish requests)."""
        out = self.scheduler.schedule()
        assert out.num_scheduled_tokens <= self.scheduler.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.scheduler.config.max_num_seqs
        freed = out.freed_block_ids
        assert freed.dtype.name == "int32" and list(freed) == sorted(set(freed.tolist()))
        assert 0 not in freed
        self.clean_pages.update(freed.tolist())
        # A block reported freed lost every holder: if it is held again (a preemption
        # freed it and this very step handed it out fresh), its new holder may cache it.
        self.unhashed_held.difference_update(freed.tolist())
        if out.preempted_request_ids:
            event("step: preempted")
        running = self.running
        for s in out.scheduled:
            assert s.request.request_id in running
            assert s.num_computed_tokens + s.num_new_tokens == s.request.num_computed_tokens
        updates = self.scheduler.update_from_output(out, tokens)
        for request_id, reason in updates.finish_reasons.items():
            event(f"finished: {reason}")
            del self.unfinished[request_id]

    @precondition(lambda self: self.unfinished)
    @rule(idx=st.integers(0, 100))
    def abort(self, idx: int) -> None:
        request_id = list(self.unfinished)[idx % len(self.unfinished)]
        self.scheduler.abort_request(request_id)
        del self.unfinished[request_id]
        with pytest.raises(KeyError, match=request_id):
            self.scheduler.abort_request(request_id)

    @precondition(lambda self: self.manager is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        before = _snapshot(self.manager)
        ok = self.manager.reset_prefix_cache()
        assert ok == (not self.running)
        event(f"reset: {ok}")
        if ok:
            assert all(b.block_hash is None for b in self.manager.block_pool.blocks)
            assert len(self.manager.block_pool.cached_block_hash_to_block) == 0
        else:
            assert _snapshot(self.manager) == before

    @precondition(lambda self: self.manager is not None)
    @rule(block_ids=st.lists(st.integers(-1, 25), max_size=4))
    def evict_blocks(self, block_ids: list[int]) -> None:
        """Drop blocks from the prefix cache, free or held; bad ids change nothing."""
        pool = self.manager.block_pool
        before = _snapshot(self.manager)
        if not all(1 <= i < self.num_blocks for i in block_ids):
            with pytest.raises(ValueError, match="out of range"):
                pool.evict_blocks(block_ids)
            assert _snapshot(self.manager) == before
            return
        blocks = [pool.blocks[i] for i in block_ids]
        self.unhashed_held.update(
            b.block_id for b in blocks if b.ref_cnt > 0 and b.block_hash is not None
        )
        pool.evict_blocks(block_ids)
        assert all(b.block_hash is None for b in blocks)
        # Nothing but hashes changed: ownership and the free queue stay as they were.
        after = _snapshot(self.manager)
        assert after[:3] == before[:3] and after[5] == before[5]
        event(f"evict: {len(self.unhashed_held)} held blocks unhashed")

    @precondition(lambda self: self.manager is not None)
    @rule()
    def free_unknown(self) -> None:
        before = _snapshot(self.manager)
        self.manager.free(Request("never-scheduled", [0]))
        assert _snapshot(self.manager) == before

    # -- invariants ----------------------------------------------------------

    @invariant()
    def queues_consistent(self) -> None:
        """Every unfinished request is waiting (computing nothing, holding nothing) xor
        running; finished and aborted requests are gone."""
        if self.manager is None:
            return
        waiting = [r.request_id for r in self.scheduler.waiting]
        running = [r.request_id for r in self.scheduler.running]
        assert len(set(waiting)) == len(waiting) and len(set(running)) == len(running)
        assert not set(waiting) & set(running)
        assert set(waiting) | set(running) == set(self.unfinished)
        assert all(r.num_computed_tokens == 0 for r in self.scheduler.waiting)
        assert len(running) <= self.scheduler.config.max_num_seqs

    @invariant()
    def pool_consistent(self) -> None:
        if self.manager is None:
            return
        pool = self.manager.block_pool
        stm = self.manager.coordinator.single_type_managers[0]
        free_blocks = pool.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free_blocks]
        assert len(free_ids) == len(set(free_ids))
        free_set = set(free_ids)
        assert set(stm.req_to_blocks) == set(self.running)

        holders = [0] * self.num_blocks
        for rid, blocks in stm.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
            assert 0 not in ids
            for block_id in ids:
                holders[block_id] += 1

        null = pool.null_block
        assert null.block_id == 0 and null.is_null and null.ref_cnt == 0
        assert null.block_hash is None and 0 not in free_set
        for block in pool.blocks[1:]:
            # Free xor referenced; ref count = number of running holders.
            assert (block.ref_cnt == 0) == (block.block_id in free_set)
            assert block.ref_cnt == holders[block.block_id]

        num_free = pool.get_num_free_blocks()
        assert num_free == len(free_blocks) == self.manager.num_free_blocks
        assert num_free == sum(1 for b in pool.blocks if b.ref_cnt == 0) - 1
        assert self.manager.usage == 1 - num_free / (self.num_blocks - 1)

        # Hash map consistent both ways.
        cache_map = pool.cached_block_hash_to_block
        mapped = set()
        for key, blocks in cache_map.items():
            assert blocks
            for block in blocks:
                assert block.block_hash == key
                mapped.add(block.block_id)
        hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert mapped == hashed
        assert cache_map.num_blocks() == len(hashed)

        # Per request: hashes match the request's own chain; full computed blocks
        # are cached; nothing past them is (lookahead and partial blocks never are).
        bs = self.block_size
        self.unhashed_held = {i for i in self.unhashed_held if pool.blocks[i].ref_cnt > 0}
        for rid, req in self.running.items():
            blocks = stm.req_to_blocks[rid]
            assert len(blocks) >= math.ceil(req.num_computed_tokens / bs)
            assert len(blocks) <= math.ceil(MAX_MODEL_LEN / bs)
            num_cached = req.num_computed_tokens // bs if self.enable_caching else 0
            assert stm.num_cached_block.get(rid, 0) == num_cached
            capped = self.caps is not None and req.cache_salt in self.caps
            for i, block in enumerate(blocks):
                if i < num_cached and block.block_id in self.unhashed_held:
                    assert block.block_hash is None
                elif i < num_cached and capped and block.block_hash is None:
                    continue  # its salt was at its cap, every cached block held
                elif i < num_cached:
                    expected = make_block_hash_with_group_id(req.block_hashes[i], 0)
                    assert block.block_hash == expected
                else:
                    assert block.block_hash is None

        if not self.running:
            assert num_free == self.num_blocks - 1

    @invariant()
    def events_mirror_cache(self) -> None:
        """Replaying the KV events reproduces exactly the blocks the pool has cached."""
        if self.manager is None:
            return
        for ev in self.manager.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.router_view.clear()
            elif isinstance(ev, BlockStored):
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                self.router_view.update((h, ev.group_idx) for h in ev.block_hashes)
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    assert self.router_view[(h, ev.group_idx)] > 0, "removed a hash never stored"
                    self.router_view[(h, ev.group_idx)] -= 1
        cached = Counter(
            (get_block_hash(key), get_group_id(key))
            for key, blocks in self.manager.block_pool.cached_block_hash_to_block.items()
            for _ in blocks
        )
        assert +self.router_view == cached

    @invariant()
    def reused_pages_were_reported(self) -> None:
        """No request gets a page holding someone else's KV without it being reported."""
        if self.manager is None:
            return
        stm = self.manager.coordinator.single_type_managers[0]
        for rid in list(self.seen_blocks):
            if rid not in self.running:
                del self.seen_blocks[rid]
                self.hit_blocks.pop(rid, None)
        for rid, blocks in stm.req_to_blocks.items():
            start = self.seen_blocks.get(rid, 0)
            hits = self.hit_blocks.get(rid, set())
            for block in blocks[start:]:
                if block.block_id in hits:
                    continue
                assert block.block_id in self.clean_pages, (
                    f"{rid} got page {block.block_id} with stale KV, never reported freed"
                )
                self.clean_pages.discard(block.block_id)
            self.seen_blocks[rid] = len(blocks)

    def teardown(self) -> None:
        if self.manager is None:
            return
        for request_id in list(self.unfinished):
            self.scheduler.abort_request(request_id)
        assert not self.scheduler.has_unfinished_requests()
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self.manager.reset_prefix_cache() is True
        assert all(b.block_hash is None for b in pool.blocks)
        stats = self.manager.make_prefix_cache_stats()
        assert [stats.requests, stats.queries, stats.hits] == self.stats[False]
        assert [
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
        ] == self.stats[True]


TestKVCacheManagerStateful, TestKVCacheManagerStatefulDeep = quick_and_deep(
    KVCacheMachine,
    200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def check_tenant_caps(manager: KVCacheManager, caps: dict[str, int], running) -> None:
    """The pool's per-salt counts match its cached blocks, no salt holds more than its
    cap, a running salted request's cached blocks are its salt's, and each salt's free
    set is the free queue's cached blocks of that salt, in queue order."""
    pool = manager.block_pool
    counted = Counter()
    for block_id, salt in pool._tenant_of.items():
        assert pool.blocks[block_id].block_hash is not None
        counted[salt] += 1
    assert pool.tenant_cached_blocks() == dict(counted)
    for salt, cap in caps.items():
        assert counted[salt] <= cap, f"{salt} holds {counted[salt]} > {cap} blocks"
    for req in running:
        if req.cache_salt is None:
            continue
        for stm in manager.coordinator.single_type_managers:
            for block in stm.req_to_blocks.get(req.request_id, ()):
                if block.block_hash is not None and not block.is_null:
                    assert pool._tenant_of[block.block_id] == req.cache_salt
    queue = pool.free_block_queue.get_all_free_blocks()
    for salt in set(counted) | set(pool._tenant_free):
        expected = [b.block_id for b in queue if pool._tenant_of.get(b.block_id) == salt]
        assert list(pool._tenant_free.get(salt, {})) == expected


class TenantCapMachine(KVCacheMachine):
    """The same machine with per-salt caps on the prefix cache (`tenant_block_quotas`):
    after every step no salt holds more cached blocks than its cap, the pool's per-salt
    counts and free sets match the blocks, and nothing is left when all requests end."""

    @initialize(
        block_size=st.integers(2, 4),
        num_blocks=st.integers(8, 24),
        cap_a=st.integers(0, 4),
        cap_b=st.integers(1, 8),
        max_num_seqs=st.integers(1, 4),
        token_budget=st.integers(2, 24),
        lookahead=st.integers(0, 2),
    )
    def setup(
        self, block_size: int, num_blocks: int, cap_a: int, cap_b: int, max_num_seqs: int,
        token_budget: int, lookahead: int,
    ) -> None:  # fmt: skip
        self.caps = {"a": cap_a, "b": cap_b}  # "c" is counted, not capped
        super().setup(
            block_size, num_blocks, "sha256", True, max_num_seqs, token_budget, 0, lookahead
        )
        pool = self.manager.block_pool
        admit = pool._admit_tenant_blocks

        def admit_observed(salt, blocks):
            owners = dict(pool._tenant_of)
            new = {b.block_id for b in blocks}  # just stamped: uncached again if refused
            cached = {b.block_id for b in pool.blocks if b.block_hash is not None} - new
            kept = admit(salt, blocks)
            dropped = cached - {b.block_id for b in pool.blocks if b.block_hash is not None}
            assert all(owners.get(i) == salt and pool.blocks[i].ref_cnt == 0 for i in dropped)
            if dropped:
                event("cap: evicted the salt's own free block")
            if len(kept) < len(blocks):
                event("cap: left blocks uncached")
            return kept

        pool._admit_tenant_blocks = admit_observed

    @precondition(lambda self: self.manager is not None and len(self.unfinished) < 8)
    @rule(
        base=st.integers(0, len(BASE_PREFIXES) - 1),
        prefix_len=st.integers(0, 14),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        salt=st.sampled_from(["a", "a", "b", "c"]),
        max_tokens=st.integers(1, 8),
    )
    def add_salted_request(self, base, prefix_len, suffix, salt, max_tokens) -> None:
        self.add_request(base, prefix_len, suffix, salt, max_tokens)

    @invariant()
    def tenants_within_caps(self) -> None:
        if self.manager is None:
            return
        check_tenant_caps(self.manager, self.caps, self.running.values())

    def teardown(self) -> None:
        super().teardown()
        if self.manager is not None:
            pool = self.manager.block_pool
            assert pool.tenant_cached_blocks() == {} and not pool._tenant_of
            assert not any(pool._tenant_free.values())


TestTenantCapStateful, TestTenantCapStatefulDeep = quick_and_deep(
    TenantCapMachine,
    300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_evicted_held_block_reused_in_the_same_step_may_be_cached(monkeypatch) -> None:
    """Regression (model, not library): `evict_blocks` unhashes a block r1 holds; the
    next step preempts r1 to grow r0, which gets that very block at a fresh index (freed
    and handed out within one `schedule()`), and caches it once full. The model must drop
    the block from `unhashed_held` when the step reports it freed, not only when an
    invariant sees it free."""
    monkeypatch.setitem(globals(), "event", lambda *args, **kwargs: None)  # no hypothesis run
    state = TenantCapMachine()
    invariants = (
        state.events_mirror_cache, state.pool_consistent, state.queues_consistent,
        state.reused_pages_were_reported, state.tenants_within_caps,
    )  # fmt: skip

    def step(rule, **kwargs) -> None:
        getattr(state, rule)(**kwargs)
        for check in invariants:
            check()

    # 4 usable blocks: r0's prompt takes 3 (all full), r1's 1 (full).
    step("setup", block_size=3, num_blocks=5, cap_a=0, cap_b=7, max_num_seqs=4,
         token_budget=24, lookahead=0)  # fmt: skip
    step("add_request", base=0, prefix_len=9, suffix=[], salt=None, max_tokens=8)
    step("add_request", base=1, prefix_len=3, suffix=[], salt=None, max_tokens=8)
    step("schedule_step", tokens=[0, 0, 0, 0])
    pool = state.manager.block_pool
    stm = state.manager.coordinator.single_type_managers[0]
    (r1_block,) = stm.req_to_blocks["r1"]
    assert r1_block.block_hash is not None and pool.get_num_free_blocks() == 0
    step("evict_blocks", block_ids=[r1_block.block_id])
    assert state.unhashed_held == {r1_block.block_id}
    step("schedule_step", tokens=[0, 0, 0, 0])  # r0 needs a 4th block: r1 is preempted
    assert "r1" not in state.running and stm.req_to_blocks["r0"][3] is r1_block
    assert r1_block.block_id not in state.unhashed_held
    step("schedule_step", tokens=[0, 0, 0, 0])
    step("schedule_step", tokens=[0, 0, 0, 0])  # r0's 4th block is full: cached
    assert state.running["r0"].num_computed_tokens == 12
    assert r1_block.block_hash == make_block_hash_with_group_id(
        state.running["r0"].block_hashes[3], 0
    )
    state.teardown()
