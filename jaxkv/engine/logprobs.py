"""Logprobs on the host: vLLM's `Logprob` and the per-position dictionaries built from a
step's logprob arrays (`jaxkv.engine.sampling.gather_logprobs`, fetched once per step).

A position's dictionary is vLLM's: the token's own entry (its logprob and rank) first,
then the top `num` tokens with ranks 1..num (a top token that is the token itself keeps
the top entry, as in vLLM). Values are what `EngineConfig.logprobs_mode` says: by
default the model's raw log-probabilities (vLLM's "raw_logprobs"), before temperature,
penalties or any filter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["HostLogprobs", "Logprob", "position_logprobs"]


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's logprob of one token at one position: its value, its rank (1: the
    likeliest) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


Decode = Callable[[int], str | None]


def position_logprobs(
    top_ids: list[int], top_values: list[float], token: int, value: float, rank: int,
    num: int, decode: Decode,
) -> dict[int, Logprob]:  # fmt: skip
    """One position's dictionary: `token`'s entry, then the first `num` top entries."""
    entries = {token: Logprob(value, rank, decode(token))}
    for i in range(num):
        entries[top_ids[i]] = Logprob(top_values[i], i + 1, decode(top_ids[i]))
    return entries


@dataclass(frozen=True)
class HostLogprobs:
    """One step's logprob arrays on the host, each `(top ids [N, K], top values [N, K],
    token values [N], token ranks [N])`: of the sampled tokens (`sampled`, rows as the
    sampled tokens') and of every token row's next prompt token (`prompt`); None where
    the step computed none."""

    sampled: tuple[np.ndarray, ...] | None
    prompt: tuple[np.ndarray, ...] | None

    @classmethod
    def fetch(
        cls, arrays: Mapping[str, tuple], to_host: Callable[[object], np.ndarray]
    ) -> HostLogprobs | None:
        """The step's `arrays` (by name, on device) brought to the host with `to_host`
        (waits for them); None when it has none."""
        if not arrays:
            return None
        got = {name: tuple(to_host(a) for a in values) for name, values in arrays.items()}
        return cls(got.get("logprobs"), got.get("prompt_logprobs"))

    def position(
        self, prompt: bool, row: int, token: int, num: int, decode: Decode
    ) -> dict[int, Logprob]:
        """The dictionary of `token` at row `row` of the `prompt` arrays (the token row
        before the prompt token) or the `sampled` ones (the token sampled there)."""
        ids, values, token_values, ranks = self.prompt if prompt else self.sampled
        return position_logprobs(
            ids[row].tolist(), values[row].tolist(), token, float(token_values[row]),
            int(ranks[row]), num, decode,
        )  # fmt: skip
