"""Memory of a server that never stops: resident set size over a long run.

    python -m benchmarks.bench_long_run [--steps 100000] [--subscribers 4] [--record]

The tiny built-in model (`jaxkv.testing.tiny_model`) serves a stream of short requests
(a new one whenever fewer than `max_num_seqs` run) with KV events published (ipc, with
a replay socket) for `--steps` engine steps, twice: with no subscriber, then with
`--subscribers` SUB sockets that connect and never read. The RSS is sampled every
`steps / 20` steps. After warm-up (the stats window, the replay buffer and each
subscriber's queue filled: `--warm-up` of the steps) it should stay flat: the report
gives the growth from the end of warm-up to the end of the run, in MB and in bytes per
step. The bounds are EngineConfig's defaults except `--hwm` (the per-subscriber queue).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import numpy as np
import zmq

from benchmarks._common import add_record_option, print_table, results_name, write_json
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


def run(model, steps: int, subscribers: int, hwm: int, samples: int) -> dict:
    """`steps` engine steps of a steady request stream; RSS every `steps / samples`."""
    where = tempfile.mkdtemp(prefix="jaxkv-long-run-")
    config = EngineConfig(
        block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=64, kv_events_endpoint=f"ipc://{where}/pub",
        kv_events_replay_endpoint=f"ipc://{where}/replay", kv_events_hwm=hwm,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    socks = []
    for _ in range(subscribers):  # they connect, subscribe and never read
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(config.kv_events_endpoint)
        socks.append(sock)
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    every = max(1, steps // samples)
    series, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        while engine.scheduler.num_unfinished_requests < config.max_num_seqs:
            # Random prompts: each request stores new blocks, so every step has events.
            engine.add_request(rng.integers(3, 512, 12).tolist(), sampling=sampling)
        engine.step()
        if step % every == 0:
            gc.collect()
            series.append((step, rss_mb()))
            rate = step / (time.perf_counter() - start)
            print(f"  step {step:>7}/{steps}  rss {series[-1][1]:8.1f} MB  {rate:6.0f} steps/s",
                  flush=True)  # fmt: skip
    (publisher,) = engine.kv_event_publishers
    publisher.flush(10.0)
    result = {
        "subscribers": subscribers,
        "steps": steps,
        "series_mb": series,
        "stats_window": len(engine.stats.steps),
        "stats_steps": engine.stats.num_steps,
        "events_sent": publisher.num_sent,
        "events_buffered": len(publisher._buffer),
        "events_dropped": publisher.num_dropped,
        "steps_per_s": steps / (time.perf_counter() - start),
    }
    engine.shutdown()
    for sock in socks:
        sock.close()
    return result


def growth(result: dict, warm_up: float) -> tuple[float, float]:
    """RSS growth (MB) from the first sample past `warm_up` of the run to the last, and
    that in bytes per step."""
    series = result["series_mb"]
    after = [(s, mb) for s, mb in series if s >= warm_up * result["steps"]]
    (s0, mb0), (s1, mb1) = after[0], after[-1]
    return mb1 - mb0, (mb1 - mb0) * 2**20 / max(s1 - s0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--subscribers", type=int, default=4)
    parser.add_argument("--hwm", type=int, default=1000, help="kv_events_hwm")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warm-up", type=float, default=0.5, help="fraction of the steps")
    add_record_option(parser)
    args = parser.parse_args()
    model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
    results = []
    for subscribers in (0, args.subscribers):
        print(f"{args.steps} steps, {subscribers} non-reading subscribers:", flush=True)
        results.append(run(model, args.steps, subscribers, args.hwm, args.samples))
    rows = []
    for result in results:
        mb, per_step = growth(result, args.warm_up)
        series = result["series_mb"]
        result["growth_after_warm_up_mb"], result["growth_bytes_per_step"] = mb, per_step
        rows.append([result["subscribers"], result["steps"], series[0][1], series[-1][1], mb,
                     per_step, result["stats_window"], result["events_buffered"],
                     result["steps_per_s"]])  # fmt: skip
    print_table(
        f"\nRSS over a long run (growth measured after the first {args.warm_up:.0%} of steps)",
        ["subscribers", "steps", "first MB", "last MB", "growth MB", "B/step", "window",
         "buffered", "steps/s"],
        rows,
    )  # fmt: skip
    name = results_name("long_run", parser, args, ("record", "samples"))
    write_json(name, {"args": vars(args), "runs": results}, args.record)


if __name__ == "__main__":
    main()
