"""KV-aware routing over real servers: `--servers` `jaxkv serve` processes, each
publishing its KV events on its own ipc socket (`--kv-events-endpoint`, with a replay
socket, vLLM's wire), and a small router in front: an HTTP proxy (FastAPI + httpx, the
response streamed through as it comes) that sends each OpenAI request to the server
holding the longest prefix of its prompt.

The router knows the servers only through their events: a `PrefixIndex` fed by one
`ZmqKVEventSubscriber` per server. It tokenizes each request itself (the checkpoint's
tokenizer and chat template, as the servers do) and places it with `choose_engine`: the
longest cached prefix among the servers within `--slack` in-flight requests of the
least loaded. Round-robin on the same servers (prefix caches reset between) is the
baseline.

The workload is multi-turn chat: `--conversations` conversations run at once, each
`--turns` turns long; a turn's prompt is the conversation so far (a system prompt of its
own, the previous messages and answers) plus a new message. The figures: the servers'
own prefix-cache hit rate (`vllm:prefix_cache_hits` / `queries` from each `/metrics`)
and the time to first token seen through the router. Run (a couple of minutes on 2
cores):

    python examples/kv_aware_routing.py [--servers 2] [--conversations 16] [--turns 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import tempfile
import threading
import time

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxkv.prefix_index import EngineRank, PrefixIndex, ZmqKVEventSubscriber
from jaxkv.routing import choose_engine
from jaxkv.serving.process import ServeProcess, free_port

BLOCK = 16  # `jaxkv serve`'s block size on CPU
HASH_FN = "sha256"  # and its block hash
SERVER_FLAGS = ("--num-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
                "--max-model-len", "1024", "--served-model-name", "tiny")  # fmt: skip
POLICIES = ("round-robin", "prefix")


class Router:
    """Places each request on one of `backends` (their base URLs) by `policy` and proxies
    it there. Invariant: `loads[url]` counts the requests in flight on `url` (from
    placement until its response is fully relayed or the client went away)."""

    def __init__(self, backends: list[str], index: PrefixIndex, encoder, slack: int) -> None:
        self.backends, self.index, self.encoder, self.slack = backends, index, encoder, slack
        self.loads = dict.fromkeys(backends, 0)
        self.policy = "prefix"
        self._next = itertools.cycle(backends)
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

    def tokens(self, path: str, body: dict) -> list[int]:
        """The prompt's token ids as the servers will see them ([] when it cannot tell:
        the request then goes to the least loaded server, which answers its error)."""
        try:
            if path == "/v1/chat/completions":
                return self.encoder.encode_chat(body["messages"])
            prompt = body["prompt"]
            return list(prompt) if isinstance(prompt, list) else self.encoder.encode(prompt)
        except (KeyError, TypeError, ValueError):
            return []

    def place(self, path: str, body: dict) -> str:
        if self.policy == "round-robin":
            return next(self._next)
        return choose_engine(self.index, self.loads, self.tokens(path, body), self.slack,
                             lambda url: EngineRank(url, 0))  # fmt: skip

    async def proxy(self, path: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = {}
        url = self.place(path, body if isinstance(body, dict) else {})
        self.loads[url] += 1
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", url + path, content=raw,
                                          headers={"content-type": "application/json"}),
                stream=True,
            )  # fmt: skip
        except BaseException:
            self.loads[url] -= 1
            raise

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: closing upstream aborts there
                await upstream.aclose()
                self.loads[url] -= 1

        media_type = upstream.headers.get("content-type")
        return StreamingResponse(relay(), upstream.status_code, media_type=media_type)

    def app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._route(path), methods=["POST"])

        @app.get("/loads")
        async def loads() -> JSONResponse:
            return JSONResponse(self.loads)

        return app

    def _route(self, path: str):
        async def route(request: Request):
            return await self.proxy(path, request)

        return route


class Cluster:
    """The servers, the router's index over their events, and the router on a port."""

    def __init__(self, checkpoint: str, num_servers: int, tmp: str, slack: int) -> None:
        from jaxkv import models
        from jaxkv.models.prompting import PromptEncoder

        self.servers, self.subscribers = [], []
        self.index = PrefixIndex(BLOCK, HASH_FN)
        try:
            for k in range(num_servers):
                endpoints = (f"ipc://{tmp}/server-{k}", f"ipc://{tmp}/server-{k}-replay")
                server = ServeProcess(
                    checkpoint, *SERVER_FLAGS, "--kv-events-endpoint", endpoints[0],
                    "--kv-events-replay-endpoint", endpoints[1], "--kv-events-topic", f"s{k}",
                )  # fmt: skip
                self.servers.append(server)
                subscriber = ZmqKVEventSubscriber(self.index, server.url, *endpoints, topic=f"s{k}")
                subscriber.start()
                self.subscribers.append(subscriber)
        except BaseException:
            self.close()
            raise
        encoder = PromptEncoder.from_dir(checkpoint, models.load_tokenizer(checkpoint))
        self.router = Router([s.url for s in self.servers], self.index, encoder, slack)
        self.port = free_port()
        config = uvicorn.Config(self.router.app(), port=self.port, log_level="warning",
                                lifespan="off")  # fmt: skip
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        while not self._uvicorn.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Empty every server's prefix cache (the index learns it from their events)."""
        for server in self.servers:
            httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()

    def prefix_cache_counts(self) -> tuple[float, float]:
        """(hits, queries) in tokens, summed over the servers' /metrics."""
        hits = queries = 0.0
        for server in self.servers:
            text = httpx.get(f"{server.url}/metrics", timeout=60).text
            hits += _metric(text, "vllm:prefix_cache_hits_total")
            queries += _metric(text, "vllm:prefix_cache_queries_total")
        return hits, queries

    def close(self) -> None:
        if getattr(self, "_uvicorn", None) is not None:
            self._uvicorn.should_exit = True
            self._thread.join(30)
        for subscriber in self.subscribers:
            subscriber.close()
        for server in self.servers:
            server.__exit__(None, None, None)


