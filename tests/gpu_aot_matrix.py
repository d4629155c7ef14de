"""Compile the GPU attention kernels for a matrix of configurations, deviceless.

Run under a CUDA environment (`jax-cuda13-plugin` and `jax-cuda13-pjrt` at this jax
version), never imported by the CPU test process (`tests/test_gpu_aot.py` runs it in a
subprocess):

    .venv-gpu-ci/bin/python tests/gpu_aot_matrix.py h100   # or h200, a100
    .venv-gpu-ci/bin/python tests/gpu_aot_matrix.py h100 --probe-grid   # tiles of every size

No GPU is needed: `jaxkv.device.gpu_targets` describes the part to XLA, which compiles
for it ahead of time, running Triton's real pipeline for each Pallas kernel. XLA refuses
a kernel whose shared memory passes the part's per-block limit (`RESOURCE_EXHAUSTED:
Shared memory size limit exceeded: requested N, available: M`) at compile time, so a
configuration that compiles fits the part. The dispatch plans for the part's compute
capability (`pallas_gpu.gpu_target`).

Three parts, one JSON line per item, then a summary line (`"summary": true`); exit status
1 if anything failed:

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
  `prefill_smem_bytes`); `--probe-grid` probes tiles of every size instead of all this;
* on the parts of `FULL_MATRIX`, the layer layouts (`weight_slice_copies`): how many
  fusions of each step program copy a slice of a stacked weight, layers scanned and as
  `load_model` lays them out for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU here: the topology is the target

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from aot_outcome import attention_step, compile_outcome, first_line  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.device import pallas_gpu  # noqa: E402
from jaxkv.device.attention import AttentionOptions  # noqa: E402
from jaxkv.device.gpu_attention import (  # noqa: E402
    PREFILL_MIN_QUERY_LEN,
    QUERY_TILE,
    gpu_kernel_error,
)
from jaxkv.device.gpu_targets import GPU_TARGETS, gpu_topology_devices  # noqa: E402
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

FULL_MATRIX = ("h100", "a100")  # the H200 shares the H100's capability: a small matrix
DTYPES = {"bf16": "bfloat16", "f32": "float32"}
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
# 4 takes the decode kernel's vector route (its loop over the group unrolls; nothing else
# follows the group), 16 its dot route; 1 (no GQA) runs at 16-token pages; the probes and
# the grid cover 2, 8 and 32
GROUPS = (4, 16)
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
# XLA's GPU fusion that writes a dynamic slice of an array (a layer of a stacked weight)
# to a buffer of its own, in the compiled program's text
WEIGHT_SLICE_COPY = '"name":"dynamic_slice_fusion"'


def matrix(full: bool) -> list[dict]:
    """bf16: every head size x block size x group (mask cycled), and each head size with
    no GQA; f32: every head size x group (block size cycled); then the caches the GPU
    kernels refuse. Not `full`: each
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
    configs += [{**refused, "head_size": d, "group": 1} for d in HEAD_SIZES]
    configs += [
        {"dtype": "f32", "head_size": d, "block_size": BLOCK_SIZES[(i + 2 * k) % len(BLOCK_SIZES)],
         "group": g, "masks": tuple(MASKS)[(i + 2 * k) % len(MASKS)]}
        for i, d in enumerate(HEAD_SIZES) for k, g in enumerate(GROUPS)
    ]  # fmt: skip
    return configs + refusals


def requested_smem(error: BaseException) -> int | None:
    """The shared memory XLA's refusal says a kernel requested, or None."""
    found = re.search(r"Shared memory size limit exceeded: requested (\d+)", str(error))
    return int(found.group(1)) if found else None


def _spec(shape, dtype, device) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _step_program(config: dict, device):
    """`(function, argument specs)` of one `ragged_paged_attention` step on the GPU."""
    compute = jnp.dtype(DTYPES[config["dtype"]])
    kv_quant = config.get("kv_quant")
    return attention_step(
        platform="gpu", options=AttentionOptions(**MASKS[config["masks"]]), config=config,
        kv_heads=KV_HEADS, storage=jnp.int8 if kv_quant else compute, compute=compute,
        kv_quant=kv_quant, tokens=TOKENS, requests=REQUESTS, table_width=TABLE_WIDTH,
        num_blocks=NUM_BLOCKS, sharding=jax.sharding.SingleDeviceSharding(device),
    )  # fmt: skip


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


