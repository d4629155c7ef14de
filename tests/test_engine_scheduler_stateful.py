"""Hypothesis state machine for the engine's scheduler (host only, no JAX).

Random add / abort / step sequences, stepping synchronously or with one step in flight
(the engine's overlap), with prefix caching on or off, full or sliding-window attention,
a pool small enough to preempt, multimodal items through the encoder cache, and with or
without a host-memory KV tier (`HostOffload`: freed requests' blocks stored, as the
engine does after each schedule; loads staged on its worker thread, held back until a
`stagings_finish` rule, so requests wait in `loading` for several steps and can be
aborted there; a `corrupt` rule damages a block being loaded or stored, failing the
load of it; `device_forgets` drops the free blocks from the device prefix cache, so a
prefix the tier holds is a host hit). A fake model samples token
`f(request, output index)`, so every output is known in advance.

Invariants after every rule: each block's reference count equals the number of running
and loading requests holding it, and nothing else is held; waiting requests hold no
block and no encoder entry; every request is in exactly one of waiting, loading,
running (or finished); a loading request is `WAITING_FOR_REMOTE_KVS`, has one load,
whose blocks are the only pins of the tier, and is never scheduled; outputs so far are
exactly the expected tokens. After every step, the model runner's own request rows
(`RequestRows`, host only), driven by each step's reported block-id changes (reset,
appended, released on preemption and finish), hold exactly the manager's block ids of
the running requests (one whose load was just taken gets its row when first scheduled).
At the end every request not aborted finishes with its full output, everything is
returned and the tier holds no pin.
"""

from __future__ import annotations

import collections
import threading
import zlib
from concurrent.futures import wait
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from stateful_depth import quick_and_deep

import jaxkv
from jaxkv.block_table import BlockTable
from jaxkv.encoder_cache_manager import EncoderBudget, EncoderCacheManager
from jaxkv.engine.offload import HostOffload, PendingStore
from jaxkv.engine.request_rows import RequestRows, RowChanges, RowSampling
from jaxkv.engine.scheduler import Scheduler, SchedulerConfig
from jaxkv.host_tier import HostKVTier
from jaxkv.request import MultiModalFeatureSpec, RequestStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 14
MAX_LEN = 40
ITEMS = {"img-a": 4, "img-b": 6, "img-c": 5}
MAX_NUM_SEQS = 3
ROW_SAMPLING = RowSampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)


