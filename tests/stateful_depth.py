"""Hypothesis state machines run twice: a short run in the quick suite and the deep one
in the slow part (CI runs both), so the quick suite stays quick without losing depth."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine

QUICK_SHARE = 5  # the quick run has a fifth of the deep run's examples


def quick_and_deep(machine: type[RuleBasedStateMachine], deep_examples: int, **kw) -> tuple:
    """`machine`'s test case with `deep_examples // QUICK_SHARE` examples, and with
    `deep_examples` marked slow; `kw`: the rest of both runs' settings."""
    quick = type(f"{machine.__name__}Quick", (machine.TestCase,), {
        "settings": settings(max_examples=max(deep_examples // QUICK_SHARE, 10), **kw),
    })  # fmt: skip
    deep = type(f"{machine.__name__}Deep", (machine.TestCase,), {
        "settings": settings(max_examples=deep_examples, **kw),
    })  # fmt: skip
    return quick, pytest.mark.slow(deep)
