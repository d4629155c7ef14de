"""KV events on the wire: what publishing costs and what routing by them gains.

    python -m benchmarks.bench_kv_events [--repeats 5] [--record]

1. Publisher throughput: batches of `BlockStored` events (one 16-token block each, as a
   decode step stores them) published as fast as the caller can, no subscriber, then the
   caller sleeping until all are sent: events per second the background thread sustains,
   and the caller's cost per `publish()`.
2. Step-loop cost: engine host time per decode step at 256 running requests
   (`bench_engine.decode_steps`; async scheduling off, on (the engine's default) or
   both: `--overlap`), publishing off vs on, interleaved runs
   (the order alternating per round), median and range over the rounds. The timed steps
   include those where the requests fill a block (256 events in a few batches), so the
   per-run mean carries those bursts and the median the typical step. The cost of
   publishing, (1) as an A/B per round: the stepping thread's extra CPU per step (on
   minus off) plus the publishing thread's CPU per step, over the same round's host step
   without publishing (too noisy here to resolve 2%); (2) by parts (`_PartTimers`): on
   the stepping thread, queueing the step's `BlockStored` records and the engine's
   `EngineEvents.publish` (`take_events`, `publish`: a `queue.put`), plus the
   publishing thread's CPU (building, converting, encoding, sending) that ran outside the
   stepping thread's device waits; and, as an upper bound for a loop that never waits,
   with all of the publishing thread's CPU.
3. What the events cost the stepping thread, host only (no model, so less noise):
   (a) the scheduler and manager decoding as `decode_steps` does (256 requests of 8-token
   prompts, 16-token blocks, to 49 tokens each), CPU per step (the stepping thread's and
   the publishing thread's) with events off vs built and published each step as the
   engine does (queued; the publishing thread sends them), paired per round; (b)
   `bench_host`'s workload (600 requests, up to 256 running) with the manager's events
   off vs on (`enable_kv_cache_events`: the records queued, built when taken after the
   serve), interleaved rounds; the extra CPU per
   stored block, and that times the blocks a decode step at 256 running stores (256 / 16
   a step on average) over the engine's host step without publishing.
4. Routing (`examples/kv_aware_routing.py`, 4 engine processes): prefix hit rate and
   prefill tokens computed, index-routed vs round-robin.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks._common import (
    REPO_ROOT,
    add_record_option,
    print_table,
    results_name,
    write_json,
)
from benchmarks.bench_engine import decode_steps, spread
from jaxkv.kv_events import BlockStored
from jaxkv.kv_events_publisher import ZmqEventPublisher
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs


def bench_publisher(tmp: str, num_batches: int, events_per_batch: int) -> dict:
    parent = bytes(32)
    batches = [
        [
            BlockStored([os.urandom(32)], parent, list(range(i, i + 16)), 16, None)
            for i in range(events_per_batch)
        ]
        for _ in range(num_batches)
    ]
    publisher = ZmqEventPublisher(0, f"ipc://{tmp}/bench", max_queue_size=num_batches + 1)
    try:
        start = time.perf_counter()
        caller = 0.0
        for events in batches:
            t = time.perf_counter()
            publisher.publish(events)
            caller += time.perf_counter() - t
        # The caller sleeps (as the step loop waits for the device) while the thread sends.
        deadline = start + 60.0
        while publisher.num_sent < num_batches and time.perf_counter() < deadline:
            time.sleep(0.005)
        wall = time.perf_counter() - start
    finally:
        publisher.shutdown()
    assert publisher.num_sent == num_batches and publisher.num_dropped == 0
    events = num_batches * events_per_batch
    return {
        "batches": num_batches,
        "events_per_batch": events_per_batch,
        "events_per_s": events / wall,
        "publish_call_us": 1e6 * caller / num_batches,
    }


# Per-run statistics of `decode_steps`: host wall ms per step (median and mean over the
# run's steps), the stepping thread's CPU ms per step and the step loop's wall ms per step
# (the engine publishes while the device computes: what that hides shows only here).
STEP_STATS = ("host_ms", "host_ms_mean", "main_cpu_ms", "step_ms")


class _PartTimers:
    """Where publishing spends time, patched in for the timed runs (both modes).

    On the stepping thread, per step (`per_step`: one entry per `EngineEvents.publish`
    call, which each step makes once): that call (`take_events`, `publish`;
    CPU time, less that of the same call with publishing off: the call and the clock
    reads, system calls, cost a few microseconds of their own) and making the step's
    `DeferredBlockStored` records during its schedule (wall time, a clock read costing
    ~0.05 us against a system call's ~1 us; the call's own overhead is in it). On the
    publishing thread: each `ZmqEventPublisher._send_batch` (build the events, convert,
    encode, send) as a wall interval and its CPU time, and the stepping thread's device
    waits (`multihost.host_tokens`) as wall intervals, so the thread's CPU splits into
    what ran while the stepping thread waited for the device (it holds no GIL then:
    hidden) and what ran beside the step's Python (at most that much taken from the
    loop)."""

    def __init__(self) -> None:
        from jaxkv import block_pool
        from jaxkv.engine import multihost
        from jaxkv.engine.events import EngineEvents

        self.events_cls, self.block_pool, self.multihost = EngineEvents, block_pool, multihost
        self.publish_events = EngineEvents.__dict__["publish"]
        self.record_cls = block_pool.DeferredBlockStored
        self.send_batch = ZmqEventPublisher.__dict__["_send_batch"]
        self.host_tokens = multihost.host_tokens
        self.per_step: list[tuple[float, float]] = []  # (publish CPU s, build wall s)
        self._build_s = 0.0  # the step's so far
        self.waits: list[tuple[float, float]] = []
        self.sends: list[tuple[float, float, float]] = []  # (start, end, CPU s), the thread's

    def __enter__(self) -> _PartTimers:
        publish_events, record_cls = self.publish_events, self.record_cls
        send_batch, host_tokens = self.send_batch, self.host_tokens
        thread_time, perf_counter = time.thread_time, time.perf_counter
        stepping_thread = threading.get_ident()

        def timed_publish(events, *args) -> None:
            start = thread_time()
            publish_events(events, *args)
            self.per_step.append((thread_time() - start, self._build_s))
            self._build_s = 0.0

        def timed_record(*args):
            start = perf_counter()
            record = record_cls(*args)
            self._build_s += perf_counter() - start
            return record

        def timed_wait(sampled):
            start = perf_counter()
            tokens = host_tokens(sampled)
            self.waits.append((start, perf_counter()))
            return tokens

        def timed_send_batch(publisher, batch) -> None:
            assert threading.get_ident() != stepping_thread, "only the thread sends"
            start, cpu = perf_counter(), thread_time()
            send_batch(publisher, batch)
            self.sends.append((start, perf_counter(), thread_time() - cpu))

        self.events_cls.publish = timed_publish
        self.block_pool.DeferredBlockStored = timed_record
        self.multihost.host_tokens = timed_wait
        ZmqEventPublisher._send_batch = timed_send_batch
        return self

    def __exit__(self, *exc) -> None:
        self.events_cls.publish = self.publish_events
        self.block_pool.DeferredBlockStored = self.record_cls
        self.multihost.host_tokens = self.host_tokens
        ZmqEventPublisher._send_batch = self.send_batch

    def thread_cpu_beside_the_step(self) -> float:
        """CPU seconds of the publishing thread's sends that did not run wholly inside
        one of the stepping thread's device waits."""
        waits = sorted(self.waits)
        starts = [w[0] for w in waits]
        beside = 0.0
        for start, end, cpu in self.sends:
            i = bisect.bisect_right(starts, start) - 1
            if i < 0 or end > waits[i][1]:
                beside += cpu
        return beside


