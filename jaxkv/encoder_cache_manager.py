"""Host-side encoder cache for multimodal items (SPEC §7).

Encoder outputs (e.g. vision embeddings) are cached per multimodal item,
keyed by the item's content hash (`mm_hash`) and shared across requests.
Capacity is counted in *embeddings*: only the placeholder positions of an item
that receive an encoder embedding count, never the text or break tokens
between them.

This module is bookkeeping only. Store pages are released when the store's host
page allocator (`jaxkv.encoder_pages.EncoderPageAllocator`) is handed the hashes
returned by `get_freed_mm_hashes()`.

Requests are duck-typed: the managers use only `request.request_id`,
`request.mm_features[i].identifier` and `request.get_num_encoder_embeds(i)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jaxkv._checks import check_int

__all__ = [
    "EncoderBudget",
    "EncoderCacheManager",
    "EncoderDecoderCacheManager",
    "check_encoder_admission",
    "compute_encoder_budget",
]

_NO_INPUTS: frozenset[int] = frozenset()


class EncoderRequest(Protocol):
    """What the encoder cache managers need from a request."""

    request_id: str
    mm_features: Sequence[Any]

    def get_num_encoder_embeds(self, input_id: int) -> int: ...


def _bad_input_id(request: EncoderRequest, input_id: int) -> ValueError:
    return ValueError(
        f"request {request.request_id!r} has {len(request.mm_features)} multimodal inputs; "
        f"input_id {input_id!r} is out of range (allowed: 0..{len(request.mm_features) - 1})"
    )


def _mm_hash(request: EncoderRequest, input_id: int) -> str:
    """The mm_hash of the request's input `input_id`; ValueError naming it when out of range."""
    if type(input_id) is not int:
        check_int("input_id", input_id)
    if input_id < 0:
        raise _bad_input_id(request, input_id)
    try:
        return request.mm_features[input_id].identifier
    except IndexError:
        raise _bad_input_id(request, input_id) from None


def _check_size(name: str, value: int) -> None:
    check_int(name, value, min_value=0)


def _check_can_allocate_args(
    request: EncoderRequest, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
) -> None:
    _mm_hash(request, input_id)  # checks input_id
    _check_size("encoder_compute_budget", encoder_compute_budget)
    _check_size("num_embeds_to_schedule", num_embeds_to_schedule)


