"""Model runners on jaxkv: Gemma 1/2/3, Llama and LLaVA in Flax NNX, Hugging Face checkpoints.

The names below load on first use, so importing this package is cheap; the modules
themselves import JAX. The interface the engine codes to is documented in
`jaxkv.models.base`.
"""

from __future__ import annotations

from jaxkv._lazy import lazy_getattr

_EXPORTS = {
    "CausalLM": "jaxkv.models.base",
    "PagedContext": "jaxkv.models.base",
    "DecoderConfig": "jaxkv.models.config",
    "LlavaConfig": "jaxkv.models.config",
    "VisionConfig": "jaxkv.models.config",
    "parse_decoder_config": "jaxkv.models.config",
    "parse_llava_config": "jaxkv.models.config",
    "load_model": "jaxkv.models.loading",
    "load_tokenizer": "jaxkv.models.loading",
    "LlavaForConditionalGeneration": "jaxkv.models.llava",
    "merge_image_features": "jaxkv.models.llava",
    "load_image": "jaxkv.models.image",
    "preprocess_image": "jaxkv.models.image",
    "save_random_checkpoint": "jaxkv.models.testing",
    "tiny_configs": "jaxkv.models.testing",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr("jaxkv.models", _EXPORTS, globals())