def bench_step_cost(model, tmp: str, repeats: int, steps: int, running: int, overlap: bool) -> dict:
    # Compile every shape the timed runs meet (the decode grows past a block boundary).
    decode_steps(model, running, overlap, steps)
    decode_steps(model, running, overlap, steps, kv_events_endpoint=f"ipc://{tmp}/warm")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    publish_ms: list[float] = []
    build_ms: list[float] = []
    beside_ms: list[float] = []  # the publishing thread's CPU outside the device waits
    for round_ in range(repeats):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        publish_call_ms = {}  # per mode: `EngineEvents.publish`, at once when off
        for mode in order:
            fields = {} if mode == "off" else {
                "kv_events_endpoint": f"ipc://{tmp}/step-{round_}",
                "kv_events_replay_endpoint": f"ipc://{tmp}/replay-{round_}"}  # fmt: skip
            with _PartTimers() as timers:  # both modes: the same timers in the loop
                runs[mode].append(decode_steps(model, running, overlap, steps, **fields))
            timed = timers.per_step[-steps:]  # the timed steps are the run's last
            publish_call_ms[mode] = 1e3 * sum(p for p, _ in timed) / steps
            if mode == "on":
                build_ms.append(1e3 * sum(b for _, b in timed) / steps)
                beside_ms.append(1e3 * timers.thread_cpu_beside_the_step() / steps)
        # Less the call and its timer's own cost (the clock reads are system calls).
        publish_ms.append(publish_call_ms["on"] - publish_call_ms["off"])
    result: dict = {"running": running, "steps": steps, "rounds": repeats, "overlap": overlap}
    for stat in STEP_STATS:
        off = [r[stat] for r in runs["off"]]
        on = [r[stat] for r in runs["on"]]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        result[stat] = {"off": spread(off), "on": spread(on), "on/off": spread(ratios)}
    publisher_ms = [r["publisher_cpu_ms"] for r in runs["on"]]
    result["publisher_cpu_ms"] = spread(publisher_ms)
    # The publishing thread's CPU per step against the host step without it: an upper
    # bound on what it takes from the step loop (it holds the GIL at most that long).
    host_off = result["host_ms"]["off"]["median"]
    host_mean_off = result["host_ms_mean"]["off"]["median"]
    result["publisher_cpu_fraction"] = statistics.median(publisher_ms) / host_off
    # The cost of publishing per round, (1) as an A/B: the stepping thread's extra CPU
    # per step (on minus off) plus the publishing thread's, over that round's host step
    # without publishing (the mean over steps: the costs are totals over the steps too).
    extra = [
        on["main_cpu_ms"] - off["main_cpu_ms"]
        for off, on in zip(runs["off"], runs["on"], strict=True)
    ]
    result["main_cpu_extra_ms"] = spread(extra)
    result["cost_fraction"] = spread(
        [(x + on["publisher_cpu_ms"]) / off["host_ms_mean"]
         for x, off, on in zip(extra, runs["off"], runs["on"], strict=True)]
    )  # fmt: skip
    # (2) by parts, timed where the work is: less disturbed by the machine's other load
    # than the A/B, which differences two whole-step CPU times. The stepping thread's
    # parts plus the publishing thread's CPU outside the device waits: what publishing
    # takes from the step loop; with all the thread's CPU instead, an upper bound.
    parts = [p + b + t for p, b, t in zip(publish_ms, build_ms, beside_ms, strict=True)]
    bound = [p + b + t for p, b, t in zip(publish_ms, build_ms, publisher_ms, strict=True)]
    result["publish_events_ms"] = spread(publish_ms)
    result["block_stored_event_ms"] = spread(build_ms)
    result["publisher_cpu_beside_step_ms"] = spread(beside_ms)
    result["parts_ms"] = spread(parts)
    result["parts_bound_ms"] = spread(bound)
    result["parts_fraction"] = {
        f"of {stat}": spread([p / off[stat] for p, off in zip(parts, runs["off"], strict=True)])
        for stat in ("host_ms_mean", "host_ms")
    }
    result["parts_bound_fraction"] = spread(
        [p / off["host_ms_mean"] for p, off in zip(bound, runs["off"], strict=True)]
    )
    result["host_ms_off"], result["host_ms_mean_off"] = host_off, host_mean_off
    result["runs"] = runs  # each run's statistics, in round order
    return result


