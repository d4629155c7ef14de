"""Build a randomly initialised transformers model from a config and `save_pretrained` it.

Runs under the peer env's python (torch + transformers, no JAX), started by
tests/models_util.py's `save_with_transformers`:

    python hf_save.py CONFIG.json OUT_DIR SEED

CONFIG.json holds a Hugging Face config dict whose `architectures[0]` names the class
(e.g. LlamaForCausalLM, LlavaForConditionalGeneration); OUT_DIR gets `config.json` and
the safetensors exactly as this transformers version's `save_pretrained` writes them.
"""

import json
import sys

import torch
import transformers


def main(config_path: str, out_dir: str, seed: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(int(seed))
    model = cls(transformers.AutoConfig.for_model(**config))
    model.save_pretrained(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