class EncoderCacheManager:
    """Reference-counted, content-addressed cache of encoder outputs, sized in embeddings.

    Invariants kept after every public call:

    * `num_free_slots + sum(num_embeds_by_hash.values()) == cache_size`: every
      cached entry occupies exactly its embedding count, whether referenced or not.
    * `num_freeable_slots == num_free_slots + sum(freeable.values())`.
    * an entry is in `freeable` iff it is cached and its reference set is empty;
      `freeable` is ordered oldest-unreferenced first, which is the eviction order.
    * an entry referenced by some request is never evicted.
    * `freed` lists hashes evicted since the last `get_freed_mm_hashes()`, in
      eviction order.

    Public state (as in vLLM, for schedulers and tests to inspect):
    `cache_size`, `num_free_slots`, `num_freeable_slots`, `cached` (mm_hash ->
    set of request ids referencing it), `num_embeds_by_hash`, `freeable`
    (OrderedDict mm_hash -> num_embeds), `freed` (list of mm hashes).
    """

    def __init__(self, cache_size: int) -> None:
        _check_size("cache_size", cache_size)
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}
        self.num_embeds_by_hash: dict[str, int] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []
        # request id -> {input id -> mm_hash} for the inputs the request holds.
        self._held: dict[str, dict[int, str]] = {}
        # (request, input id, num embeds) of the last input `can_allocate` accepted,
        # so the `allocate` that follows it does not ask the request again.
        self._sized: tuple[object, int, int] = (None, -1, 0)

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: object = None) -> EncoderCacheManager:
        """vLLM's factory; `vllm_config` is accepted and unused."""
        return cls(cache_size)

    @property
    def request_cached_ids(self) -> dict[str, set[int]]:
        """request id -> the input ids it holds (vLLM's attribute; a fresh copy, read only)."""
        return {request_id: set(held) for request_id, held in self._held.items()}

    def reset(self) -> None:
        """Drop every entry and reference (e.g. after the model weights change)."""
        self.cached.clear()
        self.num_embeds_by_hash.clear()
        self.freeable.clear()
        self.freed.clear()
        self._held.clear()
        self._sized = (None, -1, 0)
        self.num_free_slots = self.cache_size
        self.num_freeable_slots = self.cache_size

    def check_and_update_cache(self, request: EncoderRequest, input_id: int) -> bool:
        """Return whether input `input_id` of `request` is cached; on a hit, reference it.

        A hit on an unreferenced entry takes it out of `freeable` (so it can no
        longer be evicted) and reduces `num_freeable_slots` accordingly.
        """
        mm_hash = _mm_hash(request, input_id)
        cached = self.cached
        if mm_hash not in cached:
            return False
        refs = cached[mm_hash]
        if not refs:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        request_id = request.request_id
        refs.add(request_id)
        held = self._held.get(request_id)
        if held is None:
            self._held[request_id] = {input_id: mm_hash}
        else:
            held[input_id] = mm_hash
        return True

    def get_cached_num_encoder_embeds(self, request: EncoderRequest, input_id: int) -> int | None:
        """The embedding count stored for the input's mm_hash, or None when it is not cached."""
        mm_hash = _mm_hash(request, input_id)
        return self.num_embeds_by_hash.get(mm_hash)

    def can_allocate(
        self,
        request: EncoderRequest,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether the input fits, evicting the oldest unreferenced entries if that makes it fit.

        False when the item alone exceeds `encoder_compute_budget`, or when it
        plus the `num_embeds_to_schedule` embeddings already scheduled this
        step exceed free + reclaimable slots (nothing is evicted then).
        Evicted hashes are appended to `freed`; device memory is not touched.
        """
        # Three ints in one test: a bitwise OR is negative iff one of them is.
        if not (
            type(input_id) is type(encoder_compute_budget) is type(num_embeds_to_schedule) is int
            and (input_id | encoder_compute_budget | num_embeds_to_schedule) >= 0
        ):
            _check_can_allocate_args(
                request, input_id, encoder_compute_budget, num_embeds_to_schedule
            )
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        needed = num_embeds + num_embeds_to_schedule
        num_free_slots = self.num_free_slots
        if needed <= num_free_slots:
            self._sized = (request, input_id, num_embeds)
            return True
        if needed > self.num_freeable_slots:
            return False
        freeable = self.freeable
        cached = self.cached
        num_embeds_by_hash = self.num_embeds_by_hash
        freed = self.freed
        while needed > num_free_slots:
            mm_hash, evicted = freeable.popitem(last=False)
            del cached[mm_hash]
            del num_embeds_by_hash[mm_hash]
            freed.append(mm_hash)
            num_free_slots += evicted
        self.num_free_slots = num_free_slots
        self._sized = (request, input_id, num_embeds)
        return True

    def allocate(self, request: EncoderRequest, input_id: int) -> None:
        """Create the entry for a not-yet-cached input and reference it.

        Raises ValueError, changing nothing, when the entry is already cached
        (use `check_and_update_cache`) or when its embeddings do not fit in the
        free slots (call `can_allocate` first).
        """
        mm_hash = _mm_hash(request, input_id)
        cached = self.cached
        if mm_hash in cached:
            raise ValueError(
                f"request {request.request_id!r} input {input_id}: mm_hash {mm_hash!r} is already "
                "cached; reference it with check_and_update_cache instead of allocating it again"
            )
        sized_request, sized_input, num_embeds = self._sized
        if sized_request is not request or sized_input != input_id:
            num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > self.num_free_slots:
            raise ValueError(
                f"request {request.request_id!r} input {input_id}: {num_embeds} embeddings do not "
                f"fit in {self.num_free_slots} free encoder-cache slots; call can_allocate "
                "(which evicts unreferenced entries) before allocate"
            )
        request_id = request.request_id
        cached[mm_hash] = {request_id}
        self.num_embeds_by_hash[mm_hash] = num_embeds
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds
        held = self._held.get(request_id)
        if held is None:
            self._held[request_id] = {input_id: mm_hash}
        else:
            held[input_id] = mm_hash

    def get_cached_input_ids(self, request: EncoderRequest) -> frozenset[int]:
        """The input ids of `request` that currently hold an encoder-cache reference."""
        held = self._held.get(request.request_id)
        return _NO_INPUTS if held is None else frozenset(held)

    def free_encoder_input(self, request: EncoderRequest, input_id: int) -> None:
        """Release `request`'s hold on input `input_id`.

        The request's reference to the entry is dropped only when no other
        input of the same request that is still held has the same mm_hash; an
        entry left without references becomes freeable (newest last). Its data
        stays until evicted. An input the request does not hold (never allocated,
        or already freed) is a no-op, as in vLLM: schedulers free inputs they may
        have freed before.
        """
        if type(input_id) is not int:
            check_int("input_id", input_id)
        request_id = request.request_id
        held = self._held.get(request_id)
        if held is None or input_id not in held:
            return
        mm_hash = held.pop(input_id)
        if not held:
            del self._held[request_id]
        elif mm_hash in held.values():
            return
        refs = self.cached.get(mm_hash)
        if refs:
            refs.discard(request_id)
            if not refs:
                num_embeds = self.num_embeds_by_hash[mm_hash]
                self.freeable[mm_hash] = num_embeds
                self.num_freeable_slots += num_embeds

    def free(self, request: EncoderRequest) -> None:
        """Release every input `request` holds, as `free_encoder_input` would one by one.

        Inputs are released in the order the request took them (ascending input
        id for a scheduler that walks each request's items in order), so entries
        freed together join `freeable` in that order. A request that holds
        nothing (e.g. a text-only request) is a no-op.
        """
        request_id = request.request_id
        held = self._held.pop(request_id, None)
        if held is None:
            return
        cached = self.cached
        freeable = self.freeable
        num_embeds_by_hash = self.num_embeds_by_hash
        released = 0
        for mm_hash in held.values():
            refs = cached[mm_hash]
            if request_id in refs:
                refs.remove(request_id)
                if not refs:
                    num_embeds = num_embeds_by_hash[mm_hash]
                    freeable[mm_hash] = num_embeds
                    released += num_embeds
            elif not refs:
                # A repeated item released at an earlier occurrence in this loop:
                # like `free_encoder_input`, it is released at its last occurrence.
                freeable.move_to_end(mm_hash)
        self.num_freeable_slots += released

    def check_admission(self, request: EncoderRequest, encoder_compute_budget: int) -> None:
        """At admission: ValueError when one of the request's items needs more embeddings
        than `encoder_compute_budget` or this cache holds (it would stall the scheduler:
        `can_allocate` could never accept it)."""
        check_int("encoder_compute_budget", encoder_compute_budget, min_value=0)
        check_encoder_admission(request, encoder_compute_budget, self.cache_size)

    def get_freed_mm_hashes(self) -> list[str]:
        """Return and clear the hashes evicted since the last call.

        A hash evicted and then allocated again in the same scheduling pass is
        left out: its device data must be kept.
        """
        freed = self.freed
        if not freed:
            return []
        self.freed = []
        cached = self.cached
        return [mm_hash for mm_hash in freed if mm_hash not in cached]


class EncoderDecoderCacheManager:
    """Slot accounting for encoder-decoder models: no sharing, frees reported one step late.

    Every allocation is a fresh computation (`check_and_update_cache` never
    hits). Invariant: `num_free_slots + sum of the embeddings of all held
    inputs == cache_size`. `get_freed_mm_hashes()` returns the hashes
    allocated before the previous call, so device data written for a step is
    released only after the model has run on it.
    """

    def __init__(self, cache_size: int) -> None:
        _check_size("cache_size", cache_size)
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.allocated: list[str] = []
        self.to_free: list[str] = []
        # request id -> {input id -> num_embeds} for the inputs the request holds.
        self._held: dict[str, dict[int, int]] = {}

    def reset(self) -> None:
        """Back to the initial state."""
        self.num_free_slots = self.cache_size
        self.allocated.clear()
        self.to_free.clear()
        self._held.clear()

    def check_and_update_cache(self, request: EncoderRequest, input_id: int) -> bool:
        """Always False: encoder-decoder outputs are not shared."""
        _mm_hash(request, input_id)  # checks input_id
        return False

    def get_cached_num_encoder_embeds(self, request: EncoderRequest, input_id: int) -> int | None:
        """Always None: nothing is cached across requests."""
        _mm_hash(request, input_id)  # checks input_id
        return None

    def can_allocate(
        self,
        request: EncoderRequest,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether the item fits the compute budget and, with those already scheduled, the
        free slots."""
        _check_can_allocate_args(request, input_id, encoder_compute_budget, num_embeds_to_schedule)
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        return num_embeds + num_embeds_to_schedule <= self.num_free_slots

    def allocate(self, request: EncoderRequest, input_id: int) -> None:
        """Take the input's slots and record its hash; ValueError (no change) if it does not fit
        or is already held."""
        _mm_hash(request, input_id)  # checks input_id
        num_embeds = request.get_num_encoder_embeds(input_id)
        request_id = request.request_id
        held = self._held.get(request_id, {})
        if input_id in held:
            raise ValueError(f"request {request_id!r} input {input_id} is already allocated")
        if num_embeds > self.num_free_slots:
            raise ValueError(
                f"request {request_id!r} input {input_id}: {num_embeds} embeddings do not fit "
                f"in {self.num_free_slots} free encoder-cache slots"
            )
        held[input_id] = num_embeds
        self._held[request_id] = held
        self.num_free_slots -= num_embeds
        self.allocated.append(request.mm_features[input_id].identifier)

    def get_cached_input_ids(self, request: EncoderRequest) -> frozenset[int]:
        """The input ids of `request` whose slots are still taken."""
        held = self._held.get(request.request_id)
        return _NO_INPUTS if held is None else frozenset(held)

    def free_encoder_input(self, request: EncoderRequest, input_id: int) -> None:
        """Return the input's slots; a no-op for an input the request does not hold."""
        if type(input_id) is not int:
            check_int("input_id", input_id)
        request_id = request.request_id
        held = self._held.get(request_id)
        if held is None or input_id not in held:
            return
        self.num_free_slots += held.pop(input_id)
        if not held:
            del self._held[request_id]

    def free(self, request: EncoderRequest) -> None:
        """Return the slots of every input `request` holds (no-op when it holds none)."""
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self.num_free_slots += sum(held.values())

    def check_admission(self, request: EncoderRequest, encoder_compute_budget: int) -> None:
        """At admission: ValueError when one of the request's items needs more embeddings
        than `encoder_compute_budget` or this cache holds (it would stall the scheduler:
        `can_allocate` could never accept it)."""
        check_int("encoder_compute_budget", encoder_compute_budget, min_value=0)
        check_encoder_admission(request, encoder_compute_budget, self.cache_size)

    def get_freed_mm_hashes(self) -> list[str]:
        """The hashes allocated before the previous call (their model step has run)."""
        to_free = self.to_free
        self.to_free = self.allocated
        self.allocated = []
        return to_free


@dataclass(frozen=True)
class EncoderBudget:
    """Per-step encoder compute budget and encoder cache size, both in embeddings.

    Invariant: both are >= 0. An item passing `check_admission` fits both, so
    it can always be scheduled once the cache holds nothing it must keep.
    """

    compute_budget: int
    cache_size: int

    def __post_init__(self) -> None:
        _check_size("compute_budget", self.compute_budget)
        _check_size("cache_size", self.cache_size)

    def check_admission(self, request: EncoderRequest) -> None:
        """Reject (ValueError) a request with an item larger than the compute budget or the cache.

        Such an item could never be scheduled; admitting it would stall the
        scheduler forever.
        """
        check_encoder_admission(request, self.compute_budget, self.cache_size)


def check_encoder_admission(
    request: EncoderRequest, encoder_compute_budget: int, cache_size: int
) -> None:
    """ValueError naming the item when one of `request`'s multimodal items needs more
    embeddings than `encoder_compute_budget` or `cache_size`: it could never be scheduled."""
    limit = min(encoder_compute_budget, cache_size)
    for input_id in range(len(request.mm_features)):
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > limit:
            which = "compute budget" if num_embeds > encoder_compute_budget else "cache size"
            raise ValueError(
                f"request {request.request_id!r}: multimodal input {input_id} "
                f"({request.mm_features[input_id].identifier!r}) needs {num_embeds} encoder "
                f"embeddings, more than the encoder {which} (compute budget "
                f"{encoder_compute_budget}, cache size {cache_size}); raise the limit or "
                "shrink the item"
            )


def compute_encoder_budget(
    max_tokens_per_item: Mapping[str, int],
    max_num_batched_tokens: int,
    *,
    max_num_encoder_input_tokens: int | None = None,
    encoder_cache_size: int | None = None,
    disable_chunked_mm_input: bool = False,
) -> EncoderBudget:
    """Derive the per-step encoder compute budget and the encoder cache size.

    `max_tokens_per_item` maps each enabled modality to the largest number of
    placeholder tokens one item can take (an upper bound on its embeddings).
    The user settings default to the scheduler's `max_num_batched_tokens`;
    both results are raised to at least the largest item so no admissible item
    is unschedulable. No modality enabled gives a zero budget and cache.

    Raises ValueError for negative sizes, and when chunked multimodal input is
    disabled but the largest item cannot fit in one step's token budget.
    """
    _check_size("max_num_batched_tokens", max_num_batched_tokens)
    for modality, size in max_tokens_per_item.items():
        _check_size(f"max_tokens_per_item[{modality!r}]", size)
    compute = max_num_batched_tokens
    if max_num_encoder_input_tokens is not None:
        _check_size("max_num_encoder_input_tokens", max_num_encoder_input_tokens)
        compute = max_num_encoder_input_tokens
    cache = max_num_batched_tokens
    if encoder_cache_size is not None:
        _check_size("encoder_cache_size", encoder_cache_size)
        cache = encoder_cache_size
    if not max_tokens_per_item:
        return EncoderBudget(compute_budget=0, cache_size=0)
    largest = max(max_tokens_per_item.values())
    if disable_chunked_mm_input and largest > max_num_batched_tokens:
        raise ValueError(
            f"chunked multimodal input is disabled but the largest item takes {largest} tokens, "
            f"more than max_num_batched_tokens={max_num_batched_tokens}; raise "
            "max_num_batched_tokens or enable chunked multimodal input"
        )
    return EncoderBudget(compute_budget=max(compute, largest), cache_size=max(cache, largest))
