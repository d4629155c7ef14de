"""A new engine in a fresh process, for bench_rollouts: what rebuilding a sampler costs.

    python -m benchmarks._rebuild_engine CKPT SIZES_JSON

Times (wall clock) importing jaxkv's engine, `load_model(CKPT)`, `LLMEngine(model,
EngineConfig(**SIZES_JSON))` and `warm_up()`, whose programs come from the persistent
compilation cache where an earlier run left them (`jaxkv.device.compilation_cache`: the
same directory as the parent's, through the inherited environment). Prints one JSON
line: import_s, load_s, build_s, warm_up_s, and the programs the build and warm-up made
(from_cache: of them, loaded from the cache rather than compiled).
"""

from __future__ import annotations

import json
import sys
import time

START = time.perf_counter()

from jaxkv import models  # noqa: E402  (timed: a new process pays for these imports)
from jaxkv.device import compilation_count  # noqa: E402
from jaxkv.device.compile_guard import compilation_cache_hits  # noqa: E402
from jaxkv.engine import EngineConfig, LLMEngine  # noqa: E402


def main(path: str, sizes: dict) -> dict:
    imported = time.perf_counter()
    model = models.load_model(path)
    loaded = time.perf_counter()
    programs, hits = compilation_count(), compilation_cache_hits()
    engine = LLMEngine(model, EngineConfig(**sizes))
    built = time.perf_counter()
    engine.warm_up()
    warm = time.perf_counter()
    engine.shutdown()
    return {
        "import_s": imported - START, "load_s": loaded - imported, "build_s": built - loaded,
        "warm_up_s": warm - built, "programs": compilation_count() - programs,
        "from_cache": compilation_cache_hits() - hits,
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