def fake_token(request_id: str, index: int) -> int:
    return zlib.crc32(f"{request_id}/{index}".encode()) % 1000 + 10


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        caching=st.booleans(),
        overlap=st.booleans(),
        chunk_cap=st.sampled_from([0, 3]),
        budget=st.sampled_from([6, 12]),
        window=st.sampled_from([None, 6]),
        host_blocks=st.sampled_from([0, 8, 32]),
    )
    def setup(
        self,
        caching: bool,
        overlap: bool,
        chunk_cap: int,
        budget: int,
        window: int | None,
        host_blocks: int,
    ) -> None:
        hash_fn = jaxkv.get_hash_fn_by_name("sha256")
        jaxkv.init_none_hash(hash_fn)
        self.hasher = jaxkv.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        spec = (
            jaxkv.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8)
            if window is None
            else jaxkv.SlidingWindowSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, sliding_window=window
            )
        )
        self.manager = jaxkv.KVCacheManager.from_spec(
            spec, NUM_BLOCKS, MAX_LEN, enable_caching=caching, track_freed_block_ids=True
        )
        self.encoder = EncoderCacheManager(12)
        # A host tier of `host_blocks` blocks (0: none), each a block's one layer of
        # BLOCK_SIZE float32 values; the fake model never reads what is loaded.
        self.offload = None
        if host_blocks:
            tier = HostKVTier(4 * BLOCK_SIZE, 4 * BLOCK_SIZE * host_blocks, group_specs=[spec])
            self.offload = HostOffload(tier, [[0]], (BLOCK_SIZE,), np.dtype(np.float32), BLOCK_SIZE)
            self.release = threading.Event()  # holds the staging thread until set
            self.offload._stager.submit(self.release.wait)
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(MAX_NUM_SEQS, budget, MAX_LEN, long_prefill_token_threshold=chunk_cap),
            encoder_cache_manager=self.encoder,
            encoder_budget=EncoderBudget(compute_budget=8, cache_size=12),
            offload=self.offload,
        )
        self.overlap = overlap
        self.in_flight = None
        self.requests: dict[str, jaxkv.Request] = {}
        self.aborted: set[str] = set()
        self.num_added = 0
        self.systems = [list(range(100, 108)), list(range(200, 212))]
        table = BlockTable(BLOCK_SIZE, MAX_NUM_SEQS, -(-MAX_LEN // BLOCK_SIZE), NUM_BLOCKS)
        self.rows = RequestRows([table])  # a model runner's rows, from the changes
        # Running since their loads were taken, not scheduled yet: no row so far.
        self.unrowed: set[str] = set()

    @rule(
        system=st.sampled_from([None, 0, 1]),
        tail=st.lists(st.integers(10, 60), min_size=1, max_size=14),
        max_tokens=st.integers(1, 8),
        items=st.lists(st.sampled_from(sorted(ITEMS)), max_size=2),
    )
    def add(self, system, tail, max_tokens, items) -> None:
        prompt = (self.systems[system] if system is not None else []) + tail
        features = []
        for name in items:
            features.append(MultiModalFeatureSpec(name, len(prompt), ITEMS[name]))
            prompt += [1] * ITEMS[name] + [11]
        request_id = f"r{self.num_added}"
        self.num_added += 1
        request = jaxkv.Request(
            request_id, prompt, mm_features=features, block_hasher=self.hasher,
            max_tokens=max_tokens,
        )  # fmt: skip
        if len(prompt) >= MAX_LEN:
            with pytest.raises(ValueError, match="max_model_len"):
                self.scheduler.add_request(request)
            return
        self.scheduler.add_request(request)
        self.requests[request_id] = request

    @rule(data=st.data())
    def abort(self, data) -> None:
        live = sorted(r for r, q in self.requests.items() if not q.is_finished)
        if not live:
            with pytest.raises(KeyError):
                self.scheduler.abort_request("unknown")
            return
        request_id = data.draw(st.sampled_from(live))
        self.scheduler.abort_request(request_id)
        self.aborted.add(request_id)

    def _apply(self, output) -> None:
        tokens = np.zeros(len(output.scheduled), np.int64)
        for row, item in enumerate(output.scheduled):
            index = item.num_computed_tokens + item.num_new_tokens - item.request.num_prompt_tokens
            tokens[row] = fake_token(item.request.request_id, index)
        self.scheduler.update_from_output(output, tokens)

    @rule()
    def stagings_finish(self) -> None:
        """Let the loads admitted so far finish staging (the next step takes them)."""
        if self.offload is None:
            return
        self.release.set()
        self._staged()
        self.release = threading.Event()
        self.offload._stager.submit(self.release.wait)

    def _staged(self) -> None:
        """Wait until every load admitted so far has finished staging."""
        wait([load.staging for load in self.offload.loading.values()])

    @rule(data=st.data())
    def corrupt(self, data) -> None:
        """Damage the bytes of a block a load waits for (else of a stored one): the
        load of it fails verification."""
        if self.offload is None:
            return
        tier = self.offload.tier
        keys = [k for load in self.offload.loading.values() for k in load.keys] or [
            k for k in tier._entries if tier.block_state(k) == "ready"
        ]
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.offload.buffer[tier._entries[key].slot] += 1.0

    @rule()
    def device_forgets(self) -> None:
        """The device prefix cache drops its free blocks (as reuse would): a prefix
        stored in the host tier is then a host hit."""
        pool = self.manager.block_pool
        pool.evict_blocks(
            b.block_id for b in pool.blocks[1:] if not b.ref_cnt and b.block_hash is not None
        )

    @rule(data=st.data())
    def abort_loading(self, data) -> None:
        """Abort a request waiting for its load (its staging is held: cancelled)."""
        if self.scheduler.loading:
            request_id = data.draw(st.sampled_from(sorted(self.scheduler.loading)))
            self.scheduler.abort_request(request_id)
            self.aborted.add(request_id)

    def _store(self) -> None:
        """Copy the blocks queued for the host tier, as the engine does right after a
        schedule (their bytes: the block id), and land them."""
        if self.offload is None:
            return
        store = self.offload.take_stores()
        if store.block_ids:
            blocks = np.zeros((len(store.block_ids), 1, BLOCK_SIZE), np.float32)
            blocks[:] = np.asarray(store.block_ids, np.float32)[:, None, None]
            gathered = SimpleNamespace(ready=lambda: True, read=lambda: blocks)
            self.offload.pending_stores.append(
                PendingStore(store.keys, store.slots, store.digests, gathered, 0)
            )
            self.offload.complete_stores()

    @rule()
    def step(self) -> None:
        loading = set(self.scheduler.loading)
        output = self.scheduler.schedule()
        self.unrowed |= loading - set(self.scheduler.loading)
        self._store()
        assert output.num_scheduled_tokens <= self.scheduler.config.max_num_batched_tokens
        assert len(output.scheduled) <= MAX_NUM_SEQS
        assert not {s.request.request_id for s in output.scheduled} & set(self.scheduler.loading)
        for item in output.scheduled:
            request = item.request
            tracked_pending = self.scheduler.num_pending_tokens(request.request_id)
            assert item.num_computed_tokens + item.num_new_tokens <= (
                request.num_tokens + tracked_pending
            )
            assert item.num_computed_tokens + item.num_new_tokens <= MAX_LEN
            held = self.encoder.get_cached_input_ids(request)
            end = item.num_computed_tokens + item.num_new_tokens
            for i, f in enumerate(request.mm_features):
                if f.offset < end and f.offset + f.length > item.num_computed_tokens:
                    assert i in held, "a chunk reaching an item holds its encoder entry"
        self._apply_block_changes(output)
        done = self.in_flight if self.overlap else output
        self.in_flight = output if self.overlap else None
        if done is not None:
            self._apply(done)

    def _apply_block_changes(self, output) -> None:
        """Update the request rows as the model runner does (release, record and check
        every change, apply); then they are the running requests' blocks."""
        self.rows.release(output.preempted_request_ids)
        self.rows.release(output.finished_request_ids)
        changes = RowChanges.empty(self.rows)
        sampling = {item.request.request_id: ROW_SAMPLING for item in output.scheduled}
        for item in output.scheduled:
            self.rows.record(changes, item, sampling)  # only a reset starts a row
        self.rows.check(changes)
        self.rows.apply(changes)
        running = {r.request_id for r in self.scheduler.running}
        self.unrowed &= running - {item.request.request_id for item in output.scheduled}
        assert set(self.rows.index) == running - self.unrowed
        for request_id in self.rows.index:
            assert self.rows.block_ids(request_id) == self.manager.get_block_ids(request_id)

    @invariant()
    def blocks_held_by_exactly_the_running_and_loading_requests(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        refs: collections.Counter[int] = collections.Counter()
        running = {r.request_id for r in self.scheduler.running}
        loading = set(self.scheduler.loading)
        for request_id, request in self.requests.items():
            (ids,) = self.manager.get_block_ids(request_id)
            if request_id in running:
                assert request.status == RequestStatus.RUNNING
                refs.update(i for i in ids if i)  # not the null block (left the window)
            elif request_id in loading:
                assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                assert ids, "a loading request holds the blocks its load writes"
                refs.update(i for i in ids if i)
            else:
                assert ids == [], f"{request_id} ({request.status!r}) holds blocks"
                assert not self.encoder.get_cached_input_ids(request)
        for block in self.manager.block_pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0)
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1 - len(refs)
        waiting = [r.request_id for r in self.scheduler.waiting]
        assert len(set(waiting)) == len(waiting) and not set(waiting) & (running | loading)
        assert not running & loading
        unfinished = {r for r, q in self.requests.items() if not q.is_finished}
        assert unfinished == set(waiting) | running | loading
        assert len(running | loading) <= MAX_NUM_SEQS
        for refs_of_item in self.encoder.cached.values():
            assert refs_of_item <= running

    @invariant()
    def the_tier_is_pinned_by_the_loads_only(self) -> None:
        offload = getattr(self, "offload", None)
        if offload is None:
            return
        assert set(offload.loading) == set(self.scheduler.loading)
        pins = collections.Counter(k for load in offload.loading.values() for k in load.keys)
        tier = offload.tier
        assert {k: tier.ref_count(k) for k in tier._entries if tier.ref_count(k)} == pins

    @invariant()
    def outputs_are_the_expected_tokens(self) -> None:
        for request_id, request in getattr(self, "requests", {}).items():
            want = [fake_token(request_id, i) for i in range(request.num_output_tokens)]
            assert request.output_token_ids == want
            assert request.num_output_tokens <= request.max_tokens

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        if self.offload is not None:
            self.release.set()  # the loads finish staging from here on
        for _ in range(2000):
            if not (self.scheduler.has_unfinished_requests() or self.in_flight):
                break
            if self.offload is not None:
                self._staged()
            self.step()
        assert not self.scheduler.has_unfinished_requests()
        for request_id, request in self.requests.items():
            assert request.is_finished
            if request_id not in self.aborted:
                assert request.num_output_tokens == min(
                    request.max_tokens, MAX_LEN - request.num_prompt_tokens
                ), request_id
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1
        if self.offload is not None:
            assert not self.offload.loading
            assert all(self.offload.tier.ref_count(k) == 0 for k in self.offload.tier._entries)
        assert all(not refs for refs in self.encoder.cached.values())
        assert self.encoder.num_freeable_slots == self.encoder.cache_size


# Enough runs that requests wait for loads, are aborted there and fail verification
# (a few seconds).
TestScheduler, TestSchedulerDeep = quick_and_deep(
    SchedulerMachine,
    150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