def _host_decode_cpu(mode: str, endpoint: str, running: int = 256) -> float:
    """CPU ms per step of the host-only scheduler and manager decoding `running` requests
    as `decode_steps` does; `mode` "off" (no events), "on" (built, taken and published:
    the stepping thread's CPU plus the publishing thread's)."""
    import gc

    import numpy as np

    import jaxkv
    from jaxkv.engine.scheduler import Scheduler, SchedulerConfig

    fn = jaxkv.get_hash_fn_by_name("sha256")
    jaxkv.init_none_hash(fn)
    hasher = jaxkv.get_request_block_hasher(16, fn)
    spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    manager = jaxkv.KVCacheManager.from_spec(
        spec, running * 8 + 1, 128, enable_kv_cache_events=mode == "on"
    )
    config = SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=2 * running,
                             max_model_len=128)  # fmt: skip
    scheduler = Scheduler(manager, config, with_block_ids=False)
    rng = np.random.default_rng(running)
    for i in range(running):
        prompt = rng.integers(3, 512, 8).tolist()
        scheduler.add_request(jaxkv.Request(str(i), prompt, max_tokens=41, block_hasher=hasher))
    publisher = ZmqEventPublisher(0, endpoint) if mode == "on" else None
    thread_start = publisher.cpu_time() if publisher is not None else 0.0
    steps = 0
    gc.collect()
    gc.freeze()
    start = time.thread_time()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(
            out, [s.request.num_tokens * 7919 % 500 for s in out.scheduled]
        )
        if publisher is not None:
            # As the engine does: queued; the publishing thread sends them.
            events = manager.take_events(deferred=True)
            if events:
                publisher.publish(events)
        steps += 1
    seconds = time.thread_time() - start
    gc.unfreeze()
    if publisher is not None:  # the publishing thread's CPU counts too
        assert publisher.flush(10.0) and publisher.num_dropped == 0
        seconds += publisher.cpu_time() - thread_start
        publisher.shutdown()
    return 1e3 * seconds / steps


