"""A model run layer by layer on CPU: one program per layer against a few layers per
program, with the scanned layer body beside them.

    python -m benchmarks.bench_layer_programs [--rounds 4] [--record]

On CPU a model with one stack per layer (`scan_layers=False`, the CPU default) runs its
step as an inputs program, layer programs and a head program
(`jaxkv.engine.step_programs`). Each layer program takes a group of consecutive layers
(`layer_group_sizes`, at most `MAX_LAYER_PROGRAMS` groups); "one per layer" forces a
group per layer, as the engine ran before. One process, the three engines interleaved
in each round on the same checkpoint (the real SmolLM2-135M and Gemma-3-270M weights of
`bench_decode` when present, else its real-shaped random checkpoints), float32:

* decode at batch 1: 32 greedy tokens of a 16-token prompt less one token's time, per
  token;
* decode at batch 32: 16 steps of 32 such requests less the first token's time, per
  step, with the engine's own split of the step (`StepStats`: host time, time blocked
  on the device), medians over the round's decode steps;
* prefill of an 850-token prompt (one token).

Medians and ranges over rounds; ratios per round, "groups" over each other variant.
"""

from __future__ import annotations

import argparse
import gc
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
from benchmarks.bench_decode import REAL_WEIGHTS, checkpoint_dir

VARIANTS = ("one per layer", "groups", "scanned")
METRICS = ("decode_b1_ms", "decode_b32_ms", "b32_host_ms", "b32_wait_ms", "prefill_850_s")
BATCH, DECODE_STEPS, PROMPT_LEN = 32, 16, 850


def build_engines(ckpt) -> dict:
    """The three variants' engines on `ckpt` (same pool and limits)."""
    from jaxkv import models
    from jaxkv.engine import EngineConfig, LLMEngine, step_programs

    config = EngineConfig(
        block_size=16, kv_cache_memory=2**30, max_num_seqs=BATCH, max_num_batched_tokens=1024,
        max_model_len=2048, enable_prefix_caching=False,
    )  # fmt: skip
    default_groups = step_programs.MAX_LAYER_PROGRAMS
    engines = {}
    try:
        for variant in VARIANTS:
            model = models.load_model(ckpt, scan_layers=variant == "scanned")
            layers = model.config.num_hidden_layers
            # The runner groups layers when it is built: a group per layer for the first.
            step_programs.MAX_LAYER_PROGRAMS = (
                layers if variant == "one per layer" else default_groups
            )
            engines[variant] = LLMEngine(model, config)
    finally:
        step_programs.MAX_LAYER_PROGRAMS = default_groups
    return engines


def measure(engine, prompts: dict) -> dict:
    """One round's figures for `engine` (see the module docstring)."""
    from jaxkv.engine import SamplingParams

    def timed(batch, new_tokens) -> float:
        start = time.perf_counter()
        engine.generate(batch, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        return time.perf_counter() - start

    b1 = (timed(prompts["one"], 33) - timed(prompts["one"], 1)) / 32
    first = timed(prompts["batch"], 1)
    b32 = (timed(prompts["batch"], DECODE_STEPS + 1) - first) / DECODE_STEPS
    steps = [s for s in list(engine.stats.steps)[-DECODE_STEPS:] if s.num_scheduled_tokens == BATCH]
    return {
        "decode_b1_ms": b1 * 1e3,
        "decode_b32_ms": b32 * 1e3,
        "b32_host_ms": statistics.median(s.host_s for s in steps) * 1e3,
        "b32_wait_ms": statistics.median(s.wait_s for s in steps) * 1e3,
        "prefill_850_s": timed(prompts["long"], 1),
    }


def bench_checkpoint(name: str, rounds: int) -> dict:
    ckpt = checkpoint_dir(name)
    engines = build_engines(ckpt)
    rng = np.random.default_rng(0)
    prompts = {
        "one": [rng.integers(3, 30000, 16).tolist()],
        "batch": [rng.integers(3, 30000, 16).tolist() for _ in range(BATCH)],
        "long": [rng.integers(3, 30000, PROMPT_LEN).tolist()],
    }
    for engine in engines.values():  # compile every shape the rounds use
        measure(engine, prompts)
    runs = {variant: [] for variant in VARIANTS}
    for _ in tqdm(range(rounds), desc=f"{name} rounds"):
        for variant, engine in engines.items():
            runs[variant].append(measure(engine, prompts))
    programs = {variant: engine.runner.programs_per_step for variant, engine in engines.items()}
    del engines
    gc.collect()
    return {"runs": runs, "programs_per_step_shape": programs}


def summarise(result: dict) -> dict:
    runs = result["runs"]
    out = {v: {m: spread([r[m] for r in runs[v]]) for m in METRICS} for v in VARIANTS}
    out["groups_over"] = {
        other: {
            m: spread([g[m] / o[m] for g, o in zip(runs["groups"], runs[other], strict=True)])
            for m in ("decode_b1_ms", "decode_b32_ms", "prefill_850_s")
        }
        for other in ("one per layer", "scanned")
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(REAL_WEIGHTS))
    add_record_option(parser)
    args = parser.parse_args()
    payload = {}
    for name in args.models:
        result = bench_checkpoint(name, args.rounds)
        summary = summarise(result)
        payload[name] = {**result, "summary": summary}
        rows = [
            [variant, *(f"{s[m]['median']:.4g} [{s[m]['min']:.4g}, {s[m]['max']:.4g}]"
                        for m in METRICS)]
            for variant, s in ((v, summary[v]) for v in VARIANTS)
        ]  # fmt: skip
        for other, ratios in summary["groups_over"].items():
            rows.append(
                [f"groups / {other}"]
                + [f"{ratios[m]['median']:.3f}" if m in ratios else "" for m in METRICS]
            )
        print_table(f"\n{name} (medians [ranges] over {args.rounds} rounds)", ["", *METRICS], rows)
    print(
        "wrote",
        write_json(results_name("bench_layer_programs", parser, args), payload, args.record),
    )


if __name__ == "__main__":
    main()
