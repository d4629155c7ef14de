"""One-shot GPU check of jaxkv's attention kernels (run on a lent GPU machine, never in CI).

Compiles and runs the Pallas Triton kernel that `PagedKVCache.step` dispatches to on
GPU (`jaxkv.device.pallas_gpu.paged_attention_rows_pallas`, decode and mixed steps)
and the portable blockwise path, against the float64 NumPy reference of
`tests/test_device_attention.py` on NaN-poisoned caches; then `bench_device`'s
scaling figures with the kernel and with the blockwise path; then, next to JAX's own
kernels on the same data, decode attention (`jax.experimental.pallas.ops.gpu.
paged_attention`) and an 850-token prefill over gathered pages
(`jax.nn.dot_product_attention(implementation="cudnn")`), each as a share of the HBM
bandwidth (`--hbm-gbs`, the H200's 4,800 GB/s by default); and the engine's decode
tokens/s on a Gemma-3-270M-shaped checkpoint (random weights) with the bytes a decode
step reads over its time. Every phase appends to `<out>/gpu_check.json`, so a run cut
short still reports what it finished.

    python -m benchmarks.gpu_check --out "$OUT"

On CPU (`--no-bench`, a dry run of the script) the kernels run in Pallas interpret mode
on small shapes, the prefill with XLA's attention, and the engine on a small vocabulary.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

# The tests' float64 reference and case builders (tests/ is no package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.bench_device import bench_scaling, bench_updates  # noqa: E402
from jaxkv.device import AttentionOptions, ragged_paged_attention  # noqa: E402

# (name, seq_lens, q_lens, group, window, chunk, soft_cap, spans, dtype)
CASES = [
    ("decode gqa4", [300, 17, 1, 129], [1, 1, 1, 1], 4, None, None, None, False, "float32"),
    ("decode window", [300, 17, 90], [1, 1, 1], 2, 64, None, 30.0, False, "float32"),
    ("mixed", [300, 17, 120, 1], [200, 1, 37, 1], 4, None, None, None, True, "float32"),
    ("mixed masks", [256, 33, 160], [100, 1, 60], 8, 48, 64, 20.0, True, "float32"),
    ("mixed bf16", [300, 17, 120, 1], [200, 1, 37, 1], 4, None, None, None, False, "bfloat16"),
]


def check_kernels() -> list[dict]:
    from test_device_attention import random_case, random_spans, reference_attention, rel_error

    rows = []
    for name, seq_lens, q_lens, group, window, chunk, cap, spans, dtype in CASES:
        row: dict = {"case": name}
        try:
            rng = np.random.default_rng(7)
            case = random_case(
                rng, seq_lens, q_lens, num_kv_heads=2, group=group, head_size=128,
                block_size=16, width=24, num_blocks=120, dtype=dtype, pad_tokens=5,
            )  # fmt: skip
            ends = random_spans(rng, case) if spans else None
            masks = {"sliding_window": window, "attention_chunk": chunk, "soft_cap": cap}
            want = reference_attention(case, sm_scale=0.1, span_ends=ends, **masks)
            num_q = int(case.q_lens.sum())
            for impl in ("pallas", "reference"):
                fn = jax.jit(
                    functools.partial(
                        ragged_paged_attention, num_seqs=jnp.int32(case.num_seqs),
                        options=AttentionOptions(sm_scale=0.1, impl=impl, **masks),
                        kv_dtype=case.cache.dtype,
                        interpret=impl == "pallas" and jax.default_backend() == "cpu",
                    )
                )  # fmt: skip
                args = (
                    jnp.asarray(case.q), case.kv, jnp.asarray(case.block_tables),
                    jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc),
                )  # fmt: skip
                kw = {"span_ends": None if ends is None else jnp.asarray(ends)}
                got = np.asarray(jax.block_until_ready(fn(*args, **kw))).astype(np.float64)
                start = time.perf_counter()
                for _ in range(10):
                    jax.block_until_ready(fn(*args, **kw))
                row[f"{impl}_rel_err"] = rel_error(got[:num_q], want[:num_q])
                row[f"{impl}_finite"] = bool(np.isfinite(got).all())
                row[f"{impl}_pad_rows_zero"] = not got[num_q:].any()
                row[f"{impl}_ms"] = (time.perf_counter() - start) * 100
                if impl == "pallas":
                    text = fn.lower(*args, **kw).as_text()
                    row["triton_call_in_hlo"] = "triton" in text
        except Exception as exc:  # record and go on: one failure must not hide the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        print(row, flush=True)
        rows.append(row)
    return rows


def check_step() -> dict:
    """`PagedKVCache.step` on GPU: the kernel `auto` picks, on a mixed batch."""
    from test_device_attention import random_case, reference_attention, rel_error
    from test_device_step_metadata import _run_step

    try:
        rng = np.random.default_rng(3)
        case = random_case(
            rng, [300, 17, 120, 1], [20, 1, 7, 1], num_kv_heads=2, group=4, head_size=128,
            block_size=16, width=24, num_blocks=120, pad_tokens=0,
        )  # fmt: skip
        got = _run_step(case, rng)
        want = reference_attention(case, sm_scale=0.4)[: got.shape[0]]
        return {"step_rel_err": rel_error(got, want), "finite": bool(np.isfinite(got).all())}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        return {"error": error, "traceback": traceback.format_exc()[-3000:]}


def compare_with_jax_kernels(hbm_gbs: float, small: bool) -> dict:
    """jaxkv's decode and prefill attention next to JAX's kernels on the same pages:
    agreement and, timed, the share of HBM bandwidth each reaches (KV bytes read / time)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    heads, group, head, block = 1, 4, 256, 16  # Gemma-3-270M's attention shape
    seqs, seq_len = (2, 64) if small else (8, 4096)
    pages = seq_len // block
    rng = np.random.default_rng(11)
    k, v = (rng.standard_normal((seqs * pages + 1, block, heads, head), np.float32) for _ in "kv")
    kv = jnp.asarray(np.stack([k, v], axis=3).reshape(seqs * pages + 1, block, 2 * heads, head))
    tables = jnp.asarray(1 + np.arange(seqs * pages, dtype=np.int32).reshape(seqs, pages))
    lengths = jnp.full((seqs,), seq_len, jnp.int32)
    q = jnp.asarray(rng.standard_normal((seqs, heads * group, head), np.float32))
    interpret = jax.default_backend() == "cpu"
    ours = jax.jit(
        functools.partial(
            ragged_paged_attention, num_seqs=jnp.int32(seqs),
            options=AttentionOptions(impl="pallas" if interpret else "auto"), interpret=interpret,
        )
    )  # fmt: skip
    theirs = jax.jit(
        lambda q, k_pages, v_pages, tables, lengths: paged_attention(
            q * head**-0.5, k_pages, v_pages, tables, lengths, interpret=interpret,
            pages_per_compute_block=min(8, pages), k_splits=min(16, pages),
        )
    )  # fmt: skip
    k_pages, v_pages = (jnp.asarray(x.transpose(2, 0, 1, 3)) for x in (k, v))
    starts = jnp.arange(seqs + 1, dtype=jnp.int32)
    runs = {
        "jaxkv decode": lambda: ours(q, kv, tables, lengths, starts),
        "jax paged_attention decode": lambda: theirs(q, k_pages, v_pages, tables, lengths),
    }
    kv_bytes = 2 * seqs * seq_len * heads * head * 4
    # Prefill: one sequence's queries over its gathered pages (cuDNN on GPU).
    prefill_q = jnp.asarray(rng.standard_normal((1, seq_len, heads * group, head), np.float32))
    gathered = [jnp.asarray(x[1 : pages + 1].reshape(1, seq_len, heads, head)) for x in (k, v)]
    attend = jax.jit(
        functools.partial(
            jax.nn.dot_product_attention, is_causal=True,
            implementation="xla" if interpret else "cudnn",
        )
    )  # fmt: skip
    prefill_ours = jax.jit(
        functools.partial(
            ragged_paged_attention, num_seqs=jnp.int32(1),
            options=AttentionOptions(impl="reference" if interpret else "auto"),
        )
    )  # fmt: skip
    one_table, one_len = tables[:1], lengths[:1]
    one_start = jnp.asarray([0, seq_len], jnp.int32)
    runs["jaxkv prefill"] = lambda: prefill_ours(prefill_q[0], kv, one_table, one_len, one_start)
    runs["cudnn prefill (gathered pages)"] = lambda: attend(
        prefill_q.astype(jnp.bfloat16), *(x.astype(jnp.bfloat16) for x in gathered)
    )
    report: dict = {"seqs": seqs, "seq_len": seq_len, "hbm_gbs": hbm_gbs}
    outputs = {}
    for name, run in runs.items():
        try:
            outputs[name] = np.asarray(jax.block_until_ready(run())).astype(np.float64)
            start = time.perf_counter()
            for _ in range(3 if small else 20):
                jax.block_until_ready(run())
            seconds = (time.perf_counter() - start) / (3 if small else 20)
            read = kv_bytes if "decode" in name else kv_bytes // seqs
            report[name] = {"ms": seconds * 1e3, "hbm_share": read / seconds / (hbm_gbs * 1e9)}
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if {"jaxkv decode", "jax paged_attention decode"} <= outputs.keys():
        a, b = outputs["jaxkv decode"], outputs["jax paged_attention decode"]
        report["decode_max_abs_diff"] = float(np.abs(a - b).max())
    if {"jaxkv prefill", "cudnn prefill (gathered pages)"} <= outputs.keys():
        a, b = outputs["jaxkv prefill"], outputs["cudnn prefill (gathered pages)"][0]
        report["prefill_max_abs_diff"] = float(np.abs(a - b).max())
    return report


