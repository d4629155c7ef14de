"""A pod plan on paper, checked by the compiler: per-device memory of serving a model on a
`(data, model)` mesh, from its `config.json` alone.

For each mesh the plan builds the model with abstract parameters
(`jaxkv.models.loading.abstract_model`: shapes and shardings, no memory), sizes the KV
cache with the engine's own plan (`jaxkv.engine.sizing.plan_kv_cache`: as many blocks per
data rank as the per-device budget holds), and builds the engine's `ModelRunner` without
allocating anything (`allocate=False`). With `aot`, it lowers and compiles the runner's
own step program (`ModelRunner.lower_step`) for one decode step (`max_num_seqs` requests
of one token per data rank) and one prefill step (`max_num_batched_tokens` tokens per
data rank) on abstract inputs, and reads XLA's memory analysis of each: temporary
bytes, argument bytes (weights, KV cache, step inputs) and output bytes, per device.

Weight bytes per device are each parameter's shard (its sharding's `shard_shape`), so
they count replication: a parameter the model axis does not divide is whole on every
device. The compiled argument bytes check them: weights plus KV cache plus the step's
small inputs.

On XLA's CPU backend (the simulated pod) a bfloat16 matmul runs in float32, and the
compiler hoists the conversion of the stacked layer weights out of the layer loop: the
CPU step's temporary bytes then include a float32 copy of those weights (a compiler with
native bf16 matmuls has no reason to make it; not measured here). A float32 plan shows
the step's own scratch.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxkv.device import make_mesh
from jaxkv.engine.config import EngineConfig
from jaxkv.engine.model_runner import ModelRunner
from jaxkv.engine.sizing import plan_kv_cache
from jaxkv.models.config import DecoderConfig, LlavaConfig
from jaxkv.models.loading import abstract_model

__all__ = ["MeshPlan", "StepMemory", "format_plans", "parse_mesh", "plan_mesh", "pod_mesh"]


def parse_mesh(text: str) -> tuple[int, int]:
    """`(data, model)` of `DATAxMODEL` text such as `16x16`; ValueError naming `--mesh`."""
    match = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(
            f"--mesh {text!r} is not DATAxMODEL: two positive integers joined by x, e.g. 16x16"
        )
    return int(match.group(1)), int(match.group(2))


def pod_mesh(text: str) -> Mesh:
    """The `(data, model)` mesh `DATAxMODEL` over every device of this process; ValueError
    naming `--mesh` and the allowed size when `data * model` is not the device count."""
    data, model = parse_mesh(text)
    count = jax.device_count()
    if data * model != count:
        raise ValueError(
            f"--mesh {text} spans {data * model} devices; this process has {count}: allowed "
            f"are DATAxMODEL with DATA * MODEL = {count} (on CPU, simulate N devices with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return make_mesh(data, model)


@dataclass(frozen=True)
class StepMemory:
    """One compiled step: its bucket (`num_tokens`, `num_reqs` per data rank) and XLA's
    memory analysis, bytes per device; `compile_seconds` lowering plus compiling."""

    num_tokens: int
    num_reqs: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    compile_seconds: float


@dataclass(frozen=True)
class MeshPlan:
    """What one device holds serving the model on a `data x model` mesh.

    `data_ranks` block pools of `num_blocks` blocks each (`jaxkv.device.mesh`);
    `weight_bytes` and `kv_bytes` per device; `decode` / `prefill` None without AOT.
    """

    data: int
    model: int
    data_ranks: int
    weight_bytes: int
    num_blocks: int
    kv_bytes: int
    max_model_len: int
    decode: StepMemory | None
    prefill: StepMemory | None

    def as_dict(self) -> dict:
        return asdict(self)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of every array (or abstract array) in `tree`: the largest
    shard of each leaf, by its sharding (a single-device leaf counts whole)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _compile_step(runner: ModelRunner, num_tokens: int) -> StepMemory:
    shapes = runner.step_shapes(num_tokens)
    start = time.perf_counter()
    stats = runner.lower_step(shapes).compile().memory_analysis()
    elapsed = time.perf_counter() - start
    return StepMemory(
        num_tokens=shapes[0].num_tokens,
        num_reqs=shapes[0].num_reqs,
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        compile_seconds=round(elapsed, 2),
    )


def plan_mesh(
    config: DecoderConfig | LlavaConfig,
    mesh: Mesh,
    *,
    kv_cache_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    aot: bool = True,
) -> MeshPlan:
    """The plan of serving `config`'s model on `mesh` with `kv_cache_memory` KV-cache bytes
    per device (module docstring); ValueError (from the sizing) when one request of
    `max_model_len` tokens does not fit."""
    model = abstract_model(config, dtype, mesh)
    engine_config = EngineConfig(
        block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    kv_plan = plan_kv_cache(
        model.kv_cache_specs(block_size, dtype), engine_config, mesh,
        model.config.max_position_embeddings,
    )  # fmt: skip
    runner = ModelRunner(
        model, kv_plan, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        allocate=False,
    )  # fmt: skip
    data, model_size = (int(n) for n in mesh.devices.shape)
    return MeshPlan(
        data=data,
        model=model_size,
        data_ranks=runner.dp_size,
        weight_bytes=per_device_bytes(nnx.state(model, nnx.Param)),
        num_blocks=kv_plan.num_blocks,
        kv_bytes=per_device_bytes(runner.kv_cache),
        max_model_len=max_model_len,
        decode=_compile_step(runner, max_num_seqs) if aot else None,
        prefill=_compile_step(runner, max_num_batched_tokens) if aot else None,
    )


def _size(n: int) -> str:
    """`n` bytes in the largest binary unit it reaches (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_plans(plans: list[MeshPlan]) -> str:
    """A table of `plans`, one row per mesh (bytes per device)."""
    header = ["mesh", "data ranks", "weights/device", "KV/device", "blocks/rank"]
    aot = plans and plans[0].decode is not None
    if aot:
        header += ["decode temp", "prefill temp", "decode args", "prefill args", "compile s"]
    rows = []
    for p in plans:
        row = [
            f"{p.data}x{p.model}", str(p.data_ranks), _size(p.weight_bytes), _size(p.kv_bytes),
            str(p.num_blocks),
        ]  # fmt: skip
        if aot:
            d, f = p.decode, p.prefill
            row += [
                f"{_size(d.temp_bytes)} (T={d.num_tokens})",
                f"{_size(f.temp_bytes)} (T={f.num_tokens})",
                _size(d.argument_bytes),
                _size(f.argument_bytes),
                f"{d.compile_seconds:.0f} + {f.compile_seconds:.0f}",
            ]
        rows.append(row)
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
