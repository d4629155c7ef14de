"""vLLM 0.33's host-side sampling semantics for `test_sampling_vllm_diff.py`.

Run under `.venv-vllm/bin/python` (vLLM, no JAX): reads cases as JSON on stdin, writes
results as JSON on stdout. Cases: `params` (SamplingParams kwargs: accepted or the error),
`penalties` (vLLM's `apply_penalties` on a logits row), `stops` (`check_stop_strings`).
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.detokenizer import check_stop_strings


def params(kwargs: dict) -> dict:
    try:
        p = SamplingParams(**kwargs)
    except Exception as error:  # vLLM's validation error, any type
        return {"ok": False, "error": str(error)}
    return {"ok": True, "temperature": p.temperature, "top_k": p.top_k, "seed": p.seed,
            "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids),
            "logprobs": p.logprobs, "prompt_logprobs": p.prompt_logprobs,
            "skip_reading_prefix_cache": p.skip_reading_prefix_cache}  # fmt: skip


def penalties(case: dict) -> list[float]:
    vocab = len(case["logits"])
    logits = torch.tensor([case["logits"]], dtype=torch.float32)
    pad = lambda ids: torch.tensor([ids or [vocab]], dtype=torch.int64)  # noqa: E731
    out = apply_penalties(
        logits, pad(case["prompt"]), pad(case["output"]), torch.tensor([case["presence"]]),
        torch.tensor([case["frequency"]]), torch.tensor([case["repetition"]]),
    )  # fmt: skip
    return out[0].tolist()


def main() -> None:
    cases = json.load(sys.stdin)
    json.dump({
        "params": [params(kwargs) for kwargs in cases["params"]],
        "penalties": [penalties(case) for case in cases["penalties"]],
        "stops": [check_stop_strings(*case) for case in cases["stops"]],
    }, sys.stdout)  # fmt: skip


if __name__ == "__main__":
    main()
