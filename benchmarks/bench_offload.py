"""The host-memory KV tier (`EngineConfig(kv_offloading_size=...)`) on a multi-turn chat.

    python -m benchmarks.bench_offload [--repeats 3] [--record]

Conversations over three shared system prompts come back turn after turn (each turn:
the history, the model's reply, a new user message; every conversation's turn `k`
arrives after all of turn `k - 1` finished). The device pool holds a quarter of the
working set (every conversation's final history), so returning conversations find
their prefix evicted. Three engines on the same workload, interleaved, `--repeats`
rounds each (median and range):

- "unbounded": a device pool holding the whole working set (the target),
- "tier off": the quarter pool alone (evicted prefixes are recomputed),
- "tier on": the quarter pool plus a host tier holding the working set.

Reported: prefill tokens computed (the target: tier on within 1.15x of unbounded),
time to first token p50/p90 and throughput (ratios of tier on to tier off), host-tier
hit rate and bytes moved. The tokens of all three must be equal. Random weights, CPU:
`--model tiny` (the built-in Gemma-style tiny model: prefill costs little, so the tier
saves little time) or `--model 270m-shaped` (Gemma-3-270M's width and attention: hidden
640, 4 query heads, 1 KV head of 256; 6 of its 18 layers, all full attention, as the
tier serves one full-attention group).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
from tqdm import tqdm

from benchmarks._common import add_record_option, print_table, results_name, write_json
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, TinyConfig, tiny_configs

BLOCK = 16
REPLY = SamplingParams(max_tokens=16, ignore_eos=True)
MODELS = {
    "tiny": tiny_configs()["gemma-style-tiny"],
    "270m-shaped": TinyConfig(
        hidden_size=640, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256,
    ),
}  # fmt: skip


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def conversations(num: int, turns: int, seed: int = 0) -> tuple[list[list[int]], list[list]]:
    """First prompts (a shared system prompt of 64 tokens, then a user message) and each
    turn's new user messages (16-48 tokens)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 512, 64).tolist() for _ in range(3)]
    firsts = [
        systems[i % 3] + rng.integers(3, 512, int(rng.integers(16, 48))).tolist()
        for i in range(num)
    ]
    follow = [
        [rng.integers(3, 512, int(rng.integers(16, 48))).tolist() for _ in range(turns - 1)]
        for _ in range(num)
    ]
    return firsts, follow


def working_set_blocks(firsts, follow) -> int:
    """Blocks of every conversation's final history (shared system prompts once)."""
    total = sum(
        len(f) + sum(len(m) for m in msgs) + REPLY.max_tokens * (len(msgs) + 1)
        for f, msgs in zip(firsts, follow, strict=True)
    )
    return -(-total // BLOCK) - 2 * (64 // BLOCK)


def serve(model, config: EngineConfig, firsts, follow) -> dict:
    """All turns of all conversations; prefill tokens, TTFTs, wall time, tokens."""
    engine = LLMEngine(model, config)
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
    return {
        "prefill_tokens": int(summary["num_scheduled_tokens"]) - decode,
        "ttft_p50": float(np.percentile(ttfts, 50)),
        "ttft_p90": float(np.percentile(ttfts, 90)),
        "throughput": generated / wall,
        "wall_s": wall,
        "host_hit_rate": engine.stats.host_hit_rate,
        "host_loaded_mib": summary["host_loaded_bytes"] / 2**20,
        "host_stored_mib": summary["host_stored_bytes"] / 2**20,
        "preemptions": engine.num_preemptions,
        "tokens": outputs_all,
    }


def bench(model, repeats: int, num_convs: int, turns: int) -> dict:
    firsts, follow = conversations(num_convs, turns)
    blocks = working_set_blocks(firsts, follow)
    max_len = 64 + turns * (48 + REPLY.max_tokens) + BLOCK
    base = EngineConfig(
        block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=128,
        max_model_len=-(-max_len // BLOCK) * BLOCK,
    )  # fmt: skip
    quarter = max(blocks // 4, base.max_model_len // BLOCK + 2)
    configs = {
        "unbounded": dataclasses.replace(base, num_blocks=blocks + 8),
        "tier off": dataclasses.replace(base, num_blocks=quarter),
        "tier on": dataclasses.replace(base, num_blocks=quarter, kv_offloading_size=256 * 2**20),
    }
    for config in configs.values():  # compile every shape the runs use
        serve(model, config, firsts, follow)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in tqdm(range(repeats), desc="offloading off/on", unit="round"):
        for name, config in configs.items():
            runs[name].append(serve(model, config, firsts, follow))
    tokens = {name: r[-1].pop("tokens") for name, r in runs.items()}
    for r in runs.values():
        for run in r:
            run.pop("tokens", None)
    assert tokens["tier on"] == tokens["tier off"] == tokens["unbounded"], "the tier changed tokens"

    def ratios(key: str, num: str, den: str) -> dict:
        return spread([a[key] / b[key] for a, b in zip(runs[num], runs[den], strict=True)])

    return {
        "conversations": num_convs,
        "turns": turns,
        "working_set_blocks": blocks,
        "device_blocks": {name: c.num_blocks for name, c in configs.items()},
        "runs": {
            name: {k: spread([run[k] for run in r]) for k in r[0]} for name, r in runs.items()
        },
        "prefill_on_over_unbounded": ratios("prefill_tokens", "tier on", "unbounded"),
        "prefill_off_over_unbounded": ratios("prefill_tokens", "tier off", "unbounded"),
        "ttft_p50_on_over_off": ratios("ttft_p50", "tier on", "tier off"),
        "ttft_p90_on_over_off": ratios("ttft_p90", "tier on", "tier off"),
        "throughput_on_over_off": ratios("throughput", "tier on", "tier off"),
    }


def _cell(s: dict, fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    add_record_option(parser)
    args = parser.parse_args(argv)
    model = TinyCausalLM(MODELS[args.model], seed=0)
    result = bench(model, args.repeats, args.conversations, args.turns)
    rows = [
        [name, _cell(r["prefill_tokens"], "{:.0f}"), _cell(r["ttft_p50"]), _cell(r["ttft_p90"]),
         _cell(r["throughput"]), f"{r['host_hit_rate']['median']:.1%}",
         f"{r['host_loaded_mib']['median']:.2f} / {r['host_stored_mib']['median']:.2f}",
         f"{r['preemptions']['median']:.0f}"]
        for name, r in result["runs"].items()
    ]  # fmt: skip
    print_table(
        f"{args.model} model, multi-turn chat: {args.conversations} conversations x "
        f"{args.turns} turns, working set {result['working_set_blocks']} blocks, device pool "
        f"{result['device_blocks']}",
        ["config", "prefill tokens", "TTFT p50 s", "TTFT p90 s", "tokens/s", "host hits",
         "host MiB in/out", "preempt"],
        rows,
    )  # fmt: skip
    print_table(
        "ratios, median (range) over rounds",
        ["ratio", "value"],
        [
            [
                "prefill tier on / unbounded (target <= 1.15)",
                _cell(result["prefill_on_over_unbounded"]),
            ],
            ["prefill tier off / unbounded", _cell(result["prefill_off_over_unbounded"])],
            ["TTFT p50 tier on / off", _cell(result["ttft_p50_on_over_off"])],
            ["TTFT p90 tier on / off", _cell(result["ttft_p90_on_over_off"])],
            ["throughput tier on / off", _cell(result["throughput_on_over_off"])],
        ],
    )
    write_json(results_name("bench_offload", parser, args), result, record=args.record)
    return result


if __name__ == "__main__":
    main()
