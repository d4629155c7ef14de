"""Name resolution for vLLM's unit tests rewritten by `tools/vllm_core_yardstick.py`.

The rewritten tests import every vLLM (and torch) name through this module:
``a, b = _ys.names("vllm.v1.core.kv_cache_utils", "a", "b")``. Each name is looked
up in the jaxkv modules that play the vLLM module's part (`MODULE_MAP`), or is one
of the few renamed equivalents (`RENAMED`). A name with no jaxkv equivalent
becomes a `Missing` placeholder: the module still imports, and only the tests
that touch the name fail, with `NoJaxkvEquivalentError` naming it.

Shims (`SHIMS`) stand in for vLLM objects that have no meaning in jaxkv and no
behaviour under test: torch (numpy dtypes and arrays instead of torch ones) and
its `tensor_data` (an array's bytes), the opaque multimodal payload
`MultiModalKwargsItem`, and the constant `GiB_bytes`.

With ``JAXKV_YARDSTICK_TARGET=vllm`` every name resolves to vLLM itself (torch
included), so the same rewritten files measure vLLM as the baseline; names
vLLM lacks (the tests may be newer) become `Missing` there too.
"""

from __future__ import annotations

import importlib
import os
import types
from typing import Any

import numpy as np

TARGET = os.environ.get("JAXKV_YARDSTICK_TARGET", "jaxkv")
if TARGET == "jaxkv":
    # vLLM's tests read private attributes (`BlockHashToBlockMap._cache`).
    from jaxkv.compat.vllm import install_private_views

    install_private_views()

# vLLM module -> the jaxkv modules searched, in order, for its names.
MODULE_MAP: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.kv_cache_utils": (
        "jaxkv.hashing",
        "jaxkv.blocks",
        "jaxkv.request_hashing",
        "jaxkv.kv_cache_utils",
        "jaxkv.kv_cache_coordinator",
        "jaxkv.kv_cache_planning",
        "jaxkv.kv_events",
    ),
    "vllm.v1.core.block_pool": ("jaxkv.block_pool", "jaxkv.blocks", "jaxkv.hashing"),
    "vllm.v1.core.kv_cache_manager": (
        "jaxkv.kv_cache_manager",
        "jaxkv.compat.vllm",
        "jaxkv.request",
    ),
    "vllm.v1.core.kv_cache_coordinator": ("jaxkv.kv_cache_coordinator",),
    "vllm.v1.core.single_type_kv_cache_manager": (
        "jaxkv.single_type_kv_cache_manager",
        "jaxkv.single_type_base",
        "jaxkv.mamba_manager",
    ),
    "vllm.v1.core.encoder_cache_manager": ("jaxkv.encoder_cache_manager",),
    "vllm.v1.kv_cache_interface": ("jaxkv.kv_cache_interface",),
    "vllm.v1.request": ("jaxkv.compat.vllm", "jaxkv.request"),
    "vllm.sampling_params": ("jaxkv.sampling_params",),
    "vllm.lora.request": ("jaxkv.request",),
    "vllm.multimodal.inputs": ("jaxkv.request",),
    "vllm.distributed.kv_events": ("jaxkv.kv_events",),
    "vllm.v1.metrics.stats": ("jaxkv.kv_cache_manager",),
    "vllm.utils.hashing": ("jaxkv.hashing",),
}


def _hash_fn(name: str) -> Any:
    from jaxkv.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(name)


# (vLLM module, name) -> a zero-argument factory of the jaxkv equivalent.
RENAMED: dict[tuple[str, str], Any] = {
    ("vllm.utils.hashing", "sha256"): lambda: _hash_fn("sha256"),
    ("vllm.utils.hashing", "sha256_cbor"): lambda: _hash_fn("sha256_cbor"),
    ("vllm.utils.hashing", "xxhash"): lambda: _hash_fn("xxhash"),
    ("vllm.utils.hashing", "xxhash_cbor"): lambda: _hash_fn("xxhash_cbor"),
}


class NoJaxkvEquivalentError(NotImplementedError):
    """A vLLM test touched a name that the target (jaxkv, or vLLM) lacks."""


class Missing:
    """Placeholder for a name the target lacks; any real use raises `NoJaxkvEquivalentError`.

    Type-annotation uses (``Missing | None``, ``Missing[int]``) and attribute reads
    evaluate quietly so that a module whose signatures or defaults mention the name
    still imports.
    """

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(missing, /, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (callers pass self=)
        raise NoJaxkvEquivalentError(f"{missing._qualname} has no equivalent in {TARGET}")

    __call__ = _fail
    __iter__ = _fail
    __len__ = _fail
    __bool__ = _fail
    __eq__ = _fail
    __hash__ = object.__hash__

    def __getattr__(self, attr: str) -> Missing:
        # `Missing.X` stays missing (a default argument such as `Enum.NONE` must not
        # fail the module's import); using it fails.
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._qualname}.{attr}")

    def __or__(self, other: Any) -> Missing:
        return self

    __ror__ = __or__

    def __getitem__(self, item: Any) -> Missing:
        return self

    def __repr__(self) -> str:
        return f"Missing({self._qualname!r})"


