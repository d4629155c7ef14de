"""One-shot GPU check of jaxkv's kernels and engine (run on a lent GPU machine, never in CI).

Phases, in the order they run (each appends to `<out>/gpu_check.json`, so a run cut
short still reports what it finished; `phase_s` records each one's seconds):

- `kernels`, `step`: the Pallas Triton kernel that `PagedKVCache.step` dispatches to on
  GPU (`jaxkv.device.pallas_gpu.paged_attention_rows_pallas`, decode and mixed steps)
  and the portable blockwise path, against the float64 NumPy reference of
  `tests/test_device_attention.py` on NaN-poisoned caches.
- `hbm_floor`: the device's copy bandwidth, measured (a jitted `x + 1` over 2 GiB,
  bytes read + written over the median time); a decode step's floor is the bytes it
  must read (weights, plus the KV at its context) over it.
- `attention_targets`: the issue's attention targets on the dispatched path, bf16
  (`gpu_attention_targets`): decode 32 x 1,024 and 64 x 8,192 tokens as shares of the
  bandwidth and against dense attention, a 4,096-token prefill against cuDNN, a mixed
  batch against its parts.
- `side_by_side`: the engine (`dtype="bfloat16"`, greedy, async scheduling; once more
  with it off at batch 1) and transformers (`generate`, bf16, in a child process:
  `_transformers_decode.py generate`, only where torch and transformers import, else
  "transformers unavailable" with the import errors) on one Llama-3.2-1B-shaped bf16
  checkpoint (random weights, written here) and the same 128-token prompts, 128 new
  tokens at batch 1 and 32: decode ms per step (time to `new_tokens` less time to the
  first token, over the later tokens), tokens/s, each as a multiple of the HBM floor,
  and how far their greedy tokens agree (reported, not failed: bf16 near-ties diverge).
- `layers_ab`: on that checkpoint, decode ms per step with the layers scanned as one
  body against one stack per layer (the GPU default: the compiled scan copies each
  layer's weights every step, `tests/test_gpu_aot.py`), at each batch, two interleaved
  rounds; side_by_side's engine is the default layout's.
- `step_time`: on that engine at batch 1, the engine loop's time per step (and the
  host's share, from its step stats) vs the jitted step program alone, replayed on a
  captured decode step's buffer; a `jax.profiler` trace of a few decode steps under
  `<out>/trace/` (`--no-trace`: none).
- `gemma_bf16`: a Gemma-3-270M-shaped bf16 checkpoint (head size 256) through the
  engine's default dispatch at batch 1, 8 and 64: runs (decode figures, HBM floor) or
  fails with its error recorded.
- `jax_kernels`: next to JAX's own kernels on the same data, decode attention
  (`jax.experimental.pallas.ops.gpu.paged_attention`) and a prefill over gathered pages
  (`jax.nn.dot_product_attention(implementation="cudnn")`), each as a share of the
  nominal HBM bandwidth (`--hbm-gbs`, the H200's 4,800 GB/s by default).
- `engine`: the engine's decode tokens/s on a Gemma-3-270M-shaped float32 checkpoint.
- `scaling_auto`, `scaling_reference`, `updates`: `bench_device`'s scaling figures with
  the kernel and with the blockwise path, and its cache updates (not in `--no-bench`).

The whole run keeps to `--budget-s` (450 s): each phase prints its estimate (a guess
until `phase_s` of a run replaces it) and is skipped, with the reason recorded, when the
estimate exceeds what is left; `--skip` / `--only` choose phases by name.

    python -m benchmarks.gpu_check --out "$OUT"

On CPU (`--no-bench`, a dry run of the script, under three minutes) the kernels
run in Pallas interpret mode on small shapes, the prefill with XLA's attention, the
side-by-side on a tiny Llama (transformers only where it imports), Gemma with six
layers and a small vocabulary.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# The tests' float64 reference and case builders (tests/ is no package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks._common import print_table  # noqa: E402
from benchmarks.bench_device import bench_scaling, bench_updates  # noqa: E402
from benchmarks.gpu_attention_targets import attention_targets  # noqa: E402
from jaxkv.device import AttentionOptions, ragged_paged_attention  # noqa: E402

# (name, seq_lens, q_lens, group, window, chunk, soft_cap, spans, dtype)
CASES = [
    ("decode gqa4", [300, 17, 1, 129], [1, 1, 1, 1], 4, None, None, None, False, "float32"),
    ("decode window", [300, 17, 90], [1, 1, 1], 2, 64, None, 30.0, False, "float32"),
    ("mixed", [300, 17, 120, 1], [200, 1, 37, 1], 4, None, None, None, True, "float32"),
    ("mixed masks", [256, 33, 160], [100, 1, 60], 8, 48, 64, 20.0, True, "float32"),
    ("mixed bf16", [300, 17, 120, 1], [200, 1, 37, 1], 4, None, None, None, False, "bfloat16"),
]


def check_kernels() -> list[dict]:
    from test_device_attention import random_case, random_spans, reference_attention, rel_error

    rows = []
    for name, seq_lens, q_lens, group, window, chunk, cap, spans, dtype in CASES:
        row: dict = {"case": name}
        try:
            rng = np.random.default_rng(7)
            case = random_case(
                rng, seq_lens, q_lens, num_kv_heads=2, group=group, head_size=128,
                block_size=16, width=24, num_blocks=120, dtype=dtype, pad_tokens=5,
            )  # fmt: skip
            ends = random_spans(rng, case) if spans else None
            masks = {"sliding_window": window, "attention_chunk": chunk, "soft_cap": cap}
            want = reference_attention(case, sm_scale=0.1, span_ends=ends, **masks)
            num_q = int(case.q_lens.sum())
            for impl in ("pallas", "reference"):
                fn = jax.jit(
                    functools.partial(
                        ragged_paged_attention, num_seqs=jnp.int32(case.num_seqs),
                        options=AttentionOptions(sm_scale=0.1, impl=impl, **masks),
                        kv_dtype=case.cache.dtype,
                        interpret=impl == "pallas" and jax.default_backend() == "cpu",
                    )
                )  # fmt: skip
                args = (
                    jnp.asarray(case.q), case.kv, jnp.asarray(case.block_tables),
                    jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc),
                )  # fmt: skip
                kw = {"span_ends": None if ends is None else jnp.asarray(ends)}
                got = np.asarray(jax.block_until_ready(fn(*args, **kw))).astype(np.float64)
                start = time.perf_counter()
                for _ in range(10):
                    jax.block_until_ready(fn(*args, **kw))
                row[f"{impl}_rel_err"] = rel_error(got[:num_q], want[:num_q])
                row[f"{impl}_finite"] = bool(np.isfinite(got).all())
                row[f"{impl}_pad_rows_zero"] = not got[num_q:].any()
                row[f"{impl}_ms"] = (time.perf_counter() - start) * 100
                if impl == "pallas":
                    text = fn.lower(*args, **kw).as_text()
                    row["triton_call_in_hlo"] = "triton" in text
        except Exception as exc:  # record and go on: one failure must not hide the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        print(row, flush=True)
        rows.append(row)
    return rows


def check_step() -> dict:
    """`PagedKVCache.step` on GPU: the kernel `auto` picks, on a mixed batch."""
    from test_device_attention import random_case, reference_attention, rel_error
    from test_device_step_metadata import _run_step

    try:
        rng = np.random.default_rng(3)
        case = random_case(
            rng, [300, 17, 120, 1], [20, 1, 7, 1], num_kv_heads=2, group=4, head_size=128,
            block_size=16, width=24, num_blocks=120, pad_tokens=0,
        )  # fmt: skip
        got = _run_step(case, rng)
        want = reference_attention(case, sm_scale=0.4)[: got.shape[0]]
        return {"step_rel_err": rel_error(got, want), "finite": bool(np.isfinite(got).all())}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        return {"error": error, "traceback": traceback.format_exc()[-3000:]}


def compare_with_jax_kernels(hbm_gbs: float, small: bool) -> dict:
    """jaxkv's decode and prefill attention next to JAX's kernels on the same pages:
    agreement and, timed, the share of HBM bandwidth each reaches (KV bytes read / time)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    heads, group, head, block = 1, 4, 256, 16  # Gemma-3-270M's attention shape
    seqs, seq_len = (2, 64) if small else (8, 4096)
    pages = seq_len // block
    rng = np.random.default_rng(11)
    k, v = (rng.standard_normal((seqs * pages + 1, block, heads, head), np.float32) for _ in "kv")
    kv = jnp.asarray(np.stack([k, v], axis=3).reshape(seqs * pages + 1, block, 2 * heads, head))
    tables = jnp.asarray(1 + np.arange(seqs * pages, dtype=np.int32).reshape(seqs, pages))
    lengths = jnp.full((seqs,), seq_len, jnp.int32)
    q = jnp.asarray(rng.standard_normal((seqs, heads * group, head), np.float32))
    interpret = jax.default_backend() == "cpu"
    ours = jax.jit(
        functools.partial(
            ragged_paged_attention, num_seqs=jnp.int32(seqs),
            options=AttentionOptions(impl="pallas" if interpret else "auto"), interpret=interpret,
        )
    )  # fmt: skip
    theirs = jax.jit(
        lambda q, k_pages, v_pages, tables, lengths: paged_attention(
            q * head**-0.5, k_pages, v_pages, tables, lengths, interpret=interpret,
            pages_per_compute_block=min(8, pages), k_splits=min(16, pages),
        )
    )  # fmt: skip
    k_pages, v_pages = (jnp.asarray(x.transpose(2, 0, 1, 3)) for x in (k, v))
    starts = jnp.arange(seqs + 1, dtype=jnp.int32)
    runs = {
        "jaxkv decode": lambda: ours(q, kv, tables, lengths, starts),
        "jax paged_attention decode": lambda: theirs(q, k_pages, v_pages, tables, lengths),
    }
    kv_bytes = 2 * seqs * seq_len * heads * head * 4
    # Prefill: one sequence's queries over its gathered pages (cuDNN on GPU).
    prefill_q = jnp.asarray(rng.standard_normal((1, seq_len, heads * group, head), np.float32))
    gathered = [jnp.asarray(x[1 : pages + 1].reshape(1, seq_len, heads, head)) for x in (k, v)]
    attend = jax.jit(
        functools.partial(
            jax.nn.dot_product_attention, is_causal=True,
            implementation="xla" if interpret else "cudnn",
        )
    )  # fmt: skip
    prefill_ours = jax.jit(
        functools.partial(
            ragged_paged_attention, num_seqs=jnp.int32(1),
            options=AttentionOptions(impl="reference" if interpret else "auto"),
        )
    )  # fmt: skip
    one_table, one_len = tables[:1], lengths[:1]
    one_start = jnp.asarray([0, seq_len], jnp.int32)
    runs["jaxkv prefill"] = lambda: prefill_ours(prefill_q[0], kv, one_table, one_len, one_start)
    runs["cudnn prefill (gathered pages)"] = lambda: attend(
        prefill_q.astype(jnp.bfloat16), *(x.astype(jnp.bfloat16) for x in gathered)
    )
    report: dict = {"seqs": seqs, "seq_len": seq_len, "hbm_gbs": hbm_gbs}
    outputs = {}
    for name, run in runs.items():
        try:
            outputs[name] = np.asarray(jax.block_until_ready(run())).astype(np.float64)
            start = time.perf_counter()
            for _ in range(3 if small else 20):
                jax.block_until_ready(run())
            seconds = (time.perf_counter() - start) / (3 if small else 20)
            read = kv_bytes if "decode" in name else kv_bytes // seqs
            report[name] = {"ms": seconds * 1e3, "hbm_share": read / seconds / (hbm_gbs * 1e9)}
        except Exception as exc:
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if {"jaxkv decode", "jax paged_attention decode"} <= outputs.keys():
        a, b = outputs["jaxkv decode"], outputs["jax paged_attention decode"]
        report["decode_max_abs_diff"] = float(np.abs(a - b).max())
    if {"jaxkv prefill", "cudnn prefill (gathered pages)"} <= outputs.keys():
        a, b = outputs["jaxkv prefill"], outputs["cudnn prefill (gathered pages)"][0]
        report["prefill_max_abs_diff"] = float(np.abs(a - b).max())
    return report


