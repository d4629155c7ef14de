"""Call a test module's function in a fresh Python with 8 simulated CPU devices.

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts,
so multi-device checks run in a subprocess and the rest of the suite keeps its single
CPU device. The function receives its arguments as strings and returns JSON data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_MARK = "RESULT "


def call_on_8_devices(module: str, function: str, *args: object, timeout: float = 900) -> Any:
    """`module.function(*args)` (args as strings) run under 8 devices; its JSON result."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    paths = [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
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
