"""Host encoder cache (SPEC §7): exact counters, eviction, budgets, bad input, a stateful model."""

from __future__ import annotations

import copy
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
from _state import encoder_state
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from jaxkv.encoder_cache_manager import (
    EncoderBudget,
    EncoderCacheManager,
    EncoderDecoderCacheManager,
    compute_encoder_budget,
)
from jaxkv.request import MultiModalFeatureSpec, Request


def make_request(request_id: str, *items: tuple[str, int]) -> Request:
    """A request whose i-th item has mm_hash items[i][0] and items[i][1] embeddings.

    Each placeholder starts with one break token (no embedding), so an item may
    have zero embeddings.
    """
    features = []
    offset = 2
    for mm_hash, num_embeds in items:
        is_embed = np.array([False] + [True] * num_embeds)
        features.append(MultiModalFeatureSpec(mm_hash, offset, num_embeds + 1, is_embed))
        offset += num_embeds + 3
    return Request(request_id, list(range(offset)), mm_features=features)


def schedule(manager: EncoderCacheManager, request: Request, input_id: int, budget: int = 1000):
    """The scheduler's sequence for one input; returns 'hit', 'miss' or 'blocked'."""
    if manager.check_and_update_cache(request, input_id):
        return "hit"
    if not manager.can_allocate(request, input_id, budget, 0):
        return "blocked"
    manager.allocate(request, input_id)
    return "miss"


def snapshot(manager: EncoderCacheManager) -> dict:
    return copy.deepcopy(
        {
            "free": manager.num_free_slots,
            "freeable_slots": manager.num_freeable_slots,
            "cached": manager.cached,
            "freeable": list(manager.freeable.items()),
            "freed": manager.freed,
            "embeds": manager.num_embeds_by_hash,
        }
    )


# ---- exact counter scenarios ------------------------------------------------------------