def _metric(exposition: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$",
                                            exposition, re.M))  # fmt: skip


def _words(rng: np.random.Generator, count: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(5, 256, count))


async def _conversation(client, rng_seed: int, turns: int, max_tokens: int) -> list[float]:
    """One conversation's turns in order; the TTFT (s) of each, through the router."""
    rng = np.random.default_rng(rng_seed)
    messages = [{"role": "system", "content": _words(rng, 48)}]
    ttfts = []
    for _ in range(turns):
        messages.append({"role": "user", "content": _words(rng, int(rng.integers(16, 40)))})
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        sent, answer, first = time.perf_counter(), [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and "role" not in choices[0]["delta"]:  # past the opening chunk
                    first = first or time.perf_counter()
                    answer.append(choices[0]["delta"].get("content") or "")
        ttfts.append(first - sent)
        messages.append({"role": "assistant", "content": "".join(answer).strip()})
    return ttfts


def run_policy(cluster: Cluster, policy: str, conversations: int, turns: int,
               max_tokens: int, seed: int) -> dict:  # fmt: skip
    """The workload through the router under `policy`, from empty prefix caches."""
    cluster.reset()
    cluster.router.policy = policy
    hits0, queries0 = cluster.prefix_cache_counts()

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=600) as client:
            return await asyncio.gather(*(
                _conversation(client, seed + c, turns, max_tokens) for c in range(conversations)
            ))  # fmt: skip

    start = time.perf_counter()
    ttfts = np.concatenate(asyncio.run(main())) * 1e3
    wall = time.perf_counter() - start
    hits, queries = cluster.prefix_cache_counts()
    return {
        "requests": conversations * turns,
        "hit_rate": (hits - hits0) / (queries - queries0),
        "prefill_tokens": queries - queries0 - (hits - hits0),
        "ttft_ms_median": float(np.median(ttfts)),
        "ttft_ms_p90": float(np.percentile(ttfts, 90)),
        "wall_s": wall,
    }


def run(num_servers: int = 2, conversations: int = 16, turns: int = 4, max_tokens: int = 16,
        slack: int = 3, repeats: int = 2, checkpoint: str | None = None) -> dict:  # fmt: skip
    """Both policies, alternating (ABBA...), `repeats` runs each, on one cluster:
    `{policy: [totals per run]}`."""
    from jaxkv.models.testing import save_chat_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = checkpoint or str(save_chat_checkpoint(f"{tmp}/tiny"))
        cluster = Cluster(checkpoint, num_servers, tmp, slack)
        try:
            runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for r in range(repeats):
                for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                    runs[policy].append(run_policy(cluster, policy, conversations, turns,
                                                   max_tokens, seed=1000 * r))  # fmt: skip
            return runs
        finally:
            cluster.close()


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each policy's figures: the median over its runs."""
    return {p: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for p, rs in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16, help="conversations at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--slack", type=int, default=3, help="choose_engine's load slack")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each policy")
    parser.add_argument("--checkpoint", help="a servable checkpoint (default: a tiny one)")
    parser.add_argument("--json", action="store_true", help="print the runs as one JSON line")
    args = parser.parse_args()
    start = time.perf_counter()
    runs = run(args.servers, args.conversations, args.turns, args.max_tokens, args.slack,
               args.repeats, args.checkpoint)  # fmt: skip
    medians = summary(runs)
    if args.json:
        print(json.dumps({"runs": runs, "median": medians, "wall_s": time.perf_counter() - start}))
        return
    print(f"{'policy':<12} {'hit rate':>9} {'prefill tokens':>15} {'TTFT median':>12} "
          f"{'TTFT p90':>9}   (medians of {args.repeats} runs)")  # fmt: skip
    for policy, m in medians.items():
        print(f"{policy:<12} {m['hit_rate']:>9.1%} {m['prefill_tokens']:>15.0f} "
              f"{m['ttft_ms_median']:>10.1f}ms {m['ttft_ms_p90']:>7.1f}ms")  # fmt: skip
    rr, px = medians["round-robin"], medians["prefix"]
    print(f"prefix-aware routing computes {rr['prefill_tokens'] / px['prefill_tokens']:.2f}x "
          f"fewer prefill tokens ({time.perf_counter() - start:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
