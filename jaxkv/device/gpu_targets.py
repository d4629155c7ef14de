"""GPU parts described for compiling without a GPU (deviceless ahead-of-time).

XLA's CUDA compiler builds a program for a part it is told about: `jax.experimental.
topologies.get_topology_desc(platform="cuda", target_config=...)` takes the part as a
`GpuTargetConfigProto` (text format) and gives devices that `jit(...).lower(...).compile()`
targets, with no GPU and no CUDA driver on the host. It needs the CUDA PJRT plugin
(`jax-cuda13-plugin` and `jax-cuda13-pjrt` at this jax version; the CUDA libraries a run
would load are not needed). Triton kernels go through Triton's whole pipeline for the
part, and XLA refuses one whose shared memory passes the part's per-block limit.

`GPU_TARGETS` holds what the compiler reads of each part (NVIDIA's data sheets and
CUDA's per-capability tables); `gpu_topology_devices("h100:8")` gives eight H100s.
`jax_memory_bytes` is what JAX lets a process use of a part's memory: it preallocates
`$XLA_PYTHON_CLIENT_MEM_FRACTION` of it, 0.75 unless set.
Plan the GPU kernels for the part while tracing for it: `pallas_gpu.gpu_target(
target.capability_name)`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax

JAX_GPU_MEM_FRACTION = 0.75  # JAX's default share of a GPU's memory

__all__ = [
    "JAX_GPU_MEM_FRACTION",
    "GPU_TARGETS",
    "GpuTarget",
    "gpu_topology_devices",
    "jax_memory_bytes",
    "parse_gpu_topology",
    "target_config",
]


class GpuTarget(NamedTuple):
    """What XLA's GPU compiler reads of a part."""

    device_kind: str
    capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    smem_per_block: int  # bytes: CUDA's "maximum shared memory per thread block" (opt-in)
    smem_per_core: int  # bytes per multiprocessor
    memory_bytes: int
    bandwidth: float  # HBM bytes/s
    l2_bytes: int
    clock_ghz: float

    @property
    def capability_name(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"


GPU_TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448, 233472, 80 * 2**30,
                      3.35e12, 50 * 2**20, 1.98),
    "h200": GpuTarget("NVIDIA H200", (9, 0), 132, 232448, 233472, 141 * 10**9,
                      4.8e12, 50 * 2**20, 1.98),
    "a100": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 167936, 80 * 2**30,
                      2.039e12, 40 * 2**20, 1.41),
}  # fmt: skip


def target_config(target: GpuTarget, smem_limit: int | None = None) -> str:
    """`target` as a `GpuTargetConfigProto` text; `smem_limit` overrides its per-block
    limit (0 makes XLA report every Triton kernel's shared memory in its refusal)."""
    major, minor = target.capability
    limit = target.smem_per_block if smem_limit is None else smem_limit
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: {target.smem_per_core}  threads_per_core_limit: 2048
  core_count: {target.cores}  fpus_per_core: 128  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: {int(target.bandwidth)}  l2_cache_size: {target.l2_bytes}
  clock_rate_ghz: {target.clock_ghz}  device_memory_size: {target.memory_bytes}
  shared_memory_per_block_optin: {limit}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{target.device_kind}"
"""


def jax_memory_bytes(target: GpuTarget) -> int:
    """The bytes of `target`'s memory a JAX process may use (module docstring)."""
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        share = float(fraction) if fraction else JAX_GPU_MEM_FRACTION
    except ValueError:
        raise ValueError(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}: a number in (0, 1]"
        ) from None
    if not 0 < share <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}: a number in (0, 1]")
    return int(target.memory_bytes * share)


def parse_gpu_topology(name: str) -> tuple[GpuTarget, int] | None:
    """`(part, count)` of a name like "h100" or "a100:8"; None if it names no GPU part."""
    part, _, count = name.partition(":")
    if part not in GPU_TARGETS:
        return None
    if count and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"{name!r}: the GPU count after ':' must be a positive integer")
    return GPU_TARGETS[part], int(count or 1)


def gpu_topology_devices(name: str, smem_limit: int | None = None) -> list[jax.Device]:
    """The devices of `name` ("h100", "a100:8": one host), for compiling only.

    ValueError when the name is no GPU part or the CUDA plugin is missing.
    """
    parsed = parse_gpu_topology(name)
    if parsed is None:
        raise ValueError(f"{name!r} names no GPU part: one of {', '.join(GPU_TARGETS)}[:N]")
    target, count = parsed
    # Compiling only: the CUDA libraries (cuDNN, cuBLAS) the plugin checks for a run are not
    # needed, and their absence must not keep the plugin from registering its compiler.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            target.device_kind, platform="cuda", topology=f"1x1x{count}",
            target_config=target_config(target, smem_limit),
        )  # fmt: skip
    except Exception as e:  # the CUDA plugin absent, above all
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{name!r}: the CUDA compiler cannot describe it ({first}); it needs "
            f"jax-cuda13-plugin and jax-cuda13-pjrt at this jax version "
            f"(pip install jax-cuda13-plugin=={jax.__version__} "
            f"jax-cuda13-pjrt=={jax.__version__})"
        ) from None
    return list(topology.devices)
