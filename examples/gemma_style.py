"""A Gemma-3-style model served through jaxkv's paged KV caches, checked against its dense self.

What it does, in order:

1. Writes a tiny Gemma 3 checkpoint in Hugging Face format (config.json with
   `layer_types` and per-layer-type `rope_parameters`, model.safetensors with random
   weights, a word-level tokenizer.json) to a temporary directory, or uses `--model DIR`
   (any local Gemma/Gemma2/Gemma3-text/Llama checkpoint).
2. Loads it with `jaxkv.models.load_model`: Flax NNX modules, parameters read from the
   safetensors files by their Hugging Face names.
3. Generates greedily for a few prompts that share a prefix, through `PagedGenerator`:
   sliding-window and full-attention layers each get their own KV-cache group
   (`PagedKVCache` + block tables), prompts are prefilled in small chunks, and later
   prompts reuse the shared prefix's blocks.
4. Re-derives every token with `forward_dense` (whole sequence recomputed, no cache) and
   prints both; exits 1 on any mismatch.

Run: `python examples/gemma_style.py` (`--max-tokens 8 --chunk-size 4`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

from jaxkv.models import load_model, load_tokenizer, save_random_checkpoint, tiny_configs
from jaxkv.models.paged_generate import PagedGenerator, dense_greedy
from jaxkv.models.testing import save_word_tokenizer

PROMPTS = [
    "<bos> w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22",
    "<bos> w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w90 w91",
    "<bos> w7 w8 w9",
]


def tiny_checkpoint(path: Path) -> Path:
    save_random_checkpoint(path, tiny_configs()["gemma3-tiny"], seed=0)
    save_word_tokenizer(path, 256, {0: "<pad>", 1: "<eos>", 2: "<bos>"})
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a local HF checkpoint (default: tiny)")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--chunk-size", type=int, default=4, help="prefill chunk (tokens)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_checkpoint(Path(tmp))
        start = time.perf_counter()
        model = load_model(path)
        tokenizer = load_tokenizer(path)
        cfg = model.config
        print(f"loaded {cfg.family}: {cfg.num_hidden_layers} layers {list(cfg.layer_types)}, "
              f"window {cfg.sliding_window}, in {time.perf_counter() - start:.1f} s")  # fmt: skip
        if tokenizer is not None:
            prompts = [tokenizer.encode(p).ids for p in PROMPTS]
        else:
            prompts = [[2, *range(10, 10 + n)] for n in (12, 13, 3)]
        gen = PagedGenerator(model, block_size=4, max_num_tokens=32, group_by_spec=True)
        outputs = gen.generate(prompts[:1], args.max_tokens, chunk_size=args.chunk_size)
        outputs += gen.generate(prompts[1:], args.max_tokens, chunk_size=args.chunk_size)
        print(f"KV-cache groups: {len(gen.caches)}; prompt tokens from the prefix cache: "
              f"{gen.num_cached_tokens}")  # fmt: skip
        dense = model.dense_fn()
        ok = True
        for prompt, out in zip(prompts, outputs, strict=True):
            expected, _ = dense_greedy(dense, prompt, args.max_tokens)
            ok &= out == expected
            text = tokenizer.decode(out) if tokenizer is not None else ""
            print(f"prompt {len(prompt):3d} tokens -> {out} {text!r} "
                  f"dense: {'same' if out == expected else expected}")  # fmt: skip
        first = dense(jnp.asarray(prompts[0], jnp.int32))
        print(f"dense logits of prompt 0: shape {tuple(first.shape)}, dtype {first.dtype}")
    print("paged == dense:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
