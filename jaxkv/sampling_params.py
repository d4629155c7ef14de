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

__all__ = ["RequestOutputKind", "SamplingParams"]


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

    Sampling is greedy when `temperature == 0` (jaxkv's default; vLLM's is 1.0);
    `top_k=0` and `top_p=1.0` disable those filters (`top_k=-1`, vLLM's other "disabled",
    is stored as 0); `seed=None` draws from the engine's seed and the request's arrival
    number; any other int is the seed, except -1, which means None as in vLLM. The
    request stops after `max_tokens` outputs, on an EOS token of the model (unless
    `ignore_eos`), or on any of `stop_token_ids` (kept in the output, as vLLM does for
    stop token ids). `output_kind` says what `LLMEngine.step` streams for it
    (`RequestOutputKind`; vLLM's default, `CUMULATIVE`).

    As in vLLM, `skip_reading_prefix_cache` left at None becomes True exactly when
    `prompt_logprobs` is requested (a prefix-cache hit would skip the prompt positions
    whose logprobs are asked for).

    Integer fields accept numpy integers, and float fields numpy floats and integers (a
    bool is neither); once built, every field holds Python values (ints, floats, a tuple
    of ints).
    """

    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return _bad(name, getattr(self, name), allowed)

        max_tokens = as_int(self.max_tokens)
        if max_tokens is None or max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        temperature = _as_float(self.temperature)
        if temperature is None or not (math.isfinite(temperature) and temperature >= 0):
            raise bad("temperature", "a finite float >= 0 (0 means greedy)")
        top_k = as_int(self.top_k)
        if top_k is None or top_k < -1:
            raise bad("top_k", "an int >= -1 (0 and -1 disable top-k)")
        top_p = _as_float(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise bad("top_p", "a float in (0, 1] (1 disables top-p)")
        seed = None if self.seed is None else as_int(self.seed)
        if seed is None and self.seed is not None:
            raise bad("seed", "None or an int (-1 means None)")
        stop = self.stop_token_ids
        if isinstance(stop, int | str | bytes) or not isinstance(stop, Sequence | set | frozenset):
            raise bad("stop_token_ids", "a sequence of token ids >= 0")
        stop_token_ids = []
        for given in stop:
            token_id = as_int(given)
            if token_id is None or token_id < 0:
                raise bad("stop_token_ids", "a sequence of token ids >= 0")
            stop_token_ids.append(token_id)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        prompt_logprobs = None if self.prompt_logprobs is None else as_int(self.prompt_logprobs)
        if self.prompt_logprobs is not None and (prompt_logprobs is None or prompt_logprobs < 0):
            raise bad("prompt_logprobs", "None or an int >= 0")
        if self.skip_reading_prefix_cache is not None and not isinstance(
            self.skip_reading_prefix_cache, bool
        ):
            raise bad("skip_reading_prefix_cache", "None or a bool")
        eos_token_id = None if self.eos_token_id is None else _check_eos(self.eos_token_id)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        for name, value in (
            ("max_tokens", max_tokens),
            ("temperature", temperature),
            ("top_k", 0 if top_k == -1 else top_k),  # -1: vLLM's other "disabled"
            ("top_p", top_p),
            ("seed", None if seed == -1 else seed),  # -1: vLLM's "no seed"
            ("stop_token_ids", tuple(stop_token_ids)),
            ("prompt_logprobs", prompt_logprobs),
            ("eos_token_id", eos_token_id),
        ):
            object.__setattr__(self, name, value)
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache", self.prompt_logprobs is not None)

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
