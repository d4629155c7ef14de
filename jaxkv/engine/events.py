"""The engine's KV events: each data rank's, handed to its publisher and kept for
`LLMEngine.take_kv_events`.

Invariants: a rank's events go out in the order they happened, its device pool's before
its host tier's of the same step; the stepping thread only takes the deferred records
(`take_events(deferred=True)`) and queues them (`EventPublisher.publish`): the
publishing thread builds, encodes and sends them. With events off they are dropped as
they are taken, so nothing piles up.
"""

from __future__ import annotations

import jax

from jaxkv._checks import check_int
from jaxkv.engine.config import EngineConfig
from jaxkv.engine.offload import HostOffload
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_events import DeferredKVCacheEvent, KVCacheEvent, build_events
from jaxkv.kv_events_publisher import EventPublisher, EventPublisherFactory, KVEventsConfig

__all__ = ["EngineEvents", "make_publishers"]


def make_publishers(c: EngineConfig, num_ranks: int) -> list[EventPublisher]:
    """One publisher per data rank when `kv_events_endpoint` is set, else none (and none
    on processes other than 0: process 0 publishes every rank's events). A publisher
    that cannot open its sockets raises ValueError, the ones already opened shut down."""
    if c.kv_events_endpoint is None or jax.process_index() != 0:
        return []
    events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=c.kv_events_endpoint,
        replay_endpoint=c.kv_events_replay_endpoint,
        topic=c.kv_events_topic,
        int_block_hashes=c.kv_events_int_block_hashes,
        redact_prompts=c.kv_events_redact_prompts,
        hwm=int(c.kv_events_hwm),
        buffer_steps=int(c.kv_events_buffer_steps),
        max_queue_size=int(c.kv_events_max_queue_size),
        replay_hwm=int(c.kv_events_replay_hwm),
    )
    publishers: list[EventPublisher] = []
    try:
        for rank in range(num_ranks):
            publishers.append(EventPublisherFactory.create(events_config, rank))
    except ValueError:
        for publisher in publishers:
            publisher.shutdown()
        raise
    return publishers


class EngineEvents:
    """Takes each rank's pending events and hands them on (see the module docstring)."""

    def __init__(
        self,
        managers: list[KVCacheManager],
        offloads: list[HostOffload],
        publishers: list[EventPublisher],
        *,
        recorded: bool,
        keep: bool,
    ) -> None:
        """`recorded`: the managers record events (an endpoint or `keep`); `keep`: they
        are kept for `take`."""
        self.managers, self.offloads, self.recorded = managers, offloads, recorded
        self.publishers = publishers  # read at each `publish`: the engine's may be replaced
        # Each rank's events kept for `take` (None: not kept).
        self.kept: list[list[KVCacheEvent | DeferredKVCacheEvent]] | None = (
            [[] for _ in managers] if keep else None
        )

    def publish(self) -> None:
        """Hand each rank's pending KV events (its device pool's, then its host tier's) to
        its publisher's queue and, when kept, keep them for `take`; otherwise (events
        off, or processes other than 0 without publishers) they are dropped."""
        offloads, publishers, kept = self.offloads, self.publishers, self.kept
        if not self.recorded and not publishers:
            for offload in offloads:  # events off: nothing records them (dropped)
                offload.tier.take_events()
            return
        for rank, manager in enumerate(self.managers):
            events = manager.take_events(deferred=True)  # built by the publishing thread
            if offloads:
                events += offloads[rank].tier.take_events()
            if not events:
                continue
            if publishers:
                publishers[rank].publish(events)
            if kept is not None:
                kept[rank] += events

    def take(self, data_rank: int) -> list[KVCacheEvent]:
        """Data rank `data_rank`'s kept events since the last call, built, in order."""
        if self.kept is None:
            raise ValueError(
                "take_kv_events needs EngineConfig(enable_kv_cache_events=True) (the events "
                "are not kept otherwise)"
            )
        data_rank = check_int("data_rank", data_rank, min_value=0, max_value=len(self.kept) - 1)
        events, self.kept[data_rank] = self.kept[data_rank], []
        return build_events(events)

    def shutdown(self) -> None:
        """Flush and close the publishers."""
        for publisher in self.publishers:
            publisher.shutdown()
