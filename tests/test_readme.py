"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "the README has one usage example"
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), namespace)
    lines = out.getvalue().splitlines()
    # req-0 misses; req-1 hits the 64-token system prompt and shares its 4 blocks.
    assert lines[0].startswith("req-0 cached: 0 blocks: ([1, 2, 3, 4, 5],)")
    assert lines[1].startswith("req-1 cached: 64 blocks: ([1, 2, 3, 4, 6],)")
    manager = namespace["manager"]
    # Only req-0 is still held after the example frees req-1: 5 of 1023 blocks.
    assert manager.num_free_blocks == 1023 - 5  # type: ignore[attr-defined]
