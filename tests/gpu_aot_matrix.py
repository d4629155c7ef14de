"""Compile the GPU attention kernels for a matrix of configurations, deviceless.

Run under a CUDA environment (`jax[cuda13]`'s plugin at this jax version), never imported
by the CPU test process (`tests/test_gpu_aot.py` runs it in a subprocess):

    .venv-gpu/bin/python tests/gpu_aot_matrix.py h100   # or h200, a100

No GPU is needed: `jax.experimental.topologies` describes the part from a
`GpuTargetConfigProto` (`target_config`, written from `TARGETS`) and XLA compiles for it
ahead of time, running Triton's real pipeline for each Pallas kernel. XLA refuses a
kernel whose shared memory passes the part's per-block limit (`RESOURCE_EXHAUSTED:
Shared memory size limit exceeded: requested N, available: M`) at compile time, so a
configuration that compiles fits the part. The dispatch plans for the target's compute
capability through `$JAXKV_GPU_TARGET_CAPABILITY` (set here before jaxkv plans).

Two parts, one JSON line per item, then a summary line (`"summary": true`); exit status 1
if anything failed:

* the matrix: `ragged_paged_attention(impl="auto", platform="gpu")` over a 64-token step
  (long enough for the prefill kernel) per configuration. `"compiled"`: the dispatch
  accepts the cache and the program holds the kernels it plans (the decode kernel, and
  the prefill kernel where `prefill_plan` fits) and compiles; `"refused"`:
  `gpu_kernel_error` gives a reason and `impl="auto"`'s blockwise fallback (no Triton
  kernel) compiles; `"failed"`: anything else.
* the probes: each kernel (decode on both routes, prefill) alone with the tiles the plan
  picks for this part, compiled for the same part with no shared memory at all, so XLA's
  refusal reports the kernel's real need (`"smem"`; a kernel that compiles needs none),
  beside the bound the plan relies on (`"modelled"`: `decode_smem_bytes`,
  `prefill_smem_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU here: the topology is the target

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from aot_outcome import compile_outcome, first_line  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.device import pallas_gpu  # noqa: E402
from jaxkv.device.attention import AttentionOptions, ragged_paged_attention  # noqa: E402
from jaxkv.device.gpu_attention import (  # noqa: E402
    PREFILL_MIN_QUERY_LEN,
    QUERY_TILE,
    gpu_kernel_error,
)
from jaxkv.device.pallas_gpu import paged_attention_rows_pallas  # noqa: E402
from jaxkv.device.pallas_gpu_decode import (  # noqa: E402
    decode_compute_block_pages,
    decode_smem_bytes,
    paged_decode_rows_gpu,
)
from jaxkv.device.pallas_gpu_prefill import (  # noqa: E402
    paged_prefill_gpu,
    prefill_plan,
    prefill_smem_bytes,
)
from jaxkv.device.storage import SCALE_BYTES  # noqa: E402


class GpuTarget(NamedTuple):
    """The facts of a part XLA's GPU compiler reads (NVIDIA's data sheets, CUDA's tables)."""

    name: str
    capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    smem_per_block_optin: int  # bytes: CUDA's "maximum shared memory per thread block"
    smem_per_core: int  # bytes per multiprocessor
    memory_bytes: int
    bandwidth: int  # bytes/s
    l2_bytes: int
    clock_ghz: float


TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 233472, 80 << 30,
                      3_350_000_000_000, 50 << 20, 1.98),
    "h200": GpuTarget("NVIDIA H200", (9, 0), 132, 232448, 233472, 141 * 10**9,
                      4_800_000_000_000, 50 << 20, 1.98),
    "a100": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 167936, 80 << 30,
                      2_039_000_000_000, 40 << 20, 1.41),
}  # fmt: skip
FULL_MATRIX = ("h100", "a100")  # the H200 shares the H100's capability: a small matrix
DTYPES = {"bf16": "bfloat16", "f32": "float32"}
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
GROUPS = (1, 2, 4, 8, 16)  # 16: the decode kernel's dot route
MASKS = {
    "none": {},
    "sliding_window": {"sliding_window": 40},
    "attention_chunk": {"attention_chunk": 64},
    "soft_cap": {"soft_cap": 30.0},
}
# step shape: tokens, requests, table width (pages), cache blocks, KV heads
TOKENS, REQUESTS, TABLE_WIDTH, NUM_BLOCKS, KV_HEADS = 64, 4, 64, 256, 2
TRITON = "__gpu$xla.gpu.triton"
ROWS_PROBE_PAGES = 8  # the rows kernel's compute block in the H200's figures


