"""The engine in a process of its own (`jaxkv serve`'s layout): the same tokens as an
engine stepped in this process, a clean close, the engine's refusal of bad input, a
child that dies ending every pending stream with an error, a failed build reported as
the caller's error, and a killed server taking its engine process with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest
from test_serving import checkpoint, make_engine  # noqa: F401 (the fixture)

from jaxkv.cli import build_parser
from jaxkv.engine import SamplingParams
from jaxkv.serving.command import build_engine
from jaxkv.serving.engine_loop import EngineLoop, EngineLoopClosed
from jaxkv.serving.engine_process import EngineProcess
from jaxkv.serving.process import ServeProcess

pytestmark = pytest.mark.slow

FLAGS = ["--num-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-model-len", "128"]  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11], [20]]
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)


def serve_args(checkpoint, *extra: str):  # noqa: F811
    return build_parser().parse_args(["serve", "--model", str(checkpoint), *FLAGS, *extra])


async def _tokens(loop: EngineLoop, prompts) -> list[list[int]]:
    streams = [await loop.submit(p, sampling=SAMPLING) for p in prompts]
    tokens = []
    for stream in streams:
        got = []
        while True:
            _, output = await stream.get()
            got = output.output_token_ids
            if output.finished:
                assert output.finish_reason == "length", output
                break
        tokens.append(got)
    return tokens


@pytest.fixture(scope="module")
def engine_process(checkpoint):  # noqa: F811
    process = EngineProcess(build_engine, serve_args(checkpoint))
    yield process
    process.process.kill()


def test_a_process_engine_gives_the_in_process_tokens_and_closes(checkpoint) -> None:  # noqa: F811
    engine, _ = make_engine(checkpoint)
    expected = [o.output_token_ids for o in engine.generate(PROMPTS, SAMPLING)]
    engine.shutdown()
    process = EngineProcess(build_engine, serve_args(checkpoint))
    assert process.info == {"max_model_len": 128}
    steps = []
    loop = EngineLoop(process, on_step=steps.append)

    async def run() -> None:
        assert await _tokens(loop, PROMPTS) == expected
        with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
            await loop.submit([5, 6], sampling=SamplingParams(max_tokens=-1))
        assert await loop.call("reset_prefix_cache") is True

    asyncio.run(run())
    assert steps and sum(s.num_generated_tokens for s in steps) == 6 * len(PROMPTS)
    loop.close(grace_s=5.0, timeout_s=60)
    assert process.exitcode == 0 and loop.failure is None and loop.num_pending == 0


def test_a_dead_engine_process_ends_every_pending_stream(engine_process) -> None:
    loop = EngineLoop(engine_process)

    async def run() -> None:
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        stream = await loop.submit([5, 6, 7], sampling=long)
        engine_process.process.kill()
        while True:
            _, output = await stream.get()
            if output.finished:
                break
        assert output.finish_reason == "error" and "exited" in output.error, output
        with pytest.raises(EngineLoopClosed, match="exited"):
            await loop.submit([5], sampling=SAMPLING)

    asyncio.run(run())
    assert loop.num_pending == 0 and "code -9" in loop.failure


def test_a_failure_taking_an_event_ends_every_stream_and_the_engine(checkpoint) -> None:  # noqa: F811
    def broken_metrics(step_stats) -> None:
        raise RuntimeError("a bug in the server's metrics")

    process = EngineProcess(build_engine, serve_args(checkpoint))
    loop = EngineLoop(process, on_step=broken_metrics)

    async def run() -> None:
        stream = await loop.submit([5, 6, 7], sampling=SAMPLING)
        _, output = await stream.get()
        assert output.finished and output.finish_reason == "error", output
        assert "metrics" in output.error

    asyncio.run(run())
    process.join(60)
    assert process.exitcode is not None and loop.num_pending == 0


def test_a_build_error_is_the_callers_and_leaves_nothing_running(checkpoint, tmp_path) -> None:  # noqa: F811
    args = serve_args(checkpoint)
    args.model = str(tmp_path / "missing")
    started = time.monotonic()
    with pytest.raises((ValueError, OSError), match="missing"):
        EngineProcess(build_engine, args)
    assert time.monotonic() - started < 120


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(300)
def test_a_killed_server_takes_its_engine_process_with_it(checkpoint) -> None:  # noqa: F811
    server = ServeProcess(checkpoint, *FLAGS)
    try:
        (engine_pid,) = [p for p in _children(server.proc.pid) if _is_engine(p)]
    finally:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    deadline = time.monotonic() + 60
    while _alive(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.1)


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose (its parent is dead: init reaps it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