def bench_event_building(repeats: int, tmp: str) -> dict:
    """(a) The host-only decode's CPU per step with events off vs on (built, taken and
    published), paired per round; (b) CPU seconds of a host-only serve with the manager's
    events off vs on (interleaved rounds), and the extra microseconds per block the
    events announce."""
    from benchmarks.bench_host import JaxkvEngine, make_workload, serve

    decode: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(2 * repeats + 1):
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            decode[mode].append(_host_decode_cpu(mode, f"ipc://{tmp}/host-{round_}"))
    decode_extra = [on - off for off, on in zip(decode["off"], decode["on"], strict=True)]

    workload = make_workload(600)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    num_blocks = 0
    for round_ in range(repeats):
        for events in (False, True) if round_ % 2 == 0 else (True, False):
            engine = JaxkvEngine(workload, "sha256", events=events)
            seconds[events].append(serve(engine, workload).seconds)
            if events:
                num_blocks = sum(
                    len(e.block_hashes)
                    for e in engine.manager.take_events()
                    if isinstance(e, BlockStored)
                )
    extra = statistics.median(seconds[True]) - statistics.median(seconds[False])
    ratios = [on / off for off, on in zip(seconds[False], seconds[True], strict=True)]
    return {"decode_off_ms": spread(decode["off"]), "decode_on_ms": spread(decode["on"]),
            "decode_extra_ms": spread(decode_extra),
            "off_s": spread(seconds[False]), "on_s": spread(seconds[True]),
            "on/off": spread(ratios), "blocks_stored": num_blocks,
            "us_per_block": 1e6 * extra / num_blocks}  # fmt: skip


