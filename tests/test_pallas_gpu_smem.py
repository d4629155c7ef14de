"""The Triton kernels' shared-memory plans (`jaxkv.device.pallas_gpu` and the dispatched
decode and prefill kernels), on CPU.

No GPU here: the models' arithmetic, their calibration figures, the compute block the
dispatch passes (a spy stands in for the kernel), and the Triton call cross-lowered for
CUDA. That the compiled kernels fit is checked by the real compiler, deviceless, for an
H100, H200 and A100 (`tests/test_gpu_aot.py`, slow part).
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.device import (
    AttentionOptions,
    attention,
    gpu_attention,
    paged_decode_attention,
    pallas_gpu,
)
from jaxkv.device.gpu_attention import QUERY_TILE
from jaxkv.device.pallas_gpu import (
    PAGES_PER_COMPUTE_BLOCK,
    SMEM_MARGIN_DIVISOR,
    UNKNOWN_GPU_SMEM,
    SmemLimit,
    block_shape_error,
    compute_block_error,
    compute_block_pages,
    paged_decode_attention_pallas,
    query_rows,
    smem_bytes,
    smem_limit_for,
)
from jaxkv.device.pallas_gpu_decode import decode_compute_block_pages, decode_smem_bytes
from jaxkv.device.pallas_gpu_prefill import prefill_plan, prefill_smem_bytes
from jaxkv.models.config import parse_model_config

H200 = SmemLimit(232448, "H100/H200: 227 KiB per block")
A100 = SmemLimit(166912, "A100: 163 KiB per block")
DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
BLOCK_SIZES = (4, 8, 16)  # the repo's: tests and examples 4 and 8, the engine's default 16


def repo_attention_shapes() -> dict[str, tuple[int, int]]:
    """`(head_size, group)` of every model config in the repo that pages its KV cache."""
    from benchmarks.bench_decode import REAL_SHAPES
    from benchmarks.bench_device import HEAD_SIZE
    from benchmarks.gpu_check import CASES
    from benchmarks.pod_plan import GEMMA3_27B
    from jaxkv.models.testing import tiny_configs
    from jaxkv.testing.tiny_model import tiny_configs as demo_configs

    shapes = {}
    hf = {**REAL_SHAPES, "pod_plan gemma3-27b": GEMMA3_27B, **tiny_configs()}
    for name, cfg in hf.items():
        parsed = parse_model_config(cfg, name)
        text = getattr(parsed, "text", parsed)  # LLaVA: its decoder
        group = text.num_attention_heads // text.num_key_value_heads
        shapes[name] = (text.head_dim, group)
    for name, c in demo_configs().items():
        shapes[name] = (c.head_dim, c.num_attention_heads // c.num_key_value_heads)
    for case in CASES:  # gpu_check: head size 128, its GQA groups
        shapes[f"gpu_check {case[0]}"] = (128, case[3])
    shapes["bench_device"] = (HEAD_SIZE, 4)
    shapes["examples/embed_in_your_loop.py"] = (32, 1)  # HEAD_DIM 32, as many Q as KV heads
    return shapes


def test_model_reproduces_the_h200_figures_it_is_calibrated_on() -> None:
    """Head 256, 8 pages of 16 keys, group padded to 16 rows: Triton's own figures on an
    H200, both over its 232,448 bytes (the failure the plan exists for)."""
    assert smem_bytes(256, 8 * 16, 16, 2) == 286816
    assert smem_bytes(256, 8 * 16, 16, 4) == 417888
    assert query_rows(4) == 16 and query_rows(16) == 16 and query_rows(17) == 32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_keeps_the_configurations_the_h200_ran(dtype) -> None:
    """gpu_check compiled and ran head 128, 8 pages of 16, f32 and bf16 on the H200: the
    model must admit them within its margin, so the plan leaves them unchanged."""
    assert smem_bytes(128, 128, 16, dtype.itemsize) <= H200.bytes * 15 // 16
    assert compute_block_pages(128, 16, 4, dtype, H200) == PAGES_PER_COMPUTE_BLOCK


@pytest.mark.parametrize("limit", [H200, A100], ids=["h100_h200", "a100"])
def test_every_model_config_in_the_repo_fits(limit) -> None:
    """The kernels the dispatch runs (decode; prefill at its query tile) plan tiles whose
    shared memory (the compiler-measured bounds) fits the part, for every model config."""
    shapes = repo_attention_shapes()
    assert {256, 128, 64} <= {head for head, _ in shapes.values()}, shapes  # the sizes
    budget = limit.bytes - limit.bytes // SMEM_MARGIN_DIVISOR
    for name, (head_size, group) in shapes.items():
        for dtype in DTYPES:
            for block_size in BLOCK_SIZES:
                where = f"{name}: head {head_size}, group {group}, {dtype}, block {block_size}"
                pages = decode_compute_block_pages(head_size, block_size, group, dtype, limit)
                keys = pages * block_size
                assert decode_smem_bytes(head_size, keys, group, dtype.itemsize) <= budget, where
                plan = prefill_plan(head_size, block_size, group, dtype, QUERY_TILE, limit)
                rows, keys = QUERY_TILE * plan.heads_per_program, plan.pages_per_chunk * block_size
                assert prefill_smem_bytes(head_size, keys, rows, dtype.itemsize) <= budget, where


@pytest.mark.parametrize(
    "limit", [H200, A100, smem_limit_for("8.9")], ids=["h100_h200", "a100", "cc8.9"]
)
def test_plan_takes_the_largest_fitting_compute_block(limit) -> None:
    """Head 64-256, f32/bf16, groups up to 32, block sizes 2-64: the pick fits, and twice
    as many pages would not (or are past the maximum, or the keys past what fits)."""
    budget = limit.bytes - limit.bytes // SMEM_MARGIN_DIVISOR
    for head_size in (64, 128, 256):
        for dtype in DTYPES:
            for group in (1, 2, 3, 4, 8, 16, 32):
                rows = query_rows(group)
                for block_size in (2, 4, 8, 16, 32, 64):
                    fits = [
                        p
                        for p in (1, 2, 4, 8)
                        if block_shape_error(head_size, block_size, p) is None
                        and smem_bytes(head_size, p * block_size, rows, dtype.itemsize) <= budget
                    ]
                    args = (head_size, block_size, group, dtype, limit)
                    if fits:
                        assert compute_block_pages(*args) == max(fits), args
                    else:
                        assert "no compute block fits shared memory" in compute_block_error(*args)


def test_nothing_fits_says_why_with_the_values() -> None:
    tiny = smem_limit_for("7.5")  # 64 KiB: head 256 f32 needs more at 16 keys
    with pytest.raises(ValueError) as info:
        compute_block_pages(256, 16, 4, np.float32, tiny)
    message = str(info.value)
    for part in ("head_size=256", "float32", "group 4 (16 query rows)", "block_size=16",
                 "1 page(s) = 16 keys", f"needs {smem_bytes(256, 16, 16, 4)} bytes",
                 "65536 bytes per block (compute capability 7.5)"):  # fmt: skip
        assert part in message, (part, message)
    assert compute_block_pages(256, 16, 4, np.float32, None) == PAGES_PER_COMPUTE_BLOCK  # interpret
    assert "head_size=8 must be >= 16" in compute_block_error(8, 16, 1, np.float32, H200)


def test_limit_table_and_unknown_parts() -> None:
    assert smem_limit_for("9.0") == SmemLimit(232448, "compute capability 9.0")
    assert smem_limit_for("8.0").bytes == 166912
    for unknown in (None, "gfx942", "11.7"):
        limit = smem_limit_for(unknown)
        assert limit.bytes == UNKNOWN_GPU_SMEM and "not in SMEM_PER_BLOCK" in limit.source
    assert min(pallas_gpu.SMEM_PER_BLOCK.values()) >= UNKNOWN_GPU_SMEM  # the default is the floor
    if jax.default_backend() == "cpu":  # as JAX's Triton lowering: capability 9.0 assumed
        assert pallas_gpu.gpu_smem_limit() == SmemLimit(
            232448, "compute capability 9.0, assumed: no GPU visible"
        )


def test_a_target_names_the_part_planned_for() -> None:
    """Inside `gpu_target`, the plan takes that part's limit (compiling for an A100
    ahead of time on any host); outside, this process's (or the assumed 9.0)."""
    outside = pallas_gpu.gpu_smem_limit()
    with pallas_gpu.gpu_target("8.0"):
        assert pallas_gpu.gpu_smem_limit() == SmemLimit(
            166912, "compute capability 8.0, the target compiled for"
        )
        with pallas_gpu.gpu_target("9.0"):
            assert pallas_gpu.gpu_smem_limit().bytes == 232448
        assert pallas_gpu.gpu_smem_limit().bytes == 166912
    assert pallas_gpu.gpu_smem_limit() == outside
    for unknown in ("11.7", "gfx942", "9"):
        with pytest.raises(ValueError, match=rf"gpu_target\('{unknown}'\): a compute capability"):
            with pallas_gpu.gpu_target(unknown):
                pass


