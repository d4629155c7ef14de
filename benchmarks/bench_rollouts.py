"""Rollouts for a JAX training loop: `SamplingParams(n=...)` through the engine (issue 39).

    python -m benchmarks.bench_rollouts [--quick] [--repeats 3] [--repeats-270m 2]
        [--no-peer] [--record]

Per model (`tiny`: `jaxkv.models`' gemma3-tiny; `270m-shaped`: bench_offload's
random-weight Gemma-3-270M-shaped checkpoint, vocabulary 16384), one engine (block size
16, 16 sequences, 512 batched tokens, prefix caching on; `warm_up()` first, so every
step shape is compiled before anything is timed) samples one parent request per n in
{1, 4, 16} and prompt length in {512, 2048} (random tokens, a new prompt each round, so
no round hits an earlier one's blocks), temperature 1, seeded, `ignore_eos`, to
`--max-tokens`. Rounds interleave the grid; figures are the median and [min, max]:

- rollout tokens/s: the n samples' generated tokens over the wall time from
  `add_request` to the last step (the prompt's prefill included);
- prompt tokens computed per sample: the scheduled tokens less the decode tokens fed
  back (generated less one per sample), over n;
- blocks held: the most pool blocks in use after any step, against the issue's bound
  per KV-cache group, prompt blocks + n x (generated blocks + 1), times the groups
  (a sliding-window group holds fewer: the bound is loose for Gemma 3);
- programs compiled during the timed rollouts (0: the warm-up compiled them all).

update_weights: each round, `--updates` updates of the warm engine with the model's
state (a second load of the checkpoint: arrays the trainer owns), each timed until the
written buffers are ready; against building a new engine with the same weights,
`load_model` + `LLMEngine` + `warm_up` (which runs every step program once): in this
process (JAX reuses the old engine's compiled programs) and in a new process (imports
included, the programs loaded from the persistent compilation cache).

Rounds: `--repeats` of the tiny model, `--repeats-270m` of the other, whose prompts'
prefill (8,256 prompt tokens a round at ~60 tokens/s on 2 shared cores) makes a round
take 3-6 minutes: the default run takes about 15 minutes on a loaded 2-core machine.

vLLM 0.33, host side (`benchmarks/_vllm_rollouts.py` under `.venv-vllm`; skipped when
that is absent or with `--no-peer`): the same parent requests through vLLM's own
scheduler over a pool of the same size and KV-cache groups, its `n` fanned out as its
`LLMEngine.add_request` does: prompt tokens computed per sample, blocks held, and when
each child was first scheduled and what it hit in the prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from benchmarks._common import (
    OUT_DIR,
    PEER_VENV,
    REPO_ROOT,
    add_record_option,
    print_table,
    results_name,
    write_json,
)
from benchmarks.bench_decode import run_child
from benchmarks.bench_offload import gemma3_270m_checkpoint, spread
from jaxkv import models
from jaxkv.device import compilation_count
from jaxkv.device.compile_guard import compilation_cache_hits
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from jaxkv.kv_cache_planning import get_kv_cache_groups

BLOCK = 16
MODELS = ("tiny", "270m-shaped")
VLLM_SCRIPT = Path(__file__).with_name("_vllm_rollouts.py")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint(name: str, max_model_len: int) -> Path:
    """The model's random-weight checkpoint (written once under benchmarks/out/)."""
    if name == "270m-shaped":
        return gemma3_270m_checkpoint()
    path = OUT_DIR / "checkpoints" / f"gemma3-tiny-{max_model_len}-positions"
    if not (path / "config.json").exists():
        config = dict(models.tiny_configs()["gemma3-tiny"], max_position_embeddings=max_model_len)
        models.save_random_checkpoint(path, config, seed=0)
    return path


def kv_groups(model) -> list[tuple[int, int | None]]:
    """The model's KV-cache groups as `(layers, sliding window or None)`, in the engine's
    order (what the vLLM side builds its pool of)."""
    groups = []
    for group in get_kv_cache_groups(model.kv_cache_specs(BLOCK, "float32")):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append((len(group.layer_names), spec.sliding_window))
        elif isinstance(spec, FullAttentionSpec):
            groups.append((len(group.layer_names), None))
        else:
            raise ValueError(
                f"KV-cache group {group.layer_names}: {spec!r} is neither full attention "
                "nor a sliding window (the vLLM side builds only those)"
            )
    return groups


def blocks_bound(groups: int, n: int, prompt_len: int, max_tokens: int) -> int:
    """Issue 39's bound on the blocks one parent holds, per group, times the groups."""
    return groups * (cdiv(prompt_len, BLOCK) + n * (cdiv(max_tokens, BLOCK) + 1))


