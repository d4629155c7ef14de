"""A serving plan for a TPU slice or GPUs, compiled by their compiler without the device.

`plan_topology(config, "v6e:4x4")` (or `"h100"`, `"a100:8"`) takes the devices from
`jax.experimental.topologies.get_topology_desc` (deviceless ahead-of-time compilation:
a TPU slice needs `jax[tpu]`, which brings `libtpu`; GPUs the CUDA plugin, described by
`jaxkv.device.gpu_targets`; no accelerator is touched), lays a `(data, model)` mesh
over them and plans as `pod_plan.plan_mesh` does: an abstract model (config.json only),
the KV cache sized from a per-chip budget, and the engine's own programs (the fused
decode and prefill steps with the attention kernels, Mosaic on a TPU and Triton on a
GPU planned for that part, block zeroing, copies and host-tier transfers) lowered and
compiled for it.

Per chip it reports weight bytes, KV bytes and blocks, each program's temporaries and
generated code, the longest `max_model_len` the pool holds and the concurrency at the
planned one, whether every donated cache is aliased to its output in the executable
(`kv_in_place`: a cache-sized copy anywhere is `False`), and a decode roofline.

The KV budget defaults to the chip's HBM (a GPU's: the share JAX takes of it,
`gpu_targets.jax_memory_bytes`) less the weights, the compiled programs'
largest temporaries and generated code, and a 5% reserve: a first compile with a pool of
a quarter of that measures the temporaries (they follow the step's batch, not the pool)
and any copy of the cache (a pool that holds it more than once shrinks to fit), the
second compiles the real pool.

Roofline of one decode step (`max_num_seqs` requests per data rank, each attending
`context` keys), counted from the model because the compiler does not see inside the
kernels' custom calls (its cost analysis counts a call's whole cache operand as read):
bytes = the chip's weights + the KV rows its heads read (`layers x context x 2 x
kv_heads_per_chip x head_size x bytes`, per request); FLOPs = the compiled step's
(matmuls, XLA's count) + attention's `4 x context x q_heads_per_chip x head_size` per
request and layer; time = bytes / the chip's HBM bandwidth. HBM sizes and bandwidths are
Google Cloud's published per-chip figures (cloud.google.com/tpu/docs/v5e, /v6e, /v5p)
and NVIDIA's data sheets (`gpu_targets.GPU_TARGETS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import asdict, dataclass

import jax
from flax import nnx

from jaxkv.device import make_mesh
from jaxkv.device.gpu_targets import (
    GPU_TARGETS,
    gpu_topology_devices,
    jax_memory_bytes,
    parse_gpu_topology,
)
from jaxkv.device.in_place import check_in_place
from jaxkv.device.pallas_gpu import gpu_target
from jaxkv.engine.config import EngineConfig
from jaxkv.engine.model_runner import ModelRunner
from jaxkv.engine.pod_plan import per_device_bytes
from jaxkv.engine.sizing import kv_cache_groups, plan_kv_cache
from jaxkv.models.config import DecoderConfig, LlavaConfig
from jaxkv.models.loading import abstract_model, default_scan_layers

__all__ = ["CHIPS", "TopologyPlan", "format_topology_plan", "plan_topology", "topology_devices"]

# device_kind -> (HBM bytes per chip, HBM bandwidth bytes/s): Google Cloud's TPU pages,
# NVIDIA's data sheets.
CHIPS = {
    "TPU v5 lite": (16 * 2**30, 819e9),  # v5e
    "TPU v6 lite": (32 * 2**30, 1640e9),  # v6e (Trillium)
    "TPU v5": (95 * 2**30, 2765e9),  # v5p
    "TPU v4": (32 * 2**30, 1200e9),
}
_RESERVE = 0.05  # of HBM, kept free for the runtime and fragmentation
_PROBE_SHARE = 4  # the first pass's pool: this fraction of the HBM the weights leave


def topology_devices(name: str) -> list[jax.Device]:
    """The devices of TPU slice `name` (e.g. `v5e:2x2`) or of GPUs (`h100`, `a100:8`), for
    compiling only.

    ValueError naming `--topology` when the compiler is missing or the name is unknown.
    """
    if parse_gpu_topology(name) is not None:
        try:
            return gpu_topology_devices(name)
        except ValueError as e:
            raise ValueError(f"--topology {e}") from None
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off a TPU VM
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu absent, or a topology it does not know
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--topology {name!r}: the TPU compiler cannot describe it ({first}); it needs "
            f"jax[tpu] at this jax version (pip install 'jax[tpu]=={jax.__version__}') and "
            f"a name such as v5e:2x2, v6e:4x4 or v5p:2x2x1 (GPUs: {', '.join(GPU_TARGETS)}[:N])"
        ) from None


def default_model_axis(chips: int, num_kv_heads: int) -> int:
    """The model axis: the largest power of two dividing both the chips and the KV heads
    (heads sharded, never replicated); the rest of the chips serve as data ranks."""
    model = 1
    while chips % (2 * model) == 0 and num_kv_heads % (2 * model) == 0:
        model *= 2
    return model


@dataclass(frozen=True)
class Program:
    """One compiled program on one chip: bytes XLA reports and its in-place verdict."""

    name: str
    temp_bytes: int
    code_bytes: int
    alias_bytes: int
    compile_seconds: float
    cache_copies: tuple[str, ...]


@dataclass(frozen=True)
class TopologyPlan:
    """What each chip of a TPU slice (or each GPU) holds and runs (module docstring)."""

    topology: str
    device_kind: str
    chips: int
    data: int
    model: int
    hbm_bytes: int
    weight_bytes: int
    kv_bytes: int
    num_blocks: int
    block_size: int
    max_model_len: int
    longest_model_len: int
    concurrency: float
    programs: tuple[Program, ...]
    kv_in_place: bool
    decode_bytes: int
    decode_flops: float
    decode_seconds: float
    hbm_bandwidth: float

    def as_dict(self) -> dict:
        return asdict(self)


def _compile_all(runner: ModelRunner) -> tuple[list[Program], jax.stages.Compiled]:
    """The decode step (`max_num_seqs` tokens per rank), the prefill step
    (`max_num_batched_tokens`) and every other program on the cache, compiled; returns
    them and the decode step's executable."""
    cache = [runner.paged[0].stacked_struct(len(runner.layer_to_group))]
    all_shapes = runner.packers[0].all_shapes()
    decode = runner.step_shapes(runner.max_num_seqs)
    lowered = {
        "decode": (runner.lower_step(decode), cache),
        "prefill": (runner.lower_step(runner.step_shapes(all_shapes[-1].num_tokens)), cache),
    }
    lowered.update(
        (name, program)
        for name, program in runner.lowered_programs().items()
        if not name.startswith("step ")
    )
    programs, executables = [], {}
    for name, (program, caches) in lowered.items():
        start = time.perf_counter()
        try:
            executables[name] = compiled = program.compile()
        except jax.errors.JaxRuntimeError as e:  # the compiler's memory check, above all
            first = str(e).strip().splitlines()[0]
            raise ValueError(
                f"the {name} program does not compile for this slice: {first}"
            ) from None
        elapsed = time.perf_counter() - start
        report, stats = check_in_place(compiled, caches), compiled.memory_analysis()
        programs.append(
            Program(
                name=name,
                temp_bytes=int(stats.temp_size_in_bytes),
                code_bytes=int(stats.generated_code_size_in_bytes),
                alias_bytes=int(stats.alias_size_in_bytes),
                compile_seconds=round(elapsed, 2),
                cache_copies=tuple(report.cache_sized_copies),
            )
        )
    return programs, executables["decode"]


