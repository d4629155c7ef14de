"""Hybrid-model benchmark: the shared-prefix serving workload on a Gemma-3-style model.

    python -m benchmarks.bench_hybrid                # jaxkv: hybrid vs single group
    python -m benchmarks.bench_hybrid --peer vllm    # also vLLM's hybrid coordinator

The model: 5 sliding-window layers (window 1024) per global layer, as two KV
cache groups (global: full attention; local: sliding window), block size 16.
The workload is bench_host's (32 shared 1024-token system prompts, 1500
requests of 64-512 user tokens generating 16-96; admission until blocks run
out, preemption when a decode step cannot get a block), served by the same
loop (`bench_host.serve`: the engine's scheduler over either manager);
`sha256_cbor` block hashes on both sides.

Measured: CPU seconds of the serving thread, median (and range) of
interleaved runs. Targets: identical hit tokens and preemptions in jaxkv and
vLLM; jaxkv >= 4x faster than vLLM's hybrid coordinator; jaxkv's hybrid host
time per generated token within 1.5x of the single-group (full attention) model.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable

from benchmarks._common import (
    add_record_option,
    ensure_peer_process,
    print_table,
    results_name,
    write_json,
)
from benchmarks.bench_host import (
    BLOCK_SIZE,
    JaxkvEngine,
    RunStats,
    VllmEngine,
    Workload,
    make_workload,
    serve,
)

SLIDING_WINDOW = 1024
NUM_SLIDING_LAYERS = 5
HASH_FN = "sha256_cbor"


def group_layout(hybrid: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, layer names) per KV cache group of the model."""
    if not hybrid:
        return [("full", ("layer.0",))]
    sliding = tuple(f"local.{i}" for i in range(NUM_SLIDING_LAYERS))
    return [("full", ("global.0",)), ("sliding", sliding)]


class JaxkvHybridEngine(JaxkvEngine):
    def __init__(self, workload: Workload, hybrid: bool) -> None:
        import jaxkv

        self.name = "jaxkv/hybrid" if hybrid else "jaxkv/single"
        self.jaxkv = jaxkv
        fn = jaxkv.get_hash_fn_by_name(HASH_FN)
        jaxkv.init_none_hash(fn)
        self.hasher = jaxkv.get_request_block_hasher(BLOCK_SIZE, fn)
        groups = []
        for kind, layers in group_layout(hybrid):
            common = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128)
            spec = (
                jaxkv.FullAttentionSpec(**common)
                if kind == "full"
                else jaxkv.SlidingWindowSpec(**common, sliding_window=SLIDING_WINDOW)
            )
            groups.append((spec, layers))
        config = jaxkv.KVCacheConfig.from_groups(groups, workload.num_blocks)
        self.manager = jaxkv.KVCacheManager(config, workload.max_model_len)


class VllmHybridEngine(VllmEngine):
    def __init__(self, workload: Workload, hybrid: bool) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        self.name = "vllm/hybrid" if hybrid else "vllm/single"
        self.Request, self.SamplingParams = Request, SamplingParams
        fn = get_hash_fn_by_name(HASH_FN)
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, fn)
        groups = []
        for kind, layers in group_layout(hybrid):
            common = dict(
                block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
            )
            spec = (
                FullAttentionSpec(**common)
                if kind == "full"
                else SlidingWindowSpec(**common, sliding_window=SLIDING_WINDOW)
            )
            groups.append(KVCacheGroupSpec(list(layers), spec))
        config = KVCacheConfig(
            num_blocks=workload.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=workload.max_model_len,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
        )