def engine_config(args: argparse.Namespace, groups: int) -> EngineConfig:
    """The engine for the whole grid, its pool twice the largest parent's bound: a parent
    past the bound must show up as blocks held, not as preemptions that would hide it."""
    max_model_len = max(args.prompt_lens) + args.max_tokens
    bound = blocks_bound(groups, max(args.n), max(args.prompt_lens), args.max_tokens)
    return EngineConfig(
        block_size=BLOCK, num_blocks=2 * bound + 1, max_num_seqs=max(args.n),
        max_num_batched_tokens=args.batch_tokens, max_model_len=max_model_len,
    )  # fmt: skip


@dataclass(frozen=True)
class Rollout:
    """One parent request's figures (module docstring)."""

    tokens_per_s: float
    prompt_computed: int  # over all n samples
    blocks_held: int
    compilations: int


def rollout(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Rollout:
    """Sample `prompt` `params.n` times to the end; blocks held sampled after each step."""
    pool = engine.kv_cache_manager.block_pool
    totals = engine.stats.totals
    scheduled, generated = totals["num_scheduled_tokens"], totals["num_generated_tokens"]
    compiled, held = compilation_count(), 0
    start = time.perf_counter()
    engine.add_request(prompt, sampling=params)
    while engine.has_unfinished_requests():
        engine.step()
        held = max(held, pool.num_gpu_blocks - 1 - engine.num_free_blocks)
    wall = time.perf_counter() - start
    generated = int(totals["num_generated_tokens"] - generated)
    if generated != params.n * params.max_tokens:
        raise RuntimeError(f"generated {generated} tokens, expected n x max_tokens = "
                           f"{params.n * params.max_tokens}")  # fmt: skip
    decode_fed_back = generated - params.n  # each sample's last token is never fed back
    return Rollout(
        generated / wall, int(totals["num_scheduled_tokens"] - scheduled) - decode_fed_back,
        held, compilation_count() - compiled,
    )  # fmt: skip


def time_update(engine: LLMEngine, state: nnx.State) -> float:
    """Seconds of one `update_weights`, until the engine's written buffers are ready."""
    start = time.perf_counter()
    engine.update_weights(state)
    jax.block_until_ready(engine.runner.weight_leaves)
    return time.perf_counter() - start


def time_rebuild(path: Path, config: EngineConfig) -> dict:
    """Seconds to load the checkpoint and build and warm up a new engine on it, and the
    programs that built (none: in this process JAX reuses the old engine's)."""
    programs = compilation_count()
    start = time.perf_counter()
    engine = LLMEngine(models.load_model(path), config)
    engine.warm_up()
    seconds = time.perf_counter() - start
    engine.shutdown()
    return {"seconds": seconds, "programs": compilation_count() - programs}


def time_new_process_rebuild(path: Path, sizes: dict) -> dict:
    """The same in a new process (`benchmarks/_rebuild_engine.py`: programs from the
    persistent compilation cache); `seconds` from its start to its figures, imports in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "benchmarks._rebuild_engine", str(path), json.dumps(sizes)]
    start = time.perf_counter()
    figures = run_child(argv, env)
    return {"seconds": time.perf_counter() - start, **figures}


def rounds_of(name: str, args: argparse.Namespace) -> int:
    return args.repeats_270m if name == "270m-shaped" else args.repeats


def grid(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The `(n, prompt length)` cases, in the order each round runs them."""
    return [(n, prompt_len) for prompt_len in args.prompt_lens for n in args.n]


@dataclass
class Rounds:
    """What one model's rounds measured: per case its rollouts; every update's seconds
    and the programs compiled during them; each round's rebuild in this process and in a
    new one."""

    runs: dict[tuple[int, int], list[Rollout]]
    updates: list[float] = field(default_factory=list)
    update_compilations: int = 0
    rebuilds: dict[str, list[dict]] = field(
        default_factory=lambda: {"this process": [], "new process": []}
    )


def run_grid(engine: LLMEngine, args: argparse.Namespace, name: str, vocab: int,
             round_index: int, rounds: Rounds) -> None:  # fmt: skip
    """One rollout of every case, each on a new prompt."""
    for case_index, (n, prompt_len) in enumerate(grid(args)):
        seed = round_index * len(rounds.runs) + case_index
        prompt = np.random.default_rng(seed).integers(3, vocab, prompt_len).tolist()
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=args.max_tokens,
                                ignore_eos=True)  # fmt: skip
        result = rollout(engine, prompt, params)
        rounds.runs[(n, prompt_len)].append(result)
        print(f"[{name}] round {round_index + 1}/{rounds_of(name, args)} n={n} "
              f"prompt={prompt_len}: {result.tokens_per_s:.0f} tok/s, prompt computed "
              f"{result.prompt_computed / n:.0f}/sample, {result.blocks_held} blocks held",
              flush=True)  # fmt: skip


