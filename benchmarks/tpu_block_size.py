"""The engine's TPU block size, from the TPU compiler and a cost estimate (no TPU needed).

    .venv-tpu/bin/python -m benchmarks.tpu_block_size [--json PATH]

Run in an environment with `jax[tpu]` (libtpu): it compiles jaxkv's Mosaic attention
kernel for a TPU v5e chip by deviceless AOT compilation. For each block size (16, 32,
64, 128) and two per-chip decode shapes (Llama-3.2-1B on 4 chips: 2 KV heads of 64, 8
query heads; Gemma-3-27B on 16 chips: 1 KV head of 128, 2 query heads; bfloat16):

1. **Compiler**: the kernel prefetches every request's block table into SMEM, so the
   table's `requests x pages` entries must fit the chip's scalar memory. The table
   below reports whether the decode kernel compiles for 256 requests of 32,768 tokens
   (the long-context serving point), and the compile time at 32 requests of 2,048.
2. **Cost estimate** per decode step and layer at 32 requests of 2,048 tokens: the
   DMAs the kernel issues (one per page and 128-lane column of a head block) and the
   bytes they move (whole pages, a request's last page included, row-major TPU tiles
   counted with their lane padding), with the time those bytes take at v5e's 819 GB/s
   and a per-DMA issue cost. The issue cost is an assumption (0.1 and 0.5 µs are shown),
   not a measurement: no TPU was lent. Also the tail waste: the share of the KV
   memory a request's half-filled last page costs at that context.

The engine's TPU default (`jaxkv.device.pallas_tpu.TPU_BLOCK_SIZE`) is the block size this
chooses: the smallest whose estimated time at the larger issue cost is within 10% of the
best and whose long-context table compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jaxkv.device.attention import AttentionOptions, ragged_paged_attention  # noqa: E402
from jaxkv.device.pallas_tpu import head_block, lane_columns  # noqa: E402

BLOCK_SIZES = (16, 32, 64, 128)
SHAPES = {  # per chip: (kv heads, query heads, head size)
    "llama-3.2-1b / 4 chips": (2, 8, 64),
    "gemma-3-27b / 16 chips": (1, 2, 128),
}
HBM_BANDWIDTH = 819e9  # v5e, Google Cloud's TPU v5e page
ISSUE_COSTS = (0.1e-6, 0.5e-6)  # assumed seconds per DMA issued


def _compiles(sharding, kv_heads, q_heads, head_size, bs, requests, context) -> tuple[bool, float]:
    width = -(-context // bs)

    def spec(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def attend(q, kv, tables, seq_lens, qsl, num_seqs):
        return ragged_paged_attention(
            q, kv, tables, seq_lens, qsl, num_seqs, AttentionOptions(impl="pallas"),
            platform="tpu",
        )  # fmt: skip

    args = (
        spec((requests, q_heads, head_size), jnp.bfloat16),
        spec((requests * width + 1, bs, 2 * kv_heads, head_size), jnp.bfloat16),
        spec((requests, width)), spec((requests,)), spec((requests + 1,)), spec(()),
    )  # fmt: skip
    start = time.perf_counter()
    try:
        jax.jit(attend).lower(*args).compile()
    except Exception:  # the compiler's refusal is the finding
        return False, time.perf_counter() - start
    return True, time.perf_counter() - start


def _estimate(kv_heads, head_size, bs, requests=32, context=2048) -> dict:
    pages = requests * -(-context // bs)
    blocks = kv_heads // head_block(kv_heads, 2)
    dmas = pages * len(lane_columns(head_size)) * blocks
    row_bytes = 2 * kv_heads * -(-head_size // 128) * 128 * 2  # bf16, lane-padded
    moved = pages * bs * row_bytes
    times = {f"{c * 1e6:g}us": dmas * c + moved / HBM_BANDWIDTH for c in ISSUE_COSTS}
    return {"dmas": dmas, "bytes": moved, "seconds": times, "tail_waste": bs / 2 / context}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    sharding = SingleDeviceSharding(device)
    rows = []
    for name, (kv_heads, q_heads, head_size) in SHAPES.items():
        for bs in BLOCK_SIZES:
            ok, seconds = _compiles(sharding, kv_heads, q_heads, head_size, bs, 32, 2048)
            long_ok, _ = _compiles(sharding, kv_heads, q_heads, head_size, bs, 256, 32768)
            row = {
                "shape": name, "block_size": bs, "compiles": ok, "compile_s": seconds,
                "long_context_compiles": long_ok, **_estimate(kv_heads, head_size, bs),
            }  # fmt: skip
            rows.append(row)
            slow, fast = (row["seconds"][f"{c * 1e6:g}us"] * 1e6 for c in reversed(ISSUE_COSTS))
            print(
                f"{name:24s} bs={bs:4d} compiles={ok!s:5s} ({seconds:4.1f} s) "
                f"256x32K={long_ok!s:5s} DMAs={row['dmas']:6d} MB={row['bytes'] / 1e6:6.2f} "
                f"est={fast:7.1f}/{slow:7.1f} us tail={row['tail_waste']:.1%}",
                flush=True,
            )
    chosen = {}
    for name in SHAPES:
        mine = [r for r in rows if r["shape"] == name and r["long_context_compiles"]]
        key = f"{ISSUE_COSTS[-1] * 1e6:g}us"
        best = min(r["seconds"][key] for r in mine)
        chosen[name] = min(r["block_size"] for r in mine if r["seconds"][key] <= 1.1 * best)
    print("chosen:", chosen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "chosen": chosen}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
