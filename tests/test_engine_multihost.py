"""One engine over 2 processes (`jax.distributed`, loopback coordinator, 4 simulated CPU
devices each) gives the tokens of 1 process over 8 devices.

The workload of `test_engine_sharding` (shared prefixes, chunked prefill, a pool small
enough to preempt, Gemma-3-style sliding-window layers; LLaVA-style images, freed blocks
zeroed) runs on a 4x2 `(data, model)` mesh whose data ranks live on both processes. Also:
a process killed mid-run makes the other exit with an error naming it within the
timeout; processes started with different settings are refused at start, naming the
setting; `jaxkv generate` runs over 2 processes from the command line. Faults through
the command (issue 38): a duplicate `--process-id`, a killed process 0 or 1, a taken
coordinator port, bad timeouts and ports each end every surviving process with status
1 (2 for bad input) and one last `jaxkv: error:` line naming the process and the cause.

Every process is a subprocess of the test (`python this_file.py SCENARIO ...`), bounded by
a timeout; the multi-process runs use `--distributed-timeout`-sized bounds, never a hang.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from eight_devices import simulated_devices_env

REPO = Path(__file__).resolve().parent.parent
MAX_LEN = 48
MESH = (4, 2)  # (data, model): 4 data ranks, 2 on each process
TIMEOUT_S = 10  # --distributed-timeout of the runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(devices: int) -> dict[str, str]:
    env = simulated_devices_env(devices)
    env["JAXKV_COMPILATION_CACHE"] = "none"
    return env


def _start(args: list[str], devices: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], env=_env(devices), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output; kills what is left after `timeout` seconds in all."""
    deadline, logs = time.monotonic() + timeout, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0] + "\n(killed by the test: it ran past its timeout)")
    return logs


def _workload():
    import numpy as np

    rng = np.random.default_rng(0)
    systems = [rng.integers(3, 255, 12).tolist() for _ in range(2)]
    return [systems[i % 2] + rng.integers(3, 255, int(rng.integers(2, 20))).tolist()
            for i in range(8)]  # fmt: skip


def _config(**overrides):
    from jaxkv.engine import EngineConfig

    settings = dict(
        block_size=4, num_blocks=34, max_num_seqs=4, max_num_batched_tokens=16,
        max_model_len=MAX_LEN, long_prefill_token_threshold=6, compilation_cache_dir="none",
    )  # fmt: skip
    return EngineConfig(**{**settings, **overrides})


def serve(work: str, out: str, distributed: list[str]) -> None:
    """Scenario `serve`: the workload on the 4x2 mesh; process 0 (or the only one)
    writes the tokens, every process its host-side counters."""
    import dataclasses

    import jax
    import numpy as np

    from jaxkv.engine import multihost

    if distributed:
        address, n, pid = distributed
        multihost.initialize(multihost.DistributedConfig(address, int(n), int(pid), TIMEOUT_S))
    from jaxkv.device import make_mesh
    from jaxkv.engine import LLMEngine, SamplingParams
    from jaxkv.models import load_model

    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh(*MESH, jax.devices())
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    gemma = LLMEngine(load_model(Path(work) / "gemma3", mesh=mesh), _config(), mesh=mesh)
    llava_model = load_model(Path(work) / "llava", mesh=mesh)
    n_img = llava_model.num_image_tokens
    llava_config = _config(num_blocks=48, encoder_cache_size=2 * n_img, zero_freed_blocks=True)
    llava = LLMEngine(llava_model, llava_config, mesh=mesh)
    result: dict = {}
    if jax.process_index() == 0:
        outputs = gemma.generate(_workload(), sampling)
        result["tokens"] = [o.output_token_ids for o in outputs]
        gemma.shutdown()
        image_token = llava_model.llava_config.image_token_id
        size = llava_model.llava_config.vision.image_size
        pictures = [np.random.default_rng(s).standard_normal((3, size, size)).astype(np.float32)
                    for s in (5, 6)]  # fmt: skip
        prompts = [[3, 4, 5 + i, image_token, 7, 8] for i in range(5)]
        images = [[pictures[i % 2]] for i in range(5)]
        outputs = llava.generate(prompts, sampling, images=images)
        result["image_tokens"] = [o.output_token_ids for o in outputs]
        llava.shutdown()
    else:
        gemma.follow()
        llava.follow()
    for name, engine in (("gemma", gemma), ("llava", llava)):
        result[name] = {
            "steps": engine.num_steps, "preemptions": engine.num_preemptions,
            "free_blocks": engine.num_free_blocks, "ranks": len(engine.schedulers),
            "prefix_hit_rate": engine.stats.prefix_hit_rate,
            "encoded": engine.runner.num_encoded,
            "owners": sorted({d.process_index for d in engine.mesh.devices.flat}),
            "cache_spec": str(engine.runner.kv_cache.sharding.spec),
        }  # fmt: skip
    result["config"] = dataclasses.asdict(gemma.config)
    Path(out).write_text(json.dumps(result))
    if distributed:
        multihost.shutdown()