def bench_routing(engines: int) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "kv_aware_routing.py"), "--json",
         "--engines", str(engines)],
        capture_output=True, text=True, timeout=900,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the routing example failed:\n{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    rr, ix = results["round-robin"], results["index"]
    results["prefill_ratio"] = rr["prefill_tokens"] / ix["prefill_tokens"]
    return results


# The step-cost results, by async scheduling off / on.
STEP_COST_KEYS = {False: "step_cost", True: "step_cost_overlap"}


def print_step_cost(step: dict, args: argparse.Namespace) -> None:
    print_table(
        f"engine host ms per decode step at {args.running} running, async scheduling "
        f"{'on' if step['overlap'] else 'off'}, publishing off vs on ({args.repeats} "
        f"interleaved rounds of {args.steps} steps)",
        ["per-run statistic", "off median", "on median", "on/off median", "on/off range"],
        [[stat, s["off"]["median"], s["on"]["median"], s["on/off"]["median"],
          f"{s['on/off']['min']:.3f}-{s['on/off']['max']:.3f}"]
         for stat, s in ((k, step[k]) for k in STEP_STATS)],
    )  # fmt: skip
    cost, extra = step["cost_fraction"], step["main_cpu_extra_ms"]
    print(
        f"cost of publishing per round, A/B: (stepping thread's extra CPU + publishing "
        f"thread's CPU) / mean host step without publishing: {cost['median']:.2%} "
        f"(range {cost['min']:.2%} to {cost['max']:.2%}); the stepping thread's extra "
        f"CPU {extra['median']:.3f} ms per step (range {extra['min']:.3f} to "
        f"{extra['max']:.3f})"
    )
    by_parts, bound = step["parts_fraction"], step["parts_bound_fraction"]
    print(
        f"cost by parts, ms per step (median of rounds): EngineEvents.publish (take_events, "
        f"publish) {step['publish_events_ms']['median']:.4f} + queueing BlockStored "
        f"{step['block_stored_event_ms']['median']:.4f} + the publishing thread's CPU "
        f"outside the device waits {step['publisher_cpu_beside_step_ms']['median']:.4f} "
        f"(of {step['publisher_cpu_ms']['median']:.4f} in all) = "
        f"{step['parts_ms']['median']:.4f}; of the mean host step without publishing "
        f"{by_parts['of host_ms_mean']['median']:.2%} (range "
        f"{by_parts['of host_ms_mean']['min']:.2%} to "
        f"{by_parts['of host_ms_mean']['max']:.2%}), of the median host step "
        f"{by_parts['of host_ms']['median']:.2%} (range {by_parts['of host_ms']['min']:.2%} "
        f"to {by_parts['of host_ms']['max']:.2%}); counting all the thread's CPU "
        f"{bound['median']:.2%} (range {bound['min']:.2%} to {bound['max']:.2%}) of the "
        f"mean host step"
    )


SECTIONS = ("publisher", "step", "building", "routing")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the step-cost A/B")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--events-per-batch", type=int, default=64)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--overlap", choices=("off", "on", "both"), default="both",
        help="step-cost runs with async scheduling off (each step waits for its own "
             "tokens), on (the engine's default), or both",
    )  # fmt: skip
    parser.add_argument(
        "--sections", default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )  # fmt: skip
    add_record_option(parser)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    result: dict = {"workload": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        if "publisher" in sections:
            result["publisher"] = bench_publisher(tmp, args.batches, args.events_per_batch)
        if "step" in sections:
            model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
            for overlap in (False, True):
                if args.overlap in ("both", "on" if overlap else "off"):
                    result[STEP_COST_KEYS[overlap]] = bench_step_cost(
                        model, tmp, args.repeats, args.steps, args.running, overlap
                    )
        if "building" in sections:
            result["event_building"] = bench_event_building(args.repeats, tmp)
    if "routing" in sections:
        result["routing"] = bench_routing(args.engines)

    if "publisher" in result:
        publisher = result["publisher"]
        print_table(
            "publisher throughput (no subscriber)",
            ["batches", "events/batch", "events/s", "publish() us/batch"],
            [[publisher["batches"], publisher["events_per_batch"], publisher["events_per_s"],
              publisher["publish_call_us"]]],
        )  # fmt: skip
    for overlap in (False, True):
        if STEP_COST_KEYS[overlap] in result:
            print_step_cost(result[STEP_COST_KEYS[overlap]], args)
    step = result.get(STEP_COST_KEYS[False])
    building = result.get("event_building")
    if building is not None:
        host_ms = step["host_ms"]["off"]["median"] if step is not None else None
        decode_extra = building["decode_extra_ms"]
        print(
            f"host-only decode at 256 running, stepping thread CPU per step: events off "
            f"{building['decode_off_ms']['median']:.3f} ms, built and published "
            f"{building['decode_on_ms']['median']:.3f} ms; extra per round "
            f"{decode_extra['median']:.4f} ms (range {decode_extra['min']:.4f} to "
            f"{decode_extra['max']:.4f})"
            + (f", {decode_extra['median'] / host_ms:.2%} of the engine's host step"
               if host_ms else "")
        )  # fmt: skip
        # A decode step at `running` requests of 16-token blocks stores running / 16 blocks.
        share = "-"
        if host_ms:
            building["step_fraction"] = (
                building["us_per_block"] * 1e-3 * args.running / 16 / host_ms
            )
            share = f"{building['step_fraction']:.2%}"
        print_table(
            "queueing the events on the stepping thread (host-only serve, 600 requests)",
            ["events off s", "events on s", "on/off median", "on/off range", "blocks stored",
             "us per block", "share of an engine host step"],
            [[building["off_s"]["median"], building["on_s"]["median"],
              building["on/off"]["median"],
              f"{building['on/off']['min']:.3f}-{building['on/off']['max']:.3f}",
              building["blocks_stored"], building["us_per_block"], share]],
        )  # fmt: skip
    routing = result.get("routing")
    if routing is not None:
        print_table(
            f"routing {args.engines} engines (examples/kv_aware_routing.py)",
            ["policy", "hit rate", "prefill tokens", "index predicted exactly"],
            [[p, f"{routing[p]['hit_rate']:.1%}", routing[p]["prefill_tokens"],
              f"{routing[p]['predicted_exactly']:.0%}"] for p in ("round-robin", "index")],
        )  # fmt: skip
        print(
            f"index-routed: {routing['prefill_ratio']:.2f}x fewer prefill tokens than round-robin"
        )
    write_json(results_name("bench_kv_events", parser, args), result, record=args.record)
    return result


if __name__ == "__main__":
    main()