def engine_decode(hbm_gbs: float, small: bool) -> dict:
    """The engine's decode tokens/s on a Gemma-3-270M-shaped checkpoint (random weights,
    float32) and the share of HBM bandwidth a decode step's weight reads reach."""
    import tempfile

    from benchmarks.bench_decode import GEMMA3_270M
    from jaxkv import models
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams

    config = dict(GEMMA3_270M, vocab_size=4096) if small else dict(GEMMA3_270M)
    path = tempfile.mkdtemp(prefix="jaxkv-gpu-check-")
    try:
        models.save_random_checkpoint(path, config, seed=0)
        weight_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        model = models.load_model(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    batch, new_tokens = (2, 4) if small else (8, 128)
    engine = LLMEngine(
        model,
        EngineConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=512,
            max_model_len=1024,
            kv_cache_memory=2**30,
        ),  # fmt: skip
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, 64).tolist() for _ in range(batch)]
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, sampling)  # compiles every shape this workload takes
    start = time.perf_counter()
    engine.generate([p[::-1] for p in prompts], sampling)
    seconds = time.perf_counter() - start
    step_s = seconds / new_tokens  # one decode step per generated token of the batch
    return {
        "batch": batch,
        "tokens_per_s": batch * new_tokens / seconds,
        "ms_per_step": step_s * 1e3,
        "weight_bytes": weight_bytes,
        "hbm_share_weights": weight_bytes / step_s / (hbm_gbs * 1e9),
        "scan_layers": len(model.decoder.layers) == 1,
    }