def test_allocate_takes_slots_from_both_counters():
    manager = EncoderCacheManager(cache_size=10)
    request = make_request("r1", ("a", 4))
    assert not manager.check_and_update_cache(request, 0)
    assert manager.can_allocate(request, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    manager.allocate(request, 0)
    assert manager.num_free_slots == 6
    assert manager.num_freeable_slots == 6
    assert manager.cached == {"a": {"r1"}}
    assert manager.num_embeds_by_hash == {"a": 4}
    assert manager.get_cached_input_ids(request) == {0}
    assert manager.get_cached_num_encoder_embeds(request, 0) == 4


def test_shared_entry_becomes_freeable_when_last_reference_goes_and_free_twice_is_noop():
    manager = EncoderCacheManager(cache_size=10)
    r1, r2 = make_request("r1", ("a", 4)), make_request("r2", ("a", 4))
    assert schedule(manager, r1, 0) == "miss"
    assert schedule(manager, r2, 0) == "hit"
    assert manager.cached["a"] == {"r1", "r2"}
    manager.free(r1)
    assert manager.cached["a"] == {"r2"}
    assert manager.num_freeable_slots == 6 and not manager.freeable
    manager.free(r2)
    assert manager.freeable == OrderedDict(a=4)
    assert (manager.num_free_slots, manager.num_freeable_slots) == (6, 10)
    manager.free(r2)  # freeing again changes nothing
    manager.free(r1)
    assert (manager.num_free_slots, manager.num_freeable_slots) == (6, 10)
    assert manager.freeable == OrderedDict(a=4)
    assert manager.cached == {"a": set()}


def test_hit_on_unreferenced_entry_takes_it_out_of_freeable():
    manager = EncoderCacheManager(cache_size=10)
    schedule(manager, make_request("r1", ("a", 4)), 0)
    manager.free(make_request("r1", ("a", 4)))
    assert manager.num_freeable_slots == 10
    r2 = make_request("r2", ("a", 4))
    assert manager.check_and_update_cache(r2, 0)
    assert not manager.freeable
    assert (manager.num_free_slots, manager.num_freeable_slots) == (6, 6)
    assert manager.cached == {"a": {"r2"}}


def test_eviction_of_unreferenced_entry_reported_once():
    manager = EncoderCacheManager(cache_size=10)
    rx, ry = make_request("rx", ("x", 6)), make_request("ry", ("y", 5))
    assert schedule(manager, rx, 0) == "miss"
    manager.free(rx)
    assert not manager.check_and_update_cache(ry, 0)
    assert manager.can_allocate(ry, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    assert "x" not in manager.cached and manager.freed == ["x"]
    assert (manager.num_free_slots, manager.num_freeable_slots) == (10, 10)
    manager.allocate(ry, 0)
    assert (manager.num_free_slots, manager.num_freeable_slots) == (5, 5)
    assert manager.get_freed_mm_hashes() == ["x"]
    assert manager.get_freed_mm_hashes() == []
    assert not manager.check_and_update_cache(make_request("r3", ("x", 6)), 0)


def test_eviction_is_oldest_unreferenced_first_and_only_as_much_as_needed():
    manager = EncoderCacheManager(cache_size=12)
    for name in ("a", "b", "c"):
        request = make_request(f"r-{name}", (name, 4))
        schedule(manager, request, 0)
        manager.free(request)
    assert list(manager.freeable) == ["a", "b", "c"]
    assert manager.can_allocate(make_request("r", ("d", 6)), 0, 100, 0)
    assert manager.freed == ["a", "b"]
    assert list(manager.freeable) == ["c"]
    assert (manager.num_free_slots, manager.num_freeable_slots) == (8, 12)


def test_compute_budget_refuses_an_item_larger_than_it():
    manager = EncoderCacheManager(cache_size=100)
    request = make_request("r", ("big", 11))
    assert not manager.can_allocate(request, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    assert manager.can_allocate(request, 0, encoder_compute_budget=11, num_embeds_to_schedule=0)
    assert manager.num_free_slots == 100 and not manager.freed


def test_already_scheduled_embeds_count_and_failed_check_evicts_nothing():
    manager = EncoderCacheManager(cache_size=10)
    old = make_request("old", ("old", 3))
    schedule(manager, old, 0)
    manager.free(old)
    request = make_request("r", ("a", 4))
    # 4 + 7 > 10 reclaimable: refused, and nothing evicted.
    assert not manager.can_allocate(request, 0, 100, num_embeds_to_schedule=7)
    assert list(manager.freeable) == ["old"] and manager.freed == []
    # 4 + 6 == 10: fits after evicting "old".
    assert manager.can_allocate(request, 0, 100, num_embeds_to_schedule=6)
    assert manager.freed == ["old"] and manager.num_free_slots == 10
    # 4 + 3 fits in the free slots: no eviction needed.
    schedule(manager, make_request("keep", ("keep", 3)), 0)
    manager.free(make_request("keep", ("keep", 3)))
    assert manager.can_allocate(request, 0, 100, num_embeds_to_schedule=3)
    assert list(manager.freeable) == ["keep"]


def test_capacity_counts_embed_positions_only():
    manager = EncoderCacheManager(cache_size=10)
    is_embed = np.zeros(100, dtype=bool)
    is_embed[[1, 2, 3, 10, 50, 60, 70, 99]] = True
    feature = MultiModalFeatureSpec("img", offset=5, length=100, is_embed=is_embed)
    request = Request("r", list(range(110)), mm_features=[feature])
    assert manager.can_allocate(request, 0, encoder_compute_budget=8, num_embeds_to_schedule=0)
    manager.allocate(request, 0)
    assert (manager.num_free_slots, manager.num_freeable_slots) == (2, 2)
    assert manager.num_embeds_by_hash == {"img": 8}


def test_reset_restores_initial_state():
    manager = EncoderCacheManager(cache_size=10)
    r1, r2 = make_request("r1", ("a", 4)), make_request("r2", ("b", 5))
    schedule(manager, r1, 0)
    schedule(manager, r2, 0)
    manager.free(r1)
    assert manager.can_allocate(make_request("r3", ("c", 5)), 0, 10, 0)
    assert manager.freed == ["a"]
    manager.reset()
    assert (manager.num_free_slots, manager.num_freeable_slots) == (10, 10)
    assert manager.cached == {} and manager.freeable == OrderedDict()
    assert manager.freed == [] and manager.num_embeds_by_hash == {}
    assert manager.get_cached_input_ids(r2) == set()
    assert manager.get_freed_mm_hashes() == []
    assert not manager.check_and_update_cache(r2, 0)
    manager.free(r2)  # the reference was dropped by reset: a no-op, not a double release
    assert manager.num_freeable_slots == 10


# ---- repeated items, same-pass reallocation ---------------------------------------------


def test_item_repeated_in_one_request_stays_referenced_until_last_occurrence_freed():
    manager = EncoderCacheManager(cache_size=10)
    request = make_request("r", ("a", 4), ("b", 2), ("a", 4))
    assert [schedule(manager, request, i) for i in range(3)] == ["miss", "miss", "hit"]
    assert manager.num_free_slots == 4  # "a" takes its slots once
    assert manager.get_cached_input_ids(request) == {0, 1, 2}
    manager.free_encoder_input(request, 0)
    assert manager.cached["a"] == {"r"} and not manager.freeable
    # Still referenced through input 2: cannot be evicted for a 10-embed item.
    assert not manager.can_allocate(make_request("q", ("z", 10)), 0, 100, 0)
    assert manager.freed == []
    manager.free_encoder_input(request, 2)
    assert manager.freeable == OrderedDict(a=4)
    assert manager.get_cached_input_ids(request) == {1}
    before = encoder_state(manager)
    manager.free_encoder_input(request, 2)  # already freed: a no-op, as in vLLM
    assert encoder_state(manager) == before


def test_free_releases_a_repeated_item_at_its_last_occurrence():
    manager = EncoderCacheManager(cache_size=20)
    request = make_request("r", ("a", 4), ("b", 2), ("a", 4), ("c", 1))
    for i in range(4):
        schedule(manager, request, i)
    manager.free(request)
    # b is released at input 1, a at input 2, c at input 3: eviction order b, a, c.
    assert list(manager.freeable.items()) == [("b", 2), ("a", 4), ("c", 1)]
    assert manager.num_freeable_slots == 20
    assert manager.get_cached_input_ids(request) == set()


def test_entry_evicted_and_reallocated_in_one_pass_is_not_reported_freed():
    manager = EncoderCacheManager(cache_size=10)
    rx, ry = make_request("rx", ("x", 4)), make_request("ry", ("y", 8))
    schedule(manager, rx, 0)
    manager.free(rx)
    assert schedule(manager, ry, 0) == "miss"  # evicts x
    manager.free(ry)
    rx2 = make_request("rx2", ("x", 4))
    assert schedule(manager, rx2, 0) == "miss"  # evicts y, allocates x again
    assert manager.freed == ["x", "y"]
    assert manager.get_freed_mm_hashes() == ["y"]
    assert manager.freed == []
    assert manager.cached == {"x": {"rx2"}}


# ---- bad input ----------------------------------------------------------------------------


def test_allocate_without_room_raises_and_changes_nothing():
    manager = EncoderCacheManager(cache_size=10)
    schedule(manager, make_request("r1", ("a", 8)), 0)
    before = snapshot(manager)
    with pytest.raises(ValueError, match=r"'r2' input 0: 5 embeddings do not fit in 2 free"):
        manager.allocate(make_request("r2", ("b", 5)), 0)
    assert snapshot(manager) == before


def test_allocate_of_cached_entry_raises_and_changes_nothing():
    manager = EncoderCacheManager(cache_size=10)
    schedule(manager, make_request("r1", ("a", 4)), 0)
    before = snapshot(manager)
    with pytest.raises(ValueError, match="'a' is already cached"):
        manager.allocate(make_request("r2", ("a", 4)), 0)
    assert snapshot(manager) == before


def test_allocate_uses_the_size_of_the_input_it_is_given():
    manager = EncoderCacheManager(cache_size=10)
    small, large = make_request("s", ("s", 1)), make_request("l", ("l", 9))
    assert manager.can_allocate(small, 0, 10, 0)
    manager.allocate(large, 0)  # not the input can_allocate sized
    assert manager.num_free_slots == 1
    manager.allocate(small, 0)
    assert manager.num_free_slots == 0


@pytest.mark.parametrize("input_id", [-1, 1, 7])
def test_unknown_input_id_is_rejected(input_id):
    manager = EncoderCacheManager(cache_size=10)
    request = make_request("r", ("a", 4))
    for call in (
        lambda: manager.check_and_update_cache(request, input_id),
        lambda: manager.can_allocate(request, input_id, 10, 0),
        lambda: manager.allocate(request, input_id),
        lambda: manager.get_cached_num_encoder_embeds(request, input_id),
    ):
        with pytest.raises(ValueError, match=rf"'r'.*input_id {input_id}"):
            call()
    assert manager.cached == {} and manager.num_free_slots == 10


def test_negative_sizes_are_rejected():
    with pytest.raises(ValueError, match="cache_size must be >= 0, got -1"):
        EncoderCacheManager(-1)
    with pytest.raises(ValueError, match="cache_size must be >= 0"):
        EncoderDecoderCacheManager(-3)
    manager = EncoderCacheManager(10)
    request = make_request("r", ("a", 4))
    with pytest.raises(ValueError, match="encoder_compute_budget must be >= 0, got -1"):
        manager.can_allocate(request, 0, -1, 0)
    with pytest.raises(ValueError, match="num_embeds_to_schedule must be >= 0, got -4"):
        manager.can_allocate(request, 0, 10, -4)


def test_free_encoder_input_of_unheld_input_and_free_of_unknown_request_are_noops():
    """As in vLLM (and the seed): a scheduler frees inputs it may already have freed."""
    manager = EncoderCacheManager(cache_size=10)
    request = make_request("r", ("a", 4), ("b", 4))
    schedule(manager, request, 0)
    before = encoder_state(manager)
    manager.free_encoder_input(request, 1)
    manager.free_encoder_input(make_request("ghost", ("a", 4)), 0)
    assert encoder_state(manager) == before
    manager.free(make_request("text-only", ("z", 1)))
    assert manager.cached == {"a": {"r"}} and manager.num_freeable_slots == 6


def test_requests_are_duck_typed():
    class Duck:
        def __init__(self, request_id, items):
            self.request_id = request_id
            self.mm_features = [SimpleNamespace(identifier=h) for h, _ in items]
            self._sizes = [n for _, n in items]

        def get_num_encoder_embeds(self, input_id):
            return self._sizes[input_id]

    manager = EncoderCacheManager(cache_size=10)
    duck = Duck("d", [("a", 3), ("b", 5)])
    assert [schedule(manager, duck, i) for i in range(2)] == ["miss", "miss"]
    assert manager.num_free_slots == 2
    manager.free(duck)
    assert list(manager.freeable.items()) == [("a", 3), ("b", 5)]


# ---- encoder-decoder manager --------------------------------------------------------------


def test_encoder_decoder_manager_never_shares_and_frees_one_step_late():
    manager = EncoderDecoderCacheManager(cache_size=10)
    r1, r2 = make_request("r1", ("audio", 4)), make_request("r2", ("audio", 4))
    assert not manager.check_and_update_cache(r1, 0)
    assert manager.get_cached_num_encoder_embeds(r1, 0) is None
    assert manager.can_allocate(r1, 0, 10, 0)
    manager.allocate(r1, 0)
    assert manager.num_free_slots == 6
    assert not manager.check_and_update_cache(r2, 0)  # same hash: still a miss
    assert not manager.can_allocate(r2, 0, 3, 0)  # compute budget
    assert not manager.can_allocate(r2, 0, 10, 3)  # 4 + 3 > 6 free; never evicts
    assert manager.can_allocate(r2, 0, 10, 2)
    assert manager.get_freed_mm_hashes() == []  # r1's step has not run yet
    manager.allocate(r2, 0)
    assert manager.num_free_slots == 2
    assert manager.get_freed_mm_hashes() == ["audio"]  # r1's, allocated one call earlier
    assert manager.get_freed_mm_hashes() == ["audio"]  # r2's
    assert manager.get_freed_mm_hashes() == []
    assert manager.get_cached_input_ids(r1) == {0}
    manager.free(r1)
    assert manager.num_free_slots == 6
    manager.free(r1)  # idempotent: slots are returned once
    assert manager.num_free_slots == 6
    manager.free_encoder_input(r2, 0)
    assert manager.num_free_slots == 10
    manager.free_encoder_input(r2, 0)  # not held any more: a no-op
    assert manager.num_free_slots == 10


def test_encoder_decoder_manager_bad_input_and_reset():
    manager = EncoderDecoderCacheManager(cache_size=5)
    request = make_request("r", ("audio", 4))
    manager.allocate(request, 0)
    with pytest.raises(ValueError, match="already allocated"):
        manager.allocate(request, 0)
    with pytest.raises(ValueError, match="4 embeddings do not fit in 1 free"):
        manager.allocate(make_request("q", ("audio", 4)), 0)
    with pytest.raises(ValueError, match="input_id 3"):
        manager.allocate(request, 3)
    with pytest.raises(ValueError, match="input_id -1"):
        manager.check_and_update_cache(request, -1)
    assert manager.num_free_slots == 1 and manager.allocated == ["audio"]
    manager.reset()
    assert manager.num_free_slots == 5 and manager.get_freed_mm_hashes() == []
    assert manager.get_cached_input_ids(request) == set()


# ---- budgets and admission ----------------------------------------------------------------


def test_compute_encoder_budget_defaults_and_settings():
    budget = compute_encoder_budget({"image": 576, "video": 1000}, max_num_batched_tokens=2048)
    assert budget == EncoderBudget(compute_budget=2048, cache_size=2048)
    budget = compute_encoder_budget(
        {"image": 576}, 512, max_num_encoder_input_tokens=100, encoder_cache_size=300
    )
    assert budget == EncoderBudget(compute_budget=576, cache_size=576)  # raised to the item
    budget = compute_encoder_budget(
        {"image": 576}, 512, max_num_encoder_input_tokens=1200, encoder_cache_size=5000
    )
    assert budget == EncoderBudget(compute_budget=1200, cache_size=5000)
    assert compute_encoder_budget({}, 2048) == EncoderBudget(0, 0)


def test_compute_encoder_budget_rejects_bad_settings():
    with pytest.raises(ValueError, match="largest item takes 576 tokens.*=512"):
        compute_encoder_budget({"image": 576}, 512, disable_chunked_mm_input=True)
    assert compute_encoder_budget({"image": 512}, 512, disable_chunked_mm_input=True).cache_size
    with pytest.raises(ValueError, match=r"max_tokens_per_item\['image'\] must be >= 0, got -1"):
        compute_encoder_budget({"image": -1}, 512)
    with pytest.raises(ValueError, match="encoder_cache_size must be >= 0"):
        compute_encoder_budget({"image": 5}, 512, encoder_cache_size=-2)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 0"):
        compute_encoder_budget({"image": 5}, -512)
    with pytest.raises(ValueError, match="cache_size must be >= 0"):
        EncoderBudget(compute_budget=5, cache_size=-1)


def test_admission_rejects_items_larger_than_budget_or_cache():
    budget = EncoderBudget(compute_budget=10, cache_size=20)
    budget.check_admission(make_request("ok", ("a", 10), ("b", 10)))
    with pytest.raises(ValueError, match=r"'big'.*input 1 \('b'\) needs 11.*compute budget"):
        budget.check_admission(make_request("big", ("a", 3), ("b", 11)))
    budget = EncoderBudget(compute_budget=50, cache_size=20)
    with pytest.raises(ValueError, match=r"needs 21 encoder embeddings.*cache size"):
        budget.check_admission(make_request("huge", ("a", 21)))


def test_admitted_item_always_schedulable_on_a_cache_full_of_unreferenced_entries():
    budget = compute_encoder_budget({"image": 8}, max_num_batched_tokens=4)
    manager = EncoderCacheManager(budget.cache_size)
    request = make_request("r", ("big", 8))
    budget.check_admission(request)
    for name in ("p", "q"):
        filler = make_request(name, (name, 4))
        schedule(manager, filler, 0)
        manager.free(filler)
    assert manager.can_allocate(request, 0, budget.compute_budget, 0)
    assert manager.freed == ["p", "q"]


# ---- stateful model -----------------------------------------------------------------------

SIZES = {f"h{i}": size for i, size in enumerate([0, 1, 2, 3, 4, 5, 7, 9])}
CAPACITY = 16


class EncoderCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler and checks it against a reference model."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.manager = EncoderCacheManager(CAPACITY)
        self.counter = 0
        self.held: dict[str, dict[int, str]] = {}  # request id -> {input id -> hash}
        self.stored: dict[str, int] = {}  # hash -> size, for entries cached
        self.order: list[str] = []  # unreferenced entries, oldest first
        self.evicted_since_drain: list[str] = []

    def referencing(self, mm_hash: str) -> set[str]:
        return {rid for rid, held in self.held.items() if mm_hash in held.values()}

    @rule(target=requests, hashes=st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=4))
    def new_request(self, hashes):
        self.counter += 1
        return make_request(f"r{self.counter}", *[(h, SIZES[h]) for h in hashes])

    @rule(request=requests, data=st.data(), budget=st.integers(0, 12), queued=st.integers(0, 6))
    def schedule_input(self, request, data, budget, queued):
        input_id = data.draw(st.integers(0, len(request.mm_features) - 1))
        held = self.held.setdefault(request.request_id, {})
        if input_id in held:
            return
        mm_hash = request.mm_features[input_id].identifier
        size = SIZES[mm_hash]
        if self.manager.check_and_update_cache(request, input_id):
            assert mm_hash in self.stored
            if not self.referencing(mm_hash):
                self.order.remove(mm_hash)
            held[input_id] = mm_hash
            return
        assert mm_hash not in self.stored
        free = CAPACITY - sum(self.stored.values())
        reclaimable = free + sum(self.stored[h] for h in self.order)
        expected = size <= budget and size + queued <= reclaimable
        assert self.manager.can_allocate(request, input_id, budget, queued) == expected
        if not expected:
            assert self.manager.freed == self.evicted_since_drain
            return
        while size + queued > free:
            victim = self.order.pop(0)
            assert not self.referencing(victim)
            free += self.stored.pop(victim)
            self.evicted_since_drain.append(victim)
        assert self.manager.freed == self.evicted_since_drain
        self.manager.allocate(request, input_id)
        self.stored[mm_hash] = size
        held[input_id] = mm_hash

    @rule(request=requests)
    def free_request(self, request):
        held = self.held.pop(request.request_id, {})
        self.manager.free(request)
        for mm_hash in held.values():
            if not self.referencing(mm_hash):
                if mm_hash in self.order:
                    self.order.remove(mm_hash)
                self.order.append(mm_hash)

    @rule(request=requests, data=st.data())
    def free_one_input(self, request, data):
        held = self.held.get(request.request_id)
        if not held:
            before = encoder_state(self.manager)
            self.manager.free_encoder_input(request, 0)  # a no-op
            assert encoder_state(self.manager) == before
            return
        input_id = data.draw(st.sampled_from(sorted(held)))
        mm_hash = held.pop(input_id)
        self.manager.free_encoder_input(request, input_id)
        if not self.referencing(mm_hash):
            self.order.append(mm_hash)

    @rule()
    def drain_freed(self):
        expected = [h for h in self.evicted_since_drain if h not in self.stored]
        assert self.manager.get_freed_mm_hashes() == expected
        self.evicted_since_drain = []

    @invariant()
    def slots_add_up(self):
        manager = self.manager
        referenced = sum(n for h, n in manager.num_embeds_by_hash.items() if manager.cached[h])
        unreferenced = sum(manager.freeable.values())
        assert manager.num_free_slots + referenced + unreferenced == CAPACITY
        assert manager.num_freeable_slots == manager.num_free_slots + unreferenced
        assert 0 <= manager.num_free_slots <= manager.num_freeable_slots <= CAPACITY

    @invariant()
    def matches_model(self):
        manager = self.manager
        assert manager.num_embeds_by_hash == self.stored
        assert manager.cached == {h: self.referencing(h) for h in self.stored}
        assert list(manager.freeable) == self.order
        for rid, held in self.held.items():
            assert manager.get_cached_input_ids(SimpleNamespace(request_id=rid)) == set(held)


TestEncoderCacheMachine = EncoderCacheMachine.TestCase
TestEncoderCacheMachine.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
