"""The host-memory KV tier (`EngineConfig(kv_offloading_size=...)`) on a multi-turn chat.

    python -m benchmarks.bench_offload --repeats 5
    python -m benchmarks.bench_offload --model 270m-shaped --system-tokens 480 \\
        --conversations 9 --turns 3 --repeats 3
    python -m benchmarks.bench_offload --sweep             # hit rate against host budget

(add `--record` to replace the figures RESULTS.md cites; otherwise benchmarks/out/).

Conversations over three shared system prompts (`--system-tokens` each) come back turn
after turn (each turn: the history, the model's 16-token reply, a new 16-48-token user
message; every conversation's turn `k` arrives after all of turn `k - 1` finished). The
working set is what an unbounded device pool holds cached at the end (every KV-cache
group's blocks of every conversation's final history, shared prompts once), measured
by the compile pass of "unbounded". The device pool holds a quarter of it, so returning
conversations find their prefix evicted. Engines on the same workload, interleaved,
`--repeats` rounds each after a compile pass (median and range):

- "unbounded": a device pool holding the whole working set (the target),
- "tier off": the quarter pool alone (evicted prefixes are recomputed),
- "tier on": the quarter pool plus a host tier of twice the working set's bytes,
- "tier on, sync copies": the same, every host-tier copy waited for where it is
  dispatched (the calibration of the copy time; its tokens and counts are tier on's).

Reported: prefill tokens computed (the target: tier on within 1.15x of unbounded),
time to first token p50/p90 and throughput (ratios of tier on to tier off), host-tier
hit rate, bytes moved (in total and per engine step: `StepStats.host_loaded_bytes +
host_stored_bytes`: the tier's bytes, which are also what crosses the device link, a
block's transfer moving only its group's layers), and how much of the copy time the overlap hides.
The step loop's time on host-tier copies is timed from here by wrapping the engine's
runner: stores, dispatching the gathers (`ModelRunner.gather_blocks`) plus reading
them (`GatheredBlocks.read`, which waits for a copy not done; the engine reads them a
step later, `HostOffload.complete_stores`); loads, putting the verified host blocks on
the device (`BlockTransfers.load`). "copy s" is that time in "tier on, sync
copies" (the device first idle, each copy then waited for); "loop waited s" is that
time in "tier on"; hidden = 1 - waited / copy. Not seen by these timers: a step
program that donates the KV cache may wait, at its dispatch, for a gather still
reading it (that shows in the step's host time). On a CPU the copies and the forward
share the cores, so the overlap has little to hide and contention can make the
overlapped copies slower than the isolated ones (a negative fraction). A load is
staged (read and verified) on a worker thread while its request waits
(`WAITING_FOR_REMOTE_KVS`) and the others run; its scatter then goes ahead of a later
step, so it overlaps at most that step's dispatch.
The tokens of every configuration must be equal.

`--sweep` (instead): host budgets of 1/8, 1/4, 1/2, 1 and 2 times the working set's
bytes behind the quarter pool, one run each (counts do not depend on timing), host hit
rate and prefill tokens computed per budget, plotted to a PNG next to the JSON.

Random weights, float32, CPU. `--model tiny`: the built-in Gemma-style tiny model
(prefill costs little, so the tier saves little time). `--model 270m-shaped`: a
`jaxkv.models` Gemma 3 checkpoint of Gemma-3-270M's shape (`bench_decode.GEMMA3_270M`:
18 layers, hidden 640, 4 query heads, 1 KV head of 256, five sliding-window layers
(window 512) per full-attention layer, so a full-attention group and five sliding-window
groups of three layers each), written once with random weights under
benchmarks/out/checkpoints/; its vocabulary is cut to 16384 (from 262144) to spare
memory and time (the prompts use token ids below 512; the vocabulary changes only
the embedding and the head). The window matters only for histories longer than 512
tokens: with `--system-tokens 480` every history from the second turn on exceeds it
(at least 480 + 16 + 16 + 16 = 528 tokens), so the sliding-window groups store and
load only the window's blocks before a hit's end (32-33 blocks, where full attention
needs all 31-42 of a history); with the default 64 the histories stay inside the window and a
sliding-window group needs every block, as full attention does.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from benchmarks._common import (
    OUT_DIR,
    add_record_option,
    print_table,
    results_name,
    spread,
    write_json,
)
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

BLOCK = 16
REPLY = SamplingParams(max_tokens=16, ignore_eos=True)
MODELS = ("270m-shaped", "tiny")
VOCAB_270M = 16384
SWEEP = (1 / 8, 1 / 4, 1 / 2, 1, 2)  # host budgets, times the working set's bytes
SYNC = "tier on, sync copies"


def gemma3_270m_checkpoint() -> Path:
    """The random-weight Gemma-3-270M-shaped checkpoint of `VOCAB_270M` tokens (written
    once under benchmarks/out/, then reused by every benchmark that runs it)."""
    from benchmarks.bench_decode import GEMMA3_270M
    from jaxkv import models

    path = OUT_DIR / "checkpoints" / f"gemma3-270m-shaped-{VOCAB_270M}-vocab"
    if not (path / "config.json").exists():
        print(f"writing a random-weight Gemma-3-270M-shaped checkpoint to {path} ...")
        models.save_random_checkpoint(path, dict(GEMMA3_270M, vocab_size=VOCAB_270M), seed=0)
    return path


def load_model(name: str):
    if name == "tiny":
        return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
    from jaxkv import models

    return models.load_model(gemma3_270m_checkpoint())


def conversations(
    num: int, turns: int, system_tokens: int = 64, seed: int = 0
) -> tuple[list[list[int]], list[list]]:
    """First prompts (one of three shared system prompts, then a user message) and each
    turn's new user messages (16-48 tokens)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 512, system_tokens).tolist() for _ in range(3)]
    firsts = [
        systems[i % 3] + rng.integers(3, 512, int(rng.integers(16, 48))).tolist()
        for i in range(num)
    ]
    follow = [
        [rng.integers(3, 512, int(rng.integers(16, 48))).tolist() for _ in range(turns - 1)]
        for _ in range(num)
    ]
    return firsts, follow


