"""One-shot GPU check of jaxkv's attention kernels (run on a lent GPU machine, never in CI).

Compiles and runs the Pallas Triton kernel that `PagedKVCache.step` dispatches to on
GPU (`jaxkv.device.pallas_gpu.paged_attention_rows_pallas`, decode and mixed steps)
and the portable blockwise path, against the float64 NumPy reference of
`tests/test_device_attention.py` on NaN-poisoned caches; then `bench_device`'s
scaling figures with the kernel and with the blockwise path. Every phase appends to
`<out>/gpu_check.json`, so a run cut short still reports what it finished.

    python -m benchmarks.gpu_check --out "$OUT"

On CPU (`--no-bench`, a dry run of the script) the kernel runs in Pallas interpret mode.
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
from jaxkv.device import ragged_paged_attention  # noqa: E402

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
                        ragged_paged_attention, num_seqs=jnp.int32(case.num_seqs), sm_scale=0.1,
                        kv_dtype=case.cache.dtype, impl=impl, **masks,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-bench", action="store_true", help="checks only (a CPU dry run)")
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
