"""`load_model`: a local Hugging Face checkpoint directory -> a `CausalLM` on a mesh.

`config.json` is parsed and checked in full before any tensor is read. The tensors of
each part of a model (the decoder, its output head, LLaVA's vision tower and projector)
may sit under any name prefix transformers' own `from_pretrained` accepts for it: what
transformers 4.x and 5.x `save_pretrained` write, transformers 5.x's module names (what
`save_random_checkpoint` writes) and a bare base model. `PARTS` lists them, and each
part's prefix is found on its own (transformers renames each part on its own too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxkv.models.base import CausalLM
from jaxkv.models.checkpoint import AbstractTensors, CheckpointReader, read_config
from jaxkv.models.config import DecoderConfig, LlavaConfig, parse_model_config
from jaxkv.models.decoder import Decoder

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Part:
    """Where one part of a model keeps its tensors in a checkpoint.

    `prefixes`: the name prefixes transformers' `from_pretrained` accepts for the part,
    in the order tried; the first is transformers 5.x's module name. `probe`: a tensor
    (name after the prefix) that every checkpoint of the part holds.
    """

    description: str
    probe: str
    prefixes: tuple[str, ...]


# Part name -> where its tensors may be, per architecture (verified against
# transformers 5.20's from_pretrained: every combination loads with no missing keys).
PARTS: dict[str, dict[str, Part]] = {
    "decoder": {
        # "": a base model (GemmaModel, LlamaModel) saved on its own.
        "model": Part("decoder", "embed_tokens.weight", ("model.", "")),
        "lm_head": Part("output head", "weight", ("lm_head.",)),
    },
    "llava": {
        "model": Part(
            "LLaVA language model",
            "embed_tokens.weight",
            (
                "model.language_model.",  # 5.x modules
                "language_model.model.",  # 4.x and 5.x save_pretrained
                "language_model.",
                "model.language_model.model.",
            ),
        ),
        "lm_head": Part("LLaVA output head", "weight", ("lm_head.", "language_model.lm_head.")),
        "vision_tower": Part(
            "LLaVA vision tower",
            "embeddings.patch_embedding.weight",
            (
                "model.vision_tower.vision_model.",  # 5.x modules (a CLIPVisionModel)
                "vision_tower.vision_model.",  # 4.x save_pretrained
                "vision_tower.",  # 5.x save_pretrained
                "model.vision_tower.",
            ),
        ),
        "projector": Part(
            "LLaVA projector",
            "linear_1.weight",
            ("model.multi_modal_projector.", "multi_modal_projector."),
        ),
    },
}


def architecture_of(config: DecoderConfig | LlavaConfig) -> str:
    """The key of `PARTS` for a parsed config."""
    return "llava" if isinstance(config, LlavaConfig) else "decoder"


def find_prefixes(
    config: DecoderConfig | LlavaConfig, names: Collection[str], where: str
) -> dict[str, str]:
    """Part name -> the first of its `prefixes` under which `names` hold the part's probe.

    The output head of a model with tied embeddings is never read: it gets its first
    prefix whether present or not. A part found under none is a ValueError naming
    `where`, the prefixes looked for and the prefixes the checkpoint's names have.
    """
    text = config.text if isinstance(config, LlavaConfig) else config
    out = {}
    for key, part in PARTS[architecture_of(config)].items():
        found = [p for p in part.prefixes if p + part.probe in names]
        if found or (key == "lm_head" and text.tie_word_embeddings):
            out[key] = (found or part.prefixes)[0]
            continue
        looked = ", ".join(repr(p + part.probe) for p in part.prefixes)
        present = sorted({"".join(f"{c}." for c in n.split(".")[:-1][:2]) for n in names})
        shown = ", ".join(repr(p) for p in present[:12]) + (", ..." if len(present) > 12 else "")
        raise ValueError(
            f"checkpoint {where}: no {part.description} tensors: looked for {looked}; "
            f"the checkpoint's tensor names start with {shown or 'nothing (no tensors)'}"
        )
    return out


def build_model(
    config: DecoderConfig | LlavaConfig,
    reader: CheckpointReader,
    prefixes: Mapping[str, str] | None = None,
    *,
    scan_layers: bool = True,
) -> CausalLM:
    """The model `config` describes, its parameters taken from `reader` by HF names.

    `prefixes` (part name -> prefix, see `PARTS`) default to the ones `reader`'s
    checkpoint uses (`find_prefixes` over `reader.files`). `scan_layers`: see
    `jaxkv.models.decoder`.
    """
    if prefixes is None:
        prefixes = find_prefixes(config, reader.files.keys(), str(reader.path))
    if isinstance(config, LlavaConfig):
        from jaxkv.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration(config, reader, prefixes, scan_layers=scan_layers)
    lm_head = f"{prefixes['lm_head']}weight"
    return CausalLM(Decoder(config, reader, prefixes["model"], lm_head, scan_layers=scan_layers))


def load_model(
    path: str | Path,
    *,
    dtype: str = "float32",
    mesh: Mesh | None = None,
    scan_layers: bool | None = None,
) -> CausalLM:
    """Load the checkpoint in directory `path` (see `jaxkv.models.base` for the contract).

    `scan_layers`: one scanned layer body (compile time independent of depth) or one
    stack per layer (see `jaxkv.models.decoder`); None: `default_scan_layers(mesh)`.
    Bad input (config field, file, tensor name, shape or dtype) is a ValueError naming
    the file and what is wrong, raised before the model is built where it can be.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    config = parse_model_config(read_config(path), f"{Path(path) / 'config.json'}")
    reader = CheckpointReader(path, jnp.dtype(dtype), mesh)
    try:
        if scan_layers is None:
            scan_layers = default_scan_layers(reader.mesh)
        return build_model(config, reader, scan_layers=scan_layers)
    finally:
        reader.close()


def default_scan_layers(mesh: Mesh | None) -> bool:
    """Scan the layers only on TPUs: XLA's CPU and GPU backends copy a layer's weights out
    of the stack at every step of the scan (on CPU a dynamic-slice fusion before each
    dot; on GPU a `dynamic_slice_fusion` writing each weight of the layer to a buffer of
    its own, which the dots then read: every decode step writes and reads the weights
    twice more), which every decode step pays for; the TPU compiler reads them in place.
    The engine runs a model with one stack per layer a few layers per program, so its
    programs stay small however deep the model."""
    devices = mesh.devices.flat if mesh is not None else jax.local_devices()
    return next(iter(devices)).platform == "tpu"


def abstract_model(
    config: DecoderConfig | LlavaConfig, dtype: str, mesh: Mesh, *, scan_layers: bool = True
) -> CausalLM:
    """The model `config` describes with abstract parameters (`AbstractTensors`: shapes,
    dtype `dtype` and the shardings `load_model` would give them on `mesh`, no memory):
    for lowering and compiling its programs ahead of time, without weights."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    prefixes = {key: part.prefixes[0] for key, part in PARTS[architecture_of(config)].items()}
    reader = AbstractTensors(jnp.dtype(dtype), mesh)
    return build_model(config, reader, prefixes, scan_layers=scan_layers)


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` of `path/tokenizer.json`, or None when there is none
    (ValueError naming the file when it is not a tokenizer `tokenizers` can read)."""
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(
            f"{file}: not a tokenizer.json the tokenizers library reads ({error})"
        ) from None
