"""Device-side KV cache benchmark: in-place updates and paged vs dense decode attention.

Runs on whatever backend JAX picks (CPU here; unchanged on GPU/TPU):

* update time for 512 written tokens into caches of 1x, 4x and 8x the base size,
  for float32 and for bfloat16 stored as uint16 (target: 8x costs <= 1.3x the
  1x time), plus native-bf16 storage for contrast (on CPU it copies the cache);
* the compiled update's temporary memory (target: <= 5% of the cache bytes), with
  K/V handed over as stored bits (uint16 for bf16), and for contrast in the compute
  dtype, where XLA's CPU scatter materializes the bitcast (a temporary of the step's
  K/V size, whatever the cache size);
* achieved bytes/s of the update vs a plain device copy of the same bytes;
* paged decode attention vs dense attention over the same contexts (target:
  <= 2x on CPU).

    .venv/bin/python -m benchmarks.bench_device [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks._common import (
    add_record_option,
    best_of,
    print_table,
    results_name,
    write_json,
)
from jaxkv.device import PagedKVCache, ragged_paged_attention
from jaxkv.device.storage import to_storage
from jaxkv.kv_cache_interface import FullAttentionSpec

BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 16, 8, 128
TOKENS = 512


def _ready(x):
    return jax.block_until_ready(x)


def bench_updates(base_blocks: int, repeats: int, bar: tqdm) -> list[dict]:
    """Per storage kind, the three cache sizes are timed round-robin (min over rounds)."""
    rows = []
    rng = np.random.default_rng(0)
    written = 2 * TOKENS * KV_HEADS * HEAD_SIZE
    copy_src = jnp.asarray(rng.standard_normal(written), jnp.float32)
    plain_copy = jax.jit(lambda x: x * 1.0 + 0.0)
    _ready(plain_copy(copy_src))
    for label, dtype, storage in (
        ("f32", "float32", "auto"),
        ("bf16 as uint16", "bfloat16", "auto"),
        ("bf16 native", "bfloat16", "bfloat16"),
    ):
        runs = []
        for mult in (1, 4, 8):
            spec = FullAttentionSpec(BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype)
            cache = PagedKVCache(spec, base_blocks * mult, storage_dtype=storage)
            (kv,) = cache.allocate()
            # K/V arrive as stored bits, as a producer that bitcasts its own output hands them.
            k, v = (
                to_storage(
                    jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_SIZE)), cache.dtype),
                    cache.dtype,
                    cache.storage_dtype,
                )
                for _ in range(2)
            )
            slots = rng.choice(
                np.arange(BLOCK_SIZE, cache.padding_slot), size=TOKENS, replace=False
            ).astype(np.int32)
            state = {"kv": kv}

            def update(state=state, cache=cache, k=k, v=v, slots=slots):
                state["kv"] = _ready(cache.write_kv(state["kv"], k, v, slots))

            for _ in range(3):  # compile + warm
                update()
            runs.append((mult, cache, update, [float("inf")]))
        reps = repeats if storage == "auto" else max(3, repeats // 5)
        for _ in range(reps):
            for _, _, update, best in runs:
                best[0] = min(best[0], best_of(update, 1, time.perf_counter)[0])
        t_copy, _ = best_of(lambda: _ready(plain_copy(copy_src)), repeats, time.perf_counter)
        for mult, cache, _, (t,) in runs:
            stats = cache.lower_write_kv(TOKENS, cache.storage_dtype).compile().memory_analysis()
            # For contrast: K/V handed over in the compute dtype, bitcast inside the update.
            stats_compute = cache.lower_write_kv(TOKENS).compile().memory_analysis()
            nbytes = written * cache.dtype.itemsize
            rows.append(
                {
                    "storage": label,
                    "cache_mult": mult,
                    "cache_MiB": cache.cache_bytes / 2**20,
                    "update_ms": t * 1e3,
                    "vs_1x": t / runs[0][3][0],
                    "temp_pct_of_cache": 100 * stats.temp_size_in_bytes / cache.cache_bytes,
                    "temp_pct_compute_dtype_kv": 100
                    * stats_compute.temp_size_in_bytes
                    / cache.cache_bytes,
                    "update_GBps": nbytes / t / 1e9,
                    "copy_GBps": written * 4 / t_copy / 1e9,
                    "update_vs_copy_speed": (nbytes / t) / (written * 4 / t_copy),
                }
            )
            bar.update()
        del runs
    return rows


def bench_attention(num_reqs: int, context: int, repeats: int) -> dict:
    rng = np.random.default_rng(1)
    spec = FullAttentionSpec(BLOCK_SIZE, KV_HEADS, HEAD_SIZE, "float32")
    width = context // BLOCK_SIZE
    cache = PagedKVCache(spec, num_reqs * width + 1)
    group = 4
    hq = KV_HEADS * group
    keys = rng.standard_normal((num_reqs, context, KV_HEADS, HEAD_SIZE)).astype(np.float32)
    values = rng.standard_normal((num_reqs, context, KV_HEADS, HEAD_SIZE)).astype(np.float32)
    tables = 1 + rng.permutation(num_reqs * width).reshape(num_reqs, width).astype(np.int32)
    slots = (tables[:, :, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1)
    (kv,) = cache.allocate()
    kv = cache.write_kv(
        kv,
        jnp.asarray(keys.reshape(-1, KV_HEADS, HEAD_SIZE)),
        jnp.asarray(values.reshape(-1, KV_HEADS, HEAD_SIZE)),
        slots,
    )
    q = jnp.asarray(rng.standard_normal((num_reqs, hq, HEAD_SIZE)), jnp.float32)
    lens = rng.integers(context // 2, context + 1, num_reqs).astype(np.int32)
    qsl = jnp.arange(num_reqs + 1, dtype=jnp.int32)
    scale = HEAD_SIZE**-0.5

    paged = jax.jit(lambda q, kv, bt, sl: ragged_paged_attention(
        q, kv, bt, sl, qsl, jnp.int32(num_reqs), sm_scale=scale))  # fmt: skip

    @jax.jit
    def dense(q, k, v, sl):
        qg = q.reshape(num_reqs, KV_HEADS, group, HEAD_SIZE)
        s = jnp.einsum("rhgd,rkhd->rhgk", qg, k, precision="highest") * scale
        visible = (jnp.arange(context)[None, :] < sl[:, None])[:, None, None, :]
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1)
        return jnp.einsum("rhgk,rkhd->rhgd", p, v, precision="highest").reshape(q.shape)

    bt, sl, k, v = jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(keys), jnp.asarray(values)
    out_p = _ready(paged(q, kv, bt, sl))
    out_d = _ready(dense(q, k, v, sl))
    err = float(jnp.abs(out_p - out_d).max() / jnp.abs(out_d).max())
    t_p, _ = best_of(lambda: _ready(paged(q, kv, bt, sl)), repeats, time.perf_counter)
    t_d, _ = best_of(lambda: _ready(dense(q, k, v, sl)), repeats, time.perf_counter)
    return {
        "num_reqs": num_reqs,
        "context": context,
        "q_heads": hq,
        "kv_heads": KV_HEADS,
        "paged_ms": t_p * 1e3,
        "dense_ms": t_d * 1e3,
        "paged_vs_dense": t_p / t_d,
        "max_rel_diff": err,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller caches, fewer repeats")
    add_record_option(parser)
    args = parser.parse_args()
    base_blocks = 64 if args.quick else 256  # 1x f32 = 32 MiB, 8x = 256 MiB
    repeats = 5 if args.quick else 20
    print(f"backend: {jax.default_backend()} ({jax.device_count()} device(s))")
    with tqdm(total=10, desc="bench_device", file=sys.stderr) as bar:
        updates = bench_updates(base_blocks, repeats, bar)
        attention = [
            bench_attention(r, c, repeats)
            for r, c in ((16, 512), (32, 1024))[: 1 + (not args.quick)]
        ]
        bar.update()
    cols = list(updates[0])
    print_table(
        f"KV update: {TOKENS} tokens written", cols, [[r[c] for c in cols] for r in updates]
    )
    cols_a = list(attention[0])
    print_table(
        "Decode attention: paged vs dense", cols_a, [[r[c] for c in cols_a] for r in attention]
    )
    targets = {}
    for label in ("f32", "bf16 as uint16"):
        eight = next(r for r in updates if r["storage"] == label and r["cache_mult"] == 8)
        targets[f"{label}: 8x/1x <= 1.3"] = round(eight["vs_1x"], 3)
    targets["max temp % of cache <= 5"] = round(
        max(r["temp_pct_of_cache"] for r in updates if r["storage"] != "bf16 native"), 3
    )
    targets["paged/dense decode <= 2"] = round(max(r["paged_vs_dense"] for r in attention), 3)
    for name, value in targets.items():
        print(f"  {name}: {value}")
    write_json(
        results_name("bench_device", parser, args),
        {
            "backend": jax.default_backend(),
            "tokens_written": TOKENS,
            "updates": updates,
            "attention": attention,
            "targets": targets,
        },
        record=args.record,
    )


if __name__ == "__main__":
    main()
