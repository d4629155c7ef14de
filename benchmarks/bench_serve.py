"""`jaxkv serve`'s overhead: one streamed workload (`--concurrency` clients, each sending
its next request when the last one ends; random prompt and output lengths, fixed seed;
greedy, `ignore_eos`) driven two ways over the same engine flags:

- in-process: an asyncio driver calling `EngineLoop.submit` and reading each request's
  `RequestStream`, the engine stepped on a thread of the driver's process;
- engine-process: the same driver, the engine in a process of its own as `jaxkv serve`
  runs it (`EngineProcess`): the process split's cost without HTTP;
- served: a `jaxkv serve` subprocess, the driver streaming `/v1/completions` over HTTP
  from a process of its own (no JAX runtime, no idle engines of the other modes beside
  it: a client as users run one).

Per mode: TTFT (send to first token) and ITL (gap between token-bearing outputs or
chunks), median and p90 over a run's requests in steady state, after the opening burst
(each client's first request; all are sent at once, and their TTFT hangs on how many
reach the engine before its first step: microseconds apart in-process, milliseconds
apart over 32 new connections), and again over all of them (`all_*`); output tokens per
second. The modes alternate (forwards, then backwards) over `--repeats` runs after a
warm-up run of each; the first table gives each figure's median over the runs and its
range, and each mode's ratio of the medians to in-process. The pooled tables take the
requests of every run together: the latency ratios to in-process with 95% bootstrap
intervals (requests resampled within their run), so a run-to-run swing of the closed
loop's queueing is not read as the server's cost. Run:

    python -m benchmarks.bench_serve [--concurrency 32] [--requests 128] [--repeats 6]
        [--checkpoint DIR] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

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
    request's result (send time, acceptance time, token-output times, tokens), in
    `requests`' order (the first `concurrency` are the clients' first: the opening
    burst), and the wall time."""
    pending = iter(enumerate(requests))
    results: list = [None] * len(requests)

    async def client() -> None:
        for index, (prompt, max_tokens) in pending:
            results[index] = await one(prompt, max_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def in_process_run(loop, requests, concurrency: int):
    from jaxkv.engine import SamplingParams

    async def one(prompt, max_tokens):
        sent = time.perf_counter()
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        stream = await loop.submit(prompt, sampling=sampling)
        accepted = time.perf_counter()
        times, tokens = [], 0
        while True:
            _, output = await stream.get()
            if output.new_token_ids:
                times.append(time.perf_counter())
                tokens += len(output.new_token_ids)
            if output.finished:
                return sent, accepted, times, tokens

    return asyncio.run(_closed_loop(requests, concurrency, one))


async def _post_stream(host: str, port: int, path: str, body: dict):
    """POST `body` as JSON; yield None once the response began, then the chunks of the
    chunked response body as they come.
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
        yield None  # the response began: the engine accepted the request
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
            if data is None:
                accepted = time.perf_counter()
                continue
            for event in data.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                if chunk["choices"] and (token_ids := chunk["choices"][0]["token_ids"]):
                    times.append(time.perf_counter())  # token-bearing, as in-process
                    tokens += len(token_ids)
        return sent, accepted, times, tokens

    return asyncio.run(_closed_loop(requests, concurrency, one))


def per_request(results, requests) -> list[tuple[float, np.ndarray, float]]:
    """Each request's (TTFT ms, its inter-token gaps in ms, ms until the engine accepted
    it); every output token counted."""
    expected = sum(m for _, m in requests)
    tokens = sum(r[3] for r in results)
    if tokens != expected:
        raise RuntimeError(f"{tokens} output tokens, expected {expected}")
    return [
        ((times[0] - sent) * 1e3, np.diff(times) * 1e3, (accepted - sent) * 1e3)
        for sent, accepted, times, _ in results
    ]


def latency_stats(samples: list[tuple[float, np.ndarray, float]]) -> dict:
    """TTFT and ITL median and p90 over `samples` (per-request, as `per_request`), and
    the median and p90 wait for the engine to accept a request (it takes requests
    between steps: a request that missed a step's start waits for the next one)."""
    ttft = np.array([t for t, _, _ in samples])
    itl = np.concatenate([gaps for _, gaps, _ in samples])
    admit = np.array([a for _, _, a in samples])
    return {
        "ttft_ms_median": float(np.median(ttft)), "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "itl_ms_median": float(np.median(itl)), "itl_ms_p90": float(np.percentile(itl, 90)),
        "admit_ms_median": float(np.median(admit)),
        "admit_ms_p90": float(np.percentile(admit, 90)),
    }  # fmt: skip


def run_summary(samples: list, skip: int, tokens: int, wall_s: float) -> dict:
    """One run's latencies over its requests after the first `skip` (steady state), the
    same over all of them (`all_*`), and its output tokens per second."""
    every = {f"all_{metric}": value for metric, value in latency_stats(samples).items()}
    return {**latency_stats(samples[skip:]), **every, "throughput_tok_s": tokens / wall_s}


def pooled_ratios(samples: dict[str, list[list]], draws: int = 1000, seed: int = 0) -> dict:
    """Per mode other than in-process, per latency metric: the ratio of its value over
    the requests of every run to in-process's, and a 95% bootstrap interval (requests
    resampled within their run, each with all of its gaps; `samples[mode][run]`)."""
    rng = np.random.default_rng(seed)

    def stats(mode_runs, resample: bool) -> dict:
        pooled = []
        for run in mode_runs:
            picks = rng.integers(0, len(run), len(run)) if resample else range(len(run))
            pooled += [run[i] for i in picks]
        return latency_stats(pooled)

    point = {mode: stats(runs, False) for mode, runs in samples.items()}
    drawn = [{mode: stats(runs, True) for mode, runs in samples.items()} for _ in range(draws)]
    out = {}
    for mode in samples:
        if mode == "in-process":
            continue
        out[mode] = {}
        for metric, base in point["in-process"].items():
            if metric.startswith("admit"):  # in-process takes some at once: no ratio
                continue
            ratios = [d[mode][metric] / d["in-process"][metric] for d in drawn]
            low, high = np.percentile(ratios, [2.5, 97.5])
            out[mode][metric] = {
                "value": point[mode][metric], "in_process": base,
                "ratio": point[mode][metric] / base, "ci95": [float(low), float(high)],
            }  # fmt: skip
    return out


def measure(
    checkpoint: str, concurrency: int, num_requests: int, repeats: int
) -> tuple[dict, dict]:
    """Each mode's per-run summaries and per-run, per-request samples."""
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
    samples: dict[str, list[list]] = {mode: [] for mode in runs}
    tokens = sum(max_tokens for _, max_tokens in requests)
    client = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with client, ServeProcess(checkpoint, *ENGINE_FLAGS, "--served-model-name", "bench") as server:
        modes = {
            mode: (lambda loop=loop: in_process_run(loop, requests, concurrency))
            for mode, loop in loops.items()
        }
        modes["served"] = lambda: client.submit(
            served_run, server.url, requests, concurrency
        ).result()
        for run in modes.values():  # warm-up: every step shape compiled
            run()
        for r in range(repeats):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                results, wall = modes[mode]()
                samples[mode].append(per_request(results, requests))
                runs[mode].append(run_summary(samples[mode][-1], concurrency, tokens, wall))
                print(f"run {r} {mode}: {json.dumps(runs[mode][-1])}", flush=True)
    for loop in loops.values():
        loop.close(grace_s=0.0, timeout_s=60)
    return runs, samples


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


def print_pooled(title: str, pooled: dict) -> None:
    """A `pooled_ratios` result as a table: ratio [95% interval] per mode and metric."""
    rows = [
        [metric, f"{cells['in_process']:.4g}",
         *(f"{pooled[m][metric]['ratio']:.3f} [{pooled[m][metric]['ci95'][0]:.3f}, "
           f"{pooled[m][metric]['ci95'][1]:.3f}]" for m in pooled)]
        for metric, cells in pooled["served"].items()
    ]  # fmt: skip
    header = ["metric", "in-process", *(f"{mode} / in-process [95%]" for mode in pooled)]
    print_table(title, header, rows)


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
    if args.requests <= args.concurrency:
        parser.error(f"--requests ({args.requests}) must exceed --concurrency "
                     f"({args.concurrency}): the opening burst is not steady state")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from jaxkv.models.testing import save_chat_checkpoint

            checkpoint = str(save_chat_checkpoint(f"{tmp}/tiny"))
        runs, samples = measure(checkpoint, args.concurrency, args.requests, args.repeats)
    rows, ratios = table(runs)
    header = ["metric", *(f"{mode} median [range]" for mode in runs),
              *(f"{mode}/in-process" for mode in ratios)]  # fmt: skip
    title = (f"jaxkv serve vs its engine driven in-process: {args.concurrency} streams, "
             f"{args.requests} requests, medians of {args.repeats} interleaved runs")  # fmt: skip
    print_table(title, header, rows)
    steady = {mode: [run[args.concurrency :] for run in runs_] for mode, runs_ in samples.items()}
    pooled = {"steady": pooled_ratios(steady), "all": pooled_ratios(samples)}
    for part, what in (("steady", "after the opening burst"), ("all", "every request")):
        print_pooled(f"Pooled over the runs, {what}: each mode / in-process", pooled[part])
    payload = {"args": vars(args), "engine_flags": ENGINE_FLAGS, "runs": runs,
               "ratios": ratios, "pooled": pooled,
               "ttft_ms": {mode: [[round(t, 1) for t, _, _ in run] for run in mode_runs]
                           for mode, mode_runs in samples.items()}}  # fmt: skip
    write_json(results_name("bench_serve", parser, args), payload, args.record)


if __name__ == "__main__":
    main()
