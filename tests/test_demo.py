"""The demo (examples/demo.py) runs end to end in quick mode and its checks hold."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("jaxkv_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_quick_demo_serves_everything_correctly(demo) -> None:
    summary = demo.main(["--quick"])
    assert summary["dense_check"] == "OK", summary["dense_mismatched"]
    assert summary["finished"] == summary["requests"] > 0
    assert summary["prefix_cache_hit_rate"] > 0
    assert summary["preemptions"] > 0, "the quick run is sized so the pool runs dry"
    assert summary["compilations"] <= summary["compile_bound"]
    assert summary["steps_compiling"] < summary["steps"] // 2, "most steps must compile nothing"
    assert summary["num_free_blocks"] == summary["num_blocks"] - 1, "every block came back"


def test_dense_reference_depends_on_the_context(demo) -> None:
    """A degenerate model (say, one echoing its input) would pass the dense check vacuously."""
    cfg = demo.Config()
    params = demo.init_params(cfg, seed=0)
    forward = demo.make_dense_forward(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab, cfg.max_model_len).astype(np.int32)
    changed = tokens.copy()
    changed[:64] = rng.integers(1, cfg.vocab, 64)
    before, after = np.asarray(forward(params, tokens)), np.asarray(forward(params, changed))
    assert (before[64:] != after[64:]).mean() > 0.5, "later tokens must depend on earlier ones"
    assert (before != tokens).mean() > 0.9, "the model must not echo its input"
