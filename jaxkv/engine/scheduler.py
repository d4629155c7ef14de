"""Continuous-batching scheduler over the KV cache manager and the encoder cache (host only).

One `schedule()` call plans one device step; `update_from_output()` applies the tokens the
step sampled. Pure Python + numpy: no JAX, so host benchmarks and tests drive it directly.

It uses only vLLM's `KVCacheManager` API (`get_computed_blocks`, `allocate_slots`,
`free`, `get_blocks`, `block_pool.get_num_free_blocks`, `max_model_len`,
`coordinator.scheduler_block_size`) and request attributes both `jaxkv.Request` and vLLM's `Request`
have, so the same class drives jaxkv's manager and vLLM's (benchmarks/bench_host.py). A
request's `status` is set to the members of its own `RequestStatus` enum, found by name.
jaxkv extensions are used only where present: freed block ids
(`track_freed_block_ids=True`), and whether any group turns blocks into the null block
(`coordinator.skipping_managers`; assumed with vLLM's manager). Partial-hit page copies
(`take_kv_cache_block_copies`, vLLM's) go into the step's output; their retained
blocks are released at once, as the step that runs the copies is executed before any
later step can reuse them.

Rules, in the order `schedule()` applies them:

* Running requests first, oldest first, each getting the tokens it has not computed yet
  (a prefill chunk, or one decode token) within the step's token budget. When the pool
  cannot give a request its slots, the newest running request is preempted (its blocks
  are freed, it is recomputed later, mostly from the prefix cache) until the request
  fits or is itself preempted.
* Host-tier loads whose staging has finished are taken (`HostOffload.take_loads`):
  they go with this step, scattered before its forward, and their requests run from
  the next step on; a request whose load failed verification (or staging) goes back to
  the front of `waiting` without its blocks and is recomputed from its device prefix
  hit, not looking the tier up again.
* Waiting requests are admitted, oldest first, from their longest cached prefix, while
  requests (running and loading together at most `max_num_seqs`), tokens and blocks
  last; none in a step that had to preempt. A request whose whole remaining chunk
  cannot fit the free blocks is not looked up (no cache query). With a host tier, a
  request whose prefix continues there is allocated its blocks with the tier's tokens
  as connector tokens (`num_external_computed_tokens`, caching delayed) and moves to
  `loading` (`WAITING_FOR_REMOTE_KVS`): it computes nothing and takes no token budget
  until its load is taken.
* Multimodal items: a chunk that reaches an item's placeholders needs the item's encoder
  output. A cached item (`EncoderCacheManager`) is shared, a new one is encoded once
  within the per-step encoder compute budget; the chunk is cut before an item that cannot
  be scheduled now.
* Preemption picks victims among running requests only: a request waiting for its load
  is not running (as in vLLM) and keeps its blocks until its load is taken; its load
  always ends (taken or failed) within the steps its staging takes, after which it can
  be preempted like any running request.
* A step's tokens are counted as computed when it is scheduled. A chunk that reaches the
  end of a request's tokens samples one token; until `update_from_output` appends it, it
  is *pending*, and the request's next decode step reads it from the previous step's
  device output. So the next step can be scheduled while the device still runs the
  current one (the engine's overlap); stop conditions are checked on appended tokens only.

The step's data (`SchedulerConfig`, `SchedulerOutput`, `ScheduledRequest`,
`TokenUpdates`, `FinishReason`) is `jaxkv.engine.scheduler_output`, re-exported here.

Block tables travel as changes, as in vLLM's `SchedulerOutput`: a scheduled request
carries the block ids its step's allocation added per KV-cache group (`new_block_ids`,
what `allocate_slots` returned) and, where blocks left an attention window, how many
leading blocks are now the null block (`num_null_blocks`); a new or resumed request
carries its whole block lists instead (`resets_row`). A model runner that applies them
to one persistent row per request, and releases the rows of `preempted_request_ids`
and `finished_request_ids`, holds exactly `kv_cache_manager.get_block_ids(request_id)`
for every running request.

Invariants (checked by tests/test_engine_scheduler_stateful.py): the blocks held in the
pool are exactly those of the running and loading requests; a finished, aborted or
preempted request holds no block and no encoder-cache entry, and no load; every request
is in exactly one of `waiting`, `loading`, `running`, or none (finished); a loading
request has exactly one load in its `HostOffload` (`HostOffload.loading`), and the
blocks a load writes belong to that request alone (allocated to it, not cached until
the load is taken, so no other request's hit reaches them before they hold their KV).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxkv.blocks import KVCacheBlock
from jaxkv.encoder_cache_manager import EncoderBudget, EncoderCacheManager
from jaxkv.engine.offload import HostOffload, LoadBatch
from jaxkv.engine.scheduler_output import (
    FinishReason,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    TokenUpdates,
)
from jaxkv.kv_cache_manager import KVCacheBlocks, KVCacheManager
from jaxkv.request import Request
from jaxkv.sampling_params import SamplingParams

__all__ = [
    "FinishReason",
    "TokenUpdates",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]


@dataclass(slots=True)
class _Tracked:
    """The scheduler's record of an unfinished request. Its status is the request's own
    `status` (the one record of it: waiting, waiting for its load, running, preempted,
    finished)."""

    request: Request
    stop_token_ids: frozenset[int]
    num_pending: int = 0  # sampled tokens in flight, not yet appended
    arrival: int = 0
    held_inputs: set[int] = field(default_factory=set)
    # Its host-tier load failed: its next admission does not look the tier up.
    skip_host_tier: bool = False
    # Per KV-cache group, the leading null blocks of its lists as last reported; None:
    # its row must be reset (new, or resumed after preemption).
    num_null_blocks: list[int] | None = None

    @property
    def running(self) -> bool:
        return self.request.status.name == "RUNNING"


def stop_token_ids_for(
    sampling: SamplingParams, eos_token_ids: Iterable[int] = ()
) -> frozenset[int]:
    """The tokens that end a request sampled with `sampling`: its `stop_token_ids` and,
    unless `ignore_eos`, the model's `eos_token_ids` and its own `eos_token_id`. With
    `Request.max_tokens` and the model length, what `Scheduler.update_from_output` (the
    one place a request's stop is decided) stops it at."""
    stop = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop.update(eos_token_ids)
        if sampling.eos_token_id is not None:
            stop.add(int(sampling.eos_token_id))
    return frozenset(stop)


# `ScheduledRequest`'s (new_block_ids, num_null_blocks, resets_row).
_BlockChanges = tuple[tuple[list[int], ...], tuple[int, ...], bool]
_NO_BLOCK_CHANGES: _BlockChanges = ((), (), False)  # the rows stay as they are

# The `RequestStatus` member each finish reason sets (vLLM's names; jaxkv's enum has one
# `FINISHED`).
_FINISHED_STATUS = {
    FinishReason.LENGTH: "FINISHED_LENGTH_CAPPED",
    FinishReason.STOP: "FINISHED_STOPPED",
    FinishReason.ABORT: "FINISHED_ABORTED",
    FinishReason.ERROR: "FINISHED_ERROR",
}


def _num_leading_nulls(blocks: Sequence[KVCacheBlock], start: int = 0) -> int:
    """The leading null blocks of `blocks`, the first `start` known to be null."""
    k = start
    while k < len(blocks) and blocks[k].is_null:
        k += 1
    return k


# (status enum, name) -> the member `_set_status` sets: the enum's `name`, else its
# `FINISHED`.
_STATUS_MEMBERS: dict[tuple[type, str], enum.Enum] = {}


def _set_status(request: Request, name: str) -> None:
    """Set the member `name` of the request's own status enum (jaxkv's or vLLM's)."""
    key = (type(request.status), name)
    member = _STATUS_MEMBERS.get(key)
    if member is None:
        statuses = key[0]
        member = statuses[name] if name in statuses.__members__ else statuses["FINISHED"]
        _STATUS_MEMBERS[key] = member
    request.status = member


class Scheduler:
    """Waiting/running queues, token budget, chunked prefill, prefix caching, preemption.

    `kv_cache_manager`: a jaxkv `KVCacheManager`, or vLLM's (the methods used are vLLM's).
    `with_block_ids=False` leaves `ScheduledRequest.new_block_ids` empty (a host-only
    simulation needs no block tables). `offload`: a host-memory KV tier
    (`jaxkv.engine.offload.HostOffload`, this rank's): an admitted request's blocks
    after its device prefix hit are looked up there and allocated as connector tokens,
    the request waiting in `loading` until its load goes with a step
    (`kv_load_block_ids`); a freed request's cached blocks are offered to it.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        config: SchedulerConfig,
        *,
        encoder_cache_manager: EncoderCacheManager | None = None,
        encoder_budget: EncoderBudget | None = None,
        with_block_ids: bool = True,
        offload: HostOffload | None = None,
    ) -> None:
        if (encoder_cache_manager is None) != (encoder_budget is None):
            raise ValueError("give both encoder_cache_manager and encoder_budget, or neither")
        if config.max_model_len > kv_cache_manager.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_model_len={config.max_model_len} exceeds the KV cache "
                f"manager's max_model_len={kv_cache_manager.max_model_len}"
            )
        self.kv_cache_manager = kv_cache_manager
        self.config = config
        self.encoder_cache_manager = encoder_cache_manager
        self.encoder_budget = encoder_budget
        # Partial-hit copies (jaxkv's and vLLM's managers have them).
        self.takes_block_copies = hasattr(kv_cache_manager, "take_kv_cache_block_copies")
        self.track_freed_blocks = getattr(
            kv_cache_manager.block_pool, "track_freed_block_ids", False
        )
        self.with_block_ids = with_block_ids
        self.offload = offload
        # Whether a running request's leading blocks may turn into the null block.
        self.blocks_turn_null = bool(
            getattr(kv_cache_manager.coordinator, "skipping_managers", True)
        )
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Admitted, waiting for their host-tier loads (WAITING_FOR_REMOTE_KVS), by id.
        self.loading: dict[str, Request] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._num_arrivals = 0
        self._finished_ids: list[str] = []  # since the last `schedule()`
        self._preempted_ids: list[str] = []  # preempted outside `schedule()`, since then
        self.num_preemptions = 0
        # Over all admissions (a preempted request counts again when readmitted): tokens
        # of the admitted requests, and how many of them the prefix cache or host tier served.
        self.num_admitted_tokens = 0
        self.num_admitted_hit_tokens = 0

    # -- requests ---------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """ValueError if `request` can never be served here (nothing changes)."""
        if request.request_id in self._tracked:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        limit = self.config.max_model_len
        if request.num_tokens >= limit:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_tokens} tokens; it "
                f"must have fewer than max_model_len={limit} to leave room for an output"
            )
        if request.mm_features:
            if self.encoder_budget is None:
                raise ValueError(
                    f"request {request.request_id!r} has multimodal inputs but this scheduler "
                    "has no encoder cache (the model takes text only)"
                )
            self.encoder_budget.check_admission(request)

    def add_request(self, request: Request, stop_token_ids: Iterable[int] = ()) -> None:
        """Queue a new request; stops after `request.max_tokens` outputs or a stop token."""
        self.check_request(request)
        _set_status(request, "WAITING")
        self._tracked[request.request_id] = _Tracked(
            request, frozenset(stop_token_ids), arrival=self._num_arrivals
        )
        self._num_arrivals += 1
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request:
        """Finish an unfinished request now; KeyError naming it when it is unknown."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request:
        """Finish a waiting, loading or running request now with `reason` (its blocks and
        encoder entries are freed, a load it waits for is discarded; a token of it still
        in flight is dropped); KeyError naming it when it is unknown."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        self._finish(tracked, reason)
        return tracked.request

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    def get_request(self, request_id: str) -> Request | None:
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.request

    def num_pending_tokens(self, request_id: str) -> int:
        return self._tracked[request_id].num_pending

    # -- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step; allocates its slots and encoder-cache entries."""
        # As vLLM's scheduler: a hit on a Mamba state cached during this step waits a step.
        self.kv_cache_manager.new_step_starts()
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.encoder_budget.compute_budget if self.encoder_budget else 0
        lookahead = self.config.num_lookahead_tokens
        allocate_slots = self.kv_cache_manager.allocate_slots
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        counts = [0, 0]  # encoder hits, misses
        # Oldest first. A preemption removes the newest running request, never one before
        # the current one: iterating `running` as it shrinks visits each survivor once.
        for request in self.running:
            if budget <= 0:
                break
            tracked = self._tracked[request.request_id]
            step = self._plan(tracked, request.num_computed_tokens, budget, encoder_budget)
            if step is None:
                continue
            num_new = step.num_new_tokens
            while (
                new_blocks := allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            ) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                if step.encoder_input_ids:
                    encoder_budget -= self._commit_encoder_inputs(step, counts)
                scheduled.append(self._advance(tracked, step, new_blocks))
                budget -= num_new
                continue
            self._release_planned(request, step.encoder_input_ids)
            break
        # Before admitting: the loads admitted in this call are taken by a later one.
        loads = self._take_loads() if self.loading else None
        if not preempted:
            self._admit(scheduled, budget, encoder_budget, counts)
        freed_blocks = (
            self.kv_cache_manager.take_freed_block_ids()
            if self.track_freed_blocks
            else np.zeros(0, np.int32)
        )
        freed_mm = (
            self.encoder_cache_manager.get_freed_mm_hashes() if self.encoder_cache_manager else []
        )
        if self._preempted_ids:
            preempted, self._preempted_ids = self._preempted_ids + preempted, []
        out = SchedulerOutput(scheduled, preempted, freed_blocks, freed_mm, *counts)
        if self._finished_ids:
            out.finished_request_ids, self._finished_ids = self._finished_ids, []
        if loads is not None:
            out.kv_load_block_ids, out.kv_load_blocks = loads.block_ids, loads.blocks
            out.kv_load_layers = loads.layers
        if self.takes_block_copies:
            copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
            if copies:
                out.kv_cache_block_copies = copies
            # The copies run when this step is executed, before any later step could write
            # into a block released here: the retained endpoints are released now.
            if retained:
                self.kv_cache_manager.block_pool.free_blocks(retained)
        return out

    def _admit(
        self, scheduled: list[ScheduledRequest], budget: int, encoder_budget: int, counts: list
    ) -> None:
        manager = self.kv_cache_manager
        block_size = manager.coordinator.scheduler_block_size
        max_num_seqs = self.config.max_num_seqs
        while self.waiting and len(self.running) + len(self.loading) < max_num_seqs and budget > 0:
            request = self.waiting[0]
            tracked = self._tracked[request.request_id]
            if tracked.num_pending:
                break  # preempted while its last step was in flight: wait for that token
            if manager.block_pool.get_num_free_blocks() < -(
                -min(request.num_tokens, budget) // block_size
            ):
                break  # cheap pre-check, so hopeless attempts do not count as cache lookups
            hit_blocks, num_hits, shared_prefix_boundary = manager.get_computed_blocks(request)
            request.shared_prefix_boundary = shared_prefix_boundary
            num_host = 0
            if self.offload is not None and not (
                tracked.skip_host_tier or request.skip_reading_prefix_cache
            ):
                num_host = self.offload.lookup(request, num_hits)
            if num_host:
                if not self._admit_loading(tracked, hit_blocks, num_hits, num_host):
                    break
                continue
            step = self._plan(tracked, num_hits, budget, encoder_budget)
            if step is None:
                self._cancel_load(request)
                break
            num_new = step.num_new_tokens
            new_blocks = manager.allocate_slots(
                request,
                num_new,
                num_hits,
                hit_blocks,
                num_lookahead_tokens=self.config.num_lookahead_tokens,
            )
            if new_blocks is None:
                self._release_planned(request, step.encoder_input_ids)
                self._cancel_load(request)
                break
            if self.offload is not None:  # its lookup found nothing: no load starts
                self.offload.admitted(request, manager.get_blocks(request.request_id).blocks)
            self._admitted(tracked, num_hits, 0)
            _set_status(request, "RUNNING")
            self.running.append(request)
            if step.encoder_input_ids:
                encoder_budget -= self._commit_encoder_inputs(step, counts)
            scheduled.append(self._advance(tracked, step, new_blocks))
            budget -= num_new

    def _admit_loading(
        self, tracked: _Tracked, hit_blocks: KVCacheBlocks, num_hits: int, num_host: int
    ) -> bool:
        """Admit the first waiting request, whose `num_host` tokens after its `num_hits`
        device hit the host tier holds, into `loading`: its blocks are allocated, the
        tier's tokens as connector tokens, their caching delayed until the load is taken
        (no other request may hit them before they hold their KV); no token is computed
        now. False (nothing changed): the pool has too few free blocks."""
        request = tracked.request
        manager = self.kv_cache_manager
        new_blocks = manager.allocate_slots(
            request,
            0,
            num_hits,
            hit_blocks,
            num_external_computed_tokens=num_host,
            delay_cache_blocks=True,
        )
        if new_blocks is None:
            self._cancel_load(request)
            return False
        self.offload.admitted(request, manager.get_blocks(request.request_id).blocks)
        self._admitted(tracked, num_hits, num_host)
        _set_status(request, "WAITING_FOR_REMOTE_KVS")
        self.loading[request.request_id] = request
        return True

    def _admitted(self, tracked: _Tracked, num_hits: int, num_host: int) -> None:
        """The first waiting request leaves `waiting` with its hits computed."""
        request = tracked.request
        self.waiting.popleft()
        tracked.skip_host_tier = False
        self.num_admitted_tokens += request.num_tokens
        self.num_admitted_hit_tokens += num_hits + num_host
        request.num_computed_tokens = num_hits + num_host
        if not request.num_preemptions:  # its first admission (or a failed load's retry)
            request.num_cached_tokens = num_hits + num_host
            request.num_external_cached_tokens = num_host

    def _take_loads(self) -> LoadBatch:
        """Take the finished loads: a loaded request runs from the next step (its blocks,
        scattered before this step's forward, are cached now); one whose load failed is
        freed and goes back to the front of `waiting`, to be recomputed from its device
        prefix hit without the tier."""
        loads = self.offload.take_loads()
        for request_id in loads.loaded:
            request = self.loading.pop(request_id)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            _set_status(request, "RUNNING")
            self.running.append(request)
        for request_id in reversed(loads.failed):
            request = self.loading.pop(request_id)
            tracked = self._tracked[request_id]
            self._free_blocks(request)
            request.num_computed_tokens = 0
            tracked.skip_host_tier = True
            _set_status(request, "PREEMPTED" if request.num_preemptions else "WAITING")
            self.waiting.appendleft(request)
        return loads

    def _cancel_load(self, request: Request) -> None:
        if self.offload is not None:
            self.offload.cancel(request)

    def _plan(
        self, tracked: _Tracked, start: int, budget: int, encoder_budget: int
    ) -> ScheduledRequest | None:
        """The request's share of a step from `start` computed tokens: the tokens to
        compute and the encoder inputs they need, its block changes left empty (see
        `_advance`); None: nothing now.

        Cached encoder entries the chunk needs are referenced here (so planning the rest
        cannot evict them); `_release_planned` undoes that when the slots are refused.
        """
        request = tracked.request
        config = self.config
        num_tokens = request.num_tokens
        # Its tokens from `start` on, the sampled ones still in flight included.
        num_unscheduled = num_tokens - start + tracked.num_pending
        num_new = num_unscheduled  # capped below by the budget, the model length, a chunk
        if num_new > budget:
            num_new = budget
        if num_new > config.max_model_len - start:
            num_new = config.max_model_len - start
        cap = config.long_prefill_token_threshold
        if cap and num_new > cap:
            num_new = cap
        if num_new <= 0:
            return None
        samples = num_new == num_unscheduled
        if samples and request.num_output_tokens + tracked.num_pending >= request.max_tokens:
            return None  # its last token is in flight; the update will finish it
        manager = self.encoder_cache_manager
        if manager is None or not request.mm_features:  # the hot path: a text request
            return ScheduledRequest(request, start, num_new, num_tokens, samples)
        inputs: list[int] = []
        end = start + num_new
        held = manager.get_cached_input_ids(request)
        embeds_to_schedule = 0
        for input_id, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.offset + feature.length <= start or input_id in held:
                continue
            if manager.check_and_update_cache(request, input_id):
                inputs.append(input_id)
                continue
            if any(request.mm_features[j].identifier == feature.identifier for j in inputs):
                inputs.append(input_id)  # a repeat within this chunk: encoded once
                continue
            num_embeds = request.get_num_encoder_embeds(input_id)
            if num_embeds <= encoder_budget and manager.can_allocate(
                request, input_id, encoder_budget, embeds_to_schedule
            ):
                inputs.append(input_id)
                encoder_budget -= num_embeds
                embeds_to_schedule += num_embeds
                continue
            end = feature.offset  # cut the text before an item that cannot run now
            break
        if end <= start:
            self._release_planned(request, inputs)
            return None
        return ScheduledRequest(
            request, start, end - start, num_tokens, end - start == num_unscheduled, tuple(inputs)
        )

    def _release_planned(self, request: Request, inputs: Sequence[int]) -> None:
        manager = self.encoder_cache_manager
        if manager is None:
            return
        held = manager.get_cached_input_ids(request)
        for input_id in inputs:
            if input_id in held:
                manager.free_encoder_input(request, input_id)

    def _commit_encoder_inputs(self, step: ScheduledRequest, counts: list) -> int:
        """Reference or allocate each input `step` planned, leaving in its
        `encoder_input_ids` those to encode; return their embeddings."""
        manager = self.encoder_cache_manager
        request = step.request
        tracked = self._tracked[request.request_id]
        encoded = 0
        to_encode = []
        for input_id in step.encoder_input_ids:
            tracked.held_inputs.add(input_id)
            if input_id in manager.get_cached_input_ids(request) or manager.check_and_update_cache(
                request, input_id
            ):
                counts[0] += 1
                continue
            manager.allocate(request, input_id)
            encoded += request.get_num_encoder_embeds(input_id)
            to_encode.append(input_id)
            counts[1] += 1
        step.encoder_input_ids = tuple(to_encode)
        return encoded

    def _advance(
        self, tracked: _Tracked, step: ScheduledRequest, new_blocks: KVCacheBlocks
    ) -> ScheduledRequest:
        """Schedule `step` (`_plan`'s) once `allocate_slots` gave its slots, returning
        `new_blocks`: its tokens count as computed, a token it samples as pending, and it
        gets its block changes. Returns `step`."""
        if self.with_block_ids:
            step.new_block_ids, step.num_null_blocks, step.resets_row = self._block_changes(
                tracked, new_blocks
            )
        step.request.num_computed_tokens = step.num_computed_tokens + step.num_new_tokens
        if step.samples:
            tracked.num_pending += 1
        return step

    def _block_changes(self, tracked: _Tracked, new_blocks: KVCacheBlocks) -> _BlockChanges:
        """`(new_block_ids, num_null_blocks, resets_row)` of a request `allocate_slots`
        just gave its slots, returning `new_blocks` (see `ScheduledRequest`).

        Between a request's steps its lists grow at the tail by `new_blocks` and, in
        groups that release blocks (sliding window, chunked local: what a paged cache
        serves), turn leading blocks into the null block: only where that can happen
        are the lists read, from the first block not reported null.
        """
        nulls = tracked.num_null_blocks
        if nulls is None:
            lists = self._lists_of(tracked)
            tracked.num_null_blocks = [_num_leading_nulls(blocks) for blocks in lists]
            return tuple([block.block_id for block in blocks] for blocks in lists), (), True
        grew = any(new_blocks.blocks)
        new_block_ids = new_blocks.get_block_ids() if grew else ()
        if self.blocks_turn_null:
            now = [
                _num_leading_nulls(blocks, k)
                for blocks, k in zip(self._lists_of(tracked), nulls, strict=True)
            ]
            if now != nulls:
                tracked.num_null_blocks = now
                return new_block_ids, tuple(now), False
        return (new_block_ids, (), False) if grew else _NO_BLOCK_CHANGES

    def _lists_of(self, tracked: _Tracked) -> tuple[Sequence[KVCacheBlock], ...]:
        """The request's block lists per group, as the coordinator holds them (read,
        never changed)."""
        return self.kv_cache_manager.coordinator.get_blocks(tracked.request.request_id)

    def _free_blocks(self, request: Request) -> None:
        """Free the request's blocks, offering its cached ones to the host tier first."""
        if self.offload is not None:
            self.offload.request_freed(
                request,
                self._lists_of(self._tracked[request.request_id]),
                self.kv_cache_manager.block_pool.get_one_block,
            )
        self.kv_cache_manager.free(request)

    def _preempt(self, request: Request) -> None:
        tracked = self._tracked[request.request_id]
        self._free_blocks(request)
        self._free_encoder_inputs(tracked)
        tracked.num_null_blocks = None
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        _set_status(request, "PREEMPTED")
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_weights(self, policy: str, weight_version: int | str) -> list[str]:
        """Apply a weight update to the requests, none of whose tokens may be in flight;
        returns the ids the caller must abort ("abort": every running and loading one).

        "recompute" preempts every running and loading request now (reported with the
        next `schedule()`); "keep" leaves them on their KV, except one still holding an
        encoder-cache entry (the encoder cache is flushed: its embeddings came from the
        old weights), which is preempted. Every waiting request then (none holds a
        block) is keyed under `weight_version`, so it never hits a block computed under
        older weights; a kept request keeps its admission version's key, and so do the
        blocks it fills later (mixed-version KV only its own lineage can hit).
        """
        with_kv = [*self.running, *self.loading.values()]
        to_abort = []
        for request in reversed(with_kv):  # newest first: the oldest ends up first in waiting
            tracked = self._tracked[request.request_id]
            if tracked.num_pending:
                raise RuntimeError(f"request {request.request_id!r} has a token in flight")
            if policy == "abort":
                to_abort.append(request.request_id)
            elif policy == "recompute" or tracked.held_inputs:
                if self.loading.pop(request.request_id, None) is None:
                    self.running.remove(request)
                self._preempt(request)
                self._preempted_ids.append(request.request_id)
        for request in self.waiting:
            request.set_weight_version(weight_version)
        return to_abort

    def _free_encoder_inputs(self, tracked: _Tracked) -> None:
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.free(tracked.request)
        tracked.held_inputs.clear()

    # -- after the step ----------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Sequence[int] | np.ndarray
    ) -> TokenUpdates:
        """Append the tokens sampled for `output` (row `i` for `output.scheduled[i]`).

        Requests finished or aborted since are skipped (their token is dropped); a
        preempted request keeps its token. This is the one place a request's stop is
        decided: a token of its stop set (`stop_token_ids_for`) stops it, reaching
        `Request.max_tokens` outputs or the model length caps it.
        """
        updates = TokenUpdates()
        updated = updates.requests
        all_tracked = self._tracked
        max_model_len = self.config.max_model_len
        # One conversion of a device array, rather than an `int()` per row.
        sampled = (
            sampled_token_ids.tolist()
            if isinstance(sampled_token_ids, np.ndarray)
            else sampled_token_ids
        )
        for row, item in enumerate(output.scheduled):
            request = item.request
            tracked = all_tracked.get(request.request_id)
            if tracked is None or tracked.request is not request:
                continue  # finished or aborted while the step ran
            if item.samples:
                tracked.num_pending -= 1
                token = sampled[row]
                if type(token) is not int:
                    token = int(token)
                request.append_output_token_ids(token)
                reason = None
                if token in tracked.stop_token_ids:
                    reason = FinishReason.STOP
                elif (
                    request.num_output_tokens >= request.max_tokens
                    or request.num_tokens >= max_model_len
                ):
                    reason = FinishReason.LENGTH
                if reason is not None:
                    self._finish(tracked, reason)
                    updates.finish_reasons[request.request_id] = reason
                updated.append(request)
            if tracked.held_inputs and tracked.running:
                self._release_done_inputs(tracked)
        return updates

    def _release_done_inputs(self, tracked: _Tracked) -> None:
        """Encoder entries whose placeholders are all computed are no longer needed."""
        request = tracked.request
        for input_id in sorted(tracked.held_inputs):
            feature = request.mm_features[input_id]
            if feature.offset + feature.length <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, input_id)
                tracked.held_inputs.discard(input_id)

    def _finish(self, tracked: _Tracked, reason: FinishReason) -> None:
        request = tracked.request
        if tracked.running:
            self.running.remove(request)
        elif self.loading.pop(request.request_id, None) is None:
            self.waiting.remove(request)
        # A load not taken yet is discarded; one taken went with a step already
        # dispatched, which every program using these blocks later is ordered after.
        self._free_blocks(request)
        self._free_encoder_inputs(tracked)
        _set_status(request, _FINISHED_STATUS[reason])
        del self._tracked[request.request_id]
        self._finished_ids.append(request.request_id)
