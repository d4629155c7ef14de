"""Chat templates rendered as transformers renders them, with bounded work: a
checkpoint's template is code from whoever published the checkpoint.

The dialect is transformers' (`utils/chat_template_utils.py`, `_compile_jinja_template`):
Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`; its `{% generation %}`
tag (`AssistantTracker`: the body rendered as-is, as a call block, when no assistant
mask is tracked; jaxkv never tracks one) and jinja2's `loopcontrols` (`{% break %}`,
`{% continue %}`); the globals `raise_exception` and `strftime_now` (local time); and
its `tojson` filter (`json.dumps` with `ensure_ascii`, `indent`, `separators`,
`sort_keys`: no HTML escaping, keys in their order) in place of Jinja's.
`chat_content` reads templates as parsed here (`parse_chat_template`).

Jinja's sandbox already refuses attribute tricks and mutation; it also caps each `range`
at 100,000 numbers, but by raising `OverflowError`, and it leaves nested loops, string
repetition and output size unbounded. Here one render may:
- iterate `range` over at most `MAX_RANGE_NUMBERS` numbers in all (nested loops count
  every inner range they build);
- repeat a string or list (`*`) or raise to a power (`**`) only up to results of
  `MAX_OUTPUT_CHARS` items / bits; `tojson` only up to texts of `MAX_OUTPUT_CHARS`
  characters (measured before the text is built: `indent` and `separators` multiply it);
- write at most `MAX_WRITTEN_CHARS` characters through `{{ ... }}` in all, inside
  macros, `{% set %}` blocks, call blocks and `{% generation %}` included (their text is
  built before anything writes it);
- write at most `MAX_OUTPUT_CHARS` characters (checked as the output streams).
Anything past a bound, and any template error, is a `ValueError` starting
"chat template:"; nothing the template does escapes as another exception type.

A template is compiled once (`_compiled`, the last `COMPILED_TEMPLATES` kept; compiling
costs a hundred times a render) and rendered many times: the bounds are one render's,
kept in a context variable each render sets (`_RenderBudget`), so renders on several
threads at once each have their own.
"""

from __future__ import annotations

import functools
import json
import operator
from contextvars import ContextVar
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "CHAT_EXTENSIONS", "MAX_OUTPUT_CHARS", "MAX_RANGE_NUMBERS", "MAX_WRITTEN_CHARS",
    "parse_chat_template", "render_chat_template",
]  # fmt: skip

