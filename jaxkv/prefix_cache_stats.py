"""Prefix-cache statistics: the per-step counters `KVCacheManager.make_prefix_cache_stats()`
hands out (`PrefixCacheStats`) and vLLM's windowed hit rate over them (`CachingMetrics`).

Host only, no JAX; `jaxkv.kv_cache_manager` re-exports both (where they were first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxkv._checks import check_int


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last `make_prefix_cache_stats()`.

    Requests that were preempted before are counted apart: their hits are
    re-reads of their own KV, not sharing between requests.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class CachingMetrics:
    """Prefix-cache hit rate over the most recent `max_recent_requests` requests (vLLM's).

    `observe` takes one `PrefixCacheStats` batch (`make_prefix_cache_stats()` per step).
    Invariants: `aggregated_*` are the sums over `query_queue` (one
    `(requests, queries, hits)` entry per non-empty batch, oldest first); batches are
    dropped from the old end while more than `max_recent_requests` requests are held,
    but the newest batch always stays. A batch with `reset` starts over.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        max_recent_requests = check_int("max_recent_requests", max_recent_requests, min_value=1)
        self.max_recent_requests = max_recent_requests
        self.query_queue: deque[tuple[int, int, int]] = deque()
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if not stats.requests:
            return  # an empty batch would push real ones out of the window
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.query_queue.clear()
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0

    @property
    def empty(self) -> bool:
        return not self.query_queue

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens in the window (0 when nothing was queried)."""
        if not self.aggregated_query_total:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
