"""transformers' side of bench_decode (runs under the peer env's python: torch, no JAX).

    python _transformers_decode.py CKPT PROMPT_LEN DECODE_TOKENS THREADS

Prints one JSON line: load_s, first_token_s, prefill_s (median of 3), decode_ms_per_token
(greedy, its own KV cache), peak_rss_mib. Float32, eager attention, as the reference.
"""

import json
import statistics
import sys
import time


def peak_rss_mib() -> float:
    """Peak RSS of this process (VmHWM, not inherited from the parent as ru_maxrss is)."""
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def main(ckpt: str, prompt_len: int, decode_tokens: int, threads: int) -> dict:
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
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size

    def ids(n: int, seed: int):
        rng = np.random.default_rng(seed)
        return torch.tensor([rng.integers(3, min(vocab, 30000), n)])

    with torch.no_grad():
        start = time.perf_counter()
        model(ids(prompt_len, 0))
        first = time.perf_counter() - start
        prefill = []
        for seed in (1, 2, 3):
            start = time.perf_counter()
            model(ids(prompt_len, seed))
            prefill.append(time.perf_counter() - start)
        out = model(ids(16, 4), use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return {
        "load_s": load_s,
        "first_token_s": first,
        "prefill_s": statistics.median(prefill),
        "decode_ms_per_token": decode / decode_tokens * 1e3,
        "peak_rss_mib": peak_rss_mib(),
    }


if __name__ == "__main__":
    ckpt, prompt_len, decode_tokens, threads = sys.argv[1:5]
    print(json.dumps(main(ckpt, int(prompt_len), int(decode_tokens), int(threads))))
