"""`n > 1`: vLLM's parent request fanned out into `n` child requests.

The parent's `SamplingParams` give each child's (`n=1`; a seeded parent's child `i` has
seed `seed + i`), its id `f"{i}_{parent_id}"`. The children run as any request; their
outputs are merged into the parent's (`FanOut.merge`): streaming, each child's output
becomes a parent output holding that one sample; `FINAL_ONLY`, one parent output holds
all `n` once all have finished. The parent output is finished once every child is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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


class FanOut:
    """The unfinished parents, by child id. Invariant: a parent is held exactly while one
    of its children is unfinished or its final output is not made yet."""

    def __init__(self) -> None:
        self._parents: dict[str, _Parent] = {}

    def add(self, parent_id: str, params: SamplingParams, child_ids: list[str]) -> None:
        parent = _Parent(
            parent_id, params.output_kind is RequestOutputKind.FINAL_ONLY,
            {child: i for i, child in enumerate(child_ids)}, set(child_ids),
            [None] * len(child_ids),
        )  # fmt: skip
        for child in child_ids:
            self._parents[child] = parent

    def children(self, parent_id: str) -> list[str]:
        """The unfinished children of `parent_id` (empty: not a parent)."""
        return sorted(
            child for child, p in self._parents.items()
            if p.request_id == parent_id and child in p.unfinished
        )  # fmt: skip

    def is_parent(self, request_id: str) -> bool:
        return any(p.request_id == request_id for p in self._parents.values())

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` with each child's output replaced by its parent's (or dropped while a
        `FINAL_ONLY` parent waits for its other children)."""
        merged = []
        for output in outputs:
            parent = self._parents.get(output.request_id)
            if parent is None:
                merged.append(output)
                continue
            index = parent.index[output.request_id]
            if output.finished:
                parent.unfinished.discard(output.request_id)
            finished = not parent.unfinished
            if finished:
                for child in parent.index:
                    self._parents.pop(child, None)
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
