"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 3, "the README has a usage, a hybrid and an engine example"
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


def test_readme_hybrid_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], str(README), "exec"), namespace)
    lines = out.getvalue().splitlines()
    config = namespace["config"]
    # 12 layers, 2 global: 5 sliding groups and 1 global group of 2 layers, 2 tensor slots;
    # 8 GiB over 2 slots of 64 KiB pages (bf16, 8 heads x 128, block 16).
    assert len(config.kv_cache_groups) == 6 and len(config.kv_cache_tensors) == 2
    assert config.num_blocks == (8 << 30) // (2 * 64 * 1024) == 65536
    # Per request at 16384 tokens: 5 x (ceil((1023 + 2048) / 16) + 1) sliding pages and
    # 1024 global pages.
    concurrency = 65536 / (5 * 193 + 1024)
    assert lines[0] == (
        f"KV cache size: {int(concurrency * 16384):,} tokens, maximum concurrency for "
        f"16,384 tokens per request: {concurrency:.2f}x"
    )
    assert lines[1] == "16 16"


def test_readme_engine_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[2], str(README), "exec"), namespace)
    outputs, engine = namespace["outputs"], namespace["engine"]
    assert all(1 <= len(o.output_token_ids) <= 8 for o in outputs)  # type: ignore[attr-defined]
    assert engine.stats.prefix_hit_rate > 0  # type: ignore[attr-defined]
    lines = out.getvalue().splitlines()
    assert lines[-2].endswith(("'length'", "'stop'", "length", "stop"))
    assert "prefix_hit_rate" in lines[-1]
