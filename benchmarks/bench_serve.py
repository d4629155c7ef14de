"""`jaxkv serve`'s overhead: one streamed workload (`--concurrency` clients, each sending
its next request when the last one ends; random prompt and output lengths, fixed seed;
greedy, `ignore_eos`) driven two ways over the same engine flags:

- in-process: an asyncio driver calling `EngineLoop.submit` and reading each request's
  `RequestStream`, the engine stepped on a thread of the driver's process;
- engine-process: the same driver, the engine in a process of its own as `jaxkv serve`
  runs it (`EngineProcess`): the process split's cost without HTTP;
- served: a `jaxkv serve` subprocess, the driver streaming `/v1/completions` over HTTP.

Per mode: TTFT (send to first token) and ITL (gap between token-bearing outputs or
chunks), median and p90 over every request of a run, and output tokens per second. The
modes alternate (forwards, then backwards) over `--repeats` runs after a warm-up run of
each; the table gives each figure's median over the runs and its range, and each mode's
ratio of the medians to in-process. Run:

    python -m benchmarks.bench_serve [--concurrency 32] [--requests 128] [--repeats 6]
        [--checkpoint DIR] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import numpy as np

from benchmarks._common import add_record_option, print_table, results_name, write_json

ENGINE_FLAGS = ["--num-blocks", "1536", "--max-num-seqs", "32",
                "--max-num-batched-tokens", "512", "--max-model-len", "512"]  # fmt: skip


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request: prompts 32-256 tokens, outputs 16-128."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(5, vocab, int(rng.integers(32, 257))).tolist(), int(rng.integers(16, 129)))
        for _ in range(num_requests)
    ]


async def _closed_loop(requests, concurrency: int, one) -> tuple[list, float]:
    """Run `one(prompt, max_tokens)` over `requests` with `concurrency` clients; each
    result (send time, token-output times, tokens) and the wall time."""
    pending = iter(requests)
    results = []

    async def client() -> None:
        for prompt, max_tokens in pending:
            results.append(await one(prompt, max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def in_process_run(loop, requests, concurrency: int):
    from jaxkv.engine import SamplingParams

    async def one(prompt, max_tokens):
        sent = time.perf_counter()
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        stream = await loop.submit(prompt, sampling=sampling)
        times, tokens = [], 0
        while True:
            _, output = await stream.get()
            if output.new_token_ids:
                times.append(time.perf_counter())
                tokens += len(output.new_token_ids)
            if output.finished:
                return sent, times, tokens

    return asyncio.run(_closed_loop(requests, concurrency, one))


async def _post_stream(host: str, port: int, path: str, body: dict):
    """POST `body` as JSON; yield the chunks of the chunked response body as they come.
    A minimal HTTP/1.1 client, one connection per request: the client process shares
    the machine's cores with the server, so the lighter it is, the less it distorts
    what is measured (httpx costs ~3x more CPU per chunk)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{path}: {head.decode(errors='replace').splitlines()[0]}")
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            yield (await reader.readexactly(size + 2))[:-2]
    finally:
        writer.close()


def served_run(url: str, requests, concurrency: int):
    host, port = url.removeprefix("http://").split(":")

    async def one(prompt, max_tokens):
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True}  # fmt: skip
        sent = time.perf_counter()
        times, tokens = [], 0
        async for data in _post_stream(host, int(port), "/v1/completions", body):
            for event in data.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                if chunk["choices"] and (token_ids := chunk["choices"][0]["token_ids"]):
                    times.append(time.perf_counter())  # token-bearing, as in-process
                    tokens += len(token_ids)
        return sent, times, tokens

    return asyncio.run(_closed_loop(requests, concurrency, one))


