"""`python -m jaxkv serve` as a real process: SIGTERM ends open streams properly, refuses
new connections and exits 0 within the grace period; `--kv-events-endpoint` publishes
the served prompts' blocks to a subscriber."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_serving import checkpoint  # noqa: F401 (the fixture)

from jaxkv.prefix_index import EngineRank, PrefixIndex, ZmqKVEventSubscriber
from jaxkv.serving.process import ServeProcess

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--num-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--served-model-name", "tiny")  # fmt: skip
GRACE_S = 3.0
EXIT_MARGIN_S = 30.0  # the engine's shutdown and the interpreter's exit on a loaded machine


def _chunks(lines):
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


@pytest.mark.timeout(300)
def test_sigterm_ends_open_streams_refuses_connections_and_exits_0(checkpoint) -> None:  # noqa: F811
    server = ServeProcess(checkpoint, *ENGINE_FLAGS, "--shutdown-grace", str(GRACE_S))
    try:
        body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 1000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            chunks = _chunks(r.iter_lines())
            first = json.loads(next(chunks))
            assert first["choices"][0]["finish_reason"] is None
            server.terminate()
            signalled = time.monotonic()
            while True:  # the listening socket closes at once; the stream goes on
                try:
                    httpx.get(f"{server.url}/health", timeout=1.0)
                except httpx.ConnectError:
                    break
                assert time.monotonic() - signalled < 2.0, "still accepting after SIGTERM"
                time.sleep(0.05)
            assert server.proc.poll() is None, "exited before its open stream ended"
            rest = list(chunks)
        assert rest[-1] == "[DONE]", rest[-3:]
        last = json.loads(rest[-2])["choices"][0]
        assert last["finish_reason"] in ("length", "abort"), last
        status = server.proc.wait(GRACE_S + EXIT_MARGIN_S)
        assert status == 0, server.log()
        assert time.monotonic() - signalled < GRACE_S + EXIT_MARGIN_S
    finally:
        server.kill()


@pytest.mark.timeout(300)
def test_kv_events_of_a_served_prompt_reach_a_subscriber(checkpoint, tmp_path) -> None:  # noqa: F811
    endpoint = f"ipc://{tmp_path}/events"
    index = PrefixIndex(16, "sha256")  # the engine's defaults on CPU
    with ServeProcess(
        checkpoint, *ENGINE_FLAGS, "--kv-events-endpoint", endpoint, "--kv-events-topic", "e0"
    ) as server:
        subscriber = ZmqKVEventSubscriber(index, "e0", endpoint, topic="e0")
        subscriber.start()
        try:
            prompt = " ".join(f"w{i}" for i in range(10, 50))
            tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
            time.sleep(0.5)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            served = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert served.status_code == 200, served.text
            full_blocks = len(tokens) // 16 * 16
            deadline = time.monotonic() + 30
            while index.longest_prefix(tokens).get(EngineRank("e0", 0), 0) < full_blocks:
                assert time.monotonic() < deadline, "no BlockStored for the served prompt"
                time.sleep(0.05)
        finally:
            subscriber.close()
    assert server.proc.returncode == 0