def _save_checkpoints(work: Path) -> None:
    from jaxkv.models import save_random_checkpoint, tiny_configs

    save_random_checkpoint(work / "gemma3", tiny_configs()["gemma3-tiny"], seed=3)
    save_random_checkpoint(work / "llava", tiny_configs()["llava-tiny"], seed=3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("multihost")
    _save_checkpoints(work)
    return work


def _two_processes(scenario: str, work: Path, extra: list[list[str]] | None = None):
    port = _free_port()
    return [
        _start([__file__, scenario, str(work), str(work / f"{scenario}.p{i}.json"),
                f"127.0.0.1:{port}", "2", str(i), *(extra[i] if extra else [])], 4)
        for i in range(2)
    ]  # fmt: skip


def test_two_processes_give_the_tokens_of_one(checkpoints: Path) -> None:
    procs = _two_processes("serve", checkpoints)
    procs.append(_start([__file__, "serve", str(checkpoints), str(checkpoints / "one.json")], 8))
    logs = _finish(procs, 600)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    one = json.loads((checkpoints / "one.json").read_text())
    p0, p1 = (json.loads((checkpoints / f"serve.p{i}.json").read_text()) for i in range(2))
    assert p0["tokens"] == one["tokens"] and p0["image_tokens"] == one["image_tokens"]
    assert all(len(t) == 8 for t in p0["tokens"] + p0["image_tokens"])
    for name in ("gemma", "llava"):
        # the host state of both processes is the single process's: same steps, same
        # preemptions, the same pools freed again
        assert p0[name] == {**one[name], "owners": [0, 1]}, name
        assert p1[name] == p0[name], name
        assert (
            p0[name]["ranks"] == 4
            and p0[name]["free_blocks"]
            == 4 * (one["config"]["num_blocks"] if name == "gemma" else 48) - 4
        )  # block 0 of each rank is its null block
    assert one["gemma"]["preemptions"] > 0 and one["gemma"]["prefix_hit_rate"] > 0
    assert one["llava"]["encoded"] == 2


def serve_until_killed(work: str, out: str, address: str, n: str, pid: str) -> None:
    """Scenario `kill`: process 0 serves round after round (printing `ROUND` after each)
    until process 1 is killed; the watchdog must then end it."""
    import jax

    from jaxkv.engine import multihost

    multihost.initialize(multihost.DistributedConfig(address, int(n), int(pid), TIMEOUT_S))
    from jaxkv.device import make_mesh
    from jaxkv.engine import LLMEngine, SamplingParams
    from jaxkv.models import load_model

    mesh = make_mesh(*MESH, jax.devices())
    engine = LLMEngine(load_model(Path(work) / "gemma3", mesh=mesh), _config(), mesh=mesh)
    if jax.process_index() != 0:
        engine.follow()
        return
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        for _ in range(1000):
            engine.generate(_workload()[:2], sampling)
            print("ROUND", flush=True)
    except multihost.DistributedError as error:
        multihost.exit_now(error)  # as `jaxkv generate` does


def test_a_killed_process_ends_the_other_with_an_error(checkpoints: Path) -> None:
    p0, p1 = procs = _two_processes("kill", checkpoints)
    try:
        lines = iter(p0.stdout.readline, "")
        assert any(line.strip() == "ROUND" for line in lines), "process 0 never served"
        p1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        log = p0.communicate(timeout=6 * TIMEOUT_S)[0]
        elapsed = time.monotonic() - killed
    finally:
        _finish(procs, 1)
    assert p0.returncode not in (0, None)
    assert "process 1 stopped" in log and "--distributed-timeout" in log, log[-3000:]
    assert elapsed < 3 * TIMEOUT_S, elapsed


def slices(work: str, out: str, address: str, n: str, pid: str) -> None:
    """Scenario `slices`: the weights on a 1x8 mesh (the model axis over both processes),
    counting the checkpoint bytes this process reads; an engine with KV events on it."""
    import jax
    from flax import nnx

    from jaxkv.engine import multihost

    multihost.initialize(multihost.DistributedConfig(address, int(n), int(pid), TIMEOUT_S))
    from jaxkv.device import make_mesh
    from jaxkv.engine import LLMEngine
    from jaxkv.models import checkpoint, load_model

    read_bytes = [0]
    place = checkpoint.CheckpointReader._place

    def counting(self, shape, spec, units, read):
        def counted(index):
            block = read(index)
            read_bytes[0] += block.nbytes
            return block

        return place(self, shape, spec, units, counted)

    checkpoint.CheckpointReader._place = counting
    mesh = make_mesh(1, 8, jax.devices())
    model = load_model(Path(work) / "gemma3", mesh=mesh)
    engine = LLMEngine(model, _config(kv_events_endpoint="inproc://multihost-events"), mesh=mesh)
    cache = engine.runner.kv_cache
    result = {
        "read_bytes": read_bytes[0],
        "param_bytes": sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))),
        "cache_local_shards": len(cache.addressable_shards),
        "cache_fully_addressable": cache.is_fully_addressable,
        "publisher_ranks": [p.data_parallel_rank for p in engine.kv_event_publishers],
        "ranks": len(engine.schedulers),
    }  # fmt: skip
    Path(out).write_text(json.dumps(result))
    if jax.process_index() == 0:
        engine.shutdown()
    else:
        engine.follow()
    multihost.shutdown()


