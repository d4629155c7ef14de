"""`n > 1`: vLLM's parent request fanned out into `n` child requests.

The parent's `SamplingParams` give each child's (`n=1`; a seeded parent's child `i` has
seed `seed + i`), its id `f"{i}_{parent_id}"`. The children run as any request; their
outputs are merged into the parent's (`FanOut.merge`): streaming, each child's output
becomes a parent output holding that one sample; `FINAL_ONLY`, one parent output holds
all `n` once all have finished. The parent output is finished once every child is.

One prefill: when the children can read the prefix cache, child 0 (the leader) is
admitted alone and the others are *held* until it is given its first token (or finishes
without one), when its prompt's full blocks are cached, whatever its output kind; they
are then admitted together and hit those blocks (shared, by reference count), computing
only the prompt's partial last block each. A parent's prompt is so computed about once
instead of `n` times (as in vLLM 0.33, whose scheduler caches a block when it allocates
it, so children scheduled with or after the leader hit its blocks;
`benchmarks/bench_rollouts.py` counts both). `release` hands back the held children due.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jaxkv.engine.outputs import RequestOutput
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["FanOut", "child_requests"]


def child_requests(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The `(request id, sampling params)` of each of `params.n` children of `parent_id`."""
    children = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        children.append((f"{index}_{parent_id}", dataclasses.replace(params, n=1, seed=seed)))
    return children


@dataclass
class _Parent:
    request_id: str
    final_only: bool
    index: dict[str, int]  # child id -> its sample index
    unfinished: set[str]
    finals: list[RequestOutput | None] = field(default_factory=list)
    held: list[Any] = field(default_factory=list)  # children not admitted yet


class FanOut:
    """The unfinished parents. Invariants: a parent is held (by its id and each child's)
    exactly while one of its children is unfinished or its final output is not made
    yet; a held child is unfinished and known to no scheduler."""

    def __init__(self) -> None:
        self._by_child: dict[str, _Parent] = {}
        self._by_parent: dict[str, _Parent] = {}

    def add(
        self, parent_id: str, params: SamplingParams, child_ids: list[str], held: list
    ) -> None:
        """Track `parent_id`'s children; `held`: the ones (after child 0) to admit once
        the leader has its first token."""
        parent = _Parent(
            parent_id, params.output_kind is RequestOutputKind.FINAL_ONLY,
            {child: i for i, child in enumerate(child_ids)}, set(child_ids),
            [None] * len(child_ids), list(held),
        )  # fmt: skip
        self._by_parent[parent_id] = parent
        for child in child_ids:
            self._by_child[child] = parent

    def children(self, parent_id: str) -> list[str]:
        """The unfinished children of `parent_id` (empty: not a parent)."""
        parent = self._by_parent.get(parent_id)
        return [] if parent is None else sorted(parent.unfinished)

    def is_parent(self, request_id: str) -> bool:
        return request_id in self._by_parent

    def held(self) -> list:
        """Every held child (not known to a scheduler yet), in no particular order."""
        return [new for parent in self._by_parent.values() for new in parent.held]

    def release(self, request_ids: Iterable[str]) -> list:
        """The held children due: those of each parent whose leader (child 0) is among
        `request_ids`, the requests given a token or finished this step (a `FINAL_ONLY`
        leader has no output until it finishes: its token says its prompt is computed
        and its full blocks cached)."""
        due = []
        for request_id in request_ids:
            parent = self._by_child.get(request_id)
            if parent is not None and parent.held and parent.index[request_id] == 0:
                due += parent.held
                parent.held = []
        return due

    def release_siblings(self, child_id: str) -> list:
        """The held children of `child_id`'s parent, all of them now (one is about to be
        aborted: it must be known to a scheduler first)."""
        parent = self._by_child.get(child_id)
        if parent is None:
            return []
        due, parent.held = parent.held, []
        return due

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` with each child's output replaced by its parent's (or dropped while a
        `FINAL_ONLY` parent waits for its other children)."""
        merged = []
        for output in outputs:
            parent = self._by_child.get(output.request_id)
            if parent is None:
                merged.append(output)
                continue
            index = parent.index[output.request_id]
            if output.finished:
                parent.unfinished.discard(output.request_id)
            finished = not parent.unfinished
            if finished:
                for child in parent.index:
                    self._by_child.pop(child, None)
                self._by_parent.pop(parent.request_id, None)
            if not parent.final_only:
                merged.append(
                    output.for_parent(parent.request_id, [output.completion(index)], finished)
                )
                continue
            parent.finals[index] = output
            if finished:
                completions = [o.completion(i) for i, o in enumerate(parent.finals)]
                merged.append(parent.finals[0].for_parent(parent.request_id, completions, True))
        return merged
