"""One step's `StepStats`, summed over the data ranks, as `LLMEngine` records them.

Invariant: every count is the step's (the schedule's outputs, the token updates, the
prefix-cache and host-tier counters taken since the last step), summed over the ranks;
`kv_usage` is the ranks' mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxkv.engine.scheduler import Scheduler, SchedulerOutput, TokenUpdates
from jaxkv.engine.stats import StepStats
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["step_stats"]


def step_stats(
    step: int,
    outs: Sequence[SchedulerOutput],
    updates: Sequence[TokenUpdates],
    schedulers: Sequence[Scheduler],
    managers: Sequence[KVCacheManager],
    host: Mapping[str, int],
    *,
    host_s: float,
    wait_s: float,
    compilations: int,
) -> StepStats:
    """Step `step`'s stats: `outs` its schedule (one per rank), `updates` the token
    updates it applied, `host` the host tiers' counters (`EngineTiers.take_stats`),
    `host_s` / `wait_s` the host's work and its wait for the device, `compilations` the
    programs it compiled. Takes the managers' prefix-cache counters."""
    prefix = [m.make_prefix_cache_stats() for m in managers]
    return StepStats(
        step=step,
        num_scheduled_tokens=sum(o.num_scheduled_tokens for o in outs),
        num_scheduled_requests=sum(len(o.scheduled) for o in outs),
        num_running=sum(len(s.running) for s in schedulers),
        num_waiting=sum(len(s.waiting) for s in schedulers),
        num_loading=sum(len(s.loading) for s in schedulers),
        num_generated_tokens=sum(len(u.requests) for u in updates),
        prefix_queries=sum(p.queries + p.preempted_queries for p in prefix),
        prefix_hits=sum(p.hits + p.preempted_hits for p in prefix),
        encoder_hits=sum(o.num_encoder_hits for o in outs),
        encoder_misses=sum(o.num_encoder_misses for o in outs),
        kv_usage=sum(m.usage for m in managers) / len(managers),
        num_preemptions=sum(len(o.preempted_request_ids) for o in outs),
        num_freed_blocks=sum(int(o.freed_block_ids.size) for o in outs),
        host_s=host_s,
        wait_s=wait_s,
        compilations=compilations,
        **{f"host_{name}": value for name, value in host.items()},
    )
