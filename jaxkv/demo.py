"""`jaxkv demo`: a realistic mixed workload through the engine, checked token by token.

Two built-in tiny models with random weights: a Gemma-style text decoder serving
multi-turn chats over shared system prompts (each turn's prompt is the previous turn's
prompt, its answer and a new user message, so it hits the prefix cache), and a
LLaVA-style model answering questions about a few images that keep coming back after
one of two instructions (each image is encoded once, repeats are served from the encoder
cache, and a repeated instruction and image hit the prefix cache). The KV pool is small
on purpose, so requests get preempted and recomputed. Every generated token is then
re-derived by a dense forward pass (no paging, no cache, no batching) and must match.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from jaxkv._checks import parse_memory
from jaxkv.device import compilation_cache_hits, compilation_count
from jaxkv.device.compilation_cache import enable_compilation_cache
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.reference import DenseReference, image_offsets
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

__all__ = ["main", "run_demo"]

ENGINE = EngineConfig(
    block_size=16, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=384,
    encoder_cache_size=64,  # room for the workload's three images (16 embeddings each)
)  # fmt: skip
QUICK = dataclasses.replace(ENGINE, num_blocks=28, max_num_seqs=4, max_num_batched_tokens=32)


@dataclasses.dataclass
class Job:
    """One request of the workload; `follow_up` makes the next turn of its chat."""

    prompt: list[int]
    images: list[np.ndarray] | None = None
    turns_left: int = 0
    sampling: SamplingParams = SamplingParams(max_tokens=12, ignore_eos=True)
    salt: str | None = None  # its tenant (cache_salt)


def chat_jobs(num_chats: int, rng: np.random.Generator, vocab: int) -> list[Job]:
    systems = [rng.integers(3, vocab, int(rng.integers(2, 5)) * 16).tolist() for _ in range(3)]
    return [
        Job(
            systems[i % 3] + rng.integers(3, vocab, int(rng.integers(4, 40))).tolist(),
            turns_left=int(rng.integers(1, 3)),
            sampling=SamplingParams(max_tokens=int(rng.integers(8, 20)), ignore_eos=True),
        )
        for i in range(num_chats)
    ]


def image_jobs(num: int, rng: np.random.Generator, model: TinyCausalLM) -> list[Job]:
    c = model.config
    pictures = [
        rng.standard_normal((c.num_channels, c.image_size, c.image_size)).astype(np.float32)
        for _ in range(3)
    ]
    # Two one-block instructions: a repeat of (instruction, image) hits the prefix cache
    # through the image's block too (its key includes the image's hash).
    instructions = [rng.integers(3, c.vocab_size, 16).tolist() for _ in range(2)]
    jobs = []
    for i in range(num):
        question = rng.integers(3, c.vocab_size, int(rng.integers(3, 20))).tolist()
        jobs.append(
            Job(
                instructions[i % 2] + [c.image_token_id] + question,
                images=[pictures[int(rng.integers(0, 3)) if i >= 3 else i]],
                sampling=SamplingParams(max_tokens=int(rng.integers(6, 14)), ignore_eos=True),
            )
        )
    return jobs


def serve(engine: LLMEngine, jobs: list[Job], bar: tqdm, rng: np.random.Generator) -> dict:
    """Serve `jobs` (and their follow-up turns) to completion; the finished outputs."""
    vocab = engine.vocab_size
    live: dict[str, Job] = {}
    finished: dict = {}
    for job in jobs:
        live[engine.add_request(job.prompt, job.images, job.sampling, cache_salt=job.salt)] = job
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            job = live.pop(out.request_id)
            finished[out.request_id] = (out, job)
            bar.update(1)
            if job.turns_left:
                follow = Job(
                    out.prompt_token_ids + out.output_token_ids
                    + rng.integers(3, vocab, int(rng.integers(4, 16))).tolist(),
                    turns_left=job.turns_left - 1, sampling=job.sampling, salt=job.salt,
                )  # fmt: skip
                request_id = engine.add_request(
                    follow.prompt, None, follow.sampling, cache_salt=follow.salt
                )
                live[request_id] = follow
                bar.total += 1
                bar.refresh()
        bar.set_postfix(
            running=len(engine.scheduler.running), kv=f"{engine.kv_cache_manager.usage:.0%}"
        )
    return finished


def dense_check(model: TinyCausalLM, finished: dict, max_len: int) -> list[str]:
    """Ids of requests whose tokens differ from the dense greedy reference."""
    reference = DenseReference(model, max_len)
    c = model.config
    mismatched = []
    for request_id, (out, job) in finished.items():
        images = []
        if job.images:
            offsets = image_offsets(out.prompt_token_ids, c.image_token_id, c.num_image_tokens)
            images = list(zip(offsets, job.images, strict=True))
        if reference.expected(out.prompt_token_ids, out.output_token_ids, images) != (
            out.output_token_ids
        ):
            mismatched.append(request_id)
    return mismatched


def summarize(name: str, engine: LLMEngine, finished: dict, mismatched: list, wall_s: float):
    steps = engine.stats.steps_since(0)  # the per-step series: every step of the run
    steady = [s for s in steps if s.compilations == 0]
    steady_s = sum(s.host_s + s.wait_s for s in steady)
    runner = engine.runner
    bound = runner.max_compilations(host_tier=bool(engine.offloads))
    return {
        "model": name,
        "requests": len(finished),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o, _ in finished.values()),
        "generated_tokens": sum(len(o.output_token_ids) for o, _ in finished.values()),
        "prefix_cache_hit_rate": engine.stats.prefix_hit_rate,
        "encoder_cache_hit_rate": engine.stats.encoder_hit_rate,
        "images_encoded": runner.num_encoded,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": len(steps),
        "steps_compiling": len(steps) - len(steady),
        "compilations": int(engine.stats.total("compilations")),
        "compile_bound": bound,
        "tokens_per_s": sum(s.num_scheduled_tokens for s in steady) / max(steady_s, 1e-9),
        "host_ms_per_step": 1e3 * sum(s.host_s for s in steady) / max(len(steady), 1),
        "wait_ms_per_step": 1e3 * sum(s.wait_s for s in steady) / max(len(steady), 1),
        "wall_s": wall_s,
        "host_tier": bool(engine.offloads),
        "host_hit_rate": engine.stats.host_hit_rate,
        "host_hit_tokens": int(engine.stats.total("host_hit_tokens")),
        "host_loaded_bytes": int(engine.stats.total("host_loaded_bytes")),
        "host_stored_bytes": int(engine.stats.total("host_stored_bytes")),
        "host_bytes_used": sum(offload.tier.bytes_used for offload in engine.offloads),
        "tenants": tenant_summaries(engine),
        "num_free_blocks": engine.kv_cache_manager.num_free_blocks,
        "num_blocks": engine.config.num_blocks,
        "dense_mismatched": mismatched,
        "dense_check": "OK" if finished and not mismatched else "FAILED",
        "series": {
            "prefix_hit_rate": _running_rate(
                [s.prefix_hits for s in steps], [s.prefix_queries for s in steps]
            ),
            "encoder_hit_rate": _running_rate(
                [s.encoder_hits for s in steps],
                [s.encoder_hits + s.encoder_misses for s in steps],
            ),
            "host_hit_rate": _running_rate(
                [s.host_hit_tokens for s in steps], [s.host_queried_tokens for s in steps]
            ),
            "kv_usage": [s.kv_usage for s in steps],
            "tokens_per_s": [
                s.num_scheduled_tokens / max(s.host_s + s.wait_s, 1e-9) for s in steps
            ],
            "compiling": [s.compilations > 0 for s in steps],
        },
    }


def _running_rate(hits: list[int], queries: list[int]) -> list[float]:
    """Hits over queries of every step so far (NaN before the first query)."""
    total_hits, total_queries = np.cumsum(hits), np.cumsum(queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total_hits / np.where(total_queries, total_queries, np.nan)).tolist()


def tenant_summaries(engine: LLMEngine) -> dict[str, dict]:
    """Per tenant ("-": no salt) its figures in both tiers; empty without salted requests."""
    tenants = engine.stats.tenants()
    if all(salt is None for salt in tenants):
        return {}
    out = {}
    for salt, t in tenants.items():
        out["-" if salt is None else salt] = {
            "prefix_hit_rate": t.prefix.prefix_hit_rate,
            "host_cached_tokens": t.prefix.host_cached_tokens,
            "device_cached_blocks": t.device_cached_blocks,
            "device_block_quota": t.device_block_quota,
            "host_bytes_used": t.host.bytes_used if t.host is not None else None,
            "host_blocks_evicted": t.host.blocks_evicted if t.host is not None else None,
        }
    return out


def tenant_rows(summaries: list[dict]) -> list[tuple[str, object]]:
    """Two table rows per tenant of any summary: prefix hit rate (host-served tokens),
    and device cached blocks (/ cap) / host-tier MiB held."""

    def hits(name: str, s: dict) -> str:
        t = s["tenants"].get(name)
        return "" if t is None else f"{t['prefix_hit_rate']:.1%} ({t['host_cached_tokens']})"

    def held(name: str, s: dict) -> str:
        t = s["tenants"].get(name)
        if t is None:
            return ""
        device = "-" if t["device_cached_blocks"] is None else str(t["device_cached_blocks"])
        if t["device_block_quota"] is not None:
            device += f"/{t['device_block_quota']}"
        host = "off" if t["host_bytes_used"] is None else f"{t['host_bytes_used'] / 2**20:.2f}"
        return f"{device} / {host}"

    names = dict.fromkeys(name for s in summaries for name in s["tenants"])
    rows: list[tuple[str, object]] = []
    for name in names:
        rows.append((f"tenant {name}: hit rate (host tokens)", lambda s, n=name: hits(n, s)))
        rows.append((f"tenant {name}: device blocks / host MiB", lambda s, n=name: held(n, s)))
    return rows


ROWS = [
    ("requests finished", lambda s: s["requests"]),
    ("prompt / generated tokens", lambda s: f"{s['prompt_tokens']} / {s['generated_tokens']}"),
    ("prefix-cache hit rate", lambda s: f"{s['prefix_cache_hit_rate']:.1%}"),
    ("encoder-cache hit rate", lambda s: f"{s['encoder_cache_hit_rate']:.1%} "
                                         f"({s['images_encoded']} encoded)"),
    ("host-tier hit rate (tokens)", lambda s: f"{s['host_hit_rate']:.1%} "
                                              f"({s['host_hit_tokens']})"
                                              if s["host_tier"] else "off"),
    ("host-tier MiB loaded / stored", lambda s: f"{s['host_loaded_bytes'] / 2**20:.2f} / "
                                                f"{s['host_stored_bytes'] / 2**20:.2f}"
                                                if s["host_tier"] else "off"),
    ("host-tier MiB held at the end", lambda s: f"{s['host_bytes_used'] / 2**20:.2f}"
                                                if s["host_tier"] else "off"),
    ("preemptions", lambda s: s["preemptions"]),
    ("steps (compiling)", lambda s: f"{s['steps']} ({s['steps_compiling']})"),
    ("XLA compilations (bound)", lambda s: f"{s['compilations']} ({s['compile_bound']})"),
    ("tokens/s, steady state", lambda s: f"{s['tokens_per_s']:.0f}"),
    ("host / wait ms per step", lambda s: f"{s['host_ms_per_step']:.1f} / "
                                          f"{s['wait_ms_per_step']:.1f}"),
    ("free blocks at the end", lambda s: f"{s['num_free_blocks']} / {s['num_blocks'] - 1}"),
    ("dense check", lambda s: s["dense_check"]),
    ("wall time", lambda s: f"{s['wall_s']:.1f} s"),
]  # fmt: skip


def print_table(summaries: list[dict]) -> None:
    rows = ROWS + tenant_rows(summaries)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(name) for name, _ in rows)
        print(" " * width + "".join(f"  {s['model']:>18}" for s in summaries))
        for name, cell in rows:
            print(f"{name:<{width}}" + "".join(f"  {cell(s)!s:>18}" for s in summaries))
        return
    table = Table(title="jaxkv demo")
    table.add_column("")
    for s in summaries:
        table.add_column(s["model"], justify="right")
    for name, cell in rows:
        table.add_row(name, *(str(cell(s)) for s in summaries))
    Console().print(table)


def plot(summaries: list[dict], path: str) -> None:
    """One row per model: its cumulative hit rates and KV usage (left), its tokens/s
    per step on a linear axis, the steps that compiled a program marked and left out
    (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [("prefix_hit_rate", "prefix-cache hit rate (cumulative)"),
             ("encoder_hit_rate", "encoder-cache hit rate (cumulative)"),
             ("host_hit_rate", "host-tier hit rate (cumulative)"),
             ("kv_usage", "KV usage")]  # fmt: skip
    fig, axes = plt.subplots(
        len(summaries), 2, figsize=(11, 2.8 * len(summaries)), squeeze=False,
        gridspec_kw={"width_ratios": (3, 2)},
    )  # fmt: skip
    for (left, right), s in zip(axes, summaries, strict=True):
        series = s["series"]
        for key, label in rates:
            if not np.isnan(series[key]).all():
                style = ":" if key == "kv_usage" else "-"
                left.plot(series[key], style, label=label, lw=1.4)
        left.set_ylim(0, 1.02)
        left.set_ylabel(s["model"])
        left.legend(fontsize=7, loc="best")
        _plot_throughput(right, series)
        for ax in (left, right):
            ax.grid(alpha=0.3)
    axes[0, 0].set_title("hit rates and KV usage")
    axes[0, 1].set_title("tokens/s per step")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _plot_throughput(ax, series: dict) -> None:
    """Tokens/s of the steps that compiled nothing; a red line at each step that
    compiled (its time is the compiler's, left out)."""
    compiling = np.array(series["compiling"], bool)
    tokens_per_s = np.where(compiling, np.nan, series["tokens_per_s"])
    ax.plot(tokens_per_s, lw=0.8, color="tab:blue", label="steady step")
    for i, step in enumerate(np.flatnonzero(compiling)):
        label = "compiled (left out)" if i == 0 else None
        ax.axvline(step, color="tab:red", alpha=0.4, lw=1.5, label=label)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper right")


def run_demo(
    quick: bool = False,
    seed: int = 0,
    progress: bool = True,
    num_chats: int | None = None,
    kv_offloading_size: int | None = None,
    tenants: int = 0,
    tenant_device_blocks: int | None = None,
) -> list[dict]:
    """Serve the workload on both tiny models; one summary per model.
    `kv_offloading_size`: bytes of a host-memory KV tier behind the device pool.
    `tenants`: spread the jobs over that many cache salts ("t0", "t1", ...; 0: none),
    each capped to `tenant_device_blocks` blocks of the device prefix cache (None: no
    cap; their blocks are counted either way)."""
    salts = [f"t{i}" for i in range(tenants)]
    quotas = None
    if salts:
        quotas = {} if tenant_device_blocks is None else dict.fromkeys(salts, tenant_device_blocks)
    base = dataclasses.replace(
        QUICK if quick else ENGINE,
        kv_offloading_size=kv_offloading_size,
        device_tenant_block_quotas=quotas,
    )
    num_chats = num_chats if num_chats is not None else (6 if quick else 12)
    rng = np.random.default_rng(seed)
    summaries = []
    configs = tiny_configs()
    workloads = [
        ("gemma-style-tiny", lambda m: chat_jobs(num_chats, rng, m.config.vocab_size)),
        ("llava-style-tiny", lambda m: image_jobs(num_chats, rng, m)),
    ]
    for name, make_jobs in workloads:
        start = time.perf_counter()
        model = TinyCausalLM(configs[name], seed=seed)
        engine = LLMEngine(model, dataclasses.replace(base, seed=seed))
        jobs = make_jobs(model)
        for i, job in enumerate(jobs):
            job.salt = salts[i % len(salts)] if salts else None
        with tqdm(total=len(jobs), unit="req", desc=name, disable=not progress) as bar:
            finished = serve(engine, jobs, bar, rng)
        mismatched = dense_check(model, finished, base.max_model_len)
        summaries.append(summarize(name, engine, finished, mismatched, time.perf_counter() - start))
    return summaries


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="jaxkv demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller run (tests use it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chats", type=int, help="chats (and image questions) per model")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot hit rates, KV usage and tokens/s per step to FILE.png",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--kv-offloading-size", metavar="SIZE",
        help="host memory for a KV tier behind the device pool, e.g. 64MiB (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--tenants", type=int, default=0, metavar="N",
        help="spread the requests over N cache salts; the table gets per-tenant rows",
    )  # fmt: skip
    parser.add_argument(
        "--tenant-device-blocks", type=int, metavar="BLOCKS",
        help="cap each tenant's blocks in the device prefix cache (with --tenants)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> list[dict]:
    enable_compilation_cache("auto")  # before the models are built: their programs too
    compiled, cache_hits = compilation_count(), compilation_cache_hits()
    offloading = None
    if args.kv_offloading_size is not None:
        offloading = parse_memory(args.kv_offloading_size, "--kv-offloading-size")
    if args.tenants < 0:
        raise SystemExit(f"--tenants must be >= 0, got {args.tenants}")
    if args.tenant_device_blocks is not None and (
        args.tenant_device_blocks < 0 or not args.tenants
    ):
        raise SystemExit("--tenant-device-blocks needs --tenants and must be >= 0")
    summaries = run_demo(
        args.quick, args.seed, not args.no_progress, args.chats, offloading, args.tenants,
        args.tenant_device_blocks,
    )  # fmt: skip
    print_table(summaries)
    if args.plot:
        plot(summaries, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps([{k: v for k, v in s.items() if k != "series"} for s in summaries]))
    built, loaded = compilation_count() - compiled, compilation_cache_hits() - cache_hits
    print(f"XLA programs in all: {built - loaded} compiled, {loaded} from the compilation cache")
    return summaries


if __name__ == "__main__":
    sys.exit(0 if all(s["dense_check"] == "OK" for s in main()) else 1)
