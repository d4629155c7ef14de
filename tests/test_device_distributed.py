"""Two processes on localhost join one JAX distributed runtime (CPU, gloo collectives).

Each process has 2 CPU devices; the 4 global devices form one mesh, the cache
is sharded across both processes (KV heads over the model axis, blocks over a data
axis, or blocks over every device under attention data parallelism), one step
(write + attention), a block copy and zeroing run on it, and the result must
equal this (single-process, single-device) run.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from eight_devices import simulated_devices_env

REPO = Path(__file__).resolve().parent.parent
MESHES = {  # name: (data, model, kv_heads, group, data ranks after planning)
    "heads_across_processes": (1, 4, 4, 2, 1),
    "data_across_processes": (2, 2, 2, 2, 2),
    # 2 KV heads on a model axis of 4: attention data parallelism, one rank per device
    "attention_dp_across_processes": (1, 4, 2, 2, 4),
}


def _worker(process_id: int, port: int, seed: int, out_dir: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
    )
    from test_device_sharding import run_layout

    from jaxkv.device import make_mesh

    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    assert jax.local_device_count() == 2
    results = {}
    for name, (data, model, heads, group, _) in MESHES.items():
        mesh = make_mesh(data, model)
        owners = {d.process_index for d in mesh.devices.flat}
        assert owners == {0, 1}, f"mesh {name} must span both processes, spans {owners}"
        metrics, arrays = run_layout(
            mesh, num_kv_heads=heads, group=group, policy="auto", seed=seed
        )
        results[name] = metrics
        np.savez(Path(out_dir) / f"{name}.p{process_id}.npz", **arrays)
    (Path(out_dir) / f"metrics.p{process_id}.json").write_text(json.dumps(results))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_match_single_process(tmp_path: Path) -> None:
    from test_device_sharding import run_layout

    from jaxkv.device import make_mesh

    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    port = _free_port()
    env = simulated_devices_env(2)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(seed), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed (seed {seed}):\n{logs[i][-4000:]}"

    for name, (_data, model, heads, group, dp) in MESHES.items():
        for i in range(2):
            metrics = json.loads((tmp_path / f"metrics.p{i}.json").read_text())[name]
            assert (metrics["dp"], metrics["model"], metrics["replication"]) == (dp, model, 1)
            # each worker also ran the same batches on one of its own devices
            assert metrics["out_diff"] <= 1e-6 and metrics["kv_diff"] == 0.0, (name, metrics)
            assert metrics["kv_nan_match"] and metrics["padded_rows_zero"], (name, metrics)
            assert metrics["ref_err"] < 1e-5, (name, metrics)
        if dp == 1:  # one batch: this process can replay it on its single device
            _, want = run_layout(
                make_mesh(1, 1), num_kv_heads=heads, group=group, policy="auto", seed=seed
            )
            for i in range(2):
                got = np.load(tmp_path / f"{name}.p{i}.npz")
                np.testing.assert_allclose(got["out"], want["out"], rtol=0, atol=1e-6)
                np.testing.assert_array_equal(got["kv"], want["kv"])
        a, b = (np.load(tmp_path / f"{name}.p{i}.npz") for i in range(2))
        np.testing.assert_array_equal(a["out"], b["out"])  # both processes see one result


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