def _runner(config, mesh, engine: EngineConfig, memory: int | None) -> tuple[ModelRunner, int]:
    """The engine's runner for `config` on `mesh` with `memory` KV bytes per chip (None:
    the fewest blocks that hold one `max_model_len` request), built on abstract values;
    also its pool's blocks."""
    model = abstract_model(config, engine.dtype, mesh, scan_layers=default_scan_layers(mesh))
    specs = model.kv_cache_specs(engine.block_size, engine.dtype)
    # The null block and one request of max_model_len, counted as `plan_kv_cache` counts
    # it (a sliding-window group may take a block more than its tokens fill).
    batch = min(engine.max_num_batched_tokens, engine.max_model_len)
    smallest = 1 + sum(
        group.kv_cache_spec.max_num_blocks_per_req(engine.max_model_len, batch)
        for group in kv_cache_groups(specs)[0]
    )
    engine = dataclasses.replace(
        engine, kv_cache_memory=memory, num_blocks=None if memory else smallest
    )
    plan = plan_kv_cache(specs, engine, mesh, model.config.max_position_embeddings)
    runner = ModelRunner(
        model, plan, max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens, allocate=False,
    )  # fmt: skip
    return runner, plan.num_blocks


def _probe_runner(config, mesh, engine: EngineConfig, hbm: int, weight_bytes: int):
    """The first pass's runner: its pool a `_PROBE_SHARE` of what the weights leave, so a
    cache-sized instruction in its programs is a copy of the cache (a one-request pool is
    smaller than the step's own arrays, the logits or a weight's transpose). None where
    that share holds no request of `max_model_len`."""
    share = (int(hbm * (1 - _RESERVE)) - weight_bytes) // _PROBE_SHARE
    if share <= 0:
        return None
    try:
        return _runner(config, mesh, engine, share)[0]
    except ValueError:
        return None