# -- the HBM floor, the engine next to transformers, Gemma in bf16, the step's time -------

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}  # fmt: skip
# The CPU dry run's stand-in: the same architecture, tiny.
LLAMA_TINY = dict(
    LLAMA32_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
HF_SCRIPT = Path(__file__).with_name("_transformers_decode.py")


@dataclass
class Context:
    """What the phases share: the options, the dry-run flag, the wall-clock deadline of
    the time budget, and `state` (measured bandwidth, the side-by-side's engine, temporary
    directories to remove at the end)."""

    args: argparse.Namespace
    small: bool
    deadline: float
    state: dict = field(default_factory=dict)

    def bandwidth(self) -> tuple[float, str]:
        """GB/s for the floors: the measured copy's (`hbm_floor`), else `--hbm-gbs`."""
        measured = self.state.get("copy_gbs")
        if measured:
            return measured, "measured copy (hbm_floor)"
        return self.args.hbm_gbs, "nominal (--hbm-gbs; hbm_floor did not run)"

    def temp_dir(self, prefix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        self.state.setdefault("temp_dirs", []).append(path)
        return path


def error_row(exc: BaseException) -> dict:
    return {
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-3000:],
    }


def hbm_floor(ctx: Context) -> dict:
    """The device's copy bandwidth, measured: a jitted `x + 1` over a large float32 array
    (a read and a write of every byte; XLA cannot elide it as it may a bare copy), median
    of 7 samples of 5 back-to-back calls. The floor of a decode step is then the bytes it
    must read (weights, plus KV at its context) over this bandwidth."""
    nbytes = 2**24 if ctx.small else 2**31
    x = jnp.zeros(nbytes // 4, jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(bump(x))
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(5):
            y = bump(x)
        jax.block_until_ready(y)
        samples.append((time.perf_counter() - start) / 5)
    seconds = statistics.median(samples)
    gbs = 2 * nbytes / seconds / 1e9
    ctx.state["copy_gbs"] = gbs
    weights = decoder_weight_bytes(LLAMA_TINY if ctx.small else LLAMA32_1B)
    return {
        "array_bytes": nbytes,
        "copy_ms": seconds * 1e3,
        "copy_gbs_read_plus_write": gbs,
        "share_of_nominal": gbs / ctx.args.hbm_gbs,
        "llama_shaped_bf16_weight_bytes": weights,
        "llama_shaped_floor_ms_weights_only": weights / (gbs * 1e9) * 1e3,
    }


def decoder_weight_bytes(config: dict, itemsize: int = 2) -> int:
    """Parameter bytes of a Llama-style decoder (tied or untied embeddings)."""
    h, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h
    embed = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    return (embed + layers * per_layer + h) * itemsize


def kv_bytes_per_token(config: dict, itemsize: int = 2) -> int:
    """KV-cache bytes one token holds over every layer (K and V)."""
    heads = config["num_key_value_heads"] * config["head_dim"]
    return 2 * config["num_hidden_layers"] * heads * itemsize


def floor_figures(ctx: Context, row: dict, weight_bytes: int, config: dict, batch: int,
                  prompt_len: int, new_tokens: int) -> None:  # fmt: skip
    """Add to a timed `row` the HBM floor of its decode step (weights + the KV its batch
    reads at the mean decode context, over the bandwidth) and the step as a multiple."""
    gbs, source = ctx.bandwidth()
    context = prompt_len + new_tokens / 2
    read = weight_bytes + batch * context * kv_bytes_per_token(config)
    row["floor_ms"] = read / (gbs * 1e9) * 1e3
    row["floor_from"] = source
    if "ms_per_step" in row:
        row["x_floor"] = row["ms_per_step"] / row["floor_ms"]


def step_figures(batch: int, first_s: float, total_s: float, new_tokens: int) -> dict:
    """Decode figures from the time to the first token (the prefill) and to `new_tokens`:
    the prefill excluded, each later token is one decode step of the whole batch."""
    step_s = (total_s - first_s) / max(new_tokens - 1, 1)
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "first_token_s": first_s,
        "total_s": total_s,
        "ms_per_step": step_s * 1e3,
        "decode_tokens_per_s": batch / step_s if step_s > 0 else float("nan"),
        "tokens_per_s": batch * new_tokens / total_s,
    }


def write_bf16_checkpoint(path: Path, config: dict, seed: int = 0) -> int:
    """A random-weight Hugging Face checkpoint of `config` in bfloat16 safetensors (written
    by `save_random_checkpoint` in float32 to a staging directory, then cast); returns the
    weight bytes."""
    from safetensors.numpy import save_file

    from jaxkv import models

    staging = Path(tempfile.mkdtemp(prefix="jaxkv-gpu-check-f32-"))
    try:
        tensors = models.save_random_checkpoint(staging, config, seed=seed)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    bf16 = {name: value.astype(jnp.bfloat16) for name, value in tensors.items()}
    del tensors
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16"), indent=2))
    save_file(bf16, path / "model.safetensors", metadata={"format": "pt"})
    return int(sum(value.nbytes for value in bf16.values()))


def prompt_ids(vocab: int, length: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, min(vocab, 30000), (count, length)).tolist()


def time_engine(
    engine, prompts: list[list[int]], new_tokens: int, repeats: int
) -> tuple[dict, list]:
    """`engine.generate` on `prompts`, greedy, EOS ignored: once to compile (its time
    kept), then the time to the first token (`max_tokens=1`) and to `new_tokens`,
    medians of `repeats`. Returns the figures and the last run's tokens."""
    from jaxkv.engine import SamplingParams

    def run(max_tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(errors[0])
        return seconds, [list(o.output_token_ids) for o in outs]

    first_run_s = run(new_tokens)[0]
    first = statistics.median(run(1)[0] for _ in range(repeats))
    totals = [run(new_tokens) for _ in range(repeats)]
    row = step_figures(len(prompts), first, statistics.median(t for t, _ in totals), new_tokens)
    row["first_run_s"] = first_run_s  # compiles this batch's step shapes
    return row, totals[-1][1]


def side_by_side_sizes(small: bool) -> dict:
    """The side-by-side's workload: Llama-3.2-1B-shaped, 128-token prompts, 128 greedy
    tokens at batch 1 and 32 (the CPU dry run: a tiny Llama, 16 + 8 tokens, batch 1, 4)."""
    if small:
        return {"config": LLAMA_TINY, "prompt_len": 16, "new_tokens": 8, "batches": [1, 4]}
    return {"config": LLAMA32_1B, "prompt_len": 128, "new_tokens": 128, "batches": [1, 32]}


def engine_config(batch: int, prompt_len: int, new_tokens: int, **overrides):
    """The benchmarks' engine: bf16, every prompt of a batch prefilled in one step where
    it fits, no prefix caching (repeated prompts must prefill again)."""
    from jaxkv.engine import EngineConfig

    return EngineConfig(
        dtype="bfloat16", max_num_seqs=batch,
        max_num_batched_tokens=min(4096, batch * prompt_len),
        max_model_len=-(-(prompt_len + new_tokens) // 64) * 64, kv_cache_memory=2**30,
        enable_prefix_caching=False, **overrides,
    )  # fmt: skip


def side_by_side(ctx: Context) -> dict:
    """The engine and transformers on one Llama-3.2-1B-shaped bf16 checkpoint (random
    weights) and the same token-id prompts: decode ms per step at each batch size (the
    prefill excluded), tokens/s, each as a multiple of the HBM floor, and how far their
    greedy tokens agree. The engine stays in `ctx.state` for `step_time`."""
    sizes = side_by_side_sizes(ctx.small)
    config, batches = sizes["config"], sizes["batches"]
    path = ctx.temp_dir("jaxkv-gpu-check-llama-")
    start = time.perf_counter()
    weight_bytes = write_bf16_checkpoint(path, config)
    prompts = prompt_ids(config["vocab_size"], sizes["prompt_len"], max(batches))
    (path / "prompts.json").write_text(json.dumps(prompts))
    ctx.state["llama_path"] = path  # for layers_ab
    report: dict = {
        "model": "llama-3.2-1b-shaped" if not ctx.small else "llama-tiny",
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(config),
        "prompt_len": sizes["prompt_len"],
        "new_tokens": sizes["new_tokens"],
        "checkpoint_write_s": time.perf_counter() - start,
    }
    try:
        report["engine"], tokens = engine_side(ctx, path, prompts, sizes, report)
    except Exception as exc:  # transformers still runs
        report["engine"], tokens = {"load": error_row(exc)}, {}
    report["transformers"] = transformers_side(ctx, path, sizes)
    for row in report["engine"].values():
        floor_figures(
            ctx, row, weight_bytes, config, row.get("batch", 1), sizes["prompt_len"],
            sizes["new_tokens"],
        )  # fmt: skip
    hf_rows = report["transformers"].get("batches", {})
    for key, row in hf_rows.items():
        floor_figures(ctx, row, weight_bytes, config, int(key), sizes["prompt_len"],
                      row.get("new_tokens", sizes["new_tokens"]))  # fmt: skip
    report["compare"] = (
        {"skipped": "no transformers figures"}
        if not hf_rows
        else {
            key: compare_runs(
                report["engine"].get(key, {}), row, tokens.get(key), row.pop("tokens", None)
            )
            for key, row in hf_rows.items()
        }
    )
    print_side_by_side(report)
    return report


def engine_side(ctx: Context, path: Path, prompts: list, sizes: dict, report: dict):
    """The engine's runs: async scheduling on at every batch size, off once at batch 1.
    Returns the rows and each batch's tokens."""
    from jaxkv import models
    from jaxkv.engine import LLMEngine

    start = time.perf_counter()
    model = models.load_model(path, dtype="bfloat16")
    report["engine_load_s"] = time.perf_counter() - start
    batches, repeats = sizes["batches"], 2 if ctx.small else 3
    shape = (max(batches), sizes["prompt_len"], sizes["new_tokens"])
    engine = LLMEngine(model, engine_config(*shape))
    report["scan_layers"] = len(model.decoder.layers) == 1
    rows: dict = {}
    tokens: dict = {}
    for batch in batches:
        try:
            rows[str(batch)], tokens[str(batch)] = time_engine(
                engine, prompts[:batch], sizes["new_tokens"], repeats
            )
        except Exception as exc:
            rows[str(batch)] = error_row(exc)
        print(f"engine batch {batch}:", json.dumps(rows[str(batch)], default=str), flush=True)
    ctx.state["llama"] = {
        "engine": engine, "prompt": prompts[0], "rows": rows, "scan": report["scan_layers"],
    }  # fmt: skip
    try:  # the same shapes: it reuses the programs compiled above
        sync = LLMEngine(model, engine_config(*shape, async_scheduling=False))
        rows["1 async off"] = time_engine(sync, prompts[:1], sizes["new_tokens"], repeats)[0]
        del sync
    except Exception as exc:
        rows["1 async off"] = error_row(exc)
    gc.collect()
    return rows, tokens


def compare_runs(ours: dict, theirs: dict, our_tokens, their_tokens) -> dict:
    """Engine / transformers decode step time, and how far their greedy tokens agree
    (random bf16 weights: later positions may diverge on near ties; reported, not failed)."""
    out: dict = {}
    if "ms_per_step" in ours and "ms_per_step" in theirs:
        out["engine_over_transformers_step"] = ours["ms_per_step"] / theirs["ms_per_step"]
        out["engine_over_transformers_first_token"] = (
            ours["first_token_s"] / theirs["first_token_s"]
        )
    if our_tokens and their_tokens:
        prefixes = []
        for a, b in zip(our_tokens, their_tokens, strict=False):
            n = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            prefixes.append(n)
        out["sequences"] = len(prefixes)
        out["first_4_agree"] = sum(n >= 4 for n in prefixes) / len(prefixes)
        out["first_token_agrees"] = sum(n >= 1 for n in prefixes) / len(prefixes)
        out["agreeing_prefix"] = {
            "min": min(prefixes), "median": statistics.median(prefixes), "max": max(prefixes),
        }  # fmt: skip
        out["sample"] = {"engine": our_tokens[0][:8], "transformers": their_tokens[0][:8]}
    return out


def transformers_side(ctx: Context, path: Path, sizes: dict) -> dict:
    """transformers' `generate` on the same checkpoint and prompts, in a child process
    (`_transformers_decode.py generate`; torch is never imported here) under the first
    interpreter that imports torch and transformers (`--hf-python`, else this one, else
    `python3` on PATH), within the time budget; "transformers unavailable" with each
    interpreter's import error where none does."""
    import subprocess

    if ctx.args.no_transformers:
        return {"skipped": "--no-transformers"}
    spec = {
        "ckpt": str(path), "prompts_file": str(path / "prompts.json"),
        "batches": sizes["batches"], "new_tokens": sizes["new_tokens"], "repeats": 2,
    }  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    hf_python = ctx.args.hf_python
    candidates = [hf_python] if hf_python else [sys.executable, shutil.which("python3")]
    import_errors: dict = {}
    for python in dict.fromkeys(c for c in candidates if c):
        timeout = max(60.0, ctx.deadline - time.perf_counter())
        try:
            proc = subprocess.run(
                [python, str(HF_SCRIPT), "generate", json.dumps(spec)],
                capture_output=True, text=True, timeout=timeout, env=env,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"python": python, "error": f"the child ran past {timeout:.0f} s (budget)"}
        except OSError as exc:
            import_errors[python] = f"{type(exc).__name__}: {exc}"
            continue
        if proc.returncode != 0:
            error = {"error": f"child exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
            return {"python": python, **error}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if "import_error" in result:
            import_errors[python] = result["import_error"]
            continue
        result["python"] = python
        for key, row in result["batches"].items():
            if "total_s" in row:
                figures = step_figures(
                    int(key), row["first_token_s"], row["total_s"], row["new_tokens"]
                )
                row.update(figures)
        return result
    return {"unavailable": "transformers unavailable", "import_errors": import_errors}


def print_side_by_side(report: dict) -> None:
    rows = []
    for who, runs in (
        ("engine", report["engine"]),
        ("transformers", report["transformers"].get("batches", {})),
    ):
        for key, row in runs.items():
            if "ms_per_step" in row:
                rows.append(
                    [who, key, row["ms_per_step"], row["decode_tokens_per_s"],
                     row["first_token_s"] * 1e3, row["floor_ms"], row["x_floor"]]
                )  # fmt: skip
            else:
                rows.append([who, key, row.get("error", "?")[:60], "", "", "", ""])
    print_table(
        f"{report['model']} bf16, {report['prompt_len']}-token prompts, "
        f"{report['new_tokens']} greedy tokens",
        ["who", "batch", "ms/step", "decode tok/s", "first token ms", "floor ms", "x floor"],
        rows,
    )


def layers_ab(ctx: Context) -> dict:
    """Decode ms per step on side_by_side's checkpoint, layers scanned against one stack
    per layer (module docstring): side_by_side's engine (the default layout) and one of the
    other layout, each batch, two rounds, the order alternating; medians, scanned / per-layer."""
    from jaxkv import models
    from jaxkv.engine import LLMEngine

    llama, path = ctx.state.get("llama"), ctx.state.get("llama_path")
    if llama is None or path is None:
        return {"skipped": "needs side_by_side's engine and checkpoint (skipped or failed)"}
    sizes = side_by_side_sizes(ctx.small)
    prompts = json.loads((path / "prompts.json").read_text())
    shape = (max(sizes["batches"]), sizes["prompt_len"], sizes["new_tokens"])
    other = models.load_model(path, dtype="bfloat16", scan_layers=not llama["scan"])
    engines = {
        llama["scan"]: llama["engine"],
        not llama["scan"]: LLMEngine(other, engine_config(*shape)),
    }
    runs: dict[str, list[float]] = {}
    for round_ in range(2):
        for scan in sorted(engines, reverse=bool(round_)):
            for batch in sizes["batches"]:
                row = time_engine(engines[scan], prompts[:batch], sizes["new_tokens"], 1)[0]
                label = "scanned" if scan else "per_layer"
                runs.setdefault(f"{label} {batch}", []).append(row["ms_per_step"])
    report: dict = {key: {"median_ms": statistics.median(v), "runs": v} for key, v in runs.items()}
    for batch in sizes["batches"]:
        scanned, per_layer = report[f"scanned {batch}"], report[f"per_layer {batch}"]
        report[f"scanned_over_per_layer {batch}"] = scanned["median_ms"] / per_layer["median_ms"]
    return report


def gemma_bf16(ctx: Context) -> dict:
    """A Gemma-3-270M-shaped checkpoint (random weights; head size 256, sliding-window
    and global layers) in bfloat16 through the engine's default dispatch at batch 1, 8
    and 64: each runs (decode figures and HBM floor) or fails with its error recorded."""
    from benchmarks.bench_decode import GEMMA3_270M
    from jaxkv import models
    from jaxkv.engine import LLMEngine

    config = dict(GEMMA3_270M, torch_dtype="bfloat16")
    prompt_len, new_tokens = 128, 128
    if ctx.small:  # six layers (five sliding, one global), a small vocabulary
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        config.update(vocab_size=4096, num_hidden_layers=6, layer_types=layer_types)
        prompt_len, new_tokens = 8, 4
    batches = [1, 8, 64]
    path = ctx.temp_dir("jaxkv-gpu-check-gemma-")
    weight_bytes = write_bf16_checkpoint(path, config)
    model = models.load_model(path, dtype="bfloat16")
    engine = LLMEngine(model, engine_config(max(batches), prompt_len, new_tokens))
    prompts = prompt_ids(config["vocab_size"], prompt_len, max(batches), seed=1)
    report: dict = {"weight_bytes": weight_bytes, "prompt_len": prompt_len, "runs": {}}
    for batch in batches:
        try:
            row = time_engine(engine, prompts[:batch], new_tokens, 1 if ctx.small else 2)[0]
            floor_figures(ctx, row, weight_bytes, config, batch, prompt_len, new_tokens)
        except Exception as exc:
            row = error_row(exc)
        report["runs"][str(batch)] = row
        print(f"gemma bf16 batch {batch}:", json.dumps(row, default=str), flush=True)
    return report


def step_time(ctx: Context) -> dict:
    """Where a batch-1 decode step's time goes, on the side-by-side's engine: the engine
    loop's time per step (and the host's and the wait's share of it, from its step stats)
    vs the jitted step program alone, replayed on a captured decode step's buffer (each
    call waited for, and back to back); then, unless `--no-trace`, a `jax.profiler` trace
    of a few decode steps under `<out>/trace/`."""
    from jaxkv.engine import SamplingParams

    llama = ctx.state.pop("llama", None)  # freed when this phase ends
    if llama is None:
        return {"skipped": "needs side_by_side's engine (skipped or failed)"}
    engine, prompt = llama["engine"], llama["prompt"]
    runner = engine.runner
    step = runner._step  # the jitted step of one packed buffer (ModelRunner._step)
    captured = []

    def capture(buffer, shapes, *features):
        captured.append((np.array(buffer, copy=True), shapes))
        return step(buffer, shapes, *features)

    new_tokens = 8 if ctx.small else 64
    first_stat = engine.num_steps
    runner._step = capture
    try:
        engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    finally:
        del runner._step  # back to the class's method
    stats = [s for s in engine.stats.steps_since(first_stat) if s.num_scheduled_tokens == 1]
    report: dict = {
        "decode_steps": len(stats),
        "loop_host_ms": statistics.median(s.host_s for s in stats) * 1e3,
        "loop_wait_ms": statistics.median(s.wait_s for s in stats) * 1e3,
        "loop_host_plus_wait_ms": statistics.median(s.host_s + s.wait_s for s in stats) * 1e3,
    }
    loop = llama["rows"].get("1", {}).get("ms_per_step")
    if loop is not None:
        report["loop_ms_per_step"] = loop  # side_by_side's batch-1 figure
    if not ctx.args.no_trace:
        try:
            report["trace"] = write_trace(ctx.args.out / "trace", engine, prompt)
        except Exception as exc:
            report["trace"] = error_row(exc)
    captured = captured[1:]  # the first step is the prompt's prefill
    smallest = min(shapes[0].num_tokens for _, shapes in captured)
    decode = [c for c in captured if c[1][0].num_tokens == smallest]
    buffer, shapes = decode[len(decode) // 2]
    report["step_shape"] = str(shapes[0])
    report.update(replay_step(runner, step, buffer, shapes, 5 if ctx.small else 50))
    if loop is not None:
        report["loop_over_program"] = loop / report["program_ms_back_to_back"]
    return report


def replay_step(runner, step, buffer, shapes, repeats: int) -> dict:
    """The step program alone on one captured buffer: each call waited for (median), and
    `repeats` calls back to back (mean), the cache and sampled tokens carried as the
    engine carries them (the cache is donated)."""
    runner.kv_cache, runner.sampled = step(buffer, shapes)  # compiled: a warm call
    jax.block_until_ready(runner.sampled)
    waited = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.kv_cache, runner.sampled = step(buffer, shapes)
        jax.block_until_ready(runner.sampled)
        waited.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.kv_cache, runner.sampled = step(buffer, shapes)
    jax.block_until_ready((runner.kv_cache, runner.sampled))
    return {
        "program_ms_waited": statistics.median(waited) * 1e3,
        "program_ms_back_to_back": (time.perf_counter() - start) / repeats * 1e3,
    }


def write_trace(trace_dir: Path, engine, prompt: list[int], steps: int = 6) -> dict:
    """A `jax.profiler` trace of one request's prefill and `steps - 1` decode steps."""
    from jaxkv.engine import SamplingParams

    with jax.profiler.trace(str(trace_dir)):
        engine.generate([prompt], SamplingParams(max_tokens=steps, ignore_eos=True))
    files = [p for p in trace_dir.rglob("*") if p.is_file()]
    return {
        "dir": str(trace_dir),
        "files": [str(p.relative_to(trace_dir)) for p in files],
        "bytes": sum(p.stat().st_size for p in files),
    }


# -- the phases, their time estimates and the budget ---------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase: its report key, estimated seconds on the H200 and in the CPU dry run
    (guesses until a run records `phase_s`), and whether the dry run skips it."""

    name: str
    gpu_s: int
    cpu_s: int
    run: Callable[[Context], object]
    bench_only: bool = False


def _scaling(impl: str) -> Callable[[Context], object]:
    def run(ctx: Context) -> dict:
        with tqdm(desc=f"scaling {impl}", file=sys.stderr) as bar:
            return bench_scaling(ctx.args.rounds, False, bar, impl=impl)

    return run


def _attention_targets(ctx: Context) -> dict:
    gbs, source = ctx.bandwidth()
    report = attention_targets(gbs, ctx.args.hbm_gbs, ctx.args.rounds, ctx.small)
    return {"bandwidth_from": source} | report


def _updates(ctx: Context) -> list:
    with tqdm(desc="updates", file=sys.stderr) as bar:
        return bench_updates(256, 10, bar)


# In the order they run: correctness first, then the side-by-side (the figures),
# then what results/gpu_check_h200.json already holds, so the budget cuts those first.
PHASES = (
    Phase("kernels", 60, 20, lambda ctx: check_kernels()),
    Phase("step", 10, 3, lambda ctx: check_step()),
    Phase("hbm_floor", 5, 2, hbm_floor),
    Phase("attention_targets", 45, 40, _attention_targets),
    Phase("side_by_side", 200, 30, side_by_side),
    Phase("layers_ab", 45, 20, layers_ab),
    Phase("step_time", 15, 5, step_time),
    Phase("gemma_bf16", 70, 30, gemma_bf16),
    Phase("jax_kernels", 30, 8, lambda ctx: compare_with_jax_kernels(ctx.args.hbm_gbs, ctx.small)),
    Phase("engine", 45, 15, lambda ctx: engine_decode(ctx.args.hbm_gbs, ctx.small)),
    Phase("scaling_auto", 60, 0, _scaling("auto"), bench_only=True),
    Phase("scaling_reference", 60, 0, _scaling("reference"), bench_only=True),
    Phase("updates", 30, 0, _updates, bench_only=True),
)


def skip_reason(phase: Phase, ctx: Context, estimate: int) -> str | None:
    """Why `phase` does not run (None: it runs)."""
    args = ctx.args
    if phase.bench_only and args.no_bench:
        return None if args.only and phase.name in args.only else "--no-bench (a dry run)"
    if args.only and phase.name not in args.only:
        return "not in --only"
    if phase.name in (args.skip or ()):
        return "--skip"
    left = ctx.deadline - time.perf_counter()
    if estimate > left:
        return f"over the time budget: estimated {estimate} s, {left:.0f} s of --budget-s left"
    return None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [p.name for p in PHASES]
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-bench", action="store_true", help="checks only (a CPU dry run)")
    parser.add_argument("--hbm-gbs", type=float, default=4800.0, help="peak HBM GB/s")
    parser.add_argument(
        "--budget-s", type=float, default=450.0,
        help="seconds: skip a phase whose estimate exceeds what is left of them",
    )  # fmt: skip
    parser.add_argument("--skip", nargs="+", choices=names, help="phases not to run")
    parser.add_argument("--only", nargs="+", choices=names, help="run only these phases")
    parser.add_argument("--no-transformers", action="store_true",
                        help="the side-by-side without transformers")  # fmt: skip
    parser.add_argument("--hf-python", help="interpreter with torch + transformers "
                        "(default: this one, else python3 on PATH)")  # fmt: skip
    parser.add_argument("--no-trace", action="store_true", help="no jax.profiler trace")
    return parser.parse_args()


def main() -> None:
    started = time.perf_counter()
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, small=args.no_bench, deadline=started + args.budget_s)
    report: dict = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "phase_s": {},
    }

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    print(report, flush=True)
    save()
    try:
        for phase in PHASES:
            estimate = phase.cpu_s if ctx.small else phase.gpu_s
            reason = skip_reason(phase, ctx, estimate)
            if reason is not None:
                report[phase.name] = {"skipped": reason}
                print(f"[{phase.name}] skipped: {reason}", flush=True)
                save()
                continue
            spent = time.perf_counter() - started
            print(f"[{phase.name}] estimated ~{estimate} s ({spent:.0f} s of the "
                  f"{args.budget_s:.0f} s budget spent)", flush=True)  # fmt: skip
            start = time.perf_counter()
            try:
                report[phase.name] = phase.run(ctx)
            except Exception as exc:  # record and go on: one failure must not hide the rest
                report[phase.name] = error_row(exc)
            report["phase_s"][phase.name] = time.perf_counter() - start
            print(f"[{phase.name}] {report['phase_s'][phase.name]:.1f} s:",
                  json.dumps(report[phase.name], default=str)[:4000], flush=True)  # fmt: skip
            save()
            gc.collect()
    finally:
        for path in ctx.state.pop("temp_dirs", []):
            shutil.rmtree(path, ignore_errors=True)
        ctx.state.clear()  # the side-by-side's engine, if step_time did not take it
        report["total_s"] = time.perf_counter() - started
        save()


if __name__ == "__main__":
    main()
