"""The content format a chat template takes, detected from its syntax tree as vLLM 0.33
detects it (`--chat-template-content-format auto`).

- "openai": the template loops over a message's `content`, so it gets content as a list
  of parts: `{"type": "text", "text": ...}` and `{"type": "image"}` (a LLaVA template
  writes its image token for each image part);
- "string": anything else (also a template that does not compile): content is one string,
  its text parts joined by newlines, an image as its placeholder text in front of them.

A content loop is a `for` over `m.content` / `m['content']` (filters, tests and slices
around it allowed) where `m` is the target of a `for` over `messages` or over a variable
set from it (`{% set loop_messages = messages[1:] %}`, namespace fields included), over
a macro parameter given such a `content`, or over a variable named `content` outside
macros. Templates are read as `chat_sandbox.parse_chat_template` parses them (transformers'
environment and extensions: `generation`, `loopcontrols`); one that does not compile
there is "string", as vLLM reads one transformers cannot compile. Nothing of the
template runs.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator

from jinja2 import nodes

from jaxkv.models.chat_sandbox import parse_chat_template

__all__ = ["OPENAI", "STRING", "chat_content_format"]

OPENAI = "openai"
STRING = "string"


def _is_var(node: nodes.Node, name: str) -> bool:
    """`node` reads variable `name` (a dotted name: a namespace field, `ns.rest`)."""
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads `name` (or its field `key`), through filters, tests and slices."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_var(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and (node.arg.value == key)
        )
    return isinstance(node, nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _dotted(node: nodes.Node) -> str | None:
    """An assignment target `ns.rest` (or `a.b.c`) as its dotted name."""
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    return ".".join([node.name, *reversed(parts)]) if isinstance(node, nodes.Name) else None


def _aliases_of(root: nodes.Template, name: str) -> list[str]:
    """`name` and every variable set from it, directly or through another alias."""
    found, queue = [name], deque([name])
    while queue:
        source = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            target, value = assign.target, assign.node
            names = []
            if isinstance(target, nodes.Name) and _reads(value, source):
                names = [target.name]
            elif (
                isinstance(target, nodes.Name)
                and isinstance(value, nodes.Call)
                and (isinstance(value.node, nodes.Name) and value.node.name == "namespace")
            ):
                names = [
                    f"{target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, source)
                ]
            elif isinstance(target, nodes.Getattr | nodes.NSRef) and _reads(value, source):
                names = [n for n in (_dotted(target),) if n is not None]
            for alias in names:
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _message_vars(root: nodes.Template) -> list[str]:
    """The targets of the loops over the messages (or an alias of them)."""
    aliases = _aliases_of(root, "messages")
    return [
        loop.target.name
        for loop in root.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, a) for a in aliases)
    ]


def _macro_content_params(root: nodes.Template, messages: list[str]) -> dict[int, set[str]]:
    """Per loop inside a macro (by id), the macro's parameters that some call passes a
    message's content; every loop inside a macro is a key."""
    params_of: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(macro.args)]):
                if any(_reads(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_reads(kw.value, m, "content") for m in messages):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            params_of[id(loop)] = params
    return params_of


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_vars(root)
    in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(nodes.For):
        bare = isinstance(loop.iter, nodes.Name)
        if any(_reads(loop.iter, m, "content") for m in messages):
            yield loop
        elif bare and loop.iter.name in in_macros.get(id(loop), ()):
            yield loop
        elif bare and id(loop) not in in_macros and loop.iter.name == "content":
            yield loop


@functools.lru_cache(maxsize=32)
def chat_content_format(template: str | None) -> str:
    """`OPENAI` or `STRING` for `template` (module docstring); `STRING` for None or a
    template that does not compile, as vLLM."""
    if template is None:
        return STRING
    try:
        root = parse_chat_template(template)
    except ValueError:
        return STRING
    return OPENAI if next(_content_loops(root), None) is not None else STRING
