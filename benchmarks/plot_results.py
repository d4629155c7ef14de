"""Plot the benchmarks' latest JSON results (benchmarks/results/*.json) as PNGs beside them.

    pip install -e .   # matplotlib is a dependency
    python -m benchmarks.plot_results

The benchmarks themselves only write JSON (the vLLM peer environment they may run
in has no matplotlib); this script renders whatever results are there.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

from benchmarks._common import REPO_ROOT, RESULTS_DIR

JAXKV_COLOR, VLLM_COLOR = "#1f77b4", "#bbbbbb"


def _label_bars(ax, bars, texts: list[str]) -> None:
    for bar, text in zip(bars, texts, strict=True):
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )


def plot_host(result: dict, fig) -> None:
    """Serving time per hash function (jaxkv vs vLLM) and chained-hashing cost per block."""
    serving, hashing = result["serving"], result["hashing"]
    names = [k.split("/", 1)[1] for k in serving if k.startswith("jaxkv/") and k.count("/") == 1]
    ax_serve, ax_hash = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    x = range(len(names))
    jaxkv = [serving[f"jaxkv/{n}"]["seconds"] for n in names]
    ax_serve.bar([i - 0.2 for i in x], jaxkv, 0.4, label="jaxkv", color=JAXKV_COLOR)
    if all(f"vllm/{n}" in serving for n in names):
        vllm = [serving[f"vllm/{n}"]["seconds"] for n in names]
        bars = ax_serve.bar([i + 0.2 for i in x], vllm, 0.4, label="vLLM", color=VLLM_COLOR)
        _label_bars(ax_serve, bars, [f"{v / j:.1f}×" for v, j in zip(vllm, jaxkv, strict=True)])
    workload = result["workload"]
    ax_serve.set(
        xticks=list(x),
        xticklabels=names,
        ylabel="CPU seconds (best run)",
        title=f"serving {workload['requests']} requests, {workload['num_blocks']} blocks",
    )
    ax_serve.legend()

    labels = [row["method"].replace("jaxkv chained ", "jaxkv ") for row in hashing]
    labels = [
        label.replace("per-block cbor2.dumps + sha256", "per block\ncbor2 + sha256")
        for label in labels
    ]
    bars = ax_hash.bar(
        range(len(hashing)),
        [row["us_per_block"] for row in hashing],
        color=[VLLM_COLOR] + [JAXKV_COLOR] * (len(hashing) - 1),
    )
    _label_bars(ax_hash, bars, [f"{row['speedup']:.2f}×" for row in hashing])
    ax_hash.set(
        xticks=range(len(hashing)),
        ylabel="µs per block",
        title=f"chained hashing, {result['workload']['block_size']}-token blocks",
    )
    ax_hash.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)


def plot_encoder(result: dict, fig) -> None:
    """Encoder cache manager throughput, jaxkv vs vLLM."""
    ax = fig.subplots()
    rows = result["results"]
    kinds = [("ops_per_s", "manager calls"), ("loop_ops_per_s", "scheduler loop")]
    for offset, row in zip((-0.2, 0.2), rows, strict=False):
        color = JAXKV_COLOR if row["name"] == "jaxkv" else VLLM_COLOR
        values = [row[key] / 1e6 for key, _ in kinds]
        ax.bar([i + offset for i in range(len(kinds))], values, 0.4, label=row["name"], color=color)
    ax.set(
        xticks=range(len(kinds)),
        xticklabels=[label for _, label in kinds],
        ylabel="million operations / s",
        title=f"encoder cache, {result['config']['requests']} requests",
    )
    ax.legend()


def plot_encoder_store(result: dict, fig) -> None:
    """Device encoder store before/after issue 12: programs, resident memory, seconds."""
    keys = [("programs", "programs compiled"), ("resident_mib", "resident MiB added"),
            ("seconds", "seconds")]  # fmt: skip
    axes = fig.subplots(1, len(keys))
    summary, variants = result["summary"], ["before", "after"]
    for ax, (key, label) in zip(axes, keys, strict=True):
        medians = [summary[v][key]["median"] for v in variants]
        errors = [
            [m - summary[v][key]["min"] for v, m in zip(variants, medians, strict=True)],
            [summary[v][key]["max"] - m for v, m in zip(variants, medians, strict=True)],
        ]
        bars = ax.bar(variants, medians, yerr=errors, color=[VLLM_COLOR, JAXKV_COLOR])
        _label_bars(ax, bars, ["", f"{result['ratios'][key]:.1f}× less"])
        ax.set(title=label)
    fig.suptitle(f"encoder store, {result['items']} items of random size (median, range)")


def plot_device(result: dict, fig) -> None:
    """Paged-cache update time as the cache grows; paged vs dense attention time."""
    panels = [key for key in ("updates", "scaling") if key in result]
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        (_plot_device_updates if panel == "updates" else _plot_device_scaling)(result, ax)


def _plot_device_updates(result: dict, ax) -> None:
    by_storage: dict[str, list[dict]] = {}
    for row in result["updates"]:
        by_storage.setdefault(row["storage"], []).append(row)
    for storage, rows in by_storage.items():
        ax.plot([r["cache_MiB"] for r in rows], [r["update_ms"] for r in rows], "o-", label=storage)
    sizes = sorted({row["cache_MiB"] for row in result["updates"]})
    ax.set(
        xscale="log",
        yscale="log",
        xticks=sizes,
        xticklabels=[f"{size:g}" for size in sizes],
        xlabel="cache size (MiB)",
        ylabel="update time (ms)",
        title=f"paged KV update, {result['tokens_written']} tokens ({result['backend']})",
    )
    ax.minorticks_off()
    ax.legend()


def _plot_device_scaling(result: dict, ax) -> None:
    rows = result["scaling"]["attention_vs_dense"]
    x = range(len(rows))
    paged = ax.bar([i - 0.2 for i in x], [r["paged_ms"] for r in rows], 0.4, label="paged")
    ax.bar([i + 0.2 for i in x], [r["dense_ms"] for r in rows], 0.4, label="dense",
           color=VLLM_COLOR)  # fmt: skip
    _label_bars(ax, paged, [f"{r['paged_vs_dense']:.2f}x" for r in rows])
    ax.set(
        yscale="log",
        xticks=list(x),
        ylabel="median time (ms)",
        title=f"attention: paged vs dense ({result['backend']})",
    )
    ax.set_xticklabels([r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.legend()


# By the benchmark a results file comes from (its name up to the workload suffix).
def plot_hybrid(result: dict, fig) -> None:
    """Serving time per generated token: hybrid vs single group, jaxkv vs vLLM (median, range)."""
    serving, workload = result["serving"], result["workload"]
    ax = fig.subplots()
    kinds = ["single", "hybrid"]
    for offset, impl, color in ((-0.2, "jaxkv", JAXKV_COLOR), (0.2, "vllm", VLLM_COLOR)):
        runs = [serving.get(f"{impl}/{kind}") for kind in kinds]
        if any(run is None for run in runs):
            continue
        per_token = 1e6 / workload["generated_tokens"]
        medians = [run["median_seconds"] * per_token for run in runs]
        low = [m - min(run["seconds"]) * per_token for m, run in zip(medians, runs, strict=True)]
        high = [max(run["seconds"]) * per_token - m for m, run in zip(medians, runs, strict=True)]
        bars = ax.bar(
            [i + offset for i in range(len(kinds))],
            medians,
            0.4,
            yerr=[low, high],
            label="jaxkv" if impl == "jaxkv" else "vLLM",
            color=color,
        )
        if impl == "vllm":
            jax_medians = [serving[f"jaxkv/{kind}"]["median_seconds"] for kind in kinds]
            _label_bars(
                ax,
                bars,
                [f"{r['median_seconds'] / j:.1f}×" for r, j in zip(runs, jax_medians, strict=True)],
            )
    ax.set(
        xticks=range(len(kinds)),
        xticklabels=[
            "single group (full attention)",
            f"hybrid: full + sliding window {workload['sliding_window']}",
        ],
        ylabel="host CPU µs per generated token (median, range)",
        title=f"serving {workload['requests']} requests, {workload['num_blocks_single']} / "
        f"{workload['num_blocks_hybrid']} blocks",
    )
    ax.legend()


def plot_engine(result: dict, fig) -> None:
    """Prefill tokens with prefix caching on/off, and decode step time with/without overlap."""
    prefix, overlap = result["prefix_caching"], result["overlap"]
    ax_prefix, ax_step = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
    names = list(prefix["prefill_tokens"])
    bars = ax_prefix.bar(
        names, [prefix["prefill_tokens"][n] for n in names], color=[JAXKV_COLOR, VLLM_COLOR]
    )
    _label_bars(ax_prefix, bars, [f"{prefix['wall_s'][n]['median']:.2f} s" for n in names])
    ax_prefix.set(
        ylabel="prefill tokens computed",
        title=f"prefix caching: {prefix['prefill_ratio']:.1f}x fewer tokens, "
        f"{prefix['wall_ratio']['median']:.2f}x faster",
    )
    x = range(len(overlap))
    host = [r["host_ms"] for r in overlap]
    device = [r["device_ms"] for r in overlap]
    ax_step.bar([i - 0.3 for i in x], host, 0.2, label="host", color="#ff7f0e")
    ax_step.bar([i - 0.1 for i in x], device, 0.2, label="device (wait, sync)", color="#2ca02c")
    ax_step.bar([i + 0.1 for i in x], [r["step_ms_sync"]["median"] for r in overlap], 0.2,
                label="step, sync", color=VLLM_COLOR)  # fmt: skip
    bars = ax_step.bar([i + 0.3 for i in x], [r["step_ms_overlap"]["median"] for r in overlap],
                       0.2, label="step, overlap", color=JAXKV_COLOR)  # fmt: skip
    _label_bars(ax_step, bars, [f"{r['host_hidden_fraction']:.0%} hidden" for r in overlap])
    ax_step.set(
        xticks=list(x), xticklabels=[str(r["running"]) for r in overlap],
        xlabel="running requests (all decoding)", ylabel="ms per step (median)",
        title=f"{result['compilations']['compilations_after_warm_up']} compilations in "
        f"{result['compilations']['steps']} steps after warm-up",
    )  # fmt: skip
    ax_step.legend(fontsize=8)


def plot_ab(result: dict, fig) -> None:
    """`ab_host.py`: each row's per-round ratio B/A, with its median (1.0: no difference)."""
    ax = fig.subplots()
    rows = result["rows"]
    for i, figures in enumerate(rows.values()):
        ratios = figures["b_over_a"]
        ax.scatter([i] * len(ratios), ratios, color=JAXKV_COLOR, alpha=0.6)
        median = statistics.median(ratios)
        ax.hlines(median, i - 0.25, i + 0.25, color="black")
        ax.annotate(f"{median:.3f}", (i + 0.27, median), va="center", fontsize=8)
    ax.axhline(1.0, color=VLLM_COLOR, linestyle="--")
    ax.set(
        xticks=list(range(len(rows))),
        xticklabels=list(rows),
        ylabel="B / A per round (CPU seconds)",
        title=f"{result['rounds']} interleaved rounds: B = {result['trees']['B']}, "
        f"A = {result['trees']['A']}",
    )


PLOTS: dict[str, Callable[[dict, object], None]] = {
    "ab_host": plot_ab,
    "bench_engine": plot_engine,
    "bench_host": plot_host,
    "bench_encoder_store": plot_encoder_store,  # before "bench_encoder": first prefix wins
    "bench_encoder": plot_encoder,
    "bench_device": plot_device,
    "bench_hybrid": plot_hybrid,
}


def main() -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install -e .") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted([*RESULTS_DIR.glob("bench_*.json"), *RESULTS_DIR.glob("ab_host*.json")])
    if not sources:
        raise SystemExit(f"no results in {RESULTS_DIR.relative_to(REPO_ROOT)}: run a benchmark")
    for source in sources:
        benchmark = next((b for b in PLOTS if source.stem.startswith(b)), None)
        if benchmark is None:
            print(f"{source.relative_to(REPO_ROOT)}: no plot for it; skipped")
            continue
        fig = plt.figure(figsize=(10, 4.2), layout="constrained")
        PLOTS[benchmark](json.loads(source.read_text()), fig)
        target = source.with_suffix(".png")
        fig.savefig(target, dpi=110)
        plt.close(fig)
        print(f"wrote {target.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