def run_rounds(engine: LLMEngine, args: argparse.Namespace, name: str, vocab: int,
               state: nnx.State, path: Path) -> Rounds:  # fmt: skip
    """`rounds_of(name, args)` rounds, each the whole grid, then `args.updates` updates
    with `state`, then a rebuild on `path` in this process and one in a new process."""
    rounds = Rounds({case: [] for case in grid(args)})
    for round_index in range(rounds_of(name, args)):
        run_grid(engine, args, name, vocab, round_index, rounds)
        compiled = compilation_count()
        updates = [time_update(engine, state) for _ in range(args.updates)]
        rounds.update_compilations += compilation_count() - compiled
        rounds.updates += updates
        rounds.rebuilds["this process"].append(time_rebuild(path, engine.config))
        new = time_new_process_rebuild(path, engine_sizes(engine.config))
        rounds.rebuilds["new process"].append(new)
        print(f"[{name}] round {round_index + 1}/{rounds_of(name, args)}: update_weights "
              f"{1e3 * statistics.median(updates):.1f} ms; rebuild in this process "
              f"{rounds.rebuilds['this process'][-1]['seconds']:.1f} s, in a new one "
              f"{new['seconds']:.1f} s", flush=True)  # fmt: skip
    return rounds


def engine_sizes(config: EngineConfig) -> dict:
    """The engine's resolved sizes: what the rebuilt engine and vLLM's scheduler take."""
    fields = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
              "max_model_len")  # fmt: skip
    return {name: getattr(config, name) for name in fields}


def bench_model(name: str, args: argparse.Namespace) -> dict:
    """One model's rollouts, updates and rebuilds (module docstring)."""
    path = checkpoint(name, max(args.prompt_lens) + args.max_tokens)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    model = models.load_model(path)
    groups = kv_groups(model)
    engine = LLMEngine(model, engine_config(args, len(groups)))
    programs, hits, start = compilation_count(), compilation_cache_hits(), time.perf_counter()
    engine.warm_up()
    warm_up = {"seconds": time.perf_counter() - start, "programs": compilation_count() - programs,
               "from_cache": compilation_cache_hits() - hits}  # fmt: skip
    print(f"[{name}] warm-up: {warm_up['programs']} programs ({warm_up['from_cache']} from the "
          f"persistent cache) in {warm_up['seconds']:.1f} s", flush=True)  # fmt: skip
    trainer_state = nnx.state(models.load_model(path))  # arrays the engine does not own
    rounds = run_rounds(engine, args, name, vocab, trainer_state, path)
    engine.shutdown()
    cases = []
    for (n, prompt_len), results in rounds.runs.items():
        cases.append({
            "n": n, "prompt_len": prompt_len,
            "tokens_per_s": spread([r.tokens_per_s for r in results]),
            "prompt_computed_per_sample": [r.prompt_computed / n for r in results],
            "blocks_held": [r.blocks_held for r in results],
            "blocks_bound": blocks_bound(len(groups), n, prompt_len, args.max_tokens),
            "compilations": sum(r.compilations for r in results),
        })  # fmt: skip
    return {
        "checkpoint": str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path),
        "kv_groups": groups,
        "engine": engine_sizes(engine.config), "warm_up": warm_up, "cases": cases,
        "update_weights_s": spread(rounds.updates),
        "update_compilations": rounds.update_compilations,
        "rebuild_s": {where: spread([r["seconds"] for r in runs])
                      for where, runs in rounds.rebuilds.items()},
        "rebuilds": rounds.rebuilds,
    }  # fmt: skip


def vllm_side(results: dict, max_tokens: int) -> dict | None:
    """The same parents through vLLM's scheduler (module docstring), or None (said why)
    when the peer environment is missing."""
    peer = PEER_VENV / "bin" / "python"
    if not peer.exists():
        print(f"[peer] {peer} is missing (tools/vllm-peer-venv.sh builds it); no vLLM figures")
        return None
    specs = []
    for result in results.values():
        cases = [{"n": c["n"], "prompt_len": c["prompt_len"], "max_tokens": max_tokens,
                  "seed": index} for index, c in enumerate(result["cases"])]  # fmt: skip
        specs.append({**result["engine"], "groups": result["kv_groups"], "cases": cases})
    spec_file = OUT_DIR / "vllm_rollout_specs.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(specs))
    print("[peer] vLLM's scheduler on the same parents ...", flush=True)
    peer_result = run_child([str(peer), str(VLLM_SCRIPT), str(spec_file)], dict(os.environ))
    for result, cases in zip(results.values(), peer_result["runs"], strict=True):
        for case, theirs in zip(result["cases"], cases, strict=True):
            case["vllm"] = {**theirs, "prompt_computed_per_sample":
                            theirs["prompt_computed"] / theirs["n"]}  # fmt: skip
    return {"version": peer_result["vllm"]}


