"""Hypothesis state machine over hybrid KV-cache configs.

Random mixes of full-attention, sliding-window, chunked-local, Mamba, R-SWA,
sink full-attention and circular-buffer groups (one to four) over one small pool; random
admit / chunked prefill / decode / preempt / finish / evict sequences with
prompts from a tiny vocabulary (prefixes collide, blocks are shared, released,
cached, evicted and re-hit). After every step:
per-group ref counts and free queue, no block id held by two groups, every hit
block carries the hash of the position it serves, each group's table has the
shape its attention type allows (R-SWA: null blocks exactly on the released
gap between the prompt and the decode window; a circular buffer: one uncached
block), and nothing is leaked when all requests end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from stateful_depth import quick_and_deep
from test_hybrid_managers import block_keys, check_invariants
from test_kv_cache_manager_stateful import check_tenant_caps

from jaxkv import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
)
from jaxkv.hashing import BlockHashListWithBlockSize, make_block_hash_with_group_id
from jaxkv.single_type_kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    RSWAManager,
    SlidingWindowManager,
)

MAX_MODEL_LEN = 40
PREFIXES = ([0, 1, 2, 3] * 10, [1, 1, 0, 0] * 10, [2, 3, 2, 3, 0] * 8)


@st.composite
def hybrid_specs(draw):
    kinds = draw(
        st.lists(
            st.sampled_from(["full", "sw", "chunked", "mamba", "rswa", "sink", "circ"]),
            min_size=1,  # one group: the unitary coordinator (or the sole-manager path)
            max_size=4,
        )
    )
    if len(kinds) > 1 and all(kind == "circ" for kind in kinds):
        kinds[0] = "rswa"  # a hybrid needs a prefix-cacheable group
    uniform = "chunked" in kinds  # chunked local needs hits on its own block size
    specs = []
    for kind in kinds:
        bs = 4 if uniform else draw(st.sampled_from([4, 8]))
        if kind == "full":
            specs.append(FullAttentionSpec(bs, 1, 4, "float32"))
        elif kind == "sw":
            window = draw(st.sampled_from([3, 5, 8, 13]))
            specs.append(SlidingWindowSpec(bs, 1, 4, "float32", sliding_window=window))
        elif kind == "chunked":
            chunk = draw(st.sampled_from([8, 12]))
            specs.append(ChunkedLocalAttentionSpec(bs, 1, 4, "float32", attention_chunk_size=chunk))
        elif kind == "rswa":
            window = draw(st.sampled_from([2, 5, 8]))
            specs.append(RSWASpec(bs, 1, 4, "float32", rswa_window=window))
        elif kind == "sink":
            specs.append(SinkFullAttentionSpec(bs, 1, 4, "float32", sink_len=bs))
        elif kind == "circ":
            specs.append(CircularBufferSpec(bs, 1, 4, "float32"))
        else:
            alignment = draw(st.sampled_from([None, 4]))  # a backend exporting checkpoints
            specs.append(
                MambaSpec(
                    bs,
                    shapes=((2,),),
                    dtypes=("float32",),
                    mamba_cache_mode="align",
                    num_prefill_checkpoint_blocks=0 if alignment is None else 1,
                    prefill_checkpoint_alignment=alignment,
                )
            )
    return specs


class HybridMachine(RuleBasedStateMachine):
    caps: dict[str, int] | None = None  # the pool's tenant_block_quotas

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.counter = 0
        # Running request id -> the computed-token count its latest allocate_slots saw
        # (where blocks left the attention window were released); 0 at admission, where
        # the release runs before the hits are added.
        self.released_at: dict[str, int] = {}

    @initialize(specs=hybrid_specs(), num_blocks=st.integers(8, 24))
    def setup(self, specs, num_blocks):
        init_none_hash(get_hash_fn_by_name("sha256_cbor"), "hybrid-machine")
        config = KVCacheConfig.from_groups(
            [(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks
        )
        self.manager = KVCacheManager(config, MAX_MODEL_LEN, tenant_block_quotas=self.caps)
        self.hasher = get_request_block_hasher(
            self.manager.hash_block_size, get_hash_fn_by_name("sha256_cbor")
        )

    def _check_hits(self, req: Request, blocks, num_hit: int) -> None:
        m = self.manager
        alignment = getattr(m.coordinator, "cache_hit_alignment_tokens", m.scheduler_block_size)
        assert num_hit % alignment == 0
        for manager, group_blocks in zip(
            m.coordinator.single_type_managers, blocks.blocks, strict=True
        ):
            if not manager.kv_cache_spec.prefix_cacheable:  # a circular buffer never hits
                assert not group_blocks
                continue
            bs = manager.block_size
            hashes = req.block_hashes
            if bs != m.hash_block_size:
                hashes = BlockHashListWithBlockSize(hashes, m.hash_block_size, bs)
            for i, block in enumerate(group_blocks):
                if block.is_null:
                    continue
                if (i + 1) * bs > num_hit:  # a partial hit's block: keyed at the hit's end
                    block_hash = req.block_hashes[num_hit // m.hash_block_size - 1]
                else:
                    block_hash = hashes[i]
                key = make_block_hash_with_group_id(block_hash, manager.kv_cache_group_id)
                assert key in block_keys(m.block_pool, block)
            if isinstance(manager, SlidingWindowManager) and num_hit:
                need = SlidingWindowManager.contiguous_blocks_for_hit(
                    manager.sliding_window, bs, False
                )
                tail = group_blocks[-need:] if len(group_blocks) >= need else group_blocks
                assert len(group_blocks) == num_hit // bs
                assert all(not b.is_null for b in tail)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        shared=st.integers(0, 30),
        extra=st.lists(st.integers(0, 3), max_size=8),
    )
    def add_request(self, prefix, shared, extra, salt=None):
        tokens = prefix[:shared] + extra
        if not tokens or len(tokens) > MAX_MODEL_LEN - 4:
            return
        self.counter += 1
        self.waiting.append(
            Request(f"r{self.counter}", tokens, block_hasher=self.hasher, cache_salt=salt)
        )

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        req = self.waiting[0]
        m = self.manager
        blocks, num_hit = m.get_computed_blocks(req)[:2]
        self._check_hits(req, blocks, num_hit)
        event("hit" if num_hit else "miss")
        remaining = req.num_tokens - num_hit
        chunk = data.draw(st.integers(1, remaining))
        if m.allocate_slots(req, chunk, num_hit, blocks) is None:
            return
        req.num_computed_tokens = num_hit + chunk
        self.released_at[req.request_id] = 0
        self.waiting.pop(0)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running(self, data):
        self._step(data.draw(st.sampled_from(self.running)), data)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_steps=st.integers(2, 16))
    def run_steps(self, data, num_steps):
        """Several steps of one request: long decodes reach R-SWA's gap."""
        req = data.draw(st.sampled_from(self.running))
        for _ in range(num_steps):
            if req not in self.running:
                return
            self._step(req, data)

    def _step(self, req: Request, data) -> None:
        m = self.manager
        if req.num_computed_tokens < req.num_tokens:  # chunked prefill
            n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        else:  # decode one token
            if req.num_tokens >= MAX_MODEL_LEN - 1:
                return
            req.append_output_token_ids(data.draw(st.integers(0, 3)))
            n = 1
        self.released_at[req.request_id] = req.num_computed_tokens
        if m.allocate_slots(req, n) is None:
            if req.num_tokens > req.num_computed_tokens + n:
                return
            event("preempted: out of blocks")
            self._preempt(req)
            return
        req.num_computed_tokens += n

    def _preempt(self, req: Request) -> None:
        self.manager.free(req)
        self.running.remove(req)
        del self.released_at[req.request_id]
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.manager.free(req)
        self.running.remove(req)
        del self.released_at[req.request_id]

    @rule()
    def run_copies(self):
        """The device runs the queued copy-on-write copies; their endpoints are released."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        assert [b.block_id for b in retained] == [
            i for c in copies for i in (c.src_block_id, c.dst_block_id)
        ]
        if copies:
            event("copy-on-write")
        self.manager.block_pool.free_blocks(retained)

    @rule(data=st.data())
    def evict(self, data):
        ids = data.draw(
            st.lists(st.integers(1, self.manager.block_pool.num_gpu_blocks - 1), max_size=3)
        )
        self.manager.evict_blocks(ids)

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "manager"):
            check_invariants(self.manager)

    @invariant()
    def tables_have_their_attention_type_shape(self):
        if not hasattr(self, "manager"):
            return
        for manager in self.manager.coordinator.single_type_managers:
            for req in self.running:
                table = manager.req_to_blocks[req.request_id]
                if isinstance(manager, CircularBufferManager):
                    assert len(table) == 1 and table[0].block_hash is None
                elif isinstance(manager, RSWAManager):
                    self._check_rswa_table(manager, req, table)
                elif isinstance(manager, FullAttentionManager):
                    assert not any(b.is_null for b in table)

    def _check_rswa_table(self, manager: RSWAManager, req: Request, table) -> None:
        """Null exactly on the gap released so far: [ceil(prompt / block), end of the
        gap at the last release), held before it (the prompt) and after it (the window)."""
        bs = manager.block_size
        prompt = req.num_prompt_tokens
        first = -(-prompt // bs)
        released = max(prompt, self.released_at[req.request_id] - manager.rswa_window)
        gap_end = max(first, min(released // bs, len(table)))
        nulls = [i for i, b in enumerate(table) if b.is_null]
        assert nulls == list(range(first, gap_end)), (nulls, first, gap_end)
        if nulls:
            event("rswa gap released")

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for req in self.running + self.waiting:  # a waiting one may have been refused
            self.manager.free(req)
        check_invariants(self.manager)
        self.run_copies()  # pending copies hold their endpoints until drained
        check_invariants(self.manager)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        for manager in self.manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks and not manager.num_cached_block
            if isinstance(manager, RSWAManager):
                assert not manager._num_prompt_tokens and not manager._gap_end


TestHybridMachine, TestHybridMachineDeep = quick_and_deep(
    HybridMachine,
    200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class HybridTenantCapMachine(HybridMachine):
    """The hybrid machine with per-salt caps on the prefix cache (`tenant_block_quotas`,
    counted over every group's blocks): after every step no salt holds more than its
    cap and the pool's per-salt bookkeeping matches its blocks; nothing is left at the
    end."""

    @initialize(
        specs=hybrid_specs(),
        num_blocks=st.integers(8, 24),
        cap_a=st.integers(0, 4),
        cap_b=st.integers(1, 10),
    )
    def setup(self, specs, num_blocks, cap_a, cap_b):
        self.caps = {"a": cap_a, "b": cap_b}  # "c" is counted, not capped
        super().setup(specs, num_blocks)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        shared=st.integers(0, 30),
        extra=st.lists(st.integers(0, 3), max_size=8),
        salt=st.sampled_from(["a", "a", "b", "c"]),
    )
    def add_salted_request(self, prefix, shared, extra, salt):
        self.add_request(prefix, shared, extra, salt)

    @invariant()
    def tenants_within_caps(self):
        if hasattr(self, "manager"):
            check_tenant_caps(self.manager, self.caps, self.running)

    def teardown(self):
        super().teardown()
        if hasattr(self, "manager"):
            check_tenant_caps(self.manager, self.caps, ())
            assert self.manager.reset_prefix_cache()
            assert self.manager.block_pool.tenant_cached_blocks() == {}


TestHybridTenantCapMachine, TestHybridTenantCapMachineDeep = quick_and_deep(
    HybridTenantCapMachine,
    150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
