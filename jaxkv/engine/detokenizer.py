"""A request's output text, decoded as its tokens come: each token's text is found from
the tokens before it (tokenizers' `DecodeStream`, what vLLM's detokenizer uses), not by
decoding the whole output again every step, so a request of n tokens costs O(n) to
decode, not O(n^2).

Invariants: the text only grows while the request runs (a character split over several
tokens appears once it is whole), and the text of a finished request is exactly
`tokenizer.decode(tokens)`, of which every earlier text is a prefix. A tokenizer that is
not the `tokenizers` library's is decoded whole each time.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer as FastTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalText", "Tokenizer"]


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalText:
    """The text of one request's output tokens (module docstring)."""

    __slots__ = ("_count", "_text", "_stream")

    def __init__(self) -> None:
        self._count, self._text = 0, ""  # the tokens decoded so far, their text
        self._stream: DecodeStream | None = None

    def text(self, tokens: list[int], tokenizer: Tokenizer, finished: bool = False) -> str:
        """The text of `tokens` (the request's output so far: it only grows)."""
        if finished:
            self._count, self._text = len(tokens), tokenizer.decode(tokens)
        elif self._count != len(tokens):
            if isinstance(tokenizer, FastTokenizer) and self._count < len(tokens):
                if self._stream is None:
                    # `Tokenizer.decode`'s default, so the texts agree.
                    self._stream = DecodeStream(skip_special_tokens=True)
                step = self._stream.step
                self._text += "".join(step(tokenizer, t) or "" for t in tokens[self._count :])
            else:
                self._text = tokenizer.decode(tokens)
            self._count = len(tokens)
        return self._text
