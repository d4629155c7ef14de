"""A request waiting for its host-tier load (`RequestStatus.WAITING_FOR_REMOTE_KVS`).

On admission the blocks the host tier holds after a request's device prefix hit are
allocated as connector tokens and staged on the tier's worker thread; the request
computes nothing until a later step takes its load, while the others run. Here the
worker is held back (`stagings_held`) so that a load stays pending for as many steps as
a test needs: the others run meanwhile and tokens equal those without the tier and the
dense reference's; aborting a request during its load (staging queued, or the load
just dispatched) leaks nothing; a running request is preempted around a loading one,
never the loading one; with nothing but a load pending, the engine waits for its
staging rather than stepping empty. (A corrupt load's fallback: test_engine_offload;
random sequences with loads: test_engine_scheduler_stateful.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from concurrent.futures import wait

import numpy as np
from test_engine_offload import (
    GREEDY,
    TIER,
    assert_dense,
    assert_nothing_held,
    text_model,
    text_reference,
)

from jaxkv.engine import LLMEngine, SamplingParams
from jaxkv.request import RequestStatus

__all__ = ["text_model", "text_reference"]  # the fixtures, shared with the offload tests

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@contextlib.contextmanager
def stagings_held(engine: LLMEngine):
    """Hold rank 0's staging thread: the loads admitted meanwhile stay pending (their
    stagings queued behind this one) until the block ends."""
    release = threading.Event()
    engine.offload._stager.submit(release.wait)
    try:
        yield
    finally:
        release.set()


def finish_stagings(engine: LLMEngine) -> None:
    """Wait until every pending staging has finished (the next step takes their loads)."""
    wait([load.staging for load in engine.offload.loading.values()])


def watch(engine: LLMEngine) -> list[dict[str, set[str]]]:
    """Record each `schedule()` of rank 0: the requests loading before and after it, those
    it scheduled and preempted; checks that every loading request is
    `WAITING_FOR_REMOTE_KVS`, has a load in the tier's offload and is not scheduled."""
    scheduler, seen = engine.scheduler, []

    def schedule(schedule=scheduler.schedule):
        before = set(scheduler.loading)
        out = schedule()
        loading = set(scheduler.loading)
        assert loading == set(engine.offload.loading)
        assert all(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in scheduler.loading.values()
        )
        scheduled = {s.request.request_id for s in out.scheduled}
        assert not scheduled & loading
        seen.append(
            {
                "before": before,
                "after": loading,
                "scheduled": scheduled,
                "preempted": set(out.preempted_request_ids),
            }
        )
        return out

    scheduler.schedule = schedule
    return seen


def run(engine: LLMEngine, ids: list[str], outputs=()) -> dict:
    """Step until every request of `ids` has finished; their final outputs, from these
    steps' and `outputs` (of earlier steps)."""
    done = {o.request_id: o for o in outputs if o.finished}
    for _ in range(500):
        if set(ids) <= set(done):
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError(f"unfinished after 500 steps: {set(ids) - set(done)}")


