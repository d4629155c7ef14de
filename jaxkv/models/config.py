"""Parsed model configurations, read from Hugging Face `config.json` dicts.

One `DecoderConfig` describes every supported text decoder (Gemma 1/2/3, Llama): the
families differ only in the switches it carries. The parser accepts the fields as
transformers 4.x and 5.x write them (`rope_theta` + `rope_local_base_freq` + `rope_scaling`
or a per-layer-type `rope_parameters`; `sliding_window_pattern` or `layer_types`).
Pure Python: importing it does not import JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# Decoder architectures by `model_type` (config.json) and the families they map to.
DECODER_MODEL_TYPES = {
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "llama": "llama",
}
ARCHITECTURES = {
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "LlamaForCausalLM": "llama",
    "LlavaForConditionalGeneration": "llava",
}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu", "gelu_new")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE of one layer type: base `theta`, `kind` in {"default", "linear", "llama3"}.

    `factor` divides the inverse frequencies ("linear") or the low ones ("llama3", with
    `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inverse_frequencies(self, head_dim: int) -> list[float]:
        """`1 / theta^(2i/d)` for `i < d/2`, scaled as `kind` says (float64, as a list)."""
        inv = [1.0 / (self.theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
        if self.kind == "linear":
            return [f / self.factor for f in inv]
        if self.kind == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            out = []
            for f in inv:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / self.factor)
                else:
                    smooth = (
                        self.original_max_position_embeddings / wavelen - self.low_freq_factor
                    ) / (self.high_freq_factor - self.low_freq_factor)
                    out.append((1 - smooth) * f / self.factor + smooth * f)
            return out
        return inv


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer; `family` in {"gemma", "gemma2", "gemma3", "llama"}.

    Invariants: `len(layer_types) == num_hidden_layers`; every layer type has a `rope`
    entry; `sliding_window` is set when any layer is "sliding_attention";
    `num_attention_heads % num_key_value_heads == 0`.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    layer_types: tuple[str, ...]
    rope: tuple[tuple[str, RopeConfig], ...]  # (layer type, its RoPE)
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None  # None: head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    max_position_embeddings: int = 8192
    image_token_id: int | None = None  # set when the decoder is a LLaVA language model

    # --- family switches -------------------------------------------------------------
    @property
    def norm_unit_offset(self) -> bool:
        """RMSNorm scales by `1 + weight` (Gemma) instead of `weight` (Llama)."""
        return self.family != "llama"

    @property
    def scale_embeddings(self) -> bool:
        """Embeddings are multiplied by `sqrt(hidden_size)` (Gemma)."""
        return self.family != "llama"

    @property
    def sandwich_norms(self) -> bool:
        """Norms after attention and around the MLP (Gemma 2/3): four norms per layer."""
        return self.family in ("gemma2", "gemma3")

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each query/key head before RoPE (Gemma 3)."""
        return self.family == "gemma3"

    @property
    def sm_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for(self, layer: int) -> RopeConfig:
        return dict(self.rope)[self.layer_types[layer]]

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window (keys at positions `> p - window` are visible)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A CLIP- or SigLIP-style ViT (`kind` "clip" has a CLS token and a pre-layernorm)."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + (1 if self.kind == "clip" else 0)


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    """LLaVA: vision tower, two-layer projector, a decoder; `image_token_id` placeholders."""

    text: DecoderConfig
    vision: VisionConfig
    image_token_id: int
    vision_feature_layer: int
    vision_feature_select_strategy: str  # "default" drops the CLS position, "full" keeps all
    projector_hidden_act: str
    multimodal_projector_bias: bool

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and features) per image."""
        n = self.vision.num_positions
        return n - 1 if self.vision_feature_select_strategy == "default" else n


# --------------------------------------------------------------------------- parsing
#
# Every field is checked as it is read: a bad value is a ValueError naming `where` (the
# config file and section), the field, the value and what is allowed.

_REQUIRED = object()  # `default` of a field that must be present


def _value(cfg: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    """`cfg[key]`, or `default` when absent or null (ValueError when `_REQUIRED`)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where}: config field {key!r} is missing")
        return default
    return value


