"""Run transformers' own model on a checkpoint directory; write its logits and greedy tokens.

Runs under the peer env's python (torch + transformers, no JAX), started by
tests/test_models_hf.py:

    python hf_reference.py CKPT_DIR INPUT.npz OUT.npz

INPUT.npz holds `input_ids [S]` and optionally `pixel_values [N, C, H, W]` and
`max_new_tokens`. OUT.npz gets `logits [S, vocab]` (float32, one forward pass over the
prompt), `generated [max_new_tokens]` (greedy `generate`, HF's own KV cache) and
`missing`/`unexpected` (parameter names transformers did not find / did not use).
"""

import sys

import numpy as np
import torch
import transformers


def main(ckpt: str, inputs_path: str, out_path: str) -> None:
    inputs = np.load(inputs_path)
    config = transformers.AutoConfig.from_pretrained(ckpt)
    cls = (
        transformers.LlavaForConditionalGeneration
        if config.model_type == "llava"
        else transformers.AutoModelForCausalLM
    )
    model, info = cls.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    ids = torch.from_numpy(inputs["input_ids"].astype(np.int64))[None]
    kwargs = {}
    if "pixel_values" in inputs:
        kwargs["pixel_values"] = torch.from_numpy(inputs["pixel_values"].astype(np.float32))
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float().numpy()
        new = int(inputs["max_new_tokens"]) if "max_new_tokens" in inputs else 8
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            **kwargs,
        )
    np.savez(
        out_path,
        logits=logits,
        generated=out[0, ids.shape[1] :].numpy().astype(np.int32),
        missing=np.array(sorted(info["missing_keys"]), dtype=str),
        unexpected=np.array(sorted(info["unexpected_keys"]), dtype=str),
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
