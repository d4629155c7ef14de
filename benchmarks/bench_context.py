"""The engine's decode step as the context grows, on real weights (CPU).

    python -m benchmarks.bench_context [--batch 8] [--contexts 64 1024] [--rounds 3] [--record]

A batch of `--batch` requests with random prompts of each `--contexts` length (prefix
caching off, so every request reads its own pages; the whole batch prefills in one step,
so every later step decodes all of it) decodes `DECODE_STEPS` greedy tokens;
a step's time is the engine's own split of it (host time plus time blocked on the
device), the median over the decode steps. The step at the longest context less the
step at the shortest is what attention over the extra keys costs:
`attention_ms_per_1k_keys` divides it by the extra keys per request over 1,000. The
engine runs as a CPU user gets it (one stack per layer, float32) on `bench_decode`'s
checkpoints: its real weights by default (dequantised in the peer environment the first
time), its real-shaped random ones by name (`--models smollm2-135m-shaped`). Medians and ranges
over rounds; the contexts interleaved in each round. Each row's first two cells are its
name and milliseconds (`ab_host` reads them).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from tqdm import tqdm

from benchmarks._common import add_record_option, print_table, results_name, spread, write_json
from benchmarks.bench_decode import REAL_WEIGHTS, checkpoint_dir

DECODE_STEPS = 16


def step_ms(engine, prompts: list[list[int]]) -> float:
    """Milliseconds per decode step of the whole batch: the median over one generation's
    decode steps (every request decoding, nothing compiled) of the engine's own split of
    the step, host time plus time blocked on the device."""
    from jaxkv.engine import SamplingParams

    first = engine.num_steps
    engine.generate(prompts, SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True))
    steps = [
        s.host_s + s.wait_s
        for s in engine.stats.steps_since(first)
        if s.num_scheduled_tokens == len(prompts) and s.compilations == 0
    ]
    if not steps:
        raise RuntimeError(f"no step decoded all {len(prompts)} requests (is the pool too small?)")
    return statistics.median(steps) * 1e3


def bench_checkpoint(name: str, batch: int, contexts: list[int], rounds: int) -> dict:
    from jaxkv import models
    from jaxkv.engine import EngineConfig, LLMEngine

    longest = max(contexts)
    config = EngineConfig(
        block_size=16, kv_cache_memory=2**32, max_num_seqs=batch,
        max_num_batched_tokens=batch * longest, max_model_len=longest + 2 * DECODE_STEPS,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(models.load_model(checkpoint_dir(name)), config)
    rng = np.random.default_rng(0)
    prompts = {c: [rng.integers(3, 30000, c).tolist() for _ in range(batch)] for c in contexts}
    for batch_prompts in prompts.values():  # compile every step shape the rounds use
        step_ms(engine, batch_prompts)
    runs: dict[int, list[float]] = {c: [] for c in contexts}
    for _ in tqdm(range(rounds), desc=f"{name} rounds"):
        for context, batch_prompts in prompts.items():
            runs[context].append(step_ms(engine, batch_prompts))
    short, long_ = min(contexts), max(contexts)
    extra_k = (long_ - short) / 1000
    per_1k = [(b - a) / extra_k for a, b in zip(runs[short], runs[long_], strict=True)]
    return {"batch": batch, "runs": runs, "attention_ms_per_1k_keys": per_1k}


def spread_cell(values: list[float]) -> str:
    figures = spread(values)
    return f"{figures['median']:.4g} [{figures['min']:.4g}, {figures['max']:.4g}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(REAL_WEIGHTS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    add_record_option(parser)
    args = parser.parse_args()
    if len(args.contexts) < 2:
        parser.error(f"--contexts needs at least two lengths, got {args.contexts}")
    payload = {}
    for name in args.models:
        result = payload[name] = bench_checkpoint(name, args.batch, args.contexts, args.rounds)
        rows = [[f"{name}/ctx_{c}", spread_cell(result["runs"][c])] for c in args.contexts]
        per_1k = spread_cell(result["attention_ms_per_1k_keys"])
        rows.append([f"{name}/attention_ms_per_1k_keys", per_1k])
        title = f"\n{name}: decode ms per step at batch {args.batch} (median [range])"
        print_table(title, ["", "ms"], rows)
    print("wrote", write_json(results_name("bench_context", parser, args), payload, args.record))


if __name__ == "__main__":
    main()