def _decoder(config: DecoderConfig | LlavaConfig) -> DecoderConfig:
    return config.text if isinstance(config, LlavaConfig) else config


def _decode_roofline(
    runner: ModelRunner, compiled, engine: EngineConfig, weight_bytes: int, context: int
) -> tuple[int, float]:
    """Bytes one chip reads and FLOPs it runs in one decode step (module docstring). XLA's
    GPU compiler without a GPU reports no cost analysis: there the FLOPs are attention's."""
    paged, text = runner.paged[0], _decoder(runner.model.config)
    layers = len(runner.layer_to_group)
    row_bytes = paged.bytes_per_block // paged.block_size  # one token of one layer, per chip
    kv_bytes = engine.max_num_seqs * context * layers * row_bytes
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    q_heads = -(-text.num_attention_heads // paged.layout.model_size)
    attention = 4.0 * engine.max_num_seqs * context * layers * q_heads * paged.head_size
    return int(weight_bytes + kv_bytes), float(cost.get("flops", 0.0)) + attention


def plan_topology(
    config: DecoderConfig | LlavaConfig,
    topology: str,
    engine: EngineConfig,
    *,
    memory: int | None = None,
    model_axis: int | None = None,
    context: int | None = None,
) -> TopologyPlan:
    """The plan of serving `config` on TPU slice or GPUs `topology` (module docstring).

    `engine` gives the dtype, KV-cache dtype, block size, batch sizes and `max_model_len`;
    `memory` the KV bytes per chip (None: what the chip's HBM leaves); `model_axis` the
    mesh's model axis (None: `default_model_axis`); `context` the keys each decode request
    attends in the roofline (None: `max_model_len`). ValueError when the model does not fit.
    """
    devices = topology_devices(topology)
    gpus = parse_gpu_topology(topology)
    if gpus is None:
        hbm, bandwidth = CHIPS.get(devices[0].device_kind, (0, 0.0))
        part = contextlib.nullcontext()
    else:
        hbm, bandwidth = jax_memory_bytes(gpus[0]), gpus[0].bandwidth
        part = gpu_target(gpus[0].capability_name)  # the Triton kernels planned for it
    with part:
        return _plan(config, topology, devices, engine, memory, model_axis, context, hbm, bandwidth)


def _plan(
    config, topology, devices, engine, memory, model_axis, context, hbm, bandwidth
) -> TopologyPlan:
    """`plan_topology` on `devices` with `hbm` bytes of memory per chip (0: unknown)."""
    kind = devices[0].device_kind
    if memory is None and not hbm:
        raise ValueError(f"no HBM size known for {kind!r}: give --memory")
    model = model_axis or default_model_axis(len(devices), _decoder(config).num_key_value_heads)
    if len(devices) % model:
        raise ValueError(f"--mesh model axis {model} does not divide {len(devices)} chips")
    mesh = make_mesh(len(devices) // model, model, devices)
    runner, _ = _runner(config, mesh, engine, memory)
    weight_bytes = per_device_bytes(nnx.state(runner.model, nnx.Param))
    if memory is None:  # the temporaries follow the batch, not the pool: measured small
        runner = _probe_runner(config, mesh, engine, hbm, weight_bytes) or runner
        try:
            programs, _ = _compile_all(runner)
        except ValueError as e:
            raise ValueError(
                f"{topology}: {weight_bytes:,} weight bytes per chip and a small pool "
                f"do not fit its {hbm:,} bytes of HBM ({e}); give it more chips"
            ) from None
        need = max(p.temp_bytes for p in programs) + sum(p.code_bytes for p in programs)
        # A program that copies the cache holds it that many more times (kv_in_place False).
        copies = max(len(p.cache_copies) for p in programs)
        memory = (int(hbm * (1 - _RESERVE)) - weight_bytes - need) // (1 + copies)
        if memory <= 0:
            raise ValueError(
                f"{topology}: {weight_bytes:,} weight bytes and {need:,} bytes of compiled "
                f"programs per chip leave nothing of its {hbm:,} bytes of HBM for the KV cache"
            )
        # The compile-only client counts the first pass's executables against the chip's
        # HBM (a full pool then fails to fit): drop them before the second pass.
        del runner, programs
        jax.clear_caches()
        runner, _ = _runner(config, mesh, engine, memory)
    programs, decode = _compile_all(runner)
    paged = runner.paged[0]
    tokens = paged.num_blocks * paged.block_size
    bytes_read, flops = _decode_roofline(
        runner, decode, engine, weight_bytes, context or engine.max_model_len
    )
    return TopologyPlan(
        topology=topology, device_kind=kind, chips=len(devices), data=len(devices) // model,
        model=model, hbm_bytes=hbm, weight_bytes=weight_bytes,
        kv_bytes=paged.num_blocks * paged.bytes_per_block * len(runner.layer_to_group),
        num_blocks=paged.num_blocks,
        block_size=paged.block_size, max_model_len=engine.max_model_len,
        longest_model_len=tokens, concurrency=round(tokens / engine.max_model_len, 2),
        programs=tuple(programs), kv_in_place=not any(p.cache_copies for p in programs),
        decode_bytes=bytes_read, decode_flops=flops,
        decode_seconds=bytes_read / bandwidth if bandwidth else math.nan,
        hbm_bandwidth=bandwidth,
    )  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_topology_plan(plan: TopologyPlan) -> str:
    """`plan` as lines a person reads: per chip, then one line per compiled program."""
    head = (
        f"{plan.topology} ({plan.device_kind}, {plan.chips} chips, mesh {plan.data}x{plan.model}"
        f", {_gib(plan.hbm_bytes)} of HBM per chip to use)"
    )
    lines = [
        head,
        f"  weights per chip: {_gib(plan.weight_bytes)}; KV cache: {_gib(plan.kv_bytes)} "
        f"({plan.num_blocks} blocks of {plan.block_size} tokens per data rank)",
        f"  longest max_model_len: {plan.longest_model_len}; concurrency at "
        f"{plan.max_model_len} tokens: {plan.concurrency}x",
        f"  KV cache in place in every program: {'yes' if plan.kv_in_place else 'NO'}",
        f"  decode roofline: {plan.decode_bytes / 1e9:.2f} GB read per step, "
        f"{plan.decode_flops / 1e12:.3f} TFLOP, {plan.decode_seconds * 1e3:.2f} ms at "
        f"{plan.hbm_bandwidth / 1e9:.0f} GB/s",
    ]
    for p in plan.programs:
        copies = f", {len(p.cache_copies)} cache-sized copies" if p.cache_copies else ""
        lines.append(
            f"  {p.name}: temporaries {p.temp_bytes / 2**20:.1f} MiB, code "
            f"{p.code_bytes / 2**20:.1f} MiB, compiled in {p.compile_seconds:.1f} s{copies}"
        )
    return "\n".join(lines)
