"""Call a test module's function in a fresh Python with 8 simulated CPU devices.

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts,
so multi-device checks run in a subprocess and the rest of the suite keeps its single
CPU device. The function receives its arguments as strings and returns JSON data.
`simulated_devices_env` is the environment of any such subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_MARK = "RESULT "


def simulated_devices_env(num_devices: int) -> dict[str, str]:
    """This process's environment with `num_devices` simulated CPU devices, the suite's
    other XLA flags kept (tests/conftest.py: its fast compilation, which subprocesses
    compiling the same programs need as much as the suite), the repository and tests/
    importable."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")
    )
    env = dict(
        os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}"
    )
    paths = [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def call_on_8_devices(module: str, function: str, *args: object, timeout: float = 900) -> Any:
    """`module.function(*args)` (args as strings) run under 8 devices; its JSON result."""
    env = simulated_devices_env(8)
    code = (
        f"import json, sys, {module} as m; "
        f"print({_MARK!r} + json.dumps(m.{function}(*sys.argv[1:])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{module}.{function}{args}\n{proc.stderr[-4000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK))
    return json.loads(line[len(_MARK) :])
