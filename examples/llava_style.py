"""A LLaVA-style model (CLIP ViT + projector + Llama decoder) served through jaxkv's paged
KV caches, checked against its dense self.

What it does, in order:

1. Writes a tiny LLaVA checkpoint in Hugging Face format (config.json, random weights in
   model.safetensors, preprocessor_config.json, a word-level tokenizer.json with an
   `<image>` token) to a temporary directory, or uses `--model DIR`.
2. Loads it with `jaxkv.models.load_model`; reads an image (`--image FILE`, default a
   synthetic gradient) with Pillow and preprocesses it as preprocessor_config.json says.
3. Serves the prompt with its image through `jaxkv.engine.LLMEngine`, greedily: the
   engine expands the `<image>` placeholder to one token per image feature, runs the
   vision tower + projector once (its encoder cache) and prefills in small chunks (the
   image rows are cut across chunks).
4. Re-derives the tokens with the dense reference (`forward_dense` on the same image
   features); exits 1 on mismatch.

Run: `python examples/llava_style.py` (`--image photo.jpg --max-tokens 8`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.models import (
    load_model,
    load_tokenizer,
    preprocess_image,
    save_random_checkpoint,
    tiny_configs,
)
from jaxkv.models.testing import TINY_PREPROCESSOR, save_word_tokenizer
from jaxkv.testing.reference import DenseReference, image_offsets

PROMPT = "<bos> w30 <image> w31 w32 w33"


def tiny_checkpoint(path: Path) -> Path:
    config = tiny_configs()["llava-tiny"]
    save_random_checkpoint(path, config, seed=0)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    specials = {0: "<pad>", 1: "<bos>", 2: "<eos>", config["image_token_index"]: "<image>"}
    save_word_tokenizer(path, config["text_config"]["vocab_size"], specials)
    return path


def synthetic_image() -> Image.Image:
    y, x = np.mgrid[0:40, 0:56]
    rgb = np.stack([x * 4, y * 6, (x + y) * 2], axis=-1).clip(0, 255).astype(np.uint8)
    return Image.fromarray(rgb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a local LLaVA checkpoint (default: tiny)")
    parser.add_argument("--image", type=Path, help="a PNG/JPEG (default: a synthetic one)")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--chunk-size", type=int, default=5, help="prefill chunk (tokens)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_checkpoint(Path(tmp))
        model = load_model(path)
        tokenizer = load_tokenizer(path)
        preprocessor = json.loads((path / "preprocessor_config.json").read_text())
        image = Image.open(args.image) if args.image else synthetic_image()
        pixels = preprocess_image(image, preprocessor)[None]  # [1, C, H, W]
        image_id = model.config.image_token_id
        ids = tokenizer.encode(PROMPT).ids if tokenizer is not None else [1, 30, image_id, 31]
        config = EngineConfig(
            block_size=4, num_blocks=32, max_num_seqs=2, max_model_len=64,
            max_num_batched_tokens=16, long_prefill_token_threshold=args.chunk_size,
        )  # fmt: skip
        engine = LLMEngine(model, config)
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        (result,) = engine.generate([ids], sampling, images=[[pixels[0]]])
        prompt, out = result.prompt_token_ids, result.output_token_ids
        print(f"image {image.size} -> pixels {pixels.shape}; prompt {len(ids)} tokens -> "
              f"{len(prompt)} with {model.num_image_tokens} image features")  # fmt: skip
        (offset,) = image_offsets(prompt, image_id, model.num_image_tokens)
        reference = DenseReference(model, config.max_model_len)
        expected = reference.expected(prompt, out, [(offset, pixels[0])])
        text = tokenizer.decode(out) if tokenizer is not None else ""
        print(f"generated {out} {text!r}; dense: {'same' if out == expected else expected}")
    print("engine == dense:", "OK" if out == expected else "MISMATCH")
    return 0 if out == expected else 1


if __name__ == "__main__":
    sys.exit(main())
