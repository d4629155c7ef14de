"""One engine over 2 processes vs 1 process on the same 8 (simulated CPU) devices.

    python -m benchmarks.bench_multihost [--repeats 5] [--record]

The tiny Gemma-3-style checkpoint (sliding-window and full layers) serves one batch of
prompts on a 4x2 `(data, model)` mesh: once as 1 process over 8 devices (the baseline),
once as 2 processes over 4 devices each (`jax.distributed`, loopback coordinator, gloo
collectives; `jaxkv.engine.multihost`: process 0's requests replayed on both). Each run
warms up on the batch, drops the prefix cache and serves it again, timed. Runs alternate
(single first in even rounds, the pair first in odd ones); medians and ranges over the
rounds. Per step, on process 0: `host` is the engine's host time (schedule, pack,
dispatch, apply; `StepStats.host_s`), `exchange` the replay broadcast before it
(`RequestStream.seconds`: one 4-byte `broadcast_one_to_all`, plus the pickled requests
on the steps where some arrive), `step` the wall time per step; and generated tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO_ROOT, add_record_option, print_table, results_name, write_json

_MARK = "RESULT "
MESH = (4, 2)


def child(work: str, prompts: int, max_tokens: int, distributed: list[str]) -> None:
    """One run (one process of it): prints the `RESULT` JSON on process 0."""
    import jax
    import numpy as np

    from jaxkv.engine import multihost

    if distributed:
        address, n, pid = distributed
        multihost.initialize(multihost.DistributedConfig(address, int(n), int(pid), 60))
    from jaxkv.device import make_mesh
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
    from jaxkv.models import load_model

    mesh = make_mesh(*MESH, jax.devices())
    config = EngineConfig(
        block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=128, compilation_cache_dir="none",
    )  # fmt: skip
    engine = LLMEngine(load_model(Path(work) / "gemma3", mesh=mesh), config, mesh=mesh)
    if jax.process_index() != 0:
        engine.follow()
        multihost.shutdown()
        return
    rng = np.random.default_rng(0)
    system = rng.integers(3, 255, 32).tolist()
    batch = [system + rng.integers(3, 255, 16).tolist() for _ in range(prompts)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for _ in range(2):  # warm-up: compiles every shape the batch needs (cold and warm)
        engine.generate(batch, sampling)
        engine.reset_prefix_cache()
    first_step, stream = engine.num_steps, engine._replay.stream
    exchanged = stream.seconds if stream else 0.0
    start = time.perf_counter()
    outputs = engine.generate(batch, sampling)
    elapsed = time.perf_counter() - start
    steps = engine.stats.steps_since(first_step)
    result = {
        "steps": len(steps),
        "tokens": sum(len(o.output_token_ids) for o in outputs),
        "step_ms": 1e3 * elapsed / len(steps),
        "host_ms": 1e3 * statistics.median(s.host_s for s in steps),
        "exchange_ms": 1e3 * ((stream.seconds if stream else 0.0) - exchanged) / len(steps),
        "tokens_per_s": sum(len(o.output_token_ids) for o in outputs) / elapsed,
        "first_tokens": outputs[0].output_token_ids[:8],
        "compilations": sum(s.compilations for s in steps),
    }
    engine.shutdown()
    print(_MARK + json.dumps(result), flush=True)
    if distributed:
        multihost.shutdown()


def _run(work: Path, args: argparse.Namespace, processes: int) -> dict:
    env = dict(os.environ, JAXKV_COMPILATION_CACHE="none")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    base = [sys.executable, "-m", "benchmarks.bench_multihost", "--child", str(work),
            str(args.prompts), str(args.max_tokens)]  # fmt: skip
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base += [f"127.0.0.1:{port}", str(processes)]
    procs = [
        subprocess.Popen(base + ([str(i)] if processes > 1 else []), env=env, cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(processes)
    ]  # fmt: skip
    logs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, logs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a benchmark process failed:\n{err[-3000:]}")
    line = next(ln for ln in logs[0][0].splitlines() if ln.startswith(_MARK))
    return json.loads(line[len(_MARK) :])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], int(argv[2]), int(argv[3]), argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (one run of each)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    add_record_option(parser)
    args = parser.parse_args(argv)
    from jaxkv.models import save_random_checkpoint, tiny_configs

    runs: dict[str, list[dict]] = {"1 process x 8": [], "2 processes x 4": []}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(Path(tmp) / "gemma3", tiny_configs()["gemma3-tiny"], seed=3)
        for r in range(args.repeats):
            order = [1, 2] if r % 2 == 0 else [2, 1]
            for processes in order:
                name = "1 process x 8" if processes == 1 else "2 processes x 4"
                runs[name].append(_run(Path(tmp), args, processes))
                print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    tokens = {name: [r["first_tokens"] for r in rs] for name, rs in runs.items()}
    same = all(t == tokens["1 process x 8"][0] for ts in tokens.values() for t in ts)
    summary, rows = {}, []
    for name, rs in runs.items():
        summary[name] = {}
        for key in ("step_ms", "host_ms", "exchange_ms", "tokens_per_s"):
            values = [r[key] for r in rs]
            summary[name][key] = {"median": statistics.median(values), "min": min(values),
                                  "max": max(values)}  # fmt: skip
    base = summary["1 process x 8"]
    for name, s in summary.items():
        rows.append([name] + [
            f"{s[k]['median']:.3g} ({s[k]['min']:.3g}-{s[k]['max']:.3g})"
            for k in ("step_ms", "host_ms", "exchange_ms", "tokens_per_s")
        ] + [f"{s['step_ms']['median'] / base['step_ms']['median']:.2f}"])  # fmt: skip
    print_table(
        f"multi-controller engine, {args.prompts} prompts x {args.max_tokens} tokens, mesh "
        f"{MESH[0]}x{MESH[1]}, {runs['1 process x 8'][0]['steps']} steps, median (range) of "
        f"{args.repeats} rounds; same tokens: {same}",
        ["run", "step ms", "host ms", "exchange ms", "tokens/s", "step vs 1 process"],
        rows,
    )
    payload = {"args": vars(args), "summary": summary, "runs": runs, "same_tokens": same}
    write_json(results_name("bench_multihost", parser, args), payload, args.record)


if __name__ == "__main__":
    main()
