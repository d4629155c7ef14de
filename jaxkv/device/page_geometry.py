"""How one block of one layer of an attention spec is stored on a mesh, by arithmetic:
its layout (`KVLayout`), storage dtype, page shape and bytes per device. `PagedKVCache`
builds its arrays from a `PageGeometry` and the engine's sizing plan divides memory
budgets by its `bytes_per_block`, so the two cannot disagree."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxkv.device.kv_blocks import tpu_tiled
from jaxkv.device.mesh import KVLayout, make_mesh
from jaxkv.device.storage import (
    KV_QUANT,
    SCALE_BYTES,
    DTypeLike,
    check_kv_quant,
    resolve_dtype,
    resolve_storage_dtype,
)
from jaxkv.kv_cache_interface import (
    AttentionSpec,
    CircularBufferSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)

__all__ = ["PageGeometry", "check_served", "page_geometry"]

# Specs whose layers attend to keys no `[lo, hi)` interval of one block table describes.
_UNSERVED_MASKS = {
    RSWASpec: "the prompt plus the last rswa_window generated tokens (two key intervals)",
    SinkFullAttentionSpec: "static sink tokens ahead of the request's own keys",
    CircularBufferSpec: "a per-request ring written by position modulo its size",
}


def check_served(spec: AttentionSpec) -> None:
    """TypeError / ValueError unless the device attention serves `spec`."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    for unserved, keys in _UNSERVED_MASKS.items():
        if isinstance(spec, unserved):
            raise ValueError(
                f"PagedKVCache cannot serve {type(spec).__name__}: its layers attend to "
                f"{keys}, which the device attention does not implement (host-side "
                "block management only; docs/vllm-differences.md)"
            )


def _storage_dtype(
    dtype: np.dtype, storage_dtype: DTypeLike | None, kv_quant: str | None, platform: str
) -> np.dtype:
    if kv_quant is None:
        return resolve_storage_dtype(dtype, storage_dtype, platform)
    if storage_dtype not in (None, "auto"):
        raise ValueError(
            f"storage_dtype={storage_dtype!r} conflicts with kv_quant={kv_quant!r}, "
            f"which stores {KV_QUANT[kv_quant][0]}; leave storage_dtype at 'auto'"
        )
    return KV_QUANT[kv_quant][0]


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """How one block of one layer of a spec is stored: its layout on the mesh, storage
    dtype and page shape `(block_size, 2 * kv_heads, head_size [+ scale bytes])` (all
    heads, all devices). Pure arithmetic: building one allocates nothing.

    Invariant: `bytes_per_block` is what each device holds of one block of one layer,
    the one number both `PagedKVCache` and the engine's sizing use.
    """

    layout: KVLayout
    platform: str
    storage_dtype: np.dtype
    page_shape: tuple[int, int, int]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer on each device (quantisation scales included;
        on a TPU the padding of its row-major tiles too: head size 64 takes 128 lanes)."""
        block_size, _, lanes = self.page_shape
        rows = 2 * self.layout.kv_heads_per_device
        if self.platform == "tpu":
            rows, lanes = tpu_tiled(rows, lanes, self.storage_dtype.itemsize)
        return block_size * rows * lanes * self.storage_dtype.itemsize


def page_geometry(
    spec: AttentionSpec,
    mesh: Mesh | None = None,
    *,
    head_policy: str = "auto",
    storage_dtype: DTypeLike | None = "auto",
    kv_quant: str | None = None,
) -> PageGeometry:
    """The `PageGeometry` of `spec` on `mesh` (None: this process's first device);
    TypeError / ValueError for a spec the device attention does not serve, a bad head
    policy, storage dtype or quantisation."""
    check_served(spec)
    mesh = mesh if mesh is not None else make_mesh(1, 1, jax.local_devices()[:1])
    layout = KVLayout.plan(mesh, spec.num_kv_heads, head_policy)
    platform = layout.mesh.devices.flat[0].platform
    kv_quant = check_kv_quant(kv_quant)
    storage = _storage_dtype(resolve_dtype(spec.dtype), storage_dtype, kv_quant, platform)
    lanes = spec.head_size + (SCALE_BYTES if kv_quant else 0)
    return PageGeometry(layout, platform, storage, (spec.block_size, 2 * spec.num_kv_heads, lanes))
