"""vLLM's own benchmark client (`vllm bench serve`, from the peer environment
`.venv-vllm`; skipped without it) accepts `jaxkv serve` unchanged: with the `vllm`
(completions) and `openai-chat` backends on its random dataset, every request completes
with every token asked for."""

from __future__ import annotations

import pytest

from benchmarks.bench_vllm_client import PEER_PYTHON, measure
from jaxkv.models.testing import save_chat_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER_PYTHON.exists(), reason=f"no peer environment at {PEER_PYTHON}"),
]


@pytest.mark.timeout(900)
def test_vllm_bench_serve_completes_every_request_on_both_backends(tmp_path) -> None:
    checkpoint = str(save_chat_checkpoint(tmp_path / "tiny"))
    results = measure(checkpoint, num_prompts=24, concurrency=8, input_len=32, output_len=12)
    for backend, result in results.items():
        assert result["failed"] == 0 and result["completed"] == 24, (backend, result)
        assert result["total_output_tokens"] == 24 * 12, (backend, result)
        assert result["median_ttft_ms"] > 0 and result["output_throughput"] > 0, backend
