"""Hypothesis state machine for the engine's scheduler (host only, no JAX).

Random add / abort / step sequences, stepping synchronously or with one step in flight
(the engine's overlap), with prefix caching on or off, full or sliding-window attention,
a pool small enough to preempt and multimodal items through the encoder cache. A fake
model samples token `f(request, output index)`, so every output is known in advance.

Invariants after every rule: each block's reference count equals the number of running
requests holding it, and nothing else is held; waiting requests hold no block and no
encoder entry; every request is in exactly one queue; outputs so far are exactly the
expected tokens. After every step, rows rebuilt from the reported block-id changes (as a
model runner keeps them: reset, appended, released on preemption and finish) are exactly
the manager's block ids of the running requests. At the end every request not aborted
finishes with its full output and everything is returned.
"""

from __future__ import annotations

import collections
import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import jaxkv
from jaxkv.encoder_cache_manager import EncoderBudget, EncoderCacheManager
from jaxkv.engine.scheduler import Scheduler, SchedulerConfig
from jaxkv.request import MultiModalFeatureSpec, RequestStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 14
MAX_LEN = 40
ITEMS = {"img-a": 4, "img-b": 6, "img-c": 5}


def fake_token(request_id: str, index: int) -> int:
    return zlib.crc32(f"{request_id}/{index}".encode()) % 1000 + 10


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        caching=st.booleans(),
        overlap=st.booleans(),
        chunk_cap=st.sampled_from([0, 3]),
        budget=st.sampled_from([6, 12]),
        window=st.sampled_from([None, 6]),
    )
    def setup(
        self, caching: bool, overlap: bool, chunk_cap: int, budget: int, window: int | None
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
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(3, budget, MAX_LEN, long_prefill_token_threshold=chunk_cap),
            encoder_cache_manager=self.encoder,
            encoder_budget=EncoderBudget(compute_budget=8, cache_size=12),
        )
        self.overlap = overlap
        self.in_flight = None
        self.requests: dict[str, jaxkv.Request] = {}
        self.aborted: set[str] = set()
        self.num_added = 0
        self.systems = [list(range(100, 108)), list(range(200, 212))]
        self.rows: dict[str, list[list[int]]] = {}  # a model runner's rows, from the changes

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
    def step(self) -> None:
        output = self.scheduler.schedule()
        assert output.num_scheduled_tokens <= self.scheduler.config.max_num_batched_tokens
        assert len(output.scheduled) <= 3
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
        """Keep rows as a model runner does; then they are the running requests' blocks."""
        for request_id in output.preempted_request_ids + output.finished_request_ids:
            self.rows.pop(request_id, None)
        for item in output.scheduled:
            request_id = item.request.request_id
            if item.resets_row:
                self.rows[request_id] = [list(ids) for ids in item.new_block_ids]
            else:
                assert request_id in self.rows, "only a reset starts a row"
                rows = self.rows[request_id]
                for row, ids in zip(rows, item.new_block_ids, strict=False):
                    row += ids
                for row, num_nulls in zip(rows, item.num_null_blocks, strict=False):
                    row[:num_nulls] = [0] * num_nulls
        running = {r.request_id for r in self.scheduler.running}
        assert set(self.rows) == running
        for request_id, row in self.rows.items():
            assert tuple(row) == self.manager.get_block_ids(request_id), request_id

    @invariant()
    def blocks_held_by_exactly_the_running_requests(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        refs: collections.Counter[int] = collections.Counter()
        running = {r.request_id for r in self.scheduler.running}
        for request_id, request in self.requests.items():
            (ids,) = self.manager.get_block_ids(request_id)
            if request_id in running:
                assert request.status == RequestStatus.RUNNING
                refs.update(i for i in ids if i)  # not the null block (left the window)
            else:
                assert ids == [], f"{request_id} ({request.status!r}) holds blocks"
                assert not self.encoder.get_cached_input_ids(request)
        for block in self.manager.block_pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0)
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1 - len(refs)
        waiting = [r.request_id for r in self.scheduler.waiting]
        assert len(set(waiting)) == len(waiting) and not set(waiting) & running
        unfinished = {r for r, q in self.requests.items() if not q.is_finished}
        assert unfinished == set(waiting) | running
        for refs_of_item in self.encoder.cached.values():
            assert refs_of_item <= running

    @invariant()
    def outputs_are_the_expected_tokens(self) -> None:
        for request_id, request in getattr(self, "requests", {}).items():
            want = [fake_token(request_id, i) for i in range(request.num_output_tokens)]
            assert request.output_token_ids == want
            assert request.num_output_tokens <= request.max_tokens

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(2000):
            if not (self.scheduler.has_unfinished_requests() or self.in_flight):
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests()
        for request_id, request in self.requests.items():
            assert request.is_finished
            if request_id not in self.aborted:
                assert request.num_output_tokens == min(
                    request.max_tokens, MAX_LEN - request.num_prompt_tokens
                ), request_id
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1
        assert all(not refs for refs in self.encoder.cached.values())
        assert self.encoder.num_freeable_slots == self.encoder.cache_size


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