def target_config(target: GpuTarget, smem_limit: int | None = None) -> str:
    """The part as a `GpuTargetConfigProto` text; `smem_limit` overrides its per-block limit."""
    major, minor = target.capability
    limit = target.smem_per_block_optin if smem_limit is None else smem_limit
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: {target.smem_per_core}  threads_per_core_limit: 2048
  core_count: {target.cores}  fpus_per_core: 128  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535  block_dim_limit_z: 65535  memory_bandwidth: {target.bandwidth}
  l2_cache_size: {target.l2_bytes}  clock_rate_ghz: {target.clock_ghz}
  device_memory_size: {target.memory_bytes}  shared_memory_per_block_optin: {limit}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{target.name}"
"""


def matrix(full: bool) -> list[dict]:
    """bf16: every head size x block size x group (mask cycled); f32: every head size x
    group (block size cycled); then the caches the GPU kernels refuse. Not `full`: each
    dtype and head size at 16-token pages and group 4 (a part whose capability, and so
    whose plan, another part's full matrix covers)."""
    refused = {"dtype": "bf16", "head_size": 128, "block_size": 16, "group": 4, "masks": "none"}
    refusals = [{**refused, "kv_quant": "int8"}, {**refused, "kv_head_mode": True}]
    if not full:
        small = [
            {**refused, "dtype": dtype, "head_size": d} for dtype in DTYPES for d in HEAD_SIZES
        ]
        return small + refusals
    configs = [
        {"dtype": "bf16", "head_size": d, "block_size": bs, "group": g,
         "masks": tuple(MASKS)[(i + j + k) % len(MASKS)]}
        for i, d in enumerate(HEAD_SIZES) for j, bs in enumerate(BLOCK_SIZES)
        for k, g in enumerate(GROUPS)
    ]  # fmt: skip
    configs += [
        {"dtype": "f32", "head_size": d, "block_size": BLOCK_SIZES[(i + k) % len(BLOCK_SIZES)],
         "group": g, "masks": tuple(MASKS)[(i + 2 * k) % len(MASKS)]}
        for i, d in enumerate(HEAD_SIZES) for k, g in enumerate(GROUPS)
    ]  # fmt: skip
    return configs + refusals


def requested_smem(error: BaseException) -> int | None:
    """The shared memory XLA's refusal says a kernel requested, or None."""
    found = re.search(r"Shared memory size limit exceeded: requested (\d+)", str(error))
    return int(found.group(1)) if found else None


def device_for(target: GpuTarget, smem_limit: int | None = None):
    """A deviceless device of the part (`target_config`)."""
    config = target_config(target, smem_limit)
    topology = topologies.get_topology_desc(
        target.name, platform="cuda", target_config=config, topology="1x1x1"
    )
    return topology.devices[0]


def _spec(shape, dtype, device) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _step_program(config: dict, device):
    """`(function, argument specs)` of one `ragged_paged_attention` step on the GPU."""
    compute = jnp.dtype(DTYPES[config["dtype"]])
    kv_quant = config.get("kv_quant")
    storage = jnp.int8 if kv_quant else compute
    d, g = config["head_size"], config["group"]
    kv_head = config.get("kv_head_mode", False)
    options = AttentionOptions(**MASKS[config["masks"]])

    def attend(q, kv_cache, tables, seq_lens, query_start_loc, num_seqs):
        return ragged_paged_attention(
            q, kv_cache, tables, seq_lens, query_start_loc, num_seqs, options,
            platform="gpu", kv_dtype=compute, kv_quant=kv_quant,
            kv_head=jnp.int32(KV_HEADS - 1) if kv_head else None,
        )  # fmt: skip

    stored = d + (SCALE_BYTES if kv_quant else 0)
    args = (
        _spec((TOKENS, g if kv_head else KV_HEADS * g, d), compute, device),
        _spec((NUM_BLOCKS, config["block_size"], 2 * KV_HEADS, stored), storage, device),
        _spec((REQUESTS, TABLE_WIDTH), jnp.int32, device),
        _spec((REQUESTS,), jnp.int32, device),
        _spec((REQUESTS + 1,), jnp.int32, device),
        _spec((), jnp.int32, device),
    )
    return attend, args


def planned_kernels(config: dict) -> tuple[str | None, int]:
    """`(the dispatch's refusal or None, the Triton kernels it plans for the step)`."""
    compute = np.dtype(DTYPES[config["dtype"]])
    d, bs, g = config["head_size"], config["block_size"], config["group"]
    storage = jnp.zeros((1, bs, 2 * KV_HEADS, d), jnp.int8 if config.get("kv_quant") else compute)
    q_shape = (TOKENS, KV_HEADS * g, d)
    kv_head = jnp.int32(0) if config.get("kv_head_mode") else None
    reason = gpu_kernel_error(
        storage, compute, kv_head, q_shape, quantised="kv_quant" in config, interpret=False
    )
    if reason is not None:
        return reason, 0
    try:
        prefill_plan(d, bs, g, compute, QUERY_TILE, pallas_gpu.gpu_smem_limit())
    except ValueError:
        return None, 1
    return None, 2 if TOKENS > PREFILL_MIN_QUERY_LEN else 1


def compile_one(config: dict, device) -> dict:
    """Compile one step; its outcome, the dispatch's reason, error and compile seconds."""
    reason, kernels = planned_kernels(config)
    attend, args = _step_program(config, device)

    def mismatch(text: str) -> str | None:
        found = text.count(TRITON)
        return None if found == kernels else f"{found} Triton kernels, the plan {kernels}"

    result = compile_outcome(lambda: jax.jit(attend).lower(*args), mismatch, reason)
    return {**result, "kernels": kernels}


def probes() -> list[dict]:
    """Each kernel at 16-token pages for every dtype and head size: decode on the vector
    route (group 4) and the dot route (group 16), prefill (group 4); and the rows kernel
    (`gpu_check`'s baseline) at the shape an H200 reported its figures for."""
    dispatched = [
        {"kernel": kernel, "dtype": dtype, "head_size": d, "block_size": 16, "group": g}
        for dtype in DTYPES for d in HEAD_SIZES
        for kernel, g in (("decode", 4), ("decode", 16), ("prefill", 4))
    ]  # fmt: skip
    rows = {"kernel": "rows", "head_size": 256, "block_size": 16, "group": 4}
    return dispatched + [{**rows, "dtype": dtype} for dtype in DTYPES]


def _probe_program(probe: dict, device):
    """`(function, argument specs, the plan's tiles, their modelled shared memory)`."""
    compute = np.dtype(DTYPES[probe["dtype"]])
    d, bs, g = probe["head_size"], probe["block_size"], probe["group"]
    smem = pallas_gpu.gpu_smem_limit()
    q = _spec((TOKENS, KV_HEADS * g, d), compute, device)
    cache = _spec((NUM_BLOCKS, bs, 2 * KV_HEADS, d), compute, device)
    ints = [_spec((n,), jnp.int32, device) for n in (TOKENS, TOKENS, REQUESTS + 1)]
    if probe["kernel"] == "rows":
        tiles = {"pages_per_compute_block": ROWS_PROBE_PAGES}
        table = _spec((TOKENS, TABLE_WIDTH), jnp.int32, device)

        def call(q, cache, table, lo, hi):
            return paged_attention_rows_pallas(q, cache, table, lo, hi, sm_scale=0.1, **tiles)

        keys = ROWS_PROBE_PAGES * bs
        modelled = pallas_gpu.smem_bytes(d, keys, pallas_gpu.query_rows(g), compute.itemsize)
        return call, (q, cache, table, *ints[:2]), tiles, modelled
    if probe["kernel"] == "decode":
        pages = decode_compute_block_pages(d, bs, g, compute, smem)
        tiles = {"pages_per_compute_block": pages}
        table = _spec((TOKENS, TABLE_WIDTH), jnp.int32, device)

        def call(q, cache, table, lo, hi):
            return paged_decode_rows_gpu(q, cache, table, lo, hi, sm_scale=0.1, **tiles)

        modelled = decode_smem_bytes(d, pages * bs, g, compute.itemsize)
        return call, (q, cache, table, *ints[:2]), tiles, modelled
    plan = prefill_plan(d, bs, g, compute, QUERY_TILE, smem)
    tiles = {"pages_per_chunk": plan.pages_per_chunk, "heads_per_program": plan.heads_per_program}
    table = _spec((REQUESTS, TABLE_WIDTH), jnp.int32, device)

    def call(q, cache, table, lo, hi, query_start_loc):
        return paged_prefill_gpu(
            q, cache, table, query_start_loc, jnp.int32(REQUESTS), lo, hi, sm_scale=0.1,
            min_query_len=PREFILL_MIN_QUERY_LEN, query_tile=QUERY_TILE, **tiles,
        )  # fmt: skip

    keys, rows = plan.pages_per_chunk * bs, QUERY_TILE * plan.heads_per_program
    modelled = prefill_smem_bytes(d, keys, rows, compute.itemsize)
    return call, (q, cache, table, *ints), tiles, modelled


def probe_one(probe: dict, device) -> dict:
    """One kernel's real shared memory (`smem`) under the plan's tiles, or why not;
    `device` has no shared memory, so a kernel that compiles needs none."""
    result = {"smem": None, "error": None}
    try:
        call, args, result["tiles"], result["modelled"] = _probe_program(probe, device)
        jax.jit(call).lower(*args).compile()
        result["smem"] = 0
    except Exception as error:  # noqa: BLE001 - every failure is reported, not raised
        result["smem"] = requested_smem(error)
        if result["smem"] is None:
            result["error"] = first_line(error)
    return result


def run(name: str) -> dict:
    """Compile the matrix and the probes for one part, a line each; returns the summary."""
    target = TARGETS[name]
    limit = pallas_gpu.gpu_smem_limit()
    device = device_for(target)
    summary = {
        "summary": True, "target": name, "jax": jax.__version__, "jaxkv": jaxkv.__file__,
        "device_kind": device.device_kind, "plan_limit": limit.bytes,
        "plan_limit_source": limit.source, "limit": target.smem_per_block_optin,
    }  # fmt: skip
    counts = {"configs": 0, "compiled": 0, "refused": 0, "failed": 0, "compile_s": 0.0}
    for config in matrix(full=name in FULL_MATRIX):
        result = compile_one(config, device)
        print(json.dumps({"target": name, **config, **result}), flush=True)
        counts["configs"] += 1
        counts[result["outcome"]] += 1
        counts["compile_s"] = round(counts["compile_s"] + result["compile_s"], 3)
    probe_device = device_for(target, smem_limit=0)
    probes_failed = 0
    for probe in probes():
        result = probe_one(probe, probe_device)
        print(json.dumps({"target": name, "probe": True, **probe, **result}), flush=True)
        probes_failed += result["smem"] is None
    summary.update(counts, probes_failed=probes_failed)
    summary["failed"] = counts["failed"] + probes_failed
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(TARGETS), help="the part to compile for")
    name = parser.parse_args(argv).target
    major, minor = TARGETS[name].capability
    os.environ[pallas_gpu.TARGET_CAPABILITY_ENV] = f"{major}.{minor}"  # before jaxkv plans
    summary = run(name)
    print(json.dumps(summary), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
