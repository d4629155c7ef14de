"""`jaxkv serve` under load: 256 concurrent streams of random lengths, about a quarter
of whose clients hang up part-way. Every stream that ran to its end is complete and
token-for-token `LLMEngine.generate`'s (greedy); afterwards nothing is pending and every
KV block is free."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from test_serving import Running, checkpoint, make_engine  # noqa: F401 (the fixture)

from jaxkv.engine import EngineConfig, SamplingParams

NUM_REQUESTS = 256
CONFIG = EngineConfig(block_size=4, num_blocks=1024, max_num_seqs=32, max_num_batched_tokens=256,
                      max_model_len=128)  # fmt: skip


def workload(seed: int = 0) -> list[tuple[list[int], int, int | None]]:
    """(prompt ids, max_tokens, chunks read before hanging up or None) per request."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(5, 256, int(rng.integers(2, 48))).tolist(),
            int(rng.integers(4, 48)),
            int(rng.integers(1, 12)) if rng.random() < 0.25 else None,
        )
        for _ in range(NUM_REQUESTS)
    ]


async def stream_one(client: httpx.AsyncClient, prompt, max_tokens, hang_up_after):
    """The streamed text, finish reason and usage; None for a client that hung up."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, reason, usage, chunks = [], None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "".join(text), reason, usage
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                reason = chunk["choices"][0]["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    raise AssertionError("the stream ended without [DONE]")


async def run_all(url: str, requests) -> list:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        return await asyncio.gather(*(stream_one(client, *r) for r in requests))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_256_concurrent_streams_with_hang_ups_match_generate_and_free_every_block(
    checkpoint,  # noqa: F811
) -> None:
    requests = workload()
    server = Running(checkpoint, CONFIG, max_pending=NUM_REQUESTS)
    try:
        free = server.engine.num_free_blocks
        results = asyncio.run(run_all(server.url, requests))
        deadline = time.monotonic() + 60
        while server.engine.num_free_blocks != free or server.server.loop.num_pending:
            assert time.monotonic() < deadline, "blocks or requests left behind"
            time.sleep(0.05)
    finally:
        server.stop()
    engine, _ = make_engine(checkpoint, CONFIG)
    reference = engine.generate(
        [p for p, _, _ in requests],
        [SamplingParams(max_tokens=m, ignore_eos=True) for _, m, _ in requests],
    )
    engine.shutdown()
    completed = 0
    for (prompt, max_tokens, hang_up), result, expected in zip(
        requests, results, reference, strict=True
    ):
        if hang_up is not None:
            continue
        text, reason, usage = result
        assert reason == "length" and usage["completion_tokens"] == max_tokens, result
        assert usage["prompt_tokens"] == len(prompt)
        assert text == expected.text, (prompt, max_tokens)
        completed += 1
    assert completed > NUM_REQUESTS // 2
    assert sum(r is None for r in results) > NUM_REQUESTS // 8, "too few clients hung up"
