"""Hypothesis state machine: add / step / abort / update_weights on the tiny engine model.

Random sequences under each `weight_update_policy`, stepping with or without overlap,
in a pool small enough to preempt, prompts sharing prefixes. The KV events tell which
weight version was serving when each block was cached (events are taken after every
step and before every update). Invariants: a request, at its first admission, hits only
blocks cached under the version serving then (so none computed under an older one);
each output's `weight_versions` are versions the engine served, in the order it served
them. At the end, with every request aborted and the engine drained, every block is
free.
"""

from __future__ import annotations

import dataclasses
import itertools

import hypothesis.strategies as st
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.kv_events import BlockRemoved, BlockStored
from jaxkv.testing.tiny_model import TinyCausalLM, TinyConfig

TINY = TinyConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16,
)  # fmt: skip
BLOCK_SIZE = 4
CONFIG = EngineConfig(
    block_size=BLOCK_SIZE, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=8,
    max_model_len=32, enable_kv_cache_events=True,
)  # fmt: skip
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23], [30, 31, 32, 33]]
# New weights to update to (fresh arrays each time: never the engine's own buffers).
STATES = [nnx.state(TinyCausalLM(TINY, seed=seed)) for seed in (1, 2)]


class BlockVersions:
    """The weight version serving when each cached block was cached, read off an engine's
    KV events (to be taken after every step and before and after every weight update).

    The events describe block copies, not hashes: the pool does not de-duplicate (as in
    vLLM), so several blocks may be cached under one hash (a prompt a whole number of
    blocks long, hit in full, recomputes its last block into a new one: the hit stops a
    token short), each with its own `BlockStored`; evicting one copy is a `BlockRemoved`
    of that hash while the others stay cached. Invariant: a hash is listed iff a copy of
    it is cached, with one version per cached copy, in the order they were cached.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._copies: dict[bytes, list[int | str]] = {}  # block hash -> versions, oldest first

    def take_events(self) -> None:
        """Record the engine's KV events since the last call under the version serving."""
        version = self.engine.weight_version
        for event in self.engine.take_kv_events():
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._copies.setdefault(block_hash, []).append(version)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert block_hash in self._copies, f"{event}: never stored"
                    copies = self._copies[block_hash]
                    # Which copy went the event does not say: dropping the newest keeps any
                    # older version in sight of `check_hits`.
                    copies.pop()
                    if not copies:
                        del self._copies[block_hash]

    def cached_under(self, block_hash: bytes) -> set[int | str]:
        """The versions the cached copies of `block_hash` were cached under (empty: none)."""
        return set(self._copies.get(block_hash, ()))

    def check_hits(self, request, block_size: int) -> None:
        """`request`, at its first admission (now), hit only blocks cached under the
        version serving now (so none computed under an older one)."""
        version = self.engine.weight_version
        for block_hash in request.block_hashes[: request.num_cached_tokens // block_size]:
            assert self.cached_under(block_hash) == {version}, (
                f"{request.request_id}, admitted under {version!r}, hit a block cached "
                f"under {self.cached_under(block_hash) or None!r}"
            )


class _EventsOnly:
    """The two members of an engine `BlockVersions` reads, the events given by hand."""

    def __init__(self) -> None:
        self.weight_version: int | str = 0
        self.events: list = []

    def take_kv_events(self) -> list:
        events, self.events = self.events, []
        return events


def test_block_versions_keep_a_hash_while_a_copy_of_it_is_cached() -> None:
    engine, h = _EventsOnly(), b"h" * 32
    blocks = BlockVersions(engine)
    engine.events = [BlockStored([h], None, [1, 2, 3, 4], 4, None)]
    blocks.take_events()
    engine.weight_version = 1
    engine.events = [BlockStored([h], None, [1, 2, 3, 4], 4, None), BlockRemoved([h])]
    blocks.take_events()
    # Which copy went the event does not say: the older version stays in sight.
    assert blocks.cached_under(h) == {0}
    engine.events = [BlockStored([h], None, [1, 2, 3, 4], 4, None)]
    blocks.take_events()
    assert blocks.cached_under(h) == {0, 1}
    engine.events = [BlockRemoved([h]), BlockRemoved([h])]
    blocks.take_events()
    assert blocks.cached_under(h) == set()
    engine.events = [BlockRemoved([h])]
    with pytest.raises(AssertionError, match="never stored"):
        blocks.take_events()


class WeightsMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["keep", "recompute", "abort"]), overlap=st.booleans())
    def setup(self, policy: str, overlap: bool) -> None:
        config = dataclasses.replace(CONFIG, weight_update_policy=policy, async_scheduling=overlap)
        self.engine = LLMEngine(TinyCausalLM(TINY, seed=0), config)
        self.blocks = BlockVersions(self.engine)
        self.requests = {}  # request id -> its Request (kept after it finishes)
        self.unchecked: set[str] = set()  # not admitted yet
        self.unfinished: set[str] = set()
        self.served = [0]  # versions in the order they served
        self.ids = itertools.count()

    def _check_admissions(self) -> None:
        """Requests admitted since the last check hit only this version's blocks."""
        for request_id in sorted(self.unchecked):
            request = self.requests[request_id]
            if request.num_cached_tokens < 0:
                continue
            self.unchecked.discard(request_id)
            self.blocks.check_hits(request, BLOCK_SIZE)

    def _take_outputs(self, outputs) -> None:
        for output in outputs:
            order = [self.served.index(v) for v in output.weight_versions]
            assert order == sorted(set(order)), output.weight_versions
            if output.finished:
                self.unfinished.discard(output.request_id)

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(3, 63), max_size=6),
        max_tokens=st.integers(1, 6),
    )
    def add(self, prefix: int, tail: list[int], max_tokens: int) -> None:
        request_id = f"r{next(self.ids)}"
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(PREFIXES[prefix] + tail, sampling=sampling, request_id=request_id)
        self.requests[request_id] = self.engine.scheduler.get_request(request_id)
        self.unchecked.add(request_id)
        self.unfinished.add(request_id)

    @rule()
    def step(self) -> None:
        self._take_outputs(self.engine.step())
        self.blocks.take_events()
        self._check_admissions()

    @rule(data=st.data())
    def abort(self, data) -> None:
        if self.unfinished:
            request_id = data.draw(st.sampled_from(sorted(self.unfinished)))
            self.engine.abort(request_id)
            self.unfinished.discard(request_id)
            self.unchecked.discard(request_id)

    @rule()
    def update_weights(self) -> None:
        self.blocks.take_events()
        version = self.engine.update_weights(STATES[len(self.served) % 2])
        self.served.append(version)
        self.blocks.take_events()

    @invariant()
    def blocks_held_only_by_unfinished_requests(self) -> None:
        engine = self.engine
        if not engine.has_unfinished_requests():
            assert engine.num_free_blocks == CONFIG.num_blocks - 1

    def teardown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for request_id in sorted(self.unfinished):
            engine.abort(request_id)
        for _ in range(20):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests()
        assert engine.num_free_blocks == CONFIG.num_blocks - 1, "every block is free"


WeightsMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWeightsMachine = pytest.mark.timeout(600)(pytest.mark.slow(WeightsMachine.TestCase))
