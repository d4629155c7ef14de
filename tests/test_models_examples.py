"""The model examples (examples/gemma_style.py, examples/llava_style.py) run end to end and
their engine-vs-dense checks hold."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"jaxkv_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gemma_style", "llava_style"])
def test_example_runs_and_matches_dense(name, capsys):
    assert load(name).main(["--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "engine == dense: OK" in out
    if name == "gemma_style":
        assert "KV-cache groups: 4" in out and "prefix cache: 12" in out