def _int(
    cfg: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED, *, minimum: int = 1
) -> int:
    """Integer field `key` (not a bool, not a float), at least `minimum`."""
    value = _value(cfg, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{where}: {key} must be {allowed}, got {value!r}")
    return value


def _float(
    cfg: Mapping[str, Any],
    key: str,
    where: str,
    default: Any = _REQUIRED,
    *,
    positive: bool = False,
) -> float:
    """Finite number field `key` (int or float, not a bool), > 0 when `positive`, else >= 0."""
    value = _value(cfg, key, where, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        allowed = "a positive number" if positive else "a number >= 0"
        raise ValueError(f"{where}: {key} must be {allowed}, got {value!r}")
    return float(value)


def _optional_float(
    cfg: Mapping[str, Any], key: str, where: str, default: float | None
) -> float | None:
    """A positive number, or None when the field is null or 0 (switched off)."""
    value = cfg.get(key, default)
    return None if value in (None, 0) else _float({key: value}, key, where, positive=True)


def _bool(cfg: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = _value(cfg, key, where, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _mapping(
    cfg: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED
) -> Mapping[str, Any]:
    value = _value(cfg, key, where, default)
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {key} must be a JSON object, got {value!r}")
    return value


def _token_ids(cfg: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    """Token id field `key`: an integer >= 0, a list of them, or null (no ids)."""
    value = cfg.get(key)
    ids = () if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(
                f"{where}: {key} must be a token id (an integer >= 0) or a list of them, "
                f"got {value!r}"
            )
    return tuple(ids)


def _rope_from_dict(params: Mapping[str, Any], default_theta: float, where: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{where}: rope_type {kind!r} is not supported (default, linear, llama3)")
    return RopeConfig(
        theta=_float(params, "rope_theta", where, default_theta, positive=True),
        kind=kind,
        factor=_float(params, "factor", where, 1.0, positive=True),
        low_freq_factor=_float(params, "low_freq_factor", where, 1.0, positive=True),
        high_freq_factor=_float(params, "high_freq_factor", where, 4.0, positive=True),
        original_max_position_embeddings=_int(
            params, "original_max_position_embeddings", where, 8192
        ),
    )


def _parse_rope(cfg: Mapping[str, Any], family: str, where: str) -> dict[str, RopeConfig]:
    """Per-layer-type RoPE from 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = _mapping(cfg, "rope_parameters", where, {})
    global_default = 1_000_000.0 if family == "gemma3" else 10_000.0
    if any(t in params for t in LAYER_TYPES):
        out = {}
        for t in LAYER_TYPES:
            default = global_default if t == FULL_ATTENTION else 10_000.0
            p = _mapping(params, t, f"{where} rope_parameters", {})
            out[t] = _rope_from_dict(p, default, f"{where} rope_parameters[{t!r}]")
        return out
    if params:  # one dict for every layer (5.x)
        theta = _float(cfg, "rope_theta", where, global_default, positive=True)
        rope = _rope_from_dict(params, theta, f"{where} rope_parameters")
        return {t: rope for t in LAYER_TYPES}
    scaling = _mapping(cfg, "rope_scaling", where, {})
    theta = _float(cfg, "rope_theta", where, global_default, positive=True)
    full = _rope_from_dict({**scaling, "rope_theta": theta}, theta, f"{where} rope_scaling")
    if family == "gemma3":  # 4.x: local layers use rope_local_base_freq, unscaled
        local_theta = _float(cfg, "rope_local_base_freq", where, 10_000.0, positive=True)
        local = RopeConfig(theta=local_theta)
        return {FULL_ATTENTION: full, SLIDING_ATTENTION: local}
    return {t: full for t in LAYER_TYPES}


def _parse_layer_types(cfg: Mapping[str, Any], family: str, n: int, where: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != n
            or any(t not in LAYER_TYPES for t in types)
        ):
            raise ValueError(
                f"{where}: layer_types {types!r} must list {n} entries from {list(LAYER_TYPES)}"
            )
        return tuple(types)
    if family == "gemma2":  # even layers slide (1:1)
        return tuple(SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n))
    if family == "gemma3":  # every `sliding_window_pattern`-th layer is global (5:1 by default)
        pattern = _int(cfg, "sliding_window_pattern", where, 6)
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n))
    return (FULL_ATTENTION,) * n


def parse_decoder_config(cfg: Mapping[str, Any], where: str = "config.json") -> DecoderConfig:
    """A `DecoderConfig` from a Gemma/Gemma2/Gemma3-text/Llama `config.json` dict.

    Every field it reads is checked (positive sizes, heads dividing, a positive even
    head_dim, integer token ids, ...): ValueError naming `where` and the field.
    """
    model_type = cfg.get("model_type")
    if model_type not in DECODER_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not a supported decoder "
            f"({', '.join(DECODER_MODEL_TYPES)})"
        )
    family = DECODER_MODEL_TYPES[model_type]
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    n = _int(cfg, "num_hidden_layers", where)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(
            f"{where}: head_dim must be a positive even integer (RoPE rotates pairs), got "
            f"{head_dim!r}" + ("" if "head_dim" in cfg else " (hidden_size // num_attention_heads)")
        )
    default_act = "silu" if family == "llama" else "gelu_pytorch_tanh"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act
    if family == "gemma" and act == "gelu":  # legacy Gemma configs mean the tanh approximation
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    layer_types = _parse_layer_types(cfg, family, n, where)
    window = None
    if family in ("gemma2", "gemma3"):
        window = _int(cfg, "sliding_window", where, 4096)
    if SLIDING_ATTENTION in layer_types and not window:
        raise ValueError(f"{where}: sliding_attention layers need a positive sliding_window")
    if family == "gemma3" and _bool(cfg, "use_bidirectional_attention", where, False):
        raise ValueError(f"{where}: use_bidirectional_attention=True is not supported")
    gemma2 = family == "gemma2"
    sandwich = family in ("gemma2", "gemma3")
    bos = _token_ids(cfg, "bos_token_id", where)
    if len(bos) > 1:
        raise ValueError(f"{where}: bos_token_id must be one token id, got {list(bos)}")
    return DecoderConfig(
        family=family,
        vocab_size=_int(cfg, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", where, 1e-6),
        hidden_act=act,
        layer_types=layer_types,
        rope=tuple(_parse_rope(cfg, family, where).items()),
        sliding_window=window,
        query_pre_attn_scalar=_optional_float(
            cfg, "query_pre_attn_scalar", where, 256 if sandwich else None
        ),
        attn_logit_softcapping=_optional_float(
            cfg, "attn_logit_softcapping", where, 50.0 if gemma2 else None
        ),
        final_logit_softcapping=_optional_float(
            cfg, "final_logit_softcapping", where, 30.0 if gemma2 else None
        ),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", where, family != "llama"),
        attention_bias=_bool(cfg, "attention_bias", where, False),
        mlp_bias=_bool(cfg, "mlp_bias", where, False),
        eos_token_ids=_token_ids(cfg, "eos_token_id", where),
        bos_token_id=bos[0] if bos else None,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 8192),
    )


def parse_vision_config(cfg: Mapping[str, Any], where: str) -> VisionConfig:
    """A `VisionConfig` from a LLaVA `vision_config` (CLIP or SigLIP), every field checked."""
    model_type = cfg.get("model_type", "clip_vision_model")
    kinds = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
    if model_type not in kinds:
        raise ValueError(
            f"{where}: vision model_type {model_type!r} is not supported ({list(kinds)})"
        )
    kind = kinds[model_type]
    act = cfg.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: vision hidden_act {act!r} is not supported")
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    if hidden % heads:
        raise ValueError(f"{where}: vision hidden_size {hidden} is not a multiple of heads {heads}")
    image_size, patch_size = _int(cfg, "image_size", where), _int(cfg, "patch_size", where)
    if image_size % patch_size:
        raise ValueError(
            f"{where}: image_size {image_size} must be a multiple of patch_size {patch_size}"
        )
    return VisionConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_hidden_layers=_int(cfg, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_channels=_int(cfg, "num_channels", where, 3),
        image_size=image_size,
        patch_size=patch_size,
        hidden_act=act,
        layer_norm_eps=_float(cfg, "layer_norm_eps", where, 1e-5 if kind == "clip" else 1e-6),
    )


def parse_llava_config(cfg: Mapping[str, Any], where: str = "config.json") -> LlavaConfig:
    """A `LlavaConfig` from a LLaVA `config.json` dict, every field checked (as
    `parse_decoder_config` checks the text config); the image token lies in the vocabulary."""
    text_cfg = {"model_type": "llama", **_mapping(cfg, "text_config", where)}
    text = parse_decoder_config(text_cfg, f"{where} text_config")
    image_key = "image_token_id" if cfg.get("image_token_id") is not None else "image_token_index"
    image_token_id = _int(cfg, image_key, where, 32000, minimum=0)
    if image_token_id >= text.vocab_size:
        raise ValueError(
            f"{where}: {image_key} {image_token_id} is outside the vocabulary "
            f"(text_config vocab_size {text.vocab_size})"
        )
    text = dataclasses.replace(
        text,
        image_token_id=image_token_id,
        tie_word_embeddings=_bool(
            cfg, "tie_word_embeddings", where, _bool(text_cfg, "tie_word_embeddings", where, False)
        ),
        eos_token_ids=text.eos_token_ids or _token_ids(cfg, "eos_token_id", where),
    )
    vision = parse_vision_config(_mapping(cfg, "vision_config", where), f"{where} vision_config")
    n = vision.num_hidden_layers
    layer = _value(cfg, "vision_feature_layer", where, -2)
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n - 1 <= layer <= n:
        raise ValueError(
            f"{where}: vision_feature_layer {layer!r} must be one layer, an integer in "
            f"[{-n - 1}, {n}] (an index into the vision tower's {n + 1} hidden states)"
        )
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(
            f"{where}: vision_feature_select_strategy {strategy!r} not in default/full"
        )
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: projector_hidden_act {act!r} is not supported")
    return LlavaConfig(
        text=text,
        vision=vision,
        image_token_id=image_token_id,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act=act,
        multimodal_projector_bias=_bool(cfg, "multimodal_projector_bias", where, True),
    )


def model_type_of(cfg: Mapping[str, Any], where: str = "config.json") -> str:
    """The `model_type` a config describes, checked against `architectures[0]` when given."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise ValueError(f"{where}: architectures must be a list of class names, got {archs!r}")
    if archs:
        if archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"{where}: architecture {archs[0]!r} is not supported ({', '.join(ARCHITECTURES)})"
            )
        return ARCHITECTURES[archs[0]]
    model_type = cfg.get("model_type")
    if model_type not in (*DECODER_MODEL_TYPES, "llava"):
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported and no architectures"
        )
    return model_type


def parse_model_config(
    cfg: Mapping[str, Any], where: str = "config.json"
) -> DecoderConfig | LlavaConfig:
    """The config of any supported architecture (dispatching as `model_type_of` says),
    every field checked; ValueError naming `where` and the field otherwise."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where}: not a JSON object")
    model_type = model_type_of(cfg, where)
    if model_type == "llava":
        return parse_llava_config(cfg, where)
    return parse_decoder_config({**cfg, "model_type": model_type}, where)