def summarize(results, wall_s: float, requests) -> dict:
    expected = sum(m for _, m in requests)
    tokens = sum(r[2] for r in results)
    if tokens != expected:
        raise RuntimeError(f"{tokens} output tokens, expected {expected}")
    ttft = np.array([r[1][0] - r[0] for r in results]) * 1e3
    itl = np.concatenate([np.diff(r[1]) for r in results]) * 1e3
    return {
        "ttft_ms_median": float(np.median(ttft)), "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "itl_ms_median": float(np.median(itl)), "itl_ms_p90": float(np.percentile(itl, 90)),
        "throughput_tok_s": tokens / wall_s,
    }  # fmt: skip


def measure(checkpoint: str, concurrency: int, num_requests: int, repeats: int) -> dict:
    from jaxkv.cli import build_parser
    from jaxkv.serving.command import build_engine
    from jaxkv.serving.engine_loop import EngineLoop
    from jaxkv.serving.engine_process import EngineProcess
    from jaxkv.serving.process import ServeProcess

    vocab = json.loads((__import__("pathlib").Path(checkpoint) / "config.json").read_text())
    requests = workload(num_requests, vocab["vocab_size"])
    serve_args = build_parser().parse_args(["serve", "--model", checkpoint, *ENGINE_FLAGS])
    # The engine `jaxkv serve` builds, stepped here and in a process of its own.
    loops = {
        "in-process": EngineLoop(build_engine(serve_args)[0], max_pending=4 * concurrency),
        "engine-process": EngineLoop(
            EngineProcess(build_engine, serve_args), max_pending=4 * concurrency
        ),
    }
    runs: dict[str, list[dict]] = {"in-process": [], "engine-process": [], "served": []}
    with ServeProcess(checkpoint, *ENGINE_FLAGS, "--served-model-name", "bench") as server:
        modes = {
            mode: (lambda loop=loop: in_process_run(loop, requests, concurrency))
            for mode, loop in loops.items()
        }
        modes["served"] = lambda: served_run(server.url, requests, concurrency)
        for run in modes.values():  # warm-up: every step shape compiled
            run()
        for r in range(repeats):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                results, wall = modes[mode]()
                runs[mode].append(summarize(results, wall, requests))
                print(f"run {r} {mode}: {json.dumps(runs[mode][-1])}", flush=True)
    for loop in loops.values():
        loop.close(grace_s=0.0, timeout_s=60)
    return runs


def table(runs: dict[str, list[dict]]) -> tuple[list[list], dict]:
    """Per metric: each mode's median [range], then each other mode's ratio of medians to
    in-process (`ratios[mode][metric]`)."""
    rows, ratios = [], {mode: {} for mode in runs if mode != "in-process"}
    for metric in runs["in-process"][0]:
        cells = [metric]
        medians = {}
        for mode, mode_runs in runs.items():
            values = [run[metric] for run in mode_runs]
            medians[mode] = float(np.median(values))
            cells.append(f"{medians[mode]:.4g} [{min(values):.4g}, {max(values):.4g}]")
        for mode in ratios:
            ratios[mode][metric] = medians[mode] / medians["in-process"]
            cells.append(f"{ratios[mode][metric]:.3f}")
        rows.append(cells)
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument(
        "--checkpoint", help="a servable checkpoint (default: a tiny random Llama written now)"
    )
    add_record_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from jaxkv.models.testing import save_chat_checkpoint

            checkpoint = str(save_chat_checkpoint(f"{tmp}/tiny"))
        runs = measure(checkpoint, args.concurrency, args.requests, args.repeats)
    rows, ratios = table(runs)
    header = ["metric", *(f"{mode} median [range]" for mode in runs),
              *(f"{mode}/in-process" for mode in ratios)]  # fmt: skip
    title = (f"jaxkv serve vs its engine driven in-process: {args.concurrency} streams, "
             f"{args.requests} requests, medians of {args.repeats} interleaved runs")  # fmt: skip
    print_table(title, header, rows)
    payload = {"args": vars(args), "engine_flags": ENGINE_FLAGS, "runs": runs, "ratios": ratios}
    write_json(results_name("bench_serve", parser, args), payload, args.record)


if __name__ == "__main__":
    main()
