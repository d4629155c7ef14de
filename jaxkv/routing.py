"""Prefix-aware placement of a new request (host only, no JAX): the engine's data-parallel
routing (`choose_data_rank` over its KV cache managers) and a router's over engines it
knows only through their KV events (`choose_engine` over a `PrefixIndex`), one scoring."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from jaxkv.hashing import ExtraKeys
from jaxkv.prefix_index import PrefixIndex

__all__ = ["choose_data_rank", "choose_engine"]

K = TypeVar("K", bound=Hashable)


def choose_data_rank(
    loads: Sequence[int], num_cached_tokens: Callable[[int], int], slack: int
) -> int:
    """The data rank for a new request: of the ranks at most `slack` unfinished requests
    above the least loaded, the one holding the longest cached prefix of it (the least
    loaded of those on a tie; the lowest rank after that).

    Prefix affinity keeps a shared prompt's requests where it is cached; the slack bounds
    how much queueing a hit may cost (a rank far busier than another would delay the
    request more than recomputing its prefix elsewhere).
    """
    least = min(loads)
    candidates = [k for k, load in enumerate(loads) if load <= least + slack]
    if len(candidates) == 1:
        return candidates[0]
    return max(candidates, key=lambda k: (num_cached_tokens(k), -loads[k], -k))


def choose_engine(
    index: PrefixIndex,
    loads: Mapping[K, int],
    token_ids: Sequence[int],
    slack: int,
    holder_of: Callable[[K], Hashable] = lambda engine: engine,
    *,
    extra_keys: Sequence[ExtraKeys] | None = None,
    cache_salt: str | None = None,
) -> K:
    """`choose_data_rank` over the engines of `loads` (in its order), each scored by the
    tokens of `token_ids` the index says it holds. `holder_of(engine)` is the index's
    `EngineRank` for an engine of `loads` (the identity when `loads` is keyed by them);
    an engine the index has not heard from holds nothing."""
    engines = list(loads)
    hits = index.longest_prefix(token_ids, extra_keys=extra_keys, cache_salt=cache_salt)
    return engines[
        choose_data_rank(
            [loads[e] for e in engines], lambda k: hits.get(holder_of(engines[k]), 0), slack
        )
    ]
