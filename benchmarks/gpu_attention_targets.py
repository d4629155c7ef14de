"""Issue 36's attention targets, measured on one GPU (a phase of `gpu_check`).

On the dispatched path (`impl="auto"`, what `PagedKVCache.step` runs), bf16, 8 KV heads
of 128, 4 query heads per KV head, pages of 16:

- decode 32 x 1,024 tokens: at least 50% of the HBM bandwidth for the KV it reads, and
  faster than dense attention on the same data (`PagedBatch.dense_call`, XLA);
- decode 64 x 8,192 tokens: at least 70%;
- prefill of 4,096 tokens: within 2x of cuDNN's dense attention
  (`jax.nn.dot_product_attention(implementation="cudnn")`) on the same data;
- a mixed batch (one 1,024-token prefill and 31 decodes of 1,024): no slower than the
  prefill alone plus the decodes alone.

The bandwidth is the measured copy's (`hbm_floor`) where that phase ran, and each share
is also given against the nominal one. Each call is timed back to back (`CALLS` calls
dispatched, one wait: a decode of 32 x 1,024 takes tens of microseconds, less than a
dispatch and a sync), median and range of interleaved rounds. The CPU dry run takes
small shapes, XLA's attention for cuDNN's, and the blockwise path.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks._common import spread
from benchmarks.bench_device import BLOCK_SIZE, HEAD_SIZE, PagedBatch

KV_HEADS, GROUP, DTYPE = 8, 4, "bfloat16"
CALLS = 20


def table_width(*contexts: int) -> int:
    """Pages per table row: enough for the longest context."""
    return -(-max(contexts) // BLOCK_SIZE)


def back_to_back(calls: dict[str, Callable[[], jax.Array]], rounds: int) -> dict[str, dict]:
    """Milliseconds per call of each zero-argument call (`spread`: median, min, max over
    rounds): `CALLS` dispatched back to back, then one wait; one warm-up call each first,
    rounds interleaved across the calls."""
    for call in calls.values():
        jax.block_until_ready(call())
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                out = call()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / CALLS * 1e3)
    return {name: spread(ms) for name, ms in samples.items()}


def dense_prefill_call(batch: PagedBatch, implementation: str) -> Callable[[], jax.Array]:
    """Causal dense attention of a one-request prefill batch over its contiguous K/V."""
    q, k, v = (x[None] for x in (batch.q, batch.keys[0], batch.values[0]))
    attend = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=batch.scale, is_causal=True, implementation=implementation
        )
    )
    return lambda: attend(q, k, v)


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())


def shares(kv_bytes: int, ms: float, measured_gbs: float, nominal_gbs: float) -> dict:
    """The bandwidth a call reading `kv_bytes` in `ms` reaches, absolute and as shares."""
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    return {"gbs": gbs, "share_measured": gbs / measured_gbs, "share_nominal": gbs / nominal_gbs}


def decode_case(reqs: int, context: int, rounds: int, gbs: tuple[float, float]) -> dict:
    """`reqs` decodes of `context` tokens: paged (dispatched) vs dense, bandwidth shares."""
    batch = PagedBatch([(context, 1)] * reqs, table_width(context), KV_HEADS, GROUP, DTYPE)
    calls = {"paged": batch.paged_call(), "dense": batch.dense_call()}
    times = back_to_back(calls, rounds)
    kv_bytes = batch.kv_bytes()
    return {
        "kv_bytes": kv_bytes,
        **{name: t | shares(kv_bytes, t["median"], *gbs) for name, t in times.items()},
        "paged_vs_dense": times["paged"]["median"] / times["dense"]["median"],
        "max_abs_diff": max_abs_diff(calls["paged"](), calls["dense"]()),
    }


def prefill_case(tokens: int, rounds: int, implementation: str) -> dict:
    """One prefill of `tokens`: paged (dispatched) against "dense",
    `jax.nn.dot_product_attention` with `implementation` (cuDNN on a GPU), and beside
    them `PagedBatch`'s XLA attention."""
    batch = PagedBatch([(tokens, tokens)], table_width(tokens), KV_HEADS, GROUP, DTYPE)
    calls = {
        "paged": batch.paged_call(),
        "dense": dense_prefill_call(batch, implementation),
        "dense_xla": batch.dense_call(),
    }
    times = back_to_back(calls, rounds)
    return times | {
        "dense_implementation": implementation,
        "paged_vs_dense": times["paged"]["median"] / times["dense"]["median"],
        "max_abs_diff": max_abs_diff(calls["paged"](), calls["dense"]()[0]),
    }


def mixed_case(prefill: int, decodes: int, context: int, rounds: int) -> dict:
    """A prefill of `prefill` tokens with `decodes` decodes of `context`, against the two
    parts run alone (each its own batch, the same shapes)."""
    parts = {
        "mixed": [(prefill, prefill)] + [(context, 1)] * decodes,
        "prefill_alone": [(prefill, prefill)],
        "decodes_alone": [(context, 1)] * decodes,
    }
    width = table_width(prefill, context)
    calls = {
        name: PagedBatch(reqs, width, KV_HEADS, GROUP, DTYPE).paged_call()
        for name, reqs in parts.items()
    }
    times = back_to_back(calls, rounds)
    parts_ms = times["prefill_alone"]["median"] + times["decodes_alone"]["median"]
    return times | {"mixed_vs_sum_of_parts": times["mixed"]["median"] / parts_ms}


def attention_targets(measured_gbs: float, nominal_gbs: float, rounds: int, small: bool) -> dict:
    """Every case above and the targets, each with its figure and whether it is met."""
    gbs = (measured_gbs, nominal_gbs)
    (n1, c1), (n2, c2) = ((4, 64), (2, 256)) if small else ((32, 1024), (64, 8192))
    prefill = 128 if small else 4096
    mixed = (64, 3, 64) if small else (1024, 31, 1024)
    dense = "xla" if small else "cudnn"
    short, long_ = decode_case(n1, c1, rounds, gbs), decode_case(n2, c2, rounds, gbs)
    pre, mix = prefill_case(prefill, rounds, dense), mixed_case(*mixed, rounds)
    checks = {
        f"decode {n1} x {c1}: share of measured bandwidth >= 0.5":
            (short["paged"]["share_measured"], operator.ge, 0.5),
        f"decode {n1} x {c1}: paged / dense < 1": (short["paged_vs_dense"], operator.lt, 1.0),
        f"decode {n2} x {c2}: share of measured bandwidth >= 0.7":
            (long_["paged"]["share_measured"], operator.ge, 0.7),
        f"prefill {prefill}: paged / {dense} <= 2": (pre["paged_vs_dense"], operator.le, 2.0),
        "mixed / (prefill + decodes alone) <= 1": (mix["mixed_vs_sum_of_parts"], operator.le, 1.0),
    }  # fmt: skip
    return {
        "shape": {"kv_heads": KV_HEADS, "group": GROUP, "head_size": HEAD_SIZE, "dtype": DTYPE},
        "bandwidth_gbs": {"measured_copy": measured_gbs, "nominal": nominal_gbs},
        f"decode {n1} x {c1}": short,
        f"decode {n2} x {c2}": long_,
        f"prefill {prefill}": pre,
        "mixed {} + {} x {}".format(*mixed): mix,
        "targets": {
            name: {"value": value, "met": bool(holds(value, bound))}
            for name, (value, holds, bound) in checks.items()
        },
    }