def history_blocks(firsts, follow) -> int:
    """Blocks of every conversation's final history, each counted (an upper bound on one
    group's share of the working set)."""
    total = sum(
        -(-(len(f) + sum(len(m) for m in msgs) + REPLY.max_tokens * (len(msgs) + 1)) // BLOCK)
        for f, msgs in zip(firsts, follow, strict=True)
    )
    return total


class CopyTimer:
    """The step loop's seconds on host-tier copies (module docstring), by wrapping the
    engine's runner: `store_s` dispatching (`dispatch_s`) and reading gathers, `load_s`
    putting loads on the device. `sync`: wait for the device to idle before each copy
    (not counted) and for the copy after it (counted), so the time is the whole copy's.
    (the loads are the runner's `transfers.load`, wrapped on this runner only.)"""

    def __init__(self, engine: LLMEngine, sync: bool) -> None:
        self.store_s = self.load_s = self.dispatch_s = 0.0
        runner = engine.runner
        gather, load = runner.gather_blocks, runner.transfers.load

        def timed_gather(block_ids, layers):
            if sync:
                jax.block_until_ready(runner.kv_cache)
            start = time.perf_counter()
            parts = [_TimedGathered(g, self) for g in gather(block_ids, layers)]
            self.dispatch_s += time.perf_counter() - start
            self.store_s += time.perf_counter() - start
            if sync:
                for part in parts:
                    part.read()
            return parts

        def timed_load(kv_cache, outs):
            if not any(len(out.kv_load_block_ids) for out in outs):
                return load(kv_cache, outs)
            if sync:
                jax.block_until_ready(kv_cache)
            start = time.perf_counter()
            kv_cache = load(kv_cache, outs)
            if sync:
                jax.block_until_ready(kv_cache)
            self.load_s += time.perf_counter() - start
            return kv_cache

        runner.gather_blocks, runner.transfers.load = timed_gather, timed_load


class _TimedGathered:
    """A `GatheredBlocks` whose (one) read is timed into `timer.store_s`."""

    def __init__(self, inner, timer: CopyTimer) -> None:
        self.inner, self.timer, self.blocks = inner, timer, None

    def ready(self) -> bool:
        return self.blocks is not None or self.inner.ready()

    def read(self) -> np.ndarray:
        if self.blocks is None:
            start = time.perf_counter()
            self.blocks = self.inner.read()
            self.timer.store_s += time.perf_counter() - start
        return self.blocks


def serve(model, config: EngineConfig, firsts, follow, sync: bool = False) -> dict:
    """All turns of all conversations; prefill tokens, TTFTs, wall time, tokens, host-tier
    bytes and copy times, the working set (cached blocks at the end)."""
    engine = LLMEngine(model, config)
    timer = CopyTimer(engine, sync) if config.kv_offloading_size else None
    history = [list(f) for f in firsts]
    ttfts: list[float] = []
    outputs_all = []
    start = time.perf_counter()
    for turn in range(len(follow[0]) + 1):
        added = {engine.add_request(h, sampling=REPLY): time.perf_counter() for h in history}
        first_seen: set[str] = set()
        done = {}
        while len(done) < len(added):
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first_seen:
                    first_seen.add(out.request_id)
                    ttfts.append(time.perf_counter() - added[out.request_id])
                if out.finished:
                    done[out.request_id] = out
        outs = [done[rid] for rid in added]
        outputs_all.append([o.output_token_ids for o in outs])
        if turn < len(follow[0]):
            history = [
                h + o.output_token_ids + follow[i][turn]
                for i, (h, o) in enumerate(zip(history, outs, strict=True))
            ]
    wall = time.perf_counter() - start
    generated = sum(len(t) for turn in outputs_all for t in turn)
    decode = generated - sum(len(turn) for turn in outputs_all)
    summary = engine.stats.summary()
    moved = [s.host_loaded_bytes + s.host_stored_bytes for s in engine.stats.steps_since(0)]
    busy = [m for m in moved if m]
    pool = engine.kv_cache_managers[0].block_pool
    result = {
        "prefill_tokens": int(summary["num_scheduled_tokens"]) - decode,
        "ttft_p50": float(np.percentile(ttfts, 50)),
        "ttft_p90": float(np.percentile(ttfts, 90)),
        "throughput": generated / wall,
        "wall_s": wall,
        "steps": len(moved),
        "host_hit_rate": engine.stats.host_hit_rate,
        "host_loaded_mib": summary["host_loaded_bytes"] / 2**20,
        "host_stored_mib": summary["host_stored_bytes"] / 2**20,
        "kib_per_step": sum(moved) / len(moved) / 2**10,
        "kib_per_moving_step": sum(busy) / len(busy) / 2**10 if busy else 0.0,
        "max_kib_per_step": max(moved) / 2**10,
        "moving_steps": len(busy),
        "store_s": timer.store_s if timer else 0.0,
        "load_s": timer.load_s if timer else 0.0,
        "store_dispatch_s": timer.dispatch_s if timer else 0.0,
        "preemptions": engine.num_preemptions,
        "cached_blocks": sum(b.block_hash is not None for b in pool.blocks),
        "tokens": outputs_all,
    }
    result["copy_s"] = result["store_s"] + result["load_s"]
    return result


def workload(model, num_convs: int, turns: int, system_tokens: int):
    """The conversations, the base config, the unbounded config, the quarter pool (blocks)
    and the working set (blocks, host bytes) from the unbounded compile pass."""
    firsts, follow = conversations(num_convs, turns, system_tokens)
    max_len = system_tokens + turns * (48 + REPLY.max_tokens) + BLOCK
    base = EngineConfig(
        block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=128,
        max_model_len=-(-max_len // BLOCK) * BLOCK,
    )  # fmt: skip
    probe = LLMEngine(
        model,
        dataclasses.replace(
            base, num_blocks=8 * (base.max_model_len // BLOCK) + 1, kv_offloading_size=2**30
        ),
    )
    num_groups = len(probe.runner.kv_cache_config.kv_cache_groups)
    block_bytes = probe.offload.block_bytes
    del probe
    unbounded = dataclasses.replace(
        base, num_blocks=num_groups * history_blocks(firsts, follow) + 8
    )
    blocks = serve(model, unbounded, firsts, follow)["cached_blocks"]
    # the quarter pool; at least one request of max_model_len (a window may span one block
    # more) and the null block
    quarter = max(blocks // 4, num_groups * (base.max_model_len // BLOCK + 1) + 2)
    return firsts, follow, base, unbounded, quarter, blocks, blocks * block_bytes


def bench(model, repeats: int, num_convs: int, turns: int, system_tokens: int) -> dict:
    firsts, follow, base, unbounded, quarter, blocks, ws_bytes = workload(
        model, num_convs, turns, system_tokens
    )
    on = dataclasses.replace(base, num_blocks=quarter, kv_offloading_size=2 * ws_bytes)
    configs = {
        "unbounded": unbounded,
        "tier off": dataclasses.replace(base, num_blocks=quarter),
        "tier on": on,
        SYNC: on,
    }
    for name, config in configs.items():  # compile every shape the runs use
        if name != "unbounded":  # compiled by `workload`
            serve(model, config, firsts, follow, sync=name == SYNC)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in tqdm(range(repeats), desc="offloading off/on", unit="round"):
        for name, config in configs.items():
            runs[name].append(serve(model, config, firsts, follow, sync=name == SYNC))
    tokens = {name: r[-1].pop("tokens") for name, r in runs.items()}
    for r in runs.values():
        for run in r:
            run.pop("tokens", None)
    assert all(t == tokens["unbounded"] for t in tokens.values()), "the tier changed tokens"

    def ratios(key: str, num: str, den: str) -> dict:
        return spread([a[key] / b[key] for a, b in zip(runs[num], runs[den], strict=True)])

    def hidden(key: str) -> dict:
        return spread(
            [
                1 - a[key] / b[key] if b[key] else 0.0
                for a, b in zip(runs["tier on"], runs[SYNC], strict=True)
            ]
        )

    return {
        **workload_fields(num_convs, turns, system_tokens, blocks, ws_bytes),
        "host_budget_mib": on.kv_offloading_size / 2**20,
        "device_blocks": {name: c.num_blocks for name, c in configs.items()},
        "runs": {
            name: {k: spread([run[k] for run in r]) for k in r[0]} for name, r in runs.items()
        },
        "prefill_on_over_unbounded": ratios("prefill_tokens", "tier on", "unbounded"),
        "prefill_off_over_unbounded": ratios("prefill_tokens", "tier off", "unbounded"),
        "ttft_p50_on_over_off": ratios("ttft_p50", "tier on", "tier off"),
        "ttft_p90_on_over_off": ratios("ttft_p90", "tier on", "tier off"),
        "throughput_on_over_off": ratios("throughput", "tier on", "tier off"),
        "throughput_on_over_sync": ratios("throughput", "tier on", SYNC),
        "hidden_copy_fraction": hidden("copy_s"),
        "hidden_store_fraction": hidden("store_s"),
        "hidden_load_fraction": hidden("load_s"),
    }


def workload_fields(num_convs: int, turns: int, system_tokens: int, blocks: int, ws_bytes: int):
    """The workload's description in a result."""
    return {"conversations": num_convs, "turns": turns, "system_tokens": system_tokens,
            "working_set_blocks": blocks, "working_set_host_mib": ws_bytes / 2**20}  # fmt: skip


def sweep(model, num_convs: int, turns: int, system_tokens: int) -> dict:
    """Host hit rate and prefill tokens per host budget (`SWEEP`), the quarter pool."""
    firsts, follow, base, unbounded, num_quarter, blocks, ws_bytes = workload(
        model, num_convs, turns, system_tokens
    )
    quarter = dataclasses.replace(base, num_blocks=num_quarter)
    target = serve(model, unbounded, firsts, follow)["prefill_tokens"]
    points = []
    for fraction in tqdm((0, *SWEEP), desc="host budgets", unit="budget"):
        budget = int(fraction * ws_bytes) or None
        run = serve(model, dataclasses.replace(quarter, kv_offloading_size=budget), firsts, follow)
        points.append(
            {
                "budget_fraction": fraction,
                "budget_mib": (budget or 0) / 2**20,
                "host_hit_rate": run["host_hit_rate"],
                "prefill_tokens": run["prefill_tokens"],
                "prefill_over_unbounded": run["prefill_tokens"] / target,
                "host_loaded_mib": run["host_loaded_mib"],
                "host_stored_mib": run["host_stored_mib"],
            }
        )
    return {
        **workload_fields(num_convs, turns, system_tokens, blocks, ws_bytes),
        "device_blocks": quarter.num_blocks,
        "unbounded_prefill_tokens": target,
        "points": points,
    }


def plot_sweep(result: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["points"] if p["budget_fraction"]]
    x = [p["budget_fraction"] for p in points]
    fig, (hits, prefill) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    hits.plot(x, [p["host_hit_rate"] for p in points], "o-")
    hits.set_ylabel("host-tier hit rate")
    hits.set_ylim(0, 1)
    off = result["points"][0]["prefill_over_unbounded"]
    prefill.plot(x, [p["prefill_over_unbounded"] for p in points], "o-", label="tier on")
    prefill.axhline(off, color="gray", ls="--", label="tier off")
    prefill.axhline(1.15, color="green", ls=":", label="target 1.15")
    prefill.set_ylabel("prefill tokens / unbounded")
    prefill.set_xlabel("host budget / working set bytes")
    prefill.set_xscale("log", base=2)
    prefill.legend()
    for ax in (hits, prefill):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _cell(s: dict, fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument(
        "--sweep", action="store_true", help="host hit rate against host budget, plotted"
    )
    add_record_option(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    workload_name = (
        f"{args.model} model, multi-turn chat: {args.conversations} conversations x "
        f"{args.turns} turns, system prompts of {args.system_tokens} tokens"
    )
    name = results_name("bench_offload", parser, args)
    if args.sweep:
        result = sweep(model, args.conversations, args.turns, args.system_tokens)
        print_table(
            f"{workload_name}, working set {result['working_set_blocks']} blocks "
            f"({result['working_set_host_mib']:.2f} MiB), device pool "
            f"{result['device_blocks']} blocks; unbounded prefill "
            f"{result['unbounded_prefill_tokens']} tokens",
            ["host budget / working set", "MiB", "host hits", "prefill tokens",
             "prefill / unbounded", "MiB in / out"],
            [[f"{p['budget_fraction']:g}", f"{p['budget_mib']:.2f}", f"{p['host_hit_rate']:.1%}",
              p["prefill_tokens"], f"{p['prefill_over_unbounded']:.2f}",
              f"{p['host_loaded_mib']:.2f} / {p['host_stored_mib']:.2f}"]
             for p in result["points"]],
        )  # fmt: skip
        path = write_json(name, result, record=args.record)
        plot_sweep(result, path.with_suffix(".png"), workload_name)
        return result
    result = bench(model, args.repeats, args.conversations, args.turns, args.system_tokens)
    rows = [
        [name, _cell(r["prefill_tokens"], "{:.0f}"), _cell(r["ttft_p50"]), _cell(r["ttft_p90"]),
         _cell(r["throughput"]), f"{r['host_hit_rate']['median']:.1%}",
         f"{r['host_loaded_mib']['median']:.2f} / {r['host_stored_mib']['median']:.2f}",
         f"{r['preemptions']['median']:.0f}"]
        for name, r in result["runs"].items()
    ]  # fmt: skip
    print_table(
        f"{workload_name}, working set {result['working_set_blocks']} blocks, device pool "
        f"{result['device_blocks']}, host budget {result['host_budget_mib']:.1f} MiB",
        ["config", "prefill tokens", "TTFT p50 s", "TTFT p90 s", "tokens/s", "host hits",
         "host MiB in/out", "preempt"],
        rows,
    )  # fmt: skip
    copies = [
        [name, f"{r['kib_per_step']['median']:.1f}", f"{r['kib_per_moving_step']['median']:.1f}",
         f"{r['max_kib_per_step']['median']:.1f}",
         f"{r['moving_steps']['median']:.0f} / {r['steps']['median']:.0f}",
         _cell(r["store_s"]), _cell(r["load_s"])]
        for name, r in result["runs"].items() if name in ("tier on", SYNC)
    ]  # fmt: skip
    print_table(
        "host-tier copies: KiB moved per step (loaded + stored), step-loop seconds on store / "
        "load copies",
        ["config", "KiB/step", "KiB/moving step", "max KiB/step", "moving / all steps",
         "store s", "load s"],
        copies,
    )  # fmt: skip
    print_table(
        "ratios, median (range) over rounds",
        ["ratio", "value"],
        [
            ["prefill tier on / unbounded (target <= 1.15)",
             _cell(result["prefill_on_over_unbounded"])],
            ["prefill tier off / unbounded", _cell(result["prefill_off_over_unbounded"])],
            ["TTFT p50 tier on / off", _cell(result["ttft_p50_on_over_off"])],
            ["TTFT p90 tier on / off", _cell(result["ttft_p90_on_over_off"])],
            ["throughput tier on / off", _cell(result["throughput_on_over_off"])],
            ["throughput tier on / sync copies", _cell(result["throughput_on_over_sync"])],
            ["copy time hidden (1 - loop waited / copy s)",
             _cell(result["hidden_copy_fraction"])],
            ["  stores", _cell(result["hidden_store_fraction"])],
            ["  loads", _cell(result["hidden_load_fraction"])],
        ],
    )  # fmt: skip
    write_json(name, result, record=args.record)
    return result


if __name__ == "__main__":
    main()
