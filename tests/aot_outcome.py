"""What the deviceless matrices (`tpu_aot_matrix.py`, `gpu_aot_matrix.py`) share: the
attention step they compile, and one compile classified.

Imported by the matrices inside their side environments, never by the CPU test process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv.device.attention import AttentionOptions, ragged_paged_attention
from jaxkv.device.storage import SCALE_BYTES


def attention_step(
    *, platform: str, options: AttentionOptions, config: dict, kv_heads: int, storage,
    compute, kv_quant: str | None, tokens: int, requests: int, table_width: int,
    num_blocks: int, sharding,
):  # fmt: skip
    """`(function, argument specs)` of one `ragged_paged_attention` step for `platform`:
    `config`'s head size, group, block size and head mode (`kv_head_mode`: every query
    head reads the last KV head of a replicated cache) over `kv_heads` KV heads."""
    d, g, kv_head = config["head_size"], config["group"], config.get("kv_head_mode", False)

    def attend(q, kv_cache, tables, seq_lens, query_start_loc, num_seqs):
        return ragged_paged_attention(
            q, kv_cache, tables, seq_lens, query_start_loc, num_seqs, options,
            platform=platform, kv_dtype=compute, kv_quant=kv_quant,
            kv_head=jnp.int32(kv_heads - 1) if kv_head else None,
        )  # fmt: skip

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    stored = d + (SCALE_BYTES if kv_quant else 0)
    args = (
        spec((tokens, g if kv_head else kv_heads * g, d), compute),
        spec((num_blocks, config["block_size"], 2 * kv_heads, stored), storage),
        spec((requests, table_width), jnp.int32),
        spec((requests,), jnp.int32),
        spec((requests + 1,), jnp.int32),
        spec((), jnp.int32),
    )
    return attend, args


def first_line(error: BaseException, marker: str = "") -> str:
    """The line of an error that says what went wrong: the first holding `marker` (a
    compiler's own message), else the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    marked = [line for line in lines if marker and marker in line]
    line = (marked or lines or [type(error).__name__])[0]
    return f"{type(error).__name__}: {line}"[:400]


def compile_outcome(
    lower: Callable[[], jax.stages.Lowered],
    mismatch: Callable[[str], str | None],
    reason: str | None,
    marker: str = "",
) -> dict:
    """Lower and compile one program: `"compiled"` (no refusal `reason`), `"refused"` (a
    reason, the fallback compiled), or `"failed"` with the error's line, when lowering or
    compiling raised or `mismatch(the lowered text)` names a program other than planned.
    Also the reason and the seconds taken."""
    result = {"outcome": "failed", "reason": reason, "error": None}
    start = time.perf_counter()
    try:
        lowered = lower()
        wrong = mismatch(lowered.as_text())
        lowered.compile()
        if wrong is not None:
            result["error"] = wrong
        else:
            result["outcome"] = "refused" if reason else "compiled"
    except Exception as error:  # noqa: BLE001 - every failure is reported, not raised
        result["error"] = first_line(error, marker)
    result["compile_s"] = round(time.perf_counter() - start, 3)
    return result