def test_each_process_reads_only_its_slices_and_publishes_nothing(checkpoints: Path) -> None:
    """Item 2 and 4: with the model axis over both processes each reads about half of the
    split weights (never all of them); the KV cache is allocated with its global sharding
    (4 local shards of 8); process 0 publishes every data rank's KV events (each publisher
    stamped with its `data_parallel_rank`), process 1 none."""
    procs = _two_processes("slices", checkpoints)
    logs = _finish(procs, 300)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    p0, p1 = (json.loads((checkpoints / f"slices.p{i}.json").read_text()) for i in range(2))
    whole = p0["param_bytes"]
    for p in (p0, p1):
        assert p["read_bytes"] < 0.8 * whole, (p, whole)
        assert p["cache_local_shards"] == 4 and not p["cache_fully_addressable"]
    assert p0["read_bytes"] + p1["read_bytes"] >= whole
    assert p0["publisher_ranks"] == list(range(p0["ranks"])) and p0["ranks"] > 1
    assert p1["publisher_ranks"] == []


def _generate(work: Path, *flags: str) -> list[str]:
    return ["-m", "jaxkv", "generate", "--model", str(work / "gemma3"),
            "--prompt-token-ids", "5,6,7,8,9", "--max-tokens", "4", "--max-model-len", "32",
            "--json", "--data-parallel-size", "2", "--tensor-parallel-size", "4",
            "--num-blocks", "16", "--compilation-cache", "none", *flags]  # fmt: skip