def engine_decode(hbm_gbs: float, small: bool) -> dict:
    """The engine's decode tokens/s on a Gemma-3-270M-shaped checkpoint (random weights,
    float32) and the share of HBM bandwidth a decode step's weight reads reach."""
    import tempfile

    from benchmarks.bench_decode import GEMMA3_270M
    from jaxkv import models
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams

    config = dict(GEMMA3_270M, vocab_size=4096) if small else dict(GEMMA3_270M)
    path = tempfile.mkdtemp(prefix="jaxkv-gpu-check-")
    models.save_random_checkpoint(path, config, seed=0)
    weight_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    model = models.load_model(path)
    batch, new_tokens = (2, 4) if small else (8, 128)
    engine = LLMEngine(
        model,
        EngineConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=512,
            max_model_len=1024,
            kv_cache_memory=2**30,
        ),  # fmt: skip
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, 64).tolist() for _ in range(batch)]
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, sampling)  # compiles every shape this workload takes
    start = time.perf_counter()
    engine.generate([p[::-1] for p in prompts], sampling)
    seconds = time.perf_counter() - start
    step_s = seconds / new_tokens  # one decode step per generated token of the batch
    return {
        "batch": batch,
        "tokens_per_s": batch * new_tokens / seconds,
        "ms_per_step": step_s * 1e3,
        "weight_bytes": weight_bytes,
        "hbm_share_weights": weight_bytes / step_s / (hbm_gbs * 1e9),
        "scan_layers": len(model.decoder.layers) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-bench", action="store_true", help="checks only (a CPU dry run)")
    parser.add_argument("--hbm-gbs", type=float, default=4800.0, help="peak HBM GB/s")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    print(report, flush=True)
    save()
    report["kernels"] = check_kernels()
    save()
    report["step"] = check_step()
    print(report["step"], flush=True)
    save()
    for phase, fn in (("jax_kernels", compare_with_jax_kernels), ("engine", engine_decode)):
        try:
            report[phase] = fn(args.hbm_gbs, small=args.no_bench)
        except Exception as exc:
            report[phase] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(phase, json.dumps(report[phase], default=str), flush=True)
        save()
    if args.no_bench:
        return
    with tqdm(total=20, desc="gpu bench", file=sys.stderr) as bar:
        for impl in ("auto", "reference"):
            try:
                report[f"scaling_{impl}"] = bench_scaling(args.rounds, False, bar, impl=impl)
            except Exception as exc:
                report[f"scaling_{impl}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(impl, json.dumps(report[f"scaling_{impl}"], default=str), flush=True)
            save()
        try:
            report["updates"] = bench_updates(256, 10, bar)
        except Exception as exc:
            report["updates"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        save()


if __name__ == "__main__":
    main()