def _range(values: dict, scale: float = 1.0) -> str:
    return f"[{scale * values['min']:.3g}, {scale * values['max']:.3g}]"


def print_rollouts(results: dict, max_tokens: int) -> None:
    rows, fan_out = [], []
    for name, result in results.items():
        for c in result["cases"]:
            theirs = c.get("vllm", {})
            rows.append([
                name, c["n"], c["prompt_len"], c["tokens_per_s"]["median"],
                _range(c["tokens_per_s"]), statistics.median(c["prompt_computed_per_sample"]),
                theirs.get("prompt_computed_per_sample", "-"), max(c["blocks_held"]),
                theirs.get("blocks_held", "-"), c["blocks_bound"], c["compilations"],
            ])  # fmt: skip
            if theirs and c["n"] > 1:
                fan_out.append([name, c["n"], c["prompt_len"], theirs["first_step"][0],
                                sorted(set(theirs["first_step"][1:])), theirs["hit_tokens"][0],
                                sorted(set(theirs["hit_tokens"][1:]))])  # fmt: skip
    print_table(
        f"\nrollouts: one parent of n samples, {max_tokens} tokens each (median of rounds)",
        ["model", "n", "prompt", "tok/s", "[min, max]", "prompt/sample", "vLLM",
         "blocks held", "vLLM", "bound", "compiled"], rows,
    )  # fmt: skip
    if fan_out:
        print_table(
            "\nvLLM's scheduler: the step its children were first scheduled in, their hits",
            ["model", "n", "prompt", "child 0 step", "others' steps", "child 0 hits",
             "others' hits"], fan_out,
        )  # fmt: skip


def print_weights(results: dict) -> None:
    rows = []
    for name, result in results.items():
        update = result["update_weights_s"]
        for where, rebuild in result["rebuild_s"].items():
            built = sorted({(r["programs"], r.get("from_cache", 0)) for r in
                            result["rebuilds"][where]})  # fmt: skip
            rows.append([
                name, 1e3 * update["median"], _range(update, 1e3), where, rebuild["median"],
                _range(rebuild), rebuild["median"] / update["median"],
                ", ".join(f"{p} ({c})" for p, c in built), result["update_compilations"],
            ])  # fmt: skip
    print_table(
        "\nupdate_weights on the warm engine vs a new engine on the same weights (medians)",
        ["model", "update ms", "[min, max]", "rebuild in", "rebuild s", "[min, max]",
         "rebuild/update", "rebuild programs (cached)", "update compiled"], rows,
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=512,
                        help="the engine's max_num_batched_tokens (prefill chunk)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the tiny model")
    parser.add_argument("--repeats-270m", type=int, default=2,
                        help="rounds of the 270M-shaped model (its prefill makes a round "
                        "take 3-6 minutes on 2 shared cores)")  # fmt: skip
    parser.add_argument("--updates", type=int, default=3, help="update_weights per round")
    parser.add_argument("--quick", action="store_true",
                        help="a dry run: the tiny model only, 2 rounds of 2 updates")  # fmt: skip
    parser.add_argument("--no-peer", action="store_true", help="skip vLLM's side")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.updates = ["tiny"], 2, 2
    positive = ("n", "prompt_lens", "max_tokens", "batch_tokens", "repeats", "repeats_270m",
                "updates")  # fmt: skip
    for option in positive:
        values = getattr(args, option)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1, got {values}")
    if args.batch_tokens < max(args.n):
        parser.error(f"--batch-tokens {args.batch_tokens} is less than the largest --n "
                     f"{max(args.n)}: a step must fit one decode token per sample")  # fmt: skip
    return parser, args


def main(argv: list[str] | None = None) -> dict:
    parser, args = parse_args(argv)
    results = {name: bench_model(name, args) for name in args.models}
    peer = None if args.no_peer else vllm_side(results, args.max_tokens)
    print_rollouts(results, args.max_tokens)
    print_weights(results)
    payload = {"command": " ".join(sys.argv), "workload": vars(args), "models": results,
               "vllm": peer}  # fmt: skip
    measurement = ("repeats", "repeats_270m", "updates", "record", "no_peer")
    name = results_name("bench_rollouts", parser, args, measurement)
    write_json(name, payload, record=args.record)
    return payload


if __name__ == "__main__":
    main()