def probe_grid() -> list[dict]:
    """Tiles of every size around the plans' (`--probe-grid`): decode at 1-8 pages of 16
    on both routes and at GQA 1-32, prefill at 1-4 pages x 1-4 heads per program."""
    grid = [
        {"kernel": "decode", "dtype": dtype, "head_size": d, "block_size": 16, "group": g,
         "tiles": {"pages_per_compute_block": pages}}
        for dtype in DTYPES for d in HEAD_SIZES for pages in (1, 2, 4, 8) for g in (4, 16)
    ]  # fmt: skip
    grid += [
        {"kernel": "decode", "dtype": dtype, "head_size": 128, "block_size": 16, "group": g,
         "tiles": {"pages_per_compute_block": 4}}
        for dtype in DTYPES for g in (1, 2, 8, 32)
    ]  # fmt: skip
    return grid + [
        {"kernel": "prefill", "dtype": dtype, "head_size": d, "block_size": 16, "group": 4,
         "tiles": {"pages_per_chunk": pages, "heads_per_program": heads}}
        for dtype in DTYPES for d in HEAD_SIZES for pages in (1, 2, 4) for heads in (1, 2, 4)
    ]  # fmt: skip


def probe_tiles(probe: dict) -> tuple[dict, int]:
    """The tiles a probe compiles with (its own `"tiles"`, else what the plan picks for
    this part) and the bound on their shared memory the plan relies on."""
    compute = np.dtype(DTYPES[probe["dtype"]])
    d, bs, g, size = probe["head_size"], probe["block_size"], probe["group"], compute.itemsize
    smem, tiles = pallas_gpu.gpu_smem_limit(), probe.get("tiles")
    if probe["kernel"] == "rows":
        tiles = tiles or {"pages_per_compute_block": ROWS_PROBE_PAGES}
        keys = tiles["pages_per_compute_block"] * bs
        return tiles, pallas_gpu.smem_bytes(d, keys, pallas_gpu.query_rows(g), size)
    if probe["kernel"] == "decode":
        pages = decode_compute_block_pages(d, bs, g, compute, smem)
        tiles = tiles or {"pages_per_compute_block": pages}
        return tiles, decode_smem_bytes(d, tiles["pages_per_compute_block"] * bs, g, size)
    if not tiles:
        plan = prefill_plan(d, bs, g, compute, QUERY_TILE, smem)
        tiles = {
            "pages_per_chunk": plan.pages_per_chunk,
            "heads_per_program": plan.heads_per_program,
        }
    keys, rows = tiles["pages_per_chunk"] * bs, QUERY_TILE * tiles["heads_per_program"]
    return tiles, prefill_smem_bytes(d, keys, rows, size)


def _probe_program(probe: dict, tiles: dict, device):
    """`(function, argument specs)`: the probe's kernel alone with `tiles`."""
    compute = np.dtype(DTYPES[probe["dtype"]])
    d, bs, g = probe["head_size"], probe["block_size"], probe["group"]
    q = _spec((TOKENS, KV_HEADS * g, d), compute, device)
    cache = _spec((NUM_BLOCKS, bs, 2 * KV_HEADS, d), compute, device)
    lo_hi = [_spec((TOKENS,), jnp.int32, device)] * 2
    if probe["kernel"] in ("rows", "decode"):
        kernel = paged_attention_rows_pallas if probe["kernel"] == "rows" else paged_decode_rows_gpu

        def call(q, cache, table, lo, hi):
            return kernel(q, cache, table, lo, hi, sm_scale=0.1, **tiles)

        return call, (q, cache, _spec((TOKENS, TABLE_WIDTH), jnp.int32, device), *lo_hi)

    def prefill(q, cache, table, lo, hi, query_start_loc):
        return paged_prefill_gpu(
            q, cache, table, query_start_loc, jnp.int32(REQUESTS), lo, hi, sm_scale=0.1,
            min_query_len=PREFILL_MIN_QUERY_LEN, query_tile=QUERY_TILE, **tiles,
        )  # fmt: skip

    table = _spec((REQUESTS, TABLE_WIDTH), jnp.int32, device)
    return prefill, (q, cache, table, *lo_hi, _spec((REQUESTS + 1,), jnp.int32, device))


