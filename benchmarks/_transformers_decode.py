"""transformers' side of bench_decode and of gpu_check's side-by-side (torch, no JAX).

    python _transformers_decode.py CKPT PROMPT_LEN DECODE_TOKENS THREADS
    python _transformers_decode.py generate SPEC_JSON

The first form (bench_decode, CPU) times `generate` (greedy, float32, eager attention,
batch 1: what a transformers user runs) and prints one JSON line: load_s, first_token_s
and prefill_s (`max_new_tokens=1` on a PROMPT_LEN-token prompt; median of 3), and on a
16-token prompt decode_ms_per_token, `generate` of DECODE_TOKENS + 1 tokens less the
median of three of 1 token, per token (so prefill and set-up are not counted), with
its greedy tokens (decode_tokens) for the parent to compare; peak_rss_mib.

The second form (gpu_check) loads the checkpoint in bfloat16 on the GPU (the CPU when
torch sees none) and, for each batch size of the spec, times `generate` (greedy, every
sequence run to `new_tokens`: EOS is switched off, as the engine's `ignore_eos`) on the
first `batch` prompts of `prompts_file` (equal-length token-id lists, so no padding):
`max_new_tokens=1` (time to the first token, median of `repeats`) and `new_tokens`.
Prints one JSON line: versions, device, dtype, attention implementation, load_s and
per batch first_token_s, total_s, new_tokens (generated) and the generated token ids;
or {"import_error": ...} where torch or transformers does not import.
SPEC_JSON: {"ckpt", "prompts_file", "batches", "new_tokens", "repeats"}.
"""

import json
import re
import statistics
import sys
import time


def peak_rss_mib() -> float:
    """Peak RSS of this process (VmHWM, not inherited from the parent as ru_maxrss is)."""
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def main(ckpt: str, prompt_len: int, decode_tokens: int, threads: int) -> dict:
    """bench_decode's side: float32 `generate` on the CPU, batch 1, greedy."""
    start = time.perf_counter()
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as XLA does on CPU: random weights make denormals
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    model.generation_config.eos_token_id = None  # every run generates what it asks for
    load_s = time.perf_counter() - start

    def generate(prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start, out[0, ids.shape[1] :].tolist()

    vocab = model.config.vocab_size
    ids = lambda n, seed: np.random.default_rng(seed).integers(3, min(vocab, 30000), n).tolist()  # noqa: E731
    first, _ = generate(ids(prompt_len, 0), 1)
    prefill = [generate(ids(prompt_len, seed), 1)[0] for seed in (1, 2, 3)]
    decode_prompt = ids(16, 5)
    generate(decode_prompt, decode_tokens + 1)  # warm-up
    one = [generate(decode_prompt, 1)[0] for _ in range(3)]
    full, tokens = generate(decode_prompt, decode_tokens + 1)
    return {
        "load_s": load_s,
        "first_token_s": first,
        "prefill_s": statistics.median(prefill),
        "decode_ms_per_token": (full - statistics.median(one)) / decode_tokens * 1e3,
        "decode_tokens": tokens,
        "peak_rss_mib": peak_rss_mib(),
    }


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _time_generate(model, torch, prompts: list[list[int]], spec: dict) -> dict:
    """`generate` on `prompts`: time to the first token, and to `new_tokens`."""
    device = model.device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> tuple[float, list[list[int]]]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()

    run(min(4, spec["new_tokens"]))  # warm-up: kernels, allocator
    first = statistics.median(run(1)[0] for _ in range(spec["repeats"]))
    total, tokens = run(spec["new_tokens"])
    return {
        "first_token_s": first,
        "total_s": total,
        "new_tokens": min(len(t) for t in tokens),
        "tokens": tokens,
    }


def generate_main(spec: dict) -> dict:
    """gpu_check's side: bfloat16 `generate` timings and tokens per batch size."""
    start = time.perf_counter()
    try:
        import torch
        import transformers
    except Exception as exc:  # the parent tries another interpreter, or reports this
        return {"import_error": f"{type(exc).__name__}: {exc}"}

    on_gpu = torch.cuda.is_available()
    # transformers >= 4.56 names it `dtype`; older ones ignore that name silently.
    name = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["ckpt"], **{name: torch.bfloat16}
    ).to("cuda" if on_gpu else "cpu")
    model.eval()
    model.generation_config.eos_token_id = None  # every sequence runs to new_tokens
    if on_gpu:
        torch.cuda.synchronize()
    report = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": str(model.dtype),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "load_s": time.perf_counter() - start,
        "batches": {},
    }
    with open(spec["prompts_file"]) as f:
        prompts = json.load(f)
    for batch in spec["batches"]:
        try:
            report["batches"][str(batch)] = _time_generate(model, torch, prompts[:batch], spec)
        except Exception as exc:  # e.g. out of memory: the other batch sizes still run
            report["batches"][str(batch)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return report


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        print(json.dumps(generate_main(json.loads(sys.argv[2]))))
        sys.exit(0)
    ckpt, prompt_len, decode_tokens, threads = sys.argv[1:5]
    print(json.dumps(main(ckpt, int(prompt_len), int(decode_tokens), int(threads))))
