"""Differential test: jaxkv's `SamplingParams` checks, penalties and stop strings against
vLLM 0.33's (`tests/sampling_vllm_driver.py` under `REPO_ROOT/.venv-vllm/bin/python`, in
a subprocess; skipped when that environment is absent)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.engine.outputs import OutputStream
from jaxkv.engine.sampling import apply_penalties
from jaxkv.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "sampling_vllm_driver.py"

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON.exists(), reason=f"no vLLM peer environment at {PEER_PYTHON}"
)

# Every kwargs set is explicit about temperature (jaxkv's default is 0, vLLM's 1).
PARAMS = [
    dict(temperature=1.0, n=2), dict(temperature=0.0, n=2), dict(temperature=1.0, n=0),
    dict(temperature=2.5), dict(temperature=-0.1), dict(temperature=0.001), dict(temperature=2.0),
    dict(temperature=1.0, presence_penalty=2.0), dict(temperature=1.0, presence_penalty=2.1),
    dict(temperature=1.0, frequency_penalty=-2.5), dict(temperature=1.0, repetition_penalty=0.0),
    dict(temperature=1.0, repetition_penalty=float("inf")), dict(temperature=1.0, min_p=1.5),
    dict(temperature=1.0, min_p=-0.1), dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.0, max_tokens=None), dict(temperature=1.0, max_tokens=0),
    dict(temperature=1.0, min_tokens=5, max_tokens=4), dict(temperature=1.0, min_tokens=-1),
    dict(temperature=1.0, min_tokens=4, max_tokens=None), dict(temperature=1.0, logprobs=-1),
    dict(temperature=1.0, logprobs=-2), dict(temperature=1.0, logprobs=True),
    dict(temperature=1.0, prompt_logprobs=-1), dict(temperature=1.0, prompt_logprobs=-3),
    dict(temperature=1.0, stop="ab"), dict(temperature=1.0, stop=["x", ""]),
    dict(temperature=1.0, stop_token_ids=[3, 4, 3]), dict(temperature=1.0, top_k=-1),
    dict(temperature=1.0, top_k=-2), dict(temperature=1.0, top_p=0.0),
    dict(temperature=1.0, seed=-1),
    dict(temperature=1.0, prompt_logprobs=0),
]  # fmt: skip

PENALTIES = [
    dict(logits=[1.0, -2.0, 3.0, 0.5, -0.5, 2.0], prompt=[0, 1, 1], output=[2, 2, 4, 2],
         presence=0.5, frequency=0.25, repetition=1.3),
    dict(logits=[0.1, 0.2, -0.3, 4.0], prompt=[3], output=[], presence=-1.0, frequency=1.0,
         repetition=0.7),
    dict(logits=[2.0, -1.0, 0.0], prompt=[], output=[1, 1, 1, 0], presence=2.0, frequency=-2.0,
         repetition=1.0),
]  # fmt: skip

# (text, new_char_count, stop, include_in_output) for `check_stop_strings`.
STOPS = [
    ("hello world", 3, ["wor", "ld"], False), ("hello world", 3, ["wor", "ld"], True),
    ("hello world", 1, ["wor"], False), ("abcabc", 2, ["ca", "bc"], False),
    ("abcabc", 6, ["c"], True), ("xyz", 1, ["q"], False),
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm() -> dict:
    cases = {"params": PARAMS, "penalties": PENALTIES, "stops": STOPS}
    done = subprocess.run(
        [str(PEER_PYTHON), str(DRIVER)], input=json.dumps(cases), capture_output=True,
        text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_sampling_params_accept_and_refuse_as_vllm(vllm) -> None:
    for kwargs, want in zip(PARAMS, vllm["params"], strict=True):
        try:
            got = SamplingParams(**kwargs)
        except ValueError:
            assert not want["ok"], (kwargs, "vLLM accepts it")
            continue
        assert want["ok"], (kwargs, want["error"])
        assert got.temperature == pytest.approx(want["temperature"]), kwargs
        assert (got.top_k, got.seed) == (max(want["top_k"], 0), want["seed"]), kwargs
        assert list(got.stop) == want["stop"] and list(got.stop_token_ids) == want["stop_token_ids"]
        assert (got.logprobs, got.prompt_logprobs) == (want["logprobs"], want["prompt_logprobs"])
        assert got.skip_reading_prefix_cache == want["skip_reading_prefix_cache"], kwargs


def test_penalties_on_a_logits_row_match_vllm(vllm) -> None:
    for case, want in zip(PENALTIES, vllm["penalties"], strict=True):
        vocab = len(case["logits"])
        counts = np.bincount(case["output"], minlength=vocab)[None]
        seen = np.zeros((1, vocab), bool)
        seen[0, case["prompt"]] = True
        got = apply_penalties(
            jnp.asarray([case["logits"]], jnp.float32), jnp.asarray(counts), jnp.asarray(seen),
            *(jnp.asarray([case[k]], jnp.float32) for k in ("presence", "frequency", "repetition")),
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6, atol=1e-6)


class _Chars:
    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, token_ids: list[int]) -> str:
        return self.text[: len(token_ids)]


def test_stop_strings_match_vllm(vllm) -> None:
    for (text, new, stops, include), want in zip(STOPS, vllm["stops"], strict=True):
        # One character a token: the text before this token is all but `new` characters.
        stream = OutputStream.for_params(
            SamplingParams(stop=stops, include_stop_str_in_output=include)
        )
        tokenizer = _Chars(text)
        stream.match_stop(list(range(len(text) - new)), tokenizer)
        got = stream.match_stop(list(range(len(text))), tokenizer)
        if want is None:
            assert got is None, (text, stops)
            continue
        stop, truncate_to = want
        assert got == stop and stream.stop_reason == stop
        assert stream.text_end == (len(text) if truncate_to == -1 else truncate_to)
