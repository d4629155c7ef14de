"""Chat templates rendered with bounded work: a checkpoint's template is code from
whoever published the checkpoint.

Jinja's immutable sandbox already refuses attribute tricks and mutation; it also caps
each `range` at 100,000 numbers, but by raising `OverflowError`, and it leaves nested
loops, string repetition and output size unbounded. Here one render may:
- iterate `range` over at most `MAX_RANGE_NUMBERS` numbers in all (nested loops count
  every inner range they build);
- repeat a string or list (`*`) or raise to a power (`**`) only up to results of
  `MAX_OUTPUT_CHARS` items / bits;
- write at most `MAX_OUTPUT_CHARS` characters (checked as the output streams).
Anything past a bound, and any template error, is a `ValueError` starting
"chat template:"; nothing the template does escapes as another exception type.
"""

from __future__ import annotations

import operator
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE_NUMBERS = 100_000
MAX_OUTPUT_CHARS = 1 << 20
# What a template's own code can raise (its errors, not jaxkv's).
_TEMPLATE_FAULTS = (
    jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError,
    RecursionError, MemoryError,
)  # fmt: skip


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `*` and `**` checked before they run."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    _check_size("repetition", len(seq) * max(times, 0))
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            _check_size("power", abs(left).bit_length() * right)
        return operator.pow(left, right)


def _check_size(what: str, size: int) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise ValueError(
            f"chat template: a {what} of {size} items; the limit is {MAX_OUTPUT_CHARS}"
        )


class _RangeBudget:
    """`range` for one render: all its ranges together span at most `MAX_RANGE_NUMBERS`."""

    def __init__(self) -> None:
        self.left = MAX_RANGE_NUMBERS

    def __call__(self, *args: int) -> range:
        numbers = range(*args)
        if len(numbers) > self.left:
            raise ValueError(
                f"chat template: its ranges span more than {MAX_RANGE_NUMBERS} numbers"
            )
        self.left -= len(numbers)
        return numbers


def render_chat_template(template: str, **variables: Any) -> str:
    """`template` rendered with `variables` within the module's bounds (ValueError past
    one, or for any template error: syntax, an undefined call, `raise_exception`)."""

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(range=_RangeBudget(), raise_exception=raise_exception)
    pieces, size = [], 0
    try:
        for piece in env.from_string(template).generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise ValueError(f"chat template: writes more than {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
    except _TEMPLATE_FAULTS as error:
        message = str(error)
        if not message.startswith("chat template:"):
            message = f"chat template: {type(error).__name__}: {message}"
        raise ValueError(message) from None
    return "".join(pieces)
