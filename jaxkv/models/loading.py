"""`load_model`: a local Hugging Face checkpoint directory -> a `CausalLM` on a mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxkv.models.base import CausalLM
from jaxkv.models.checkpoint import CheckpointReader, read_config
from jaxkv.models.config import model_type_of, parse_decoder_config, parse_llava_config
from jaxkv.models.decoder import Decoder

DTYPES = ("float32", "bfloat16", "float16")

# Where LLaVA checkpoints keep their parts: transformers 5.x, then 4.x.
LLAVA_PREFIXES = (
    {
        "language_model": "model.language_model.",
        "lm_head": "lm_head.weight",
        "vision_tower": "model.vision_tower.",
        "projector": "model.multi_modal_projector.",
    },
    {
        "language_model": "language_model.model.",
        "lm_head": "language_model.lm_head.weight",
        "vision_tower": "vision_tower.",
        "projector": "multi_modal_projector.",
    },
)


def llava_prefixes(has_tensor) -> dict[str, str]:
    """The naming (5.x or 4.x) a LLaVA checkpoint uses, told by its embedding's name."""
    for prefixes in LLAVA_PREFIXES:
        if has_tensor(f"{prefixes['language_model']}embed_tokens.weight"):
            return prefixes
    names = [f"{p['language_model']}embed_tokens.weight" for p in LLAVA_PREFIXES]
    raise ValueError(f"LLaVA checkpoint: tensor {names[0]!r} (or 4.x {names[1]!r}) is missing")


def build_model(cfg: dict[str, Any], reader, where: str = "config.json") -> CausalLM:
    """The model `cfg` describes, its parameters taken from `reader` by HF names."""
    model_type = model_type_of(cfg, where)
    if model_type == "llava":
        from jaxkv.models.llava import LlavaForConditionalGeneration

        llava = parse_llava_config(cfg, where)
        return LlavaForConditionalGeneration(llava, reader, llava_prefixes(reader.__contains__))
    text = parse_decoder_config({**cfg, "model_type": model_type}, where)
    return CausalLM(Decoder(text, reader, "model.", "lm_head.weight"))


def load_model(path: str | Path, *, dtype: str = "float32", mesh: Mesh | None = None) -> CausalLM:
    """Load the checkpoint in directory `path` (see `jaxkv.models.base` for the contract)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    cfg = read_config(path)
    reader = CheckpointReader(path, jnp.dtype(dtype), mesh)
    try:
        return build_model(cfg, reader, f"{path}/config.json")
    finally:
        reader.close()


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` of `path/tokenizer.json`, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