def _cli_processes(work: Path, flags: list[list[str]], devices: int = 4):
    port = _free_port()
    return [
        _start(_generate(work, "--coordinator-address", f"127.0.0.1:{port}",
                         "--num-processes", str(len(flags)), "--process-id", str(i),
                         "--distributed-timeout", str(TIMEOUT_S), *extra), devices)
        for i, extra in enumerate(flags)
    ]  # fmt: skip


def test_generate_over_two_processes_from_the_command_line(checkpoints: Path) -> None:
    procs = [*_cli_processes(checkpoints, [[], []]), _start(_generate(checkpoints), 8)]
    logs = _finish(procs, 600)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    (two,), (one,) = (
        [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")] for log in logs[::2]
    )
    assert not [ln for ln in logs[1].splitlines() if ln.startswith("{")], "only process 0 prints"
    assert two["output_token_ids"] == one["output_token_ids"] and len(one["output_token_ids"]) == 4


def test_processes_with_different_flags_are_refused_at_start(checkpoints: Path) -> None:
    procs = _cli_processes(checkpoints, [[], ["--max-num-seqs", "4"]])
    logs = _finish(procs, 120)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 1, log[-3000:]
        assert "started with different settings: --max-num-seqs is" in log, log[-3000:]
        assert "'8' on process 0" in log and "'4' on process 1" in log, log[-3000:]


def test_a_process_that_never_joins_ends_the_other_with_an_error(checkpoints: Path) -> None:
    port = _free_port()  # process 0 of 2; process 1 never starts
    p0 = _start(_generate(checkpoints, "--coordinator-address", f"127.0.0.1:{port}",
                          "--num-processes", "2", "--process-id", "0",
                          "--distributed-timeout", "5"), 4)  # fmt: skip
    start = time.monotonic()
    (log,) = _finish([p0], 120)
    assert p0.returncode == 1, log[-3000:]
    assert "did not all join the coordinator" in log and "within 5 s" in log, log[-3000:]
    assert time.monotonic() - start < 60


class _Output:
    """A process's merged output, read on a thread, so that a test can wait for a line
    with a bound; `ended` is when the output closed (the process ended)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.ended = proc, [], None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
        self.ended = time.monotonic()

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.ended is None:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.2)
        return any(text in line for line in self.lines)

    def finish(self, deadline: float) -> str:
        """The whole output, once the process ended (killed at `deadline`, monotonic)."""
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.lines.append("\n(killed by the test: it ran past its timeout)")
        self._thread.join(10)
        return "".join(self.lines)


def _error_line(log: str) -> str:
    """The last line of a failed process's output, checked to be its only error line."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("jaxkv: error: ")]
    assert errors == lines[-1:], log[-3000:]
    return errors[0]


def _long_run(work: Path, port: int, pid: int) -> list[str]:
    """`jaxkv generate` as process `pid` of 2: minutes of decoding on this machine."""
    return _generate(
        work, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", str(pid), "--distributed-timeout", str(TIMEOUT_S),
        "--max-tokens", "480", "--max-model-len", "512", "--num-blocks", "160",
    )  # fmt: skip


def _running_job(work: Path, port: int) -> tuple[list[subprocess.Popen], list[_Output]]:
    procs = [_start(_long_run(work, port, pid), 4) for pid in (0, 1)]
    outputs = [_Output(p) for p in procs]
    if not outputs[0].wait_for("KV cache:", 300):  # the engine is built: the job runs
        _finish(procs, 1)
        pytest.fail("the job never ran:\n" + "".join(outputs[0].lines)[-3000:])
    return procs, outputs


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_duplicate_process_id_ends_every_process_naming_it(checkpoints: Path) -> None:
    """A second `--process-id 1` while the job runs: JAX's coordination service ends every
    process of the job (it gives no way to refuse the newcomer alone); each ends with
    status 1 and one error line naming the duplicate, none later than the newcomer's own
    `--distributed-timeout` bound (it was a SIGABRT with a C++ trace in process 1, a
    missing heartbeat in process 0)."""
    port = _free_port()
    procs, outputs = _running_job(checkpoints, port)
    try:
        procs.append(_start(_long_run(checkpoints, port, 1), 4))
        outputs.append(_Output(procs[-1]))
        deadline = time.monotonic() + 300
        logs = [out.finish(deadline) for out in outputs]
    finally:
        _finish(procs, 1)
    lines = [_error_line(log) for log in logs]
    assert [p.returncode for p in procs] == [1, 1, 1], lines
    for pid, line in enumerate(lines[:2]):
        assert line.startswith(f"jaxkv: error: process {pid}: a second process with "
                               "--process-id 1 tried to join the running job"), line  # fmt: skip
    assert lines[2].startswith("jaxkv: error: process 1: the 2 processes did not all join")
    assert "--process-id 1 was already in a running job (a duplicate" in lines[2]
    assert max(out.ended for out in outputs[:2]) < outputs[2].ended + 5


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_command_ends_the_other_with_an_error(checkpoints: Path, killed: int) -> None:
    """`jaxkv generate` of process `killed` gets SIGKILL mid-run: its worker dies with it,
    and the other process ends within `--distributed-timeout` with status 1 and one line
    naming the lost process (with process 0 gone it was a SIGABRT and a C++ trace)."""
    procs, outputs = _running_job(checkpoints, _free_port())
    try:
        time.sleep(2)
        workers = _children(procs[killed].pid)
        assert len(workers) == 1, workers  # the command supervises one worker
        procs[killed].kill()
        start = time.monotonic()
        survivor = outputs[1 - killed]
        log = survivor.finish(start + 6 * TIMEOUT_S)
        elapsed = survivor.ended - start
        time.sleep(2)
        assert not _children(procs[killed].pid) and not Path(f"/proc/{workers[0]}").exists()
    finally:
        _finish(procs, 1)
    assert procs[1 - killed].returncode == 1, log[-3000:]
    why = "the coordinator (process 0) stopped answering" if killed == 0 else (
        "process 1 stopped (no heartbeat)")  # fmt: skip
    assert _error_line(log).startswith(f"jaxkv: error: process {1 - killed}: {why}"), log[-3000:]
    assert elapsed < TIMEOUT_S + 5, elapsed


@pytest.mark.slow
def test_a_taken_coordinator_port_ends_process_0_with_an_error(checkpoints: Path) -> None:
    """Another listener on the coordinator's port: exit 2 before JAX starts (it was a
    SIGSEGV after gRPC's "Failed to add port")."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        p0 = _start(_long_run(checkpoints, port, 0), 4)
        (log,) = _finish([p0], 120)
    assert p0.returncode == 2, log[-3000:]
    assert _error_line(log).startswith(
        f"jaxkv: error: --coordinator-address '127.0.0.1:{port}': port {port} is taken"
    )


@pytest.mark.slow
def test_bad_timeouts_and_ports_exit_2_naming_the_flag(checkpoints: Path) -> None:
    """Before any process joins: exit 2 and one line naming the flag (1e12 was a TypeError
    traceback, inf an OverflowError, ports 0 and 99999 "did not all join")."""
    port = _free_port()
    cases = {"--distributed-timeout": ["1e12", "inf"],  # nan, 0, < 0: the fast tests
             "--coordinator-address": ["127.0.0.1:0", "127.0.0.1:99999"]}  # fmt: skip
    runs = [(flag, value) for flag, values in cases.items() for value in values]
    procs = [_start(_long_run(checkpoints, port, 1) + [flag, value], 4) for flag, value in runs]
    logs = _finish(procs, 120)
    for (flag, value), p, log in zip(runs, procs, logs, strict=True):
        assert p.returncode == 2, (flag, value, log[-3000:])
        assert _error_line(log).startswith(f"jaxkv: error: {flag}"), (value, log[-3000:])


if __name__ == "__main__":
    scenario, rest = sys.argv[1], sys.argv[2:]
    if scenario == "serve":
        serve(rest[0], rest[1], rest[2:])
    else:
        {"kill": serve_until_killed, "slices": slices}[scenario](*rest)
