"""Tiny built-in configurations and random-weight checkpoints in Hugging Face format.

`save_random_checkpoint(path, config, seed)` writes `config.json` and safetensors with
every tensor the model reads, under the names transformers gives them (`layout`: its
5.x module names by default, or what `save_pretrained` of transformers 4.x / 5.x
writes), optionally split into shards with a `model.safetensors.index.json`. The tensor
list comes from building the model against a recording reader, so it is exactly what
`load_model` asks for; the Hugging Face equivalence tests load the same files into
transformers, which checks the names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jaxkv.models.checkpoint import INDEX_FILE, SINGLE_FILE
from jaxkv.models.config import LlavaConfig, parse_model_config
from jaxkv.models.llava import VisionTower
from jaxkv.models.loading import PARTS, architecture_of, build_model

# Part -> prefix of each tensor layout `save_random_checkpoint` writes (see
# `jaxkv.models.loading.PARTS`). Decoders: the same in every layout.
LAYOUTS: dict[str, dict[str, dict[str, str]]] = {
    "decoder": dict.fromkeys(("model", "4.x", "5.x"), {"model": "model.", "lm_head": "lm_head."}),
    "llava": {
        "model": {key: part.prefixes[0] for key, part in PARTS["llava"].items()},
        "4.x": {
            "model": "language_model.model.",
            "lm_head": "language_model.lm_head.",
            "vision_tower": "vision_tower.vision_model.",
            "projector": "multi_modal_projector.",
        },
        "5.x": {
            "model": "language_model.model.",
            "lm_head": "language_model.lm_head.",
            "vision_tower": "vision_tower.",
            "projector": "multi_modal_projector.",
        },
    },
}


class RandomTensors:
    """A stand-in `CheckpointReader`: hands out random tensors and records them by name."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = jnp.dtype(jnp.float32)
        self.tensors: dict[str, np.ndarray] = {}

    def get(
        self, name: str, shape: Sequence[int], spec: P | None = None, *, units: int | None = None
    ):
        shape = tuple(shape)
        if name in self.tensors:
            return jnp.asarray(self.tensors[name])
        normal = self.rng.standard_normal(shape)
        module = name.split(".")[-2]
        if "norm" in module or "layrnorm" in module:  # RMSNorm / LayerNorm: scale ~0.5, bias ~0
            value = normal * 0.1 + (0.5 if name.endswith(".weight") else 0.0)
        elif len(shape) >= 2:
            value = normal / math.sqrt(math.prod(shape[1:]))
        else:
            value = normal * 0.1
        value = value.astype(np.float32)
        self.tensors[name] = value
        return jnp.asarray(value)

    def get_stacked(
        self,
        names: Sequence[str],
        shape: Sequence[int],
        spec: P | None = None,
        *,
        units: int | None = None,
    ):
        return jnp.stack([self.get(name, shape, spec, units=units) for name in names])


def save_random_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    seed: int = 0,
    *,
    num_shards: int = 1,
    layout: str = "model",
) -> dict[str, np.ndarray]:
    """Write a random-weight checkpoint of `config` into directory `path`; returns the tensors.

    `layout` ("model", "4.x" or "5.x", see `LAYOUTS`) names the tensors. `num_shards > 1`
    splits them over `model-0000i-of-0000n.safetensors` files with an index, as
    `save_pretrained` does for large models.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    parsed = parse_model_config(config)
    layouts = LAYOUTS[architecture_of(parsed)]
    if layout not in layouts:
        raise ValueError(f"layout {layout!r} is not one of {list(layouts)}")
    prefixes = layouts[layout]
    recorder = RandomTensors(seed)
    build_model(parsed, recorder, prefixes)
    if isinstance(parsed, LlavaConfig):  # tensors a real checkpoint holds but LLaVA never reads
        _record_unread_vision_tensors(parsed, recorder, prefixes["vision_tower"])
    tensors = recorder.tensors
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if num_shards <= 1:
        save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.array(names, dtype=object), num_shards)):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = int(sum(v.nbytes for v in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return tensors


def save_word_tokenizer(path: str | Path, vocab_size: int, specials: dict[int, str]) -> None:
    """Write a `tokenizer.json` (a `tokenizers` WordLevel model) of `vocab_size` ids:
    `specials` (id -> text, e.g. "<bos>", "<image>"), every other id `i` the word "w{i}";
    words split at whitespace, decoded joined by spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials.get(0, "w0")))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(str(Path(path) / "tokenizer.json"))


