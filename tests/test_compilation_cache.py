"""XLA's persistent compilation cache: a second process compiles nothing the first did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.device.compilation_cache import ENV_VAR, resolve_compilation_cache_dir

REPO = Path(__file__).resolve().parent.parent

SERVE = """
import json, time
from jaxkv.device import compilation_cache_hits, compilation_count
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs
model = TinyCausalLM(tiny_configs()["gemma-style-tiny"])  # before the engine turns it on
base, base_hits = compilation_count(), compilation_cache_hits()
start = time.perf_counter()
engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=2))
programs = engine.warm_up()
warm_up_s = time.perf_counter() - start
(out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
compiled = compilation_count() - base - (compilation_cache_hits() - base_hits)
print(json.dumps({"compiled": compiled, "tokens": out.output_token_ids,
                  "programs": programs, "warm_up_s": warm_up_s,
                  "cache": str(engine.compilation_cache_dir)}))
"""


def serve(env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_run_compiles_nothing_the_first_compiled(tmp_path) -> None:
    env = dict(os.environ, **{ENV_VAR: str(tmp_path / "xla")})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cold = serve(env)
    assert cold["cache"] == str(tmp_path / "xla") and cold["compiled"] >= cold["programs"] > 0
    assert any((tmp_path / "xla").iterdir())
    warm = serve(env)
    assert warm["compiled"] == 0, "every program came from the cache"
    assert warm["programs"] == cold["programs"]
    assert warm["tokens"] == cold["tokens"]


def test_cache_dir_settings(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "from-env"))
    assert resolve_compilation_cache_dir("auto") == tmp_path / "from-env"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_compilation_cache_dir("auto") == tmp_path / "xdg" / "jaxkv" / "xla"
    assert resolve_compilation_cache_dir("none") is None
    assert resolve_compilation_cache_dir(None) is None
    assert resolve_compilation_cache_dir(str(tmp_path / "d")) == tmp_path / "d"
    with pytest.raises(TypeError, match="compilation_cache_dir"):
        resolve_compilation_cache_dir(3)  # type: ignore[arg-type]