def probe_one(probe: dict, device) -> dict:
    """One kernel's real shared memory (`smem`) under its tiles (`probe_tiles`), or why
    not; `device` has no shared memory, so a kernel that compiles needs none."""
    result = {"smem": None, "error": None}
    try:
        result["tiles"], result["modelled"] = probe_tiles(probe)
        call, args = _probe_program(probe, result["tiles"], device)
        jax.jit(call).lower(*args).compile()
        result["smem"] = 0
    except Exception as error:  # noqa: BLE001 - every failure is reported, not raised
        result["smem"] = requested_smem(error)
        if result["smem"] is None:
            result["error"] = first_line(error)
    return result


def weight_slice_copies(name: str) -> list[dict]:
    """Per step program of a two-layer Llama-3.2-1B-shaped model on the part, the fusions
    that copy a slice of a stacked weight into a buffer of its own: with the layers
    scanned as one body, and as `load_model` lays them out for a GPU by default."""
    from models_util import real_shaped_two_layer_configs

    from jaxkv.device import make_mesh
    from jaxkv.engine import EngineConfig
    from jaxkv.engine.model_runner import ModelRunner
    from jaxkv.engine.sizing import plan_kv_cache
    from jaxkv.models.config import parse_model_config
    from jaxkv.models.loading import abstract_model, default_scan_layers

    config = parse_model_config(real_shaped_two_layer_configs()["llama-3.2-1b-2l"], "llama")
    mesh = make_mesh(1, 1, gpu_topology_devices(name))
    engine = EngineConfig(
        block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
        dtype="bfloat16", kv_cache_memory=2**30,
    )  # fmt: skip
    rows = []
    for scan in (True, default_scan_layers(mesh)):
        model = abstract_model(config, engine.dtype, mesh, scan_layers=scan)
        plan = plan_kv_cache(model.kv_cache_specs(16, engine.dtype), engine, mesh, 2048)
        runner = ModelRunner(model, plan, max_num_seqs=16, max_num_batched_tokens=256,
                             allocate=False)  # fmt: skip
        copies = {
            program: lowered.compile().as_text().count(WEIGHT_SLICE_COPY)
            for program, (lowered, _) in runner.lowered_programs().items()
            if program.startswith("step")
        }
        rows.append({"layers": True, "scan_layers": scan, "copies": copies})
    return rows


def run(name: str, grid: bool = False) -> dict:
    """Compile the matrix and the probes for one part, a line each (`grid`: only the
    probes of `probe_grid`); returns the summary."""
    target = GPU_TARGETS[name]
    limit = pallas_gpu.gpu_smem_limit()
    [device] = gpu_topology_devices(name)
    summary = {
        "summary": True, "target": name, "jax": jax.__version__, "jaxkv": jaxkv.__file__,
        "device_kind": device.device_kind, "plan_limit": limit.bytes,
        "plan_limit_source": limit.source, "limit": target.smem_per_block,
    }  # fmt: skip
    counts = {"configs": 0, "compiled": 0, "refused": 0, "failed": 0, "compile_s": 0.0}
    for config in [] if grid else matrix(full=name in FULL_MATRIX):
        result = compile_one(config, device)
        print(json.dumps({"target": name, **config, **result}), flush=True)
        counts["configs"] += 1
        counts[result["outcome"]] += 1
        counts["compile_s"] = round(counts["compile_s"] + result["compile_s"], 3)
    [probe_device] = gpu_topology_devices(name, smem_limit=0)
    probes_failed = 0
    for probe in probe_grid() if grid else probes():
        result = probe_one(probe, probe_device)
        print(json.dumps({"target": name, "probe": True, **probe, **result}), flush=True)
        probes_failed += result["smem"] is None
    if not grid and name in FULL_MATRIX:
        for row in weight_slice_copies(name):
            print(json.dumps({"target": name, **row}), flush=True)
    summary.update(counts, probes_failed=probes_failed)
    summary["failed"] = counts["failed"] + probes_failed
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(GPU_TARGETS), help="the part to compile for")
    parser.add_argument(
        "--probe-grid", action="store_true", help="only probe tiles of every size (probe_grid)"
    )
    args = parser.parse_args(argv)
    with pallas_gpu.gpu_target(GPU_TARGETS[args.target].capability_name):
        summary = run(args.target, grid=args.probe_grid)
    print(json.dumps(summary), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
