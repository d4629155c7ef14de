"""KV events on the wire: what publishing costs and what routing by them gains.

    python -m benchmarks.bench_kv_events [--repeats 5] [--record]

1. Publisher throughput: batches of `BlockStored` events (one 16-token block each, as a
   decode step stores them) published as fast as the caller can, no subscriber: events
   per second the background thread sustains (queue drained, all sent), and the caller's
   cost per `publish()`.
2. Step-loop cost: engine host time per decode step at 256 running requests
   (`bench_engine.decode_steps`, overlap off), publishing off vs on, interleaved runs
   (the order alternating per round), median and range over the rounds. The 20 timed
   steps include those where the requests fill a block (256 events in a few batches), so
   the per-run mean carries those bursts and the median the typical step; the stepping
   thread's CPU time per step and the publishing thread's (an upper bound on the GIL time
   it takes from the loop) are less disturbed by other load than wall time.
3. What building the events costs the stepping thread: the host-only scheduler and
   manager serving `bench_host`'s workload (600 requests, up to 256 running) with the
   manager's events off vs on (`enable_kv_cache_events`), interleaved rounds; the extra
   CPU per stored block, and that times the blocks a decode step at 256 running stores
   (256 / 16 a step on average) over the engine's host step without publishing.
4. Routing (`examples/kv_aware_routing.py`, 4 engine processes): prefix hit rate and
   prefill tokens computed, index-routed vs round-robin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
        assert publisher.flush(60.0)
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
# run's steps) and the stepping thread's CPU ms per step.
STEP_STATS = ("host_ms", "host_ms_mean", "main_cpu_ms")


def bench_step_cost(model, tmp: str, repeats: int, steps: int, running: int) -> dict:
    decode_steps(model, running, False, 3)  # compile the shapes
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for round_ in range(repeats):
        order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
        for mode in order:
            fields = {}
            if mode == "on":
                fields = {"kv_events_endpoint": f"ipc://{tmp}/step-{round_}",
                          "kv_events_replay_endpoint": f"ipc://{tmp}/replay-{round_}"}  # fmt: skip
            runs[mode].append(decode_steps(model, running, False, steps, **fields))
    result: dict = {"running": running, "steps": steps, "rounds": repeats}
    for stat in STEP_STATS:
        off = [r[stat] for r in runs["off"]]
        on = [r[stat] for r in runs["on"]]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        result[stat] = {"off": spread(off), "on": spread(on), "on/off": spread(ratios)}
    publisher_ms = [r["publisher_cpu_ms"] for r in runs["on"]]
    result["publisher_cpu_ms"] = spread(publisher_ms)
    # The publishing thread's CPU per step against the host step without it: an upper
    # bound on what it takes from the step loop (it holds the GIL at most that long).
    result["publisher_cpu_fraction"] = (
        statistics.median(publisher_ms) / result["host_ms"]["off"]["median"]
    )
    return result


def bench_event_building(repeats: int) -> dict:
    """CPU seconds of a host-only serve with the manager's events off vs on (interleaved
    rounds), and the extra microseconds per block the events announce."""
    from benchmarks.bench_host import JaxkvEngine, make_workload, serve

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
    return {"off_s": spread(seconds[False]), "on_s": spread(seconds[True]),
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the step-cost A/B")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--events-per-batch", type=int, default=64)
    parser.add_argument("--engines", type=int, default=4)
    add_record_option(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        publisher = bench_publisher(tmp, args.batches, args.events_per_batch)
        model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
        step = bench_step_cost(model, tmp, args.repeats, args.steps, args.running)
    building = bench_event_building(args.repeats)
    routing = bench_routing(args.engines)

    print_table(
        "publisher throughput (no subscriber)",
        ["batches", "events/batch", "events/s", "publish() us/batch"],
        [[publisher["batches"], publisher["events_per_batch"], publisher["events_per_s"],
          publisher["publish_call_us"]]],
    )  # fmt: skip
    print_table(
        f"engine host ms per decode step at {args.running} running, publishing off vs on "
        f"({args.repeats} interleaved rounds of {args.steps} steps)",
        ["per-run statistic", "off median", "on median", "on/off median", "on/off range"],
        [[stat, s["off"]["median"], s["on"]["median"], s["on/off"]["median"],
          f"{s['on/off']['min']:.3f}-{s['on/off']['max']:.3f}"]
         for stat, s in ((k, step[k]) for k in STEP_STATS)],
    )  # fmt: skip
    print(
        f"publishing thread: {step['publisher_cpu_ms']['median']:.3f} ms CPU per step "
        f"({step['publisher_cpu_fraction']:.1%} of the host step without publishing)"
    )
    # A decode step at `running` requests of 16-token blocks stores running / 16 blocks.
    building["step_fraction"] = (
        building["us_per_block"] * 1e-3 * args.running / 16 / step["host_ms"]["off"]["median"]
    )
    print_table(
        "building the events on the stepping thread (host-only serve, 600 requests)",
        ["events off s", "events on s", "on/off median", "on/off range", "blocks stored",
         "us per block", "share of an engine host step"],
        [[building["off_s"]["median"], building["on_s"]["median"],
          building["on/off"]["median"],
          f"{building['on/off']['min']:.3f}-{building['on/off']['max']:.3f}",
          building["blocks_stored"], building["us_per_block"],
          f"{building['step_fraction']:.2%}"]],
    )  # fmt: skip
    print_table(
        f"routing {args.engines} engines (examples/kv_aware_routing.py)",
        ["policy", "hit rate", "prefill tokens", "index predicted exactly"],
        [[p, f"{routing[p]['hit_rate']:.1%}", routing[p]["prefill_tokens"],
          f"{routing[p]['predicted_exactly']:.0%}"] for p in ("round-robin", "index")],
    )  # fmt: skip
    print(f"index-routed: {routing['prefill_ratio']:.2f}x fewer prefill tokens than round-robin")
    result = {"publisher": publisher, "step_cost": step, "event_building": building,
              "routing": routing, "workload": vars(args)}  # fmt: skip
    write_json(results_name("bench_kv_events", parser, args), result, record=args.record)
    return result


if __name__ == "__main__":
    main()