class _Torch:
    """numpy in torch's place: dtypes become numpy dtypes, tensors numpy arrays."""

    float64 = np.float64
    float32 = np.float32
    float16 = np.float16
    int64 = np.int64
    int32 = np.int32
    int8 = np.int8
    uint8 = np.uint8
    bool = np.bool_
    Tensor = np.ndarray

    def __init__(self) -> None:
        try:
            import ml_dtypes

            self.bfloat16 = ml_dtypes.bfloat16
        except ImportError:  # jaxkv also accepts the dtype's name
            self.bfloat16 = "bfloat16"

    @staticmethod
    def tensor(data: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(data, dtype=dtype)

    @staticmethod
    def randn(*shape: Any) -> np.ndarray:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return np.random.default_rng().standard_normal(shape, dtype=np.float32)

    @staticmethod
    def zeros(*shape: int, dtype: Any = None) -> np.ndarray:
        return np.zeros(shape, dtype=dtype if dtype is not None else np.float32)

    @staticmethod
    def ones(*shape: int, dtype: Any = None) -> np.ndarray:
        return np.ones(shape, dtype=dtype if dtype is not None else np.float32)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"torch.{attr}")


class _MultiModalKwargsItem:
    """vLLM's processed multimodal payload; jaxkv's features carry data opaquely."""

    @staticmethod
    def dummy() -> None:
        return None


def _tensor_data(array: np.ndarray) -> memoryview:
    """vLLM's `tensor_data` (a torch tensor's bytes) for the numpy arrays torch became."""
    return memoryview(np.ascontiguousarray(array)).cast("B")


SHIMS: dict[tuple[str, str], Any] = {
    ("vllm.multimodal.inputs", "MultiModalKwargsItem"): _MultiModalKwargsItem,
    ("vllm.v1.core.kv_cache_utils", "tensor_data"): _tensor_data,
    ("vllm.utils.mem_constants", "GiB_bytes"): 1 << 30,
}


def _resolve(vllm_module: str, name: str) -> Any:
    if TARGET == "vllm":
        try:
            return getattr(importlib.import_module(vllm_module), name)
        except (ImportError, AttributeError):
            return Missing(f"{vllm_module}.{name}")
    if (vllm_module, name) in SHIMS:
        return SHIMS[(vllm_module, name)]
    if (vllm_module, name) in RENAMED:
        return RENAMED[(vllm_module, name)]()
    for jaxkv_module in MODULE_MAP.get(vllm_module, ()):
        module = importlib.import_module(jaxkv_module)
        if hasattr(module, name):
            return getattr(module, name)
    return Missing(f"{vllm_module}.{name}")


def names(vllm_module: str, *wanted: str) -> Any:
    """The targets of ``from vllm_module import *wanted`` (a tuple, or one object)."""
    resolved = tuple(_resolve(vllm_module, name) for name in wanted)
    return resolved[0] if len(resolved) == 1 else resolved


class ModuleProxy(types.SimpleNamespace):
    """``import vllm.x.y as m``: attribute reads resolve like `names`, live each time
    (so module globals such as ``NONE_HASH`` reflect later re-initialisation);
    ``m.sub`` of a package resolves to the proxy of ``vllm.x.y.sub``."""

    def __init__(self, vllm_module: str) -> None:
        super().__init__()
        object.__setattr__(self, "_vllm_module", vllm_module)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        qualname = f"{self._vllm_module}.{attr}"
        resolved = _resolve(self._vllm_module, attr)
        if isinstance(resolved, Missing) and (
            qualname in MODULE_MAP or any(m.startswith(qualname + ".") for m in MODULE_MAP)
        ):
            return ModuleProxy(qualname)
        return resolved


def module(vllm_module: str) -> Any:
    """The target of ``import vllm_module as m`` (``import torch`` included)."""
    if vllm_module == "torch":
        return importlib.import_module("torch") if TARGET == "vllm" else _Torch()
    if TARGET == "vllm":
        try:
            return importlib.import_module(vllm_module)
        except ImportError:
            return Missing(vllm_module)
    return ModuleProxy(vllm_module)


def root(dotted: str) -> Any:
    """The name bound by a plain ``import a.b.c``: the top package ``a``."""
    top = dotted.split(".")[0]
    if top == "torch" or TARGET != "vllm":
        return module(top)
    try:
        importlib.import_module(dotted)
    except ImportError:
        return Missing(dotted)
    return importlib.import_module(top)
