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


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where}: config field {key!r} is missing")
    return cfg[key]


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_dict(params: Mapping[str, Any], default_theta: float, where: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{where}: rope_type {kind!r} is not supported (default, linear, llama3)")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _parse_rope(cfg: Mapping[str, Any], family: str, where: str) -> dict[str, RopeConfig]:
    """Per-layer-type RoPE from 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    global_default = 1_000_000.0 if family == "gemma3" else 10_000.0
    if isinstance(params, Mapping) and any(t in params for t in LAYER_TYPES):
        out = {}
        for t in LAYER_TYPES:
            p = params.get(t) or {}
            default = global_default if t == FULL_ATTENTION else 10_000.0
            out[t] = _rope_from_dict(p, default, f"{where} rope_parameters[{t!r}]")
        return out
    if isinstance(params, Mapping) and params:  # one dict for every layer (5.x)
        rope = _rope_from_dict(params, float(cfg.get("rope_theta", global_default)), where)
        return {t: rope for t in LAYER_TYPES}
    scaling = cfg.get("rope_scaling") or {}
    full = _rope_from_dict({**scaling, "rope_theta": cfg.get("rope_theta", global_default)},
                           global_default, f"{where} rope_scaling")  # fmt: skip
    if family == "gemma3":  # 4.x: local layers use rope_local_base_freq, unscaled
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
        return {FULL_ATTENTION: full, SLIDING_ATTENTION: local}
    return {t: full for t in LAYER_TYPES}


def _parse_layer_types(cfg: Mapping[str, Any], family: str, n: int, where: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        types = tuple(types)
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"{where}: layer_types {list(types)} must list {n} entries from {list(LAYER_TYPES)}"
            )
        return types
    if family == "gemma2":  # even layers slide (1:1)
        return tuple(SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n))
    if family == "gemma3":  # every `sliding_window_pattern`-th layer is global (5:1 by default)
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n))
    return (FULL_ATTENTION,) * n


def parse_decoder_config(cfg: Mapping[str, Any], where: str = "config.json") -> DecoderConfig:
    """A `DecoderConfig` from a Gemma/Gemma2/Gemma3-text/Llama `config.json` dict."""
    model_type = cfg.get("model_type")
    if model_type not in DECODER_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not a supported decoder "
            f"({', '.join(DECODER_MODEL_TYPES)})"
        )
    family = DECODER_MODEL_TYPES[model_type]
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    n = int(_require(cfg, "num_hidden_layers", where))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    default_act = "silu" if family == "llama" else "gelu_pytorch_tanh"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act
    if family == "gemma" and act == "gelu":  # legacy Gemma configs mean the tanh approximation
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    layer_types = _parse_layer_types(cfg, family, n, where)
    window = cfg.get("sliding_window") if family in ("gemma2", "gemma3") else None
    if family in ("gemma2", "gemma3") and window is None:
        window = 4096
    if SLIDING_ATTENTION in layer_types and not window:
        raise ValueError(f"{where}: sliding_attention layers need a positive sliding_window")
    if family == "gemma3" and cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=True is not supported")
    softcap_defaults = (50.0, 30.0) if family == "gemma2" else (None, None)
    attn_cap = cfg.get("attn_logit_softcapping", softcap_defaults[0])
    final_cap = cfg.get("final_logit_softcapping", softcap_defaults[1])
    qpas = cfg.get("query_pre_attn_scalar", 256 if family in ("gemma2", "gemma3") else None)
    return DecoderConfig(
        family=family,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        layer_types=layer_types,
        rope=tuple(_parse_rope(cfg, family, where).items()),
        sliding_window=int(window) if window else None,
        query_pre_attn_scalar=float(qpas) if qpas is not None else None,
        attn_logit_softcapping=float(attn_cap) if attn_cap else None,
        final_logit_softcapping=float(final_cap) if final_cap else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family != "llama")),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_ids=_as_int_tuple(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
    )


def parse_vision_config(cfg: Mapping[str, Any], where: str) -> VisionConfig:
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
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    if hidden % heads:
        raise ValueError(f"{where}: vision hidden_size {hidden} is not a multiple of heads {heads}")
    return VisionConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_channels=int(cfg.get("num_channels", 3)),
        image_size=int(_require(cfg, "image_size", where)),
        patch_size=int(_require(cfg, "patch_size", where)),
        hidden_act=act,
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
    )


def parse_llava_config(cfg: Mapping[str, Any], where: str = "config.json") -> LlavaConfig:
    text_cfg = dict(_require(cfg, "text_config", where))
    text_cfg.setdefault("model_type", "llama")
    image_token_id = cfg.get("image_token_id", cfg.get("image_token_index", 32000))
    text = dataclasses.replace(
        parse_decoder_config(text_cfg, f"{where} text_config"),
        image_token_id=int(image_token_id),
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))
        ),
    )
    if not text.eos_token_ids and cfg.get("eos_token_id") is not None:
        text = dataclasses.replace(text, eos_token_ids=_as_int_tuple(cfg["eos_token_id"]))
    vision = parse_vision_config(_require(cfg, "vision_config", where), f"{where} vision_config")
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"{where}: vision_feature_layer {layer!r}: only one layer is supported")
    if not -vision.num_hidden_layers - 1 <= layer <= vision.num_hidden_layers:
        raise ValueError(
            f"{where}: vision_feature_layer {layer} is outside the "
            f"{vision.num_hidden_layers + 1} hidden states of the vision tower"
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
        image_token_id=int(image_token_id),
        vision_feature_layer=int(layer),
        vision_feature_select_strategy=strategy,
        projector_hidden_act=act,
        multimodal_projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
    )


def model_type_of(cfg: Mapping[str, Any], where: str = "config.json") -> str:
    """The `model_type` a config describes, checked against `architectures[0]` when given."""
    archs = cfg.get("architectures") or []
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
