"""`jaxkv generate --prompts FILE`: the prompts of a file, read as people write them.

Rules (each broken one is a `ValueError` naming the file, and the line where there is
one):
- The file is UTF-8 text of at most `MAX_PROMPTS_FILE_BYTES`; a longer one (or an
  endless one such as `/dev/zero`) is refused after reading one byte past the limit.
- Lines end at `\\n` only (a `\\r` before it is dropped): a form feed, `\\x1e`, `\\x85`
  or U+2028 inside a line is part of that prompt, as every editor shows it.
- The whole file is one format: JSONL when its name ends in `.jsonl` or its first
  non-blank line parses as a JSON object, else plain text, one prompt a line. A text
  file's line starting with `{` is a prompt like any other.
- A JSONL line is an object `{"prompt": text, "max_tokens": positive int}`
  (`max_tokens` optional); nesting too deep for the JSON parser is refused, not a crash.
- Blank lines are skipped; a file with no prompts is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_PROMPTS_FILE_BYTES = 64 * 2**20

Prompt = tuple[str, int | None]  # (text, max_tokens or None: the command's --max-tokens)


def read_prompts(path: str, limit: int = MAX_PROMPTS_FILE_BYTES) -> list[Prompt]:
    """The prompts of `path` by the module's rules, in file order."""
    lines = _lines(path, limit)
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"--prompts {path}: no prompts in it")
    if path.endswith(".jsonl") or _is_object(numbered[0][1]):
        return [_json_prompt(path, number, line) for number, line in numbered]
    return [(line, None) for _, line in numbered]


def _lines(path: str, limit: int) -> list[str]:
    try:
        with Path(path).open("rb") as file:
            data = file.read(limit + 1)
    except OSError as error:
        raise ValueError(f"--prompts {path}: cannot read it ({error})") from None
    if len(data) > limit:
        raise ValueError(
            f"--prompts {path}: larger than {limit} bytes (the limit of a prompts file); "
            "split it or serve it from Python"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompts {path}: not UTF-8 text ({error})") from None
    return [line.removesuffix("\r") for line in text.split("\n")]


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def _json_prompt(path: str, number: int, line: str) -> Prompt:
    where = f"--prompts {path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON object ({error}); the file is JSONL") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    text = item.get("prompt") if isinstance(item, dict) else None
    max_tokens = item.get("max_tokens") if isinstance(item, dict) else None
    if not isinstance(text, str) or (
        max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1)
    ):
        raise ValueError(
            f'{where}: needs an object with "prompt" (text) and optionally "max_tokens" '
            "(a positive integer)"
        )
    return text, max_tokens