def run_interleaved(
    engines: list[Callable[[], object]], workloads: dict[str, Workload], repeats: int
) -> dict[str, list[RunStats]]:
    """Every engine `repeats` times, in round-robin rounds (slow phases hit all alike)."""
    runs: dict[str, list[RunStats]] = {}
    for _ in range(repeats):
        for make_engine in engines:
            engine = make_engine()
            runs.setdefault(engine.name, []).append(
                serve(engine, workloads[engine.name.split("/")[1]], progress=True)
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", choices=["vllm"], help="also run vLLM's hybrid coordinator")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=8192,
        help="blocks of the single-group model; the two-group model gets twice as many",
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per engine")
    add_record_option(parser)
    args = parser.parse_args()

    peer = args.peer == "vllm" and ensure_peer_process()
    single = make_workload(args.requests, args.num_blocks)
    hybrid = make_workload(args.requests, 2 * args.num_blocks)
    workloads = {"single": single, "hybrid": hybrid}
    generated = sum(single.max_tokens)
    print(
        f"workload: {args.requests} requests, {sum(map(len, single.prompts))} prompt tokens, "
        f"{generated} generated tokens; hybrid: full + sliding window {SLIDING_WINDOW} "
        f"({NUM_SLIDING_LAYERS} local layers per global layer), {hybrid.num_blocks} blocks"
    )
    engines: list[Callable[[], object]] = [
        functools.partial(JaxkvHybridEngine, hybrid, True),
        functools.partial(JaxkvHybridEngine, single, False),
    ]
    if peer:
        engines += [
            functools.partial(VllmHybridEngine, hybrid, True),
            functools.partial(VllmHybridEngine, single, False),
        ]
    runs = run_interleaved(engines, workloads, args.repeats)

    for kind in ("hybrid", "single"):
        counts = {
            name: {(s.hit_tokens, s.preemptions) for s in stats}
            for name, stats in runs.items()
            if name.endswith(kind)
        }
        if len(set().union(*counts.values())) != 1:
            raise SystemExit(f"{kind}: hit tokens / preemptions differ between runs: {counts}")

    median = {name: statistics.median(s.seconds for s in stats) for name, stats in runs.items()}
    # Tokens the model computes: admitted tokens the prefix cache did not serve (prompts,
    # and a preempted request's tokens again), plus the generated ones.
    computed = {
        name: stats[0].prompt_tokens - stats[0].hit_tokens + generated
        for name, stats in runs.items()
    }
    rows = []
    for name, stats in runs.items():
        seconds = [s.seconds for s in stats]
        rows.append(
            [
                name,
                median[name],
                f"{min(seconds):.3g}-{max(seconds):.3g}",
                median[name] / generated * 1e6,
                median[name] / computed[name] * 1e6,
                stats[0].hit_tokens / stats[0].prompt_tokens,
                stats[0].hit_tokens,
                stats[0].preemptions,
                stats[0].steps,
            ]
        )
    print_table(
        f"\nserving workload, CPU seconds (median and range of {args.repeats} interleaved runs)",
        [
            "config",
            "median s",
            "range s",
            "us/gen token",
            "us/computed token",
            "hit rate",
            "hit tokens",
            "preempt",
            "steps",
        ],
        rows,
    )
    summary = {
        "hybrid_over_single": median["jaxkv/hybrid"] / median["jaxkv/single"],
        "hybrid_over_single_per_computed_token": (median["jaxkv/hybrid"] / computed["jaxkv/hybrid"])
        / (median["jaxkv/single"] / computed["jaxkv/single"]),
    }
    ratio_rows = [
        ["jaxkv hybrid / single, per generated token", summary["hybrid_over_single"], "<= 1.5"],
        [
            "jaxkv hybrid / single, per computed token",
            summary["hybrid_over_single_per_computed_token"],
            "(when hit rates differ)",
        ],
    ]
    if peer:
        summary["vllm_over_jaxkv_hybrid"] = median["vllm/hybrid"] / median["jaxkv/hybrid"]
        summary["vllm_over_jaxkv_single"] = median["vllm/single"] / median["jaxkv/single"]
        per_run = [
            v.seconds / j.seconds
            for v, j in zip(runs["vllm/hybrid"], runs["jaxkv/hybrid"], strict=True)
        ]
        summary["vllm_over_jaxkv_hybrid_range"] = [min(per_run), max(per_run)]
        ratio_rows += [
            ["hybrid: vLLM / jaxkv", summary["vllm_over_jaxkv_hybrid"], ">= 4"],
            ["single group: vLLM / jaxkv", summary["vllm_over_jaxkv_single"], "(bench_host)"],
        ]
    print_table(
        "\nratios (medians; same process, same workload)",
        ["comparison", "ratio", "target"],
        ratio_rows,
    )
    write_json(
        results_name("bench_hybrid", parser, args),
        {
            "command": " ".join(sys.argv),
            "workload": {
                "requests": args.requests,
                "block_size": BLOCK_SIZE,
                "sliding_window": SLIDING_WINDOW,
                "num_blocks_single": single.num_blocks,
                "num_blocks_hybrid": hybrid.num_blocks,
                "generated_tokens": generated,
            },
            "serving": {
                name: {
                    "median_seconds": median[name],
                    "seconds": [s.seconds for s in stats],
                    "hit_tokens": stats[0].hit_tokens,
                    "prompt_tokens": stats[0].prompt_tokens,
                    "preemptions": stats[0].preemptions,
                    "steps": stats[0].steps,
                    "computed_tokens": computed[name],
                }
                for name, stats in runs.items()
            },
            "summary": summary,
        },
        record=args.record,
    )


if __name__ == "__main__":
    main()