MAX_RANGE_NUMBERS = 100_000
MAX_OUTPUT_CHARS = 1 << 20
# A template's macros and blocks build text that is written again (a macro's result
# printed by its caller): room for a few such layers over the output's own size.
MAX_WRITTEN_CHARS = 8 * MAX_OUTPUT_CHARS
COMPILED_TEMPLATES = 16  # a server renders its model's one or few templates
# What a template's own code can raise (its errors, not jaxkv's); SyntaxError is
# Python's, for a `{% break %}` outside a loop (Jinja compiles it as written).
_TEMPLATE_FAULTS = (
    jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError,
    RecursionError, MemoryError, SyntaxError,
)  # fmt: skip


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (its `AssistantTracker`,
    which marks the assistant's text for `return_assistant_tokens_mask`): parsed as
    transformers parses it, a call block over the body, so the body's `{% set %}`s stay
    inside it; rendered as transformers renders it when not tracking: the body as-is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation_support(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


# The extensions transformers compiles templates with (and so parses them with).
CHAT_EXTENSIONS = (GenerationTag, jinja2.ext.loopcontrols)


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


def _check_size(what: str, size: int, limit: int = MAX_OUTPUT_CHARS) -> None:
    if size > limit:
        raise ValueError(f"chat template: a {what} of {size} items; the limit is {limit}")


class _RenderBudget:
    """What one render may still do: numbers its `range`s may span, characters its
    `{{ ... }}` may write."""

    def __init__(self) -> None:
        self.range_numbers = MAX_RANGE_NUMBERS
        self.written_chars = MAX_WRITTEN_CHARS


_BUDGET: ContextVar[_RenderBudget] = ContextVar("chat_template_budget")


def _bounded_range(*args: int) -> range:
    """`range` for templates: all of one render's ranges span at most
    `MAX_RANGE_NUMBERS` numbers."""
    numbers, budget = range(*args), _BUDGET.get()
    if len(numbers) > budget.range_numbers:
        raise ValueError(f"chat template: its ranges span more than {MAX_RANGE_NUMBERS} numbers")
    budget.range_numbers -= len(numbers)
    return numbers


class _JsonSize:
    """The length of `json.dumps(value, ...)` with one layout, measured without building
    the text and given up (ValueError) once past `limit`: every item counts at least one
    character, so measuring visits at most `limit` items, however the value nests or
    repeats itself. Exact for what json takes (keys: str, int, float, bool, None); any
    other value counts one character (json.dumps then refuses it)."""

    def __init__(
        self, limit: int, what: str, indent: int | None = None, item_sep: str = ", ",
        key_sep: str = ": ", ensure_ascii: bool = False,
    ) -> None:  # fmt: skip
        self.left, self.limit, self.what, self.indent = limit, limit, what, indent
        self.item_sep, self.key_sep, self.ensure_ascii = len(item_sep), len(key_sep), ensure_ascii

    def _take(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise ValueError(f"chat template: {self.what} more than {self.limit} characters")

    def _text(self, text: str) -> int:
        return len(json.dumps(text, ensure_ascii=self.ensure_ascii))

    def measure(self, value: Any, level: int = 0) -> None:
        if isinstance(value, dict | list | tuple):
            if not value:
                return self._take(2)
            newline = 0 if self.indent is None else 1 + self.indent * (level + 1)
            closing = 0 if self.indent is None else 1 + self.indent * level
            self._take(2 + len(value) * (newline + self.item_sep) - self.item_sep + closing)
            for key in value if isinstance(value, dict) else ():
                self._take(self._text(str(key)) + self.key_sep)
            for item in value.values() if isinstance(value, dict) else value:
                self.measure(item, level + 1)
        elif isinstance(value, str):
            self._take(self._text(value))
        elif isinstance(value, int | float) or value is None:
            # int's text is bounded by `**`'s cap and Python's digit limit; taken after.
            self._take(len(json.dumps(value)))
        else:
            self._take(1)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` filter (its arguments and defaults), refused past
    `MAX_OUTPUT_CHARS` before its text is built."""
    item_sep, key_sep = separators if separators is not None else (
        ("," if indent is not None else ", "), ": "
    )  # fmt: skip
    width = len(indent) if isinstance(indent, str) else indent
    if isinstance(width, int):
        # json indents with `' ' * indent`: a huge indent is refused before it is built.
        _check_size("tojson indent", width)
        width = max(width, 0)
    elif indent is not None:
        width = 0  # json.dumps refuses it (TypeError) unless nothing nests
    measure = _JsonSize(
        MAX_OUTPUT_CHARS, "tojson writes", width, item_sep, key_sep, bool(ensure_ascii)
    )
    measure.measure(value)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys,
    )  # fmt: skip


def _bounded_finalize(value: Any) -> str:
    """`finalize` for templates: the text of every `{{ ... }}` of one render, at most
    `MAX_WRITTEN_CHARS` characters in all. A list, tuple or dict is measured (as JSON,
    about its text's size) before its text is built."""
    budget = _BUDGET.get()
    if isinstance(value, dict | list | tuple):
        try:
            _JsonSize(budget.written_chars, "writes").measure(value)
        except ValueError:
            _overrun()
    text = str(value)  # what Jinja writes for `value`
    budget.written_chars -= len(text)
    if budget.written_chars < 0:
        _overrun()
    return text


def _overrun() -> NoReturn:
    raise ValueError(
        f"chat template: writes more than {MAX_WRITTEN_CHARS} characters in all "
        "(macros and blocks included)"
    )


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> _BoundedSandbox:
    """The one environment templates compile in (it holds no render's state)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=list(CHAT_EXTENSIONS),
        finalize=_bounded_finalize,
    )  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals.update(
        range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now
    )
    return env


@functools.lru_cache(maxsize=COMPILED_TEMPLATES)
def _compiled(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _fault(error: BaseException) -> ValueError:
    message = str(error)
    if not message.startswith("chat template:"):
        message = f"chat template: {type(error).__name__}: {message}"
    return ValueError(message)


def parse_chat_template(template: str) -> nodes.Template:
    """`template`'s syntax tree as transformers' environment parses it, after checking
    that it compiles there (ValueError starting "chat template:" when it does not: it
    could not render). Runs nothing of the template."""
    env = _environment()
    try:
        env.compile(template)
        # A fresh tree: compiling optimizes (folds constants in) the tree it compiles.
        return env.parse(template)
    except _TEMPLATE_FAULTS as error:
        raise _fault(error) from None


def render_chat_template(template: str, **variables: Any) -> str:
    """`template` rendered with `variables` within the module's bounds (ValueError past
    one, or for any template error: syntax, an undefined call, `raise_exception`)."""
    pieces, size = [], 0
    budget = _BUDGET.set(_RenderBudget())
    try:
        for piece in _compiled(template).generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise ValueError(f"chat template: writes more than {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
    except _TEMPLATE_FAULTS as error:
        raise _fault(error) from None
    finally:
        _BUDGET.reset(budget)
    return "".join(pieces)