def served(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Serve `prompts` once (a tier entry each, then evicted from the device pool by a
    reset of its prefix cache): the histories that return."""
    first = engine.generate(prompts, GREEDY)
    engine.offload.complete_stores()
    assert engine.kv_cache_manager.reset_prefix_cache()
    return [p + o.output_token_ids + [5, 6, 7] for p, o in zip(prompts, first, strict=True)]


def test_a_request_waits_for_its_load_while_others_run(text_model, text_reference):
    """Returning conversations wait for their loads, held for several steps, while new
    prompts are served; then they run from what was loaded. Tokens equal those without
    the tier and the dense reference's; nothing is held at the end."""
    rng = np.random.default_rng(4)
    engine = LLMEngine(text_model, TIER)
    returning = served(engine, [rng.integers(3, 512, 40).tolist() for _ in range(2)])
    new = [rng.integers(3, 512, 20).tolist() for _ in range(2)]
    seen = watch(engine)
    with stagings_held(engine):
        ids = [engine.add_request(p, sampling=LONG) for p in returning + new]
        for _ in range(4):
            engine.step()
    done = run(engine, ids)
    # The returning requests were admitted into `loading` and stayed there while their
    # stagings were held; the new ones ran in those steps; then the loads were taken
    # and the returning requests computed the rest.
    assert all(s["after"] == set(ids[:2]) for s in seen[:4])
    assert all(s["scheduled"] == set(ids[2:]) for s in seen[:4])
    recent = engine.stats.steps_since(engine.num_steps - len(seen))
    assert [s.num_loading for s in recent[:4]] == [2] * 4
    assert [done[r].num_host_cached_tokens for r in ids] == [40, 40, 0, 0]
    assert engine.stats.total("host_hit_tokens") >= 80  # more: preempted ones come back
    without = LLMEngine(text_model, dataclasses.replace(TIER, kv_offloading_size=None))
    expected = without.generate(returning + new, LONG)
    assert [done[r].output_token_ids for r in ids] == [o.output_token_ids for o in expected]
    assert_dense(text_reference, [[done[r] for r in ids]])
    assert_nothing_held(engine)


def test_abort_during_a_load_leaks_nothing(text_model, text_reference):
    """One request is aborted while its staging is queued (cancelled), one right after its
    load went with a step (nothing computed yet); the others are served as without the
    aborts, and the pool, the tier's pins and its loads are all back."""
    engine = LLMEngine(text_model, TIER)
    rng = np.random.default_rng(1)
    returning = served(engine, [rng.integers(3, 512, 40).tolist() for _ in range(3)])
    prompts = [*returning, rng.integers(3, 512, 20).tolist()]  # the last one runs
    with stagings_held(engine):
        ids = [engine.add_request(p, sampling=GREEDY) for p in prompts]
        engine.step()
        assert set(engine.scheduler.loading) == set(ids[:3])
        tier = engine.offload.tier
        assert sum(e.ref_cnt for e in tier._entries.values()) == 3 * 5  # 5 blocks each
        engine.abort(ids[0])  # its staging is still queued: cancelled, unpinned
        assert ids[0] not in engine.offload.loading
        assert sum(e.ref_cnt for e in tier._entries.values()) == 2 * 5
    finish_stagings(engine)
    outputs = engine.step()  # takes the two loads: dispatched before this step's forward
    assert not engine.scheduler.loading
    assert engine.scheduler.get_request(ids[1]).status == RequestStatus.RUNNING
    assert engine.scheduler.get_request(ids[1]).num_output_tokens == 0
    engine.abort(ids[1])  # its blocks are freed after the load that writes them
    done = run(engine, ids, outputs)
    assert [done[r].finish_reason for r in ids] == ["abort", "abort", "length", "length"]
    assert [done[r].num_host_cached_tokens for r in ids[2:]] == [40, 0]
    assert_dense(text_reference, [[done[r] for r in ids[2:]]])
    without = LLMEngine(text_model, dataclasses.replace(TIER, kv_offloading_size=None))
    alone = without.generate(prompts[2:], GREEDY)  # the two, with no tier, no abort
    assert [o.output_token_ids for o in alone] == [done[r].output_token_ids for r in ids[2:]]
    assert_nothing_held(engine)


def test_running_requests_are_preempted_around_a_loading_one_never_it(text_model, text_reference):
    """Two long requests run while two returning ones wait for their held loads, holding
    their blocks: the pool runs out, a running request is preempted (a loading one
    never is: vLLM's rule, it is not running), and later re-admitted. Tokens equal those
    without the tier and the dense reference's; nothing is held at the end."""
    rng = np.random.default_rng(5)
    old = [rng.integers(3, 512, 40).tolist() for _ in range(2)]
    new = [rng.integers(3, 512, 40).tolist() for _ in range(2)]
    engine = LLMEngine(text_model, TIER)
    returning = served(engine, old)
    seen = watch(engine)
    with stagings_held(engine):
        ids = [engine.add_request(p, sampling=LONG) for p in new]
        ids += [engine.add_request(p, sampling=GREEDY) for p in returning]
        for _ in range(40):
            engine.step()
            if any(s["preempted"] and s["before"] for s in seen):
                break
    done = run(engine, ids)
    around = [s for s in seen if s["preempted"] and s["before"]]
    assert around, "a running request was preempted while others loaded"
    assert all(not s["preempted"] & s["before"] for s in seen)  # never a loading one
    assert done[ids[1]].num_preemptions > 0
    assert [done[r].num_host_cached_tokens for r in ids[2:]] == [40, 40]
    without = LLMEngine(text_model, dataclasses.replace(TIER, kv_offloading_size=None))
    expected = without.generate(new, LONG) + without.generate(returning, GREEDY)
    assert [done[r].output_token_ids for r in ids] == [o.output_token_ids for o in expected]
    assert_dense(text_reference, [[done[r] for r in ids]])
    assert_nothing_held(engine)


def test_with_only_a_load_pending_the_engine_waits_for_its_staging(text_model, text_reference):
    """A returning request alone: the step admitting it runs nothing and waits for its
    staging, the next takes its load (the request runs from the step after), then it
    computes: two empty steps, however long the staging takes, not one per poll."""
    engine = LLMEngine(text_model, TIER)
    returning = served(engine, [np.random.default_rng(6).integers(3, 512, 40).tolist()])
    first_step = engine.num_steps
    (out,) = engine.generate(returning, GREEDY)
    steps = engine.stats.steps_since(first_step)
    assert [s.num_loading for s in steps[:2]] == [1, 0]
    # (With async scheduling the last step only collects the last token.)
    assert [s.num_scheduled_requests for s in steps[:-1]] == [0, 0] + [1] * (len(steps) - 3)
    assert out.num_host_cached_tokens == 40
    assert_dense(text_reference, [[out]])
    assert_nothing_held(engine)
