"""A Gemma-3-style model served through jaxkv's paged KV caches, checked against its dense self.

What it does, in order:

1. Writes a tiny Gemma 3 checkpoint in Hugging Face format (config.json with
   `layer_types` and per-layer-type `rope_parameters`, model.safetensors with random
   weights, a word-level tokenizer.json) to a temporary directory, or uses `--model DIR`
   (any local Gemma/Gemma2/Gemma3-text/Llama checkpoint).
2. Loads it with `jaxkv.models.load_model`: Flax NNX modules, parameters read from the
   safetensors files by their Hugging Face names.
3. Serves a few prompts that share a prefix through `jaxkv.engine.LLMEngine`, greedily:
   sliding-window and full-attention layers get their own KV-cache groups, prompts are
   prefilled in small chunks (`--chunk-size` tokens a step), and the later prompts
   reuse the shared prefix's blocks from the prefix cache.
4. Re-derives every token with the dense reference (`forward_dense`, whole sequence
   recomputed, no cache) and prints both; exits 1 on any mismatch.

Run: `python examples/gemma_style.py` (`--max-tokens 8 --chunk-size 4`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.models import load_model, load_tokenizer, save_random_checkpoint, tiny_configs
from jaxkv.models.testing import save_word_tokenizer
from jaxkv.testing.reference import DenseReference

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
        config = EngineConfig(
            block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64,
            max_num_batched_tokens=16, long_prefill_token_threshold=args.chunk_size,
        )  # fmt: skip
        engine = LLMEngine(model, config)
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        outputs = engine.generate(prompts[:1], sampling)
        outputs += engine.generate(prompts[1:], sampling)
        groups = engine.runner.kv_cache_config.kv_cache_groups
        print(f"KV-cache groups: {len(groups)}; prompt tokens from the prefix cache: "
              f"{sum(o.num_cached_tokens for o in outputs)}")  # fmt: skip
        reference = DenseReference(model, config.max_model_len)
        ok = True
        for out in outputs:
            expected = reference.expected(out.prompt_token_ids, out.output_token_ids)
            tokens = out.output_token_ids
            ok &= tokens == expected
            text = tokenizer.decode(tokens) if tokenizer is not None else ""
            print(f"prompt {len(out.prompt_token_ids):3d} tokens -> {tokens} {text!r} "
                  f"dense: {'same' if tokens == expected else expected}")  # fmt: skip
        dense = model.dense_fn()
        first = dense(jnp.asarray(prompts[0], jnp.int32))
        print(f"dense logits of prompt 0: shape {tuple(first.shape)}, dtype {first.dtype}")
    print("engine == dense:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
