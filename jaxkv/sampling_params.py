"""`SamplingParams`: how a request samples, when it stops, and what it asks of the prefix cache.

One class for the cache managers (`Request(sampling_params=...)` reads `max_tokens` and
`skip_reading_prefix_cache`) and the engine (which also reads the sampling fields), with
vLLM's field names. It is validated when built: a bad value raises ValueError naming the
field, the value and what is allowed, before any request state exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from jaxkv._checks import as_int

__all__ = [
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "MAX_MIN_TOKENS_STOPS",
    "MAX_N",
    "PROCESSED_LOGPROBS_MODES",
    "RequestOutputKind",
    "SamplingParams",
]

MAX_N = 16384  # vLLM's default `VLLM_MAX_N_SEQUENCES`
MAX_LOGPROBS = 20  # vLLM's default `max_logprobs`: the most logprobs the engine returns
# What logprobs hold (vLLM's `ModelConfig.logprobs_mode`, the engine's
# `EngineConfig.logprobs_mode`; the first is the default): log-probabilities or logits, of
# the model's raw output or of the distribution sampled from (`jaxkv.engine.sampling`).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
PROCESSED_LOGPROBS_MODES = ("processed_logprobs", "processed_logits")
# The most stop tokens (its own and the model's EOS ids) a request with `min_tokens` bans.
MAX_MIN_TOKENS_STOPS = 8
_MIN_TEMPERATURE = 0.01  # vLLM's `_MAX_TEMP`: the least positive temperature it samples at
# (name, least, greatest) of the penalties; the repetition penalty must also be > 0.
_PENALTIES = (
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
    ("repetition_penalty", 0.0, math.inf),
)


class RequestOutputKind(Enum):
    """What the engine streams for a request (vLLM's enum): every output with all tokens
    so far (`CUMULATIVE`), each output with only what is new since the last (`DELTA`),
    or nothing but the final output, with all tokens (`FINAL_ONLY`)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    vLLM 0.33's fields, meanings and checks. Sampling is greedy when `temperature == 0`
    (jaxkv's default; vLLM's is 1.0), else `temperature` is in [0.01, 2] (a smaller
    positive one is raised to 0.01, as vLLM does); `top_k=0` and `top_p=1.0` disable those
    filters (`top_k=-1`, vLLM's other "disabled", is stored as 0); `min_p` drops tokens
    less likely than `min_p` times the likeliest. `presence_penalty` and
    `frequency_penalty` (in [-2, 2]) subtract from the logits of the tokens already output
    (once, and per occurrence); `repetition_penalty` (> 0) divides the positive logits (and
    multiplies the others) of the tokens in the prompt or the output. `seed=None` draws
    from the engine's seed and the request's id; any other int is the seed, except -1,
    which means None as in vLLM. `n` (>= 1; > 1 only when sampling) outputs per prompt.

    The request stops after `max_tokens` outputs (None: until the model length), on an
    EOS token of the model (unless `ignore_eos`), on any of `stop_token_ids` (kept in the
    output, as vLLM does), or once its text holds one of the `stop` strings (cut before it
    unless `include_stop_str_in_output`); none of these stops it before `min_tokens`
    outputs (the stop tokens cannot be sampled until then). `logprobs=k` returns, per
    output token, the top-k log probabilities and the sampled token's (`prompt_logprobs`
    the same per prompt token), of the model's raw distribution unless the engine's
    `logprobs_mode` says otherwise; -1 asks for the whole
    vocabulary (which the engine refuses past its limit). `output_kind` says what
    `LLMEngine.step` streams for it (`RequestOutputKind`; vLLM's default, `CUMULATIVE`).

    As in vLLM, `skip_reading_prefix_cache` left at None becomes True exactly when
    `prompt_logprobs` is requested (a prefix-cache hit would skip the prompt positions
    whose logprobs are asked for).

    Integer fields accept numpy integers, and float fields numpy floats and integers (a
    bool is neither); once built, every field holds Python values (ints, floats, a tuple
    of ints).
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    eos_token_id: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop: str | tuple[str, ...] | None = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        values = {**self._checked_sampling(), **self._checked_stops(), **self._checked_outputs()}
        if values["n"] > 1 and values["temperature"] == 0:
            raise _bad("n", self.n, "1 when sampling greedily (temperature 0)")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache", self.prompt_logprobs is not None)

    def _checked_sampling(self) -> dict[str, Any]:
        """The sampling fields, checked and normalized (vLLM's ranges)."""
        temperature = _as_float(self.temperature)
        if temperature is None or not (math.isfinite(temperature) and 0 <= temperature <= 2):
            raise _bad("temperature", self.temperature, "a float in [0, 2] (0 means greedy)")
        top_k = as_int(self.top_k)
        if top_k is None or top_k < -1:
            raise _bad("top_k", self.top_k, "an int >= -1 (0 and -1 disable top-k)")
        top_p = _as_float(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise _bad("top_p", self.top_p, "a float in (0, 1] (1 disables top-p)")
        min_p = _as_float(self.min_p)
        if min_p is None or not 0 <= min_p <= 1:
            raise _bad("min_p", self.min_p, "a float in [0, 1] (0 disables min-p)")
        seed = None if self.seed is None else as_int(self.seed)
        if seed is None and self.seed is not None:
            raise _bad("seed", self.seed, "None or an int (-1 means None)")
        n = as_int(self.n)
        if n is None or not 1 <= n <= MAX_N:
            raise _bad("n", self.n, f"an int in [1, {MAX_N}]")
        values: dict[str, Any] = {
            # Below 0.01, vLLM raises a positive temperature to 0.01 (numerical safety).
            "temperature": max(temperature, _MIN_TEMPERATURE) if temperature else 0.0,
            "top_k": 0 if top_k == -1 else top_k,  # -1: vLLM's other "disabled"
            "top_p": top_p,
            "min_p": min_p,
            "seed": None if seed == -1 else seed,  # -1: vLLM's "no seed"
            "n": n,
        }
        for name, low, high in _PENALTIES:
            value = _as_float(getattr(self, name))
            if value is None or not (math.isfinite(value) and low <= value <= high):
                allowed = f"a float in [{low}, {high}]" if high < math.inf else "a float > 0"
                raise _bad(name, getattr(self, name), allowed)
            if name == "repetition_penalty" and value <= 0:
                raise _bad(name, getattr(self, name), "a float > 0")
            values[name] = value
        return values

    def _checked_stops(self) -> dict[str, Any]:
        """The stop fields (`max_tokens`, `min_tokens`, stop tokens and strings), checked."""
        max_tokens = None if self.max_tokens is None else as_int(self.max_tokens)
        if self.max_tokens is not None and (max_tokens is None or max_tokens < 1):
            raise _bad(
                "max_tokens", self.max_tokens, "None (up to the model length) or an int >= 1"
            )
        min_tokens = as_int(self.min_tokens)
        if min_tokens is None or min_tokens < 0 or (max_tokens and min_tokens > max_tokens):
            raise _bad("min_tokens", self.min_tokens, "an int in [0, max_tokens]")
        stop = self.stop_token_ids
        if isinstance(stop, int | str | bytes) or not isinstance(stop, Sequence | set | frozenset):
            raise _bad("stop_token_ids", stop, "a sequence of token ids >= 0")
        stop_token_ids = []
        for given in stop:
            token_id = as_int(given)
            if token_id is None or token_id < 0:
                raise _bad("stop_token_ids", stop, "a sequence of token ids >= 0")
            stop_token_ids.append(token_id)
        strings = (
            () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        )
        if not isinstance(strings, Sequence) or not all(isinstance(x, str) and x for x in strings):
            raise _bad("stop", self.stop, "None, a non-empty str or a sequence of them")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        eos_token_id = None if self.eos_token_id is None else _check_eos(self.eos_token_id)
        return {
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "stop_token_ids": tuple(dict.fromkeys(stop_token_ids)),  # vLLM drops repeats
            "stop": tuple(strings),
            "eos_token_id": eos_token_id,
        }

    def _checked_outputs(self) -> dict[str, Any]:
        """What the outputs carry: logprobs (True means 1, as in vLLM), the output kind,
        the prefix-cache switch."""
        values = {}
        for name in ("logprobs", "prompt_logprobs"):
            given = getattr(self, name)
            count = 1 if given is True else None if given is None else as_int(given)
            if given is not None and (count is None or count < -1):
                raise _bad(name, given, "None, an int >= 0, or -1 (the whole vocabulary)")
            values[name] = count
        if self.skip_reading_prefix_cache is not None and not isinstance(
            self.skip_reading_prefix_cache, bool
        ):
            raise _bad(
                "skip_reading_prefix_cache", self.skip_reading_prefix_cache, "None or a bool"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad(
                "output_kind",
                self.output_kind,
                "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)",
            )
        return values

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """vLLM's hook for a model's generation config; only `eos_token_id` is kept (checked
        as the field is, before anything changes)."""
        if eos_token_id is not None:
            object.__setattr__(self, "eos_token_id", _check_eos(eos_token_id))


def _bad(name: str, value: object, allowed: str) -> ValueError:
    """The error for field `name`: what it must be and the value given."""
    return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _as_float(value: object) -> float | None:
    """`value` as a Python float when it is a real number (a Python or numpy integer or
    float, not a bool), else None."""
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        return None
    return float(value)


def _check_eos(eos_token_id: object) -> int:
    """`eos_token_id` as a Python int token id, else the field's ValueError."""
    token_id = as_int(eos_token_id)
    if token_id is None or token_id < 0:
        raise _bad("eos_token_id", eos_token_id, "None or a token id >= 0")
    return token_id
