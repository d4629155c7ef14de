"""Compile the TPU ragged paged attention kernel for a matrix of configurations, deviceless.

Run under a TPU environment (`jax[tpu]`, which brings libtpu), never imported by the CPU
test process (`tests/test_tpu_aot.py` runs it in a subprocess):

    .venv-tpu/bin/python tests/tpu_aot_matrix.py [v5e:2x2 v6e:2x2 v5p:2x2x1]

No TPU is needed: `jax.experimental.topologies` describes the chip and the real TPU
compiler (XLA + Mosaic) compiles ahead of time. For each configuration it prints one JSON
line; then one summary line (`"summary": true`). Exit status 1 if any configuration failed.

Outcomes:

* `"compiled"`: `tpu_kernel_error` accepts the cache, and `impl="pallas"` lowers to a
  Mosaic kernel (`tpu_custom_call`) that compiles;
* `"refused"`: `tpu_kernel_error` gives a reason (in `"reason"`), and `impl="auto"`
  falls back to the blockwise path (no Mosaic kernel in the program), which compiles;
* `"failed"`: anything else (`"error"` holds the error's first line).

The matrix is a covering design, not the full product: on the first topology every
storage dtype x head size x KV heads combination, in both head modes (grouped query heads
and the replicated-head `kv_head` mode), with block size, group and mask cycled; on the
others eight configurations per dtype. Every value of every dimension appears with every
dtype on every topology (`check_coverage`, run before compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server: deviceless compile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from aot_outcome import attention_step, compile_outcome  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.device.attention import AttentionOptions  # noqa: E402
from jaxkv.device.pallas_tpu import tpu_kernel_error  # noqa: E402

TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")
# name -> (storage dtype, kv_quant); a quantised cache computes in bfloat16
DTYPES = {
    "bf16": (jnp.bfloat16, None),
    "f32": (jnp.float32, None),
    "int8": (jnp.int8, "int8"),
    "fp8": (jnp.uint8, "fp8"),
}
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
GROUPS = (1, 2, 4, 8)  # query heads per KV head
KV_HEADS = (1, 2, 4, 8, 16)  # per device
MASKS = {
    "none": {},
    "sliding_window": {"sliding_window": 40},
    "attention_chunk": {"attention_chunk": 64},
    "soft_cap": {"soft_cap": 30.0},
}
KV_HEAD_MODES = (False, True)
# the dimensions every dtype must see every value of (config key -> values)
DIMENSIONS = {
    "head_size": HEAD_SIZES,
    "block_size": BLOCK_SIZES,
    "group": GROUPS,
    "kv_heads": KV_HEADS,
    "masks": tuple(MASKS),
    "kv_head_mode": KV_HEAD_MODES,
}
# batch shape: tokens, requests, table width, cache blocks
TOKENS, REQUESTS, TABLE_WIDTH, NUM_BLOCKS = 24, 4, 8, 64


def _config(dtype, head_size, kv_heads, mode, bs, group, mask) -> dict:
    return {
        "dtype": dtype,
        "kv_quant": DTYPES[dtype][1],
        "head_size": head_size,
        "block_size": BLOCK_SIZES[bs % len(BLOCK_SIZES)],
        "group": GROUPS[group % len(GROUPS)],
        "kv_heads": kv_heads,
        "masks": tuple(MASKS)[mask % len(MASKS)],
        "kv_head_mode": mode,
    }


def full_matrix() -> list[dict]:
    """Every dtype x head size x KV heads x head mode (120), block size, group, mask cycled."""
    configs = []
    for d, dtype in enumerate(DTYPES):
        for j, (head_size, kv_heads) in enumerate((hs, h) for hs in HEAD_SIZES for h in KV_HEADS):
            for m, mode in enumerate(KV_HEAD_MODES):
                configs.append(
                    _config(dtype, head_size, kv_heads, mode,
                            bs=j + 2 * m + d, group=j + j // 4 + m, mask=j // 2 + 3 * m + d)
                )  # fmt: skip
    return configs


def small_matrix(shift: int) -> list[dict]:
    """Eight configurations per dtype (32), every dimension cycled; `shift` varies the pairing."""
    configs = []
    for d, dtype in enumerate(DTYPES):
        for k in range(8):
            i = k + shift + d
            configs.append(
                _config(dtype, HEAD_SIZES[i % 3], KV_HEADS[(k + shift) % 5], bool((i + k // 4) % 2),
                        bs=i, group=k // 4 + i + shift, mask=k + k // 4 + d)
            )  # fmt: skip
    return configs


def matrix(topology_index: int) -> list[dict]:
    """The first topology's configurations are the full design, the others' the small one."""
    return full_matrix() if topology_index == 0 else small_matrix(topology_index)


def check_coverage(configs: list[dict]) -> None:
    """Raise if some dtype misses some value of some dimension (a broken design)."""
    for dtype in DTYPES:
        seen = [c for c in configs if c["dtype"] == dtype]
        for key, values in DIMENSIONS.items():
            missing = set(values) - {c[key] for c in seen}
            if missing:
                raise AssertionError(f"the matrix never pairs dtype {dtype} with {key} {missing}")


def _program(config: dict, impl: str, sharding):
    """`(function, argument specs)` of one ragged_paged_attention call on the TPU."""
    storage, kv_quant = DTYPES[config["dtype"]]
    return attention_step(
        platform="tpu", options=AttentionOptions(impl=impl, **MASKS[config["masks"]]),
        config=config, kv_heads=config["kv_heads"], storage=storage,
        compute=jnp.bfloat16 if kv_quant else storage, kv_quant=kv_quant, tokens=TOKENS,
        requests=REQUESTS, table_width=TABLE_WIDTH, num_blocks=NUM_BLOCKS, sharding=sharding,
    )  # fmt: skip


def compile_one(config: dict, sharding) -> dict:
    """Compile one configuration; returns its outcome, reason, error and compile seconds."""
    storage, kv_quant = DTYPES[config["dtype"]]
    compute = jnp.bfloat16 if kv_quant else storage
    reason = tpu_kernel_error(config["kv_heads"], storage, compute, kv_quant)
    attend, args = _program(config, "auto" if reason else "pallas", sharding)

    def mismatch(text: str) -> str | None:
        has_kernel = "tpu_custom_call" in text
        if reason is None and not has_kernel:
            return "impl='pallas' lowered without a Mosaic kernel (tpu_custom_call)"
        if reason is not None and has_kernel:
            return f"impl='auto' kept the Mosaic kernel although refused: {reason}"
        return None

    return compile_outcome(lambda: jax.jit(attend).lower(*args), mismatch, reason, "Mosaic failed")


def run(topology_names: list[str]) -> dict:
    """Compile every topology's matrix, printing a line per configuration; returns the summary."""
    summary = {"summary": True, "jax": jax.__version__, "jaxkv": jaxkv.__file__, "topologies": {}}
    for index, name in enumerate(topology_names):
        configs = matrix(index)
        check_coverage(configs)
        device = topologies.get_topology_desc(platform="tpu", topology_name=name).devices[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        counts = {"configs": 0, "compiled": 0, "refused": 0, "failed": 0, "compile_s": 0.0}
        for config in configs:
            result = compile_one(config, sharding)
            print(json.dumps({"topology": name, **config, **result}), flush=True)
            counts["configs"] += 1
            counts[result["outcome"]] += 1
            counts["compile_s"] = round(counts["compile_s"] + result["compile_s"], 3)
        summary["topologies"][name] = {"device_kind": device.device_kind, **counts}
    summary["failed"] = sum(t["failed"] for t in summary["topologies"].values())
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "topologies", nargs="*", default=list(TOPOLOGIES),
        help="topology names (the first gets the full matrix); default: %(default)s",
    )  # fmt: skip
    summary = run(parser.parse_args(argv).topologies)
    print(json.dumps(summary), flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