# A chat template over `save_chat_checkpoint`'s special words.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<turn> {{ m['role'] }} {{ m['content'] }} <end> "
    "{% endfor %}{% if add_generation_prompt %}<turn>{% endif %}"
)
# The same for a LLaVA checkpoint, over content parts as LLaVA's own template: a message's
# images (`<image>` each) before its text.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<turn> {{ m['role'] }} "
    "{% for part in m['content'] | selectattr('type', 'equalto', 'image') %}<image> {% endfor %}"
    "{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] }} "
    "{% endfor %}<end> {% endfor %}{% if add_generation_prompt %}<turn>{% endif %}"
)
CHAT_SPECIALS = {0: "<unk>", 1: "<bos>", 2: "<eos>", 3: "<turn>", 4: "<end>"}
# CLIP's preprocessing (shortest edge, center crop, CLIP's mean and std) at the tiny
# LLaVA tower's 16 pixels.
TINY_PREPROCESSOR = {
    "do_resize": True, "size": {"shortest_edge": 16}, "resample": 3,
    "do_center_crop": True, "crop_size": {"height": 16, "width": 16},
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}  # fmt: skip


def save_chat_checkpoint(path: str | Path, name: str = "llama-tiny", seed: int = 0) -> Path:
    """A servable random checkpoint: `tiny_configs()[name]` weights, a word tokenizer
    (`save_word_tokenizer`, `CHAT_SPECIALS`) with a `tokenizer_config.json` transformers
    loads (bos/eos, `CHAT_TEMPLATE`), so HTTP clients that tokenize (vLLM's benchmark)
    accept it too. A LLaVA checkpoint also has `<image>` (its image token),
    `LLAVA_CHAT_TEMPLATE` and `TINY_PREPROCESSOR` as its `preprocessor_config.json`.
    Returns `path`."""
    path = Path(path)
    config = tiny_configs()[name]
    text = config.get("text_config", config)
    save_random_checkpoint(path, config, seed=seed)
    specials, template = dict(CHAT_SPECIALS), CHAT_TEMPLATE
    if "image_token_index" in config:
        specials[config["image_token_index"]] = "<image>"
        template = LLAVA_CHAT_TEMPLATE
        (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    save_word_tokenizer(path, text["vocab_size"], specials)
    # The BOS comes from the tokenizer's own post-processor, which every loader applies
    # (transformers 5 rebuilds a Llama tokenizer's pre-tokenizer, breaking the words).
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "model_max_length": text.get("max_position_embeddings", 2048),
    }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def _record_unread_vision_tensors(config: LlavaConfig, recorder: RandomTensors, prefix: str):
    """The vision layers after the selected feature layer and the tower's post-layernorm."""
    vision = config.vision
    VisionTower(vision, recorder, prefix, vision.num_hidden_layers)
    for part in ("weight", "bias"):
        recorder.get(f"{prefix}post_layernorm.{part}", (vision.hidden_size,))


def tiny_configs() -> dict[str, dict[str, Any]]:
    """Small Hugging Face-style configs (transformers 5.x fields) for tests and demos."""
    gemma3 = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 255,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "image_seq_length": 16,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_channels": 3,
            "image_size": 16,
            "patch_size": 4,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "projection_dim": 32,
        },
        "text_config": {k: v for k, v in llama.items() if k != "architectures"},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return {"gemma3-tiny": gemma3, "llama-tiny": llama, "llava-tiny": llava}
