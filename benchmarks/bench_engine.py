"""The engine end to end on the tiny built-in Gemma-style model (random weights, CPU).

    python -m benchmarks.bench_engine [--repeats 3] [--record]

1. Prefix caching on vs off on a shared-prefix workload (a long system prompt, short
   private tails): prefill tokens computed and wall time, both configurations
   interleaved in the same run, median and range of `--repeats` rounds.
2. Host vs device time per decode step at 8, 64 and 256 running requests, with the
   engine's overlap (async scheduling) on and off: how much of the host time the
   overlap hides.
3. Compilations: after `warm_up()`, a 500-step serving run with continuous arrivals,
   preemption and freed-block zeroing must compile nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
from tqdm import tqdm

from benchmarks._common import (
    add_record_option,
    print_table,
    results_name,
    spread,
    write_json,
)
from jaxkv.device import compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

# -- 1. prefix caching ------------------------------------------------------------------


def prefix_workload(num_requests: int, system_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 512, system_len).tolist()
    return [
        system + rng.integers(3, 512, int(rng.integers(4, 16))).tolist()
        for _ in range(num_requests)
    ]


def serve_prefix(model, config: EngineConfig, prompts: list[list[int]]) -> tuple[float, int, list]:
    engine = LLMEngine(model, config)
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    wall = time.perf_counter() - start
    generated = sum(len(o.output_token_ids) for o in outputs)
    decode_tokens = generated - len(outputs)  # each request's first token comes from prefill
    prefill = int(engine.stats.total("num_scheduled_tokens")) - decode_tokens
    return wall, prefill, [o.output_token_ids for o in outputs]


def bench_prefix(model, repeats: int, num_requests: int) -> dict:
    base = EngineConfig(
        block_size=16, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
        max_model_len=512,
    )  # fmt: skip
    prompts = prefix_workload(num_requests, system_len=256)
    configs = {
        "caching on": base,
        "caching off": dataclasses.replace(base, enable_prefix_caching=False),
    }
    for config in configs.values():  # compile every shape both runs use
        serve_prefix(model, config, prompts)
    walls: dict[str, list[float]] = {name: [] for name in configs}
    prefill: dict[str, int] = {}
    tokens: dict[str, list] = {}
    for _ in tqdm(range(repeats), desc="prefix caching on/off", unit="round"):
        for name, config in configs.items():
            wall, prefill[name], tokens[name] = serve_prefix(model, config, prompts)
            walls[name].append(wall)
    assert tokens["caching on"] == tokens["caching off"], "a prefix hit changed the output"
    return {
        "requests": num_requests,
        "system_prompt_tokens": 256,
        "prefill_tokens": prefill,
        "prefill_ratio": prefill["caching off"] / prefill["caching on"],
        "wall_s": {name: spread(v) for name, v in walls.items()},
        "wall_ratio": spread(
            [off / on for on, off in zip(walls["caching on"], walls["caching off"], strict=True)]
        ),
    }


# -- 2. host vs device time per step ----------------------------------------------------


def decode_steps(
    model,
    num_running: int,
    overlap: bool,
    steps: int,
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    **config_fields,
) -> dict:
    """Time `steps` steps in which `num_running` requests all decode, streaming
    `output_kind` outputs (`config_fields`: further `EngineConfig` settings)."""
    config = EngineConfig(
        block_size=16, num_blocks=num_running * 8 + 1, max_num_seqs=num_running,
        max_num_batched_tokens=2 * num_running, max_model_len=128, async_scheduling=overlap,
        **config_fields,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(num_running)
    for _ in range(num_running):
        engine.add_request(
            rng.integers(3, 512, 8).tolist(),
            sampling=SamplingParams(max_tokens=40, ignore_eos=True, output_kind=output_kind),
        )
    while len(engine.scheduler.running) < num_running or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill, then a step so every request decodes
    engine.step()
    first = engine.num_steps
    publishers = engine.kv_event_publishers
    publisher_cpu = sum(p.cpu_time() for p in publishers)
    cpu = time.thread_time()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    cpu = time.thread_time() - cpu
    for publisher in publishers:  # what the timed steps published, sent
        publisher.flush(10.0)
    publisher_cpu = sum(p.cpu_time() for p in publishers) - publisher_cpu
    engine.shutdown()
    measured = engine.stats.steps_since(first)
    assert all(s.num_scheduled_requests == num_running for s in measured)
    return {
        "step_ms": 1e3 * wall / steps,
        "host_ms": 1e3 * statistics.median(s.host_s for s in measured),
        "host_ms_mean": 1e3 * statistics.mean(s.host_s for s in measured),
        "main_cpu_ms": 1e3 * cpu / steps,  # the stepping thread's CPU time
        "publisher_cpu_ms": 1e3 * publisher_cpu / steps,  # KV event threads' (0: off)
        "wait_ms": 1e3 * statistics.median(s.wait_s for s in measured),
        "compilations": sum(s.compilations for s in measured),
    }


def bench_overlap(model, repeats: int, sizes: list[int], steps: int) -> list[dict]:
    rows = []
    for n in tqdm(sizes, desc="host vs device", unit="size"):
        decode_steps(model, n, True, 3)  # compile this size's shapes
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(repeats):
            for overlap in (False, True):
                runs[overlap].append(decode_steps(model, n, overlap, steps))
        sync, overlapped = runs[False], runs[True]
        host = statistics.median(r["host_ms"] for r in sync)
        device = statistics.median(r["wait_ms"] for r in sync)  # sync: the wait IS the device step
        sync_step = [r["step_ms"] for r in sync]
        async_step = [r["step_ms"] for r in overlapped]
        hidden = (statistics.median(sync_step) - statistics.median(async_step)) / max(host, 1e-9)
        rows.append({
            "running": n,
            "host_ms": host,
            "device_ms": device,
            "step_ms_sync": spread(sync_step),
            "step_ms_overlap": spread(async_step),
            "host_hidden_fraction": hidden,
            "compilations": sum(r["compilations"] for r in sync + overlapped),
        })  # fmt: skip
    return rows


# -- 3. compilations over a long run ------------------------------------------------------


def bench_compilations(model, num_steps: int) -> dict:
    config = EngineConfig(
        block_size=8, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=128, zero_freed_blocks=True,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    warm_start = time.perf_counter()
    programs = engine.warm_up()
    warm_s = time.perf_counter() - warm_start
    rng = np.random.default_rng(7)
    system = rng.integers(3, 512, 24).tolist()
    before = compilation_count()
    generated = 0
    for _ in tqdm(range(num_steps), desc="500-step run", unit="step"):
        while engine.scheduler.num_unfinished_requests < 6:
            tail = rng.integers(3, 512, int(rng.integers(1, 60))).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(4, 40)), ignore_eos=True)
            engine.add_request((system if rng.random() < 0.7 else []) + tail, sampling=params)
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return {
        "steps": num_steps,
        "warm_up_programs": programs,
        "warm_up_s": warm_s,
        "compilations_after_warm_up": compilation_count() - before,
        "generated_tokens": generated,
        "preemptions": engine.scheduler.num_preemptions,
        "freed_blocks_zeroed": int(engine.stats.total("num_freed_blocks")),
        "prefix_hit_rate": engine.stats.prefix_hit_rate,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="prefix-caching workload size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per size")
    parser.add_argument("--long-run-steps", type=int, default=500)
    add_record_option(parser)
    args = parser.parse_args(argv)
    model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)

    prefix = bench_prefix(model, args.repeats, args.requests)
    print_table(
        f"prefix caching on vs off ({args.requests} requests sharing a 256-token system prompt)",
        ["config", "prefill tokens", "wall s (median)", "wall s range"],
        [[name, prefix["prefill_tokens"][name], w["median"], f"{w['min']:.3g}-{w['max']:.3g}"]
         for name, w in prefix["wall_s"].items()],
    )  # fmt: skip
    print(f"prefill tokens {prefix['prefill_ratio']:.1f}x fewer with caching; wall time "
          f"{prefix['wall_ratio']['median']:.2f}x faster (range {prefix['wall_ratio']['min']:.2f}-"
          f"{prefix['wall_ratio']['max']:.2f})")  # fmt: skip

    overlap = bench_overlap(model, args.repeats, args.sizes, args.steps)
    print_table(
        "decode step: host vs device time, overlap off vs on (ms, medians)",
        ["running", "host", "device", "step sync", "step overlap", "host hidden"],
        [[r["running"], r["host_ms"], r["device_ms"], r["step_ms_sync"]["median"],
          r["step_ms_overlap"]["median"], f"{r['host_hidden_fraction']:.0%}"] for r in overlap],
    )  # fmt: skip

    compiles = bench_compilations(model, args.long_run_steps)
    print_table(
        "compilations after warm-up",
        ["steps", "warm-up programs", "compiled after warm-up", "preemptions", "zeroed blocks"],
        [[compiles["steps"], compiles["warm_up_programs"], compiles["compilations_after_warm_up"],
          compiles["preemptions"], compiles["freed_blocks_zeroed"]]],
    )  # fmt: skip
    result = {"prefix_caching": prefix, "overlap": overlap, "compilations": compiles,
              "workload": vars(args)}  # fmt: skip
    write_json(results_name("bench_engine", parser, args), result, record=args.record)
    return result


if __name__ == "__main__":
    main()
