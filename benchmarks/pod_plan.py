"""A Gemma-3-27B pod plan on 256 simulated CPU devices (issue 22, item 5).

    python -m benchmarks.pod_plan                     # 16x16, 32x8, 64x4; bfloat16
    python -m benchmarks.pod_plan --dtype float32     # the same without CPU's bf16 upcast

Writes the text decoder's `config.json` (transformers' `Gemma3ForCausalLM`, the sizes of
google/gemma-3-27b's language model; no weights) to a temporary directory and runs
`jaxkv plan --mesh ... --aot` on it under
`XLA_FLAGS=--xla_force_host_platform_device_count=256`: per mesh, the per-device weight
and KV-cache bytes and the memory XLA's compiler reports for one decode and one prefill
step (`jaxkv.engine.pod_plan`). Nothing is allocated: the model is abstract.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

NUM_DEVICES = 256
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
    ],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", action="append", help="default: 16x16, 32x8, 64x4")
    parser.add_argument("--memory", default="8GiB", help="KV-cache memory per device")
    parser.add_argument("--max-model-len", default="32768")
    parser.add_argument("--max-num-batched-tokens", default="2048")
    parser.add_argument("--max-num-seqs", default="64")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("benchmarks.pod_plan must start JAX itself (it sets XLA_FLAGS)")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    )
    from jaxkv import cli

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(GEMMA3_27B))
        command = ["plan", "--model", model_dir, "--aot", "--memory", args.memory,
                   "--max-model-len", args.max_model_len, "--max-num-batched-tokens",
                   args.max_num_batched_tokens, "--max-num-seqs", args.max_num_seqs,
                   "--dtype", args.dtype]  # fmt: skip
        for mesh in args.mesh or ["16x16", "32x8", "64x4"]:
            command += ["--mesh", mesh]
        print("jaxkv " + " ".join(command).replace(model_dir, "gemma-3-27b-text/"))
        return cli.main(command)


if __name__ == "__main__":
    sys.exit(main())