def _decode_args(head_size: int, dtype, width: int = 3):
    q = jnp.zeros((2, 4, head_size), dtype)
    kv = jnp.zeros((8, 16, 2, head_size), dtype)  # one KV head: group 4, block size 16
    return q, kv, jnp.zeros((2, width), jnp.int32), jnp.ones(2, jnp.int32)


def test_dispatch_falls_back_when_no_decode_tile_fits(monkeypatch, caplog) -> None:
    """Head 256 f32 on a GPU: the decode kernel fits an H200 and an A100; with 4 KiB of
    shared memory nothing fits, and `auto` takes the blockwise path with one line while
    `pallas` raises."""
    calls = []

    def spy(q, *args, **kw):
        calls.append(kw)
        return jnp.zeros_like(q)

    monkeypatch.setattr(gpu_attention, "paged_decode_rows_gpu", spy)
    args = _decode_args(256, jnp.float32)
    unit = AttentionOptions(sm_scale=1.0)
    for limit in (H200, A100):
        monkeypatch.setattr(gpu_attention, "gpu_smem_limit", lambda limit=limit: limit)
        paged_decode_attention(*args, 2, unit, platform="gpu")
        assert len(calls) == 1 and calls.pop()["interpret"] is False
    tiny = SmemLimit(4096, "a 4 KiB part")
    monkeypatch.setattr(gpu_attention, "gpu_smem_limit", lambda: tiny)
    attention._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        paged_decode_attention(*args, 2, unit, platform="gpu")
    assert not calls
    [record] = caplog.records
    assert "no decode tile fits shared memory" in record.getMessage()
    assert "using the blockwise path" in record.getMessage()
    pallas = AttentionOptions(sm_scale=1.0, impl="pallas")
    with pytest.raises(ValueError, match="no decode tile fits shared memory: head_size=256"):
        paged_decode_attention(*args, 2, pallas, platform="gpu")
    paged_decode_attention(*args, 2, pallas, platform="cpu", interpret=True)  # no smem limit
    assert len(calls) == 1


@pytest.mark.parametrize(("limit", "padded_width"), [(H200, 12), (A100, 10)])
def test_kernel_default_compute_block_lowers_for_cuda(monkeypatch, limit, padded_width) -> None:
    """`pages_per_compute_block=None` takes the plan's pick (seen as the table padded to
    a multiple of it: 9 -> 12 for 4 pages, 10 for 2) under JAX's default Triton settings
    (num_warps 4, num_stages 3), the settings the model is calibrated for."""
    monkeypatch.setattr(pallas_gpu, "gpu_smem_limit", lambda: limit)
    fn = functools.partial(paged_decode_attention_pallas, sm_scale=0.1)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _decode_args(256, jnp.float32, 9)]
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tensor<2x{padded_width}xi32>" in text
    assert re.search(r"num_stages = 3 : i32", text) and re.search(r"num_warps = 4 : i32", text)
