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
from typing import Any

import numpy as np

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Sampling is greedy when `temperature == 0` (jaxkv's default; vLLM's is 1.0);
    `top_k=0` and `top_p=1.0` disable those filters; `seed=None` draws from the
    engine's seed and the request's arrival number. The request stops after
    `max_tokens` outputs, on an EOS token of the model (unless `ignore_eos`), or on any
    of `stop_token_ids` (kept in the output, as vLLM does for stop token ids).

    As in vLLM, `skip_reading_prefix_cache` left at None becomes True exactly when
    `prompt_logprobs` is requested (a prefix-cache hit would skip the prompt positions
    whose logprobs are asked for).
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

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}"
            )

        def is_int(value: object) -> bool:
            return not isinstance(value, bool | np.bool_) and isinstance(value, int | np.integer)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.temperature, int | float) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise bad("temperature", "a finite float >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 disables top-k)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a float in (0, 1] (1 disables top-p)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise bad("seed", "None or an int >= 0")
        stop = self.stop_token_ids
        if isinstance(stop, int | str | bytes) or not isinstance(stop, Sequence | set | frozenset):
            raise bad("stop_token_ids", "a sequence of token ids >= 0")
        if any(not is_int(t) or t < 0 for t in stop):
            raise bad("stop_token_ids", "a sequence of token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "None or an int >= 0")
        if self.skip_reading_prefix_cache is not None and not isinstance(
            self.skip_reading_prefix_cache, bool
        ):
            raise bad("skip_reading_prefix_cache", "None or a bool")
        if self.eos_token_id is not None and (
            not is_int(self.eos_token_id) or self.eos_token_id < 0
        ):
            raise bad("eos_token_id", "None or a token id >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache", self.prompt_logprobs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """vLLM's hook for a model's generation config; only `eos_token_id` is kept."""
        if eos_token_id is not None:
            object.__setattr__(self, "eos_token_id", eos_token_id)
