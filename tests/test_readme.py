"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_example(marker: str) -> tuple[dict[str, object], list[str]]:
    """Run the README's one Python example that contains `marker`; its namespace and stdout."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one README example containing {marker!r}"
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(matching[0], str(README), "exec"), namespace)
    return namespace, out.getvalue().splitlines()


def test_readme_usage_example_runs():
    namespace, lines = _run_example("jaxkv.KVCacheManager.from_spec")
    # req-0 misses; req-1 hits the 64-token system prompt and shares its 4 blocks.
    assert lines[0].startswith("req-0 cached: 0 blocks: ([1, 2, 3, 4, 5],)")
    assert lines[1].startswith("req-1 cached: 64 blocks: ([1, 2, 3, 4, 6],)")
    manager = namespace["manager"]
    # Only req-0 is still held after the example frees req-1: 5 of 1023 blocks.
    assert manager.num_free_blocks == 1023 - 5  # type: ignore[attr-defined]


def test_readme_hybrid_example_runs():
    namespace, lines = _run_example("jaxkv.get_kv_cache_config")
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
    namespace, lines = _run_example("LLMEngine")
    outputs = namespace["outputs"]
    assert [len(out.output_token_ids) for out in outputs] == [8, 8]  # type: ignore[attr-defined]
    # The first prompt fills the 64-token step budget; the second, admitted a step later,
    # reads the 64-token system prompt from the cache.
    assert [out.num_cached_tokens for out in outputs] == [0, 64]  # type: ignore[attr-defined]
    # The request added afterwards reads the 64-token system prompt from the cache.
    assert namespace["out"].num_cached_tokens == 64  # type: ignore[attr-defined]
    streamed = [line for line in lines if line.startswith(f"{namespace['rid']} ")]
    assert streamed and streamed[-1].split()[-1] in ("length", "stop")
    assert all(line.split()[-1] == "None" for line in streamed[:-1])
