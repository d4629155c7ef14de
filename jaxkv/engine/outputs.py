"""What the engine streams back: one `RequestOutput` per request that changed in a step,
built by the request's `OutputStream`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from jaxkv.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from jaxkv.request import Request


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class RequestOutput:
    """A request's progress: the tokens new since its last output (`new_token_ids`) and
    all of its tokens so far (`output_token_ids`; for a `RequestOutputKind.DELTA` request
    only the new tokens, and `text` only the new text). The new tokens of all of a
    request's outputs add up to all of its tokens, whatever the kind.

    `finished` is True exactly once, on the last output of a request; `finish_reason`
    is then "length", "stop", "abort" or "error". `error` says what went wrong: for a
    request `generate` could not accept (nothing else happened), or one whose part of a
    step failed (`finish_reason="error"`; the other requests were served).
    `num_cached_tokens`: prompt tokens served from a cache at first admission, the
    device prefix cache or the host tier (vLLM counts a connector's tokens too);
    `num_host_cached_tokens`: the host tier's share. `weight_versions`: the weight
    versions that sampled the request's tokens so far, oldest first.

    Both token lists are spans of the request's output tokens, which only ever grow: an
    output keeps that list and its span, and each read returns a new list of the span.
    So a step's outputs copy no tokens, however long their requests have run.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "_tokens", "_start", "_new_start", "_end",
        "finished", "finish_reason", "text", "num_preemptions", "error",
        "num_cached_tokens", "num_host_cached_tokens", "weight_versions",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        tokens: list[int],
        start: int,
        new_start: int,
        end: int,
        finished: bool,
        finish_reason: str | None = None,
        text: str | None = None,
        num_preemptions: int = 0,
        error: str | None = None,
        num_cached_tokens: int = 0,
        num_host_cached_tokens: int = 0,
    ) -> None:
        """The output spans `tokens[start:end]`, its new tokens `tokens[new_start:end]`;
        `tokens` may grow later, never change."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._tokens = tokens
        self._start = start
        self._new_start = new_start
        self._end = end
        self.finished = finished
        self.finish_reason = finish_reason
        self.text = text
        self.num_preemptions = num_preemptions
        self.error = error
        self.num_cached_tokens = num_cached_tokens
        self.num_host_cached_tokens = num_host_cached_tokens
        # The weight versions (`LLMEngine.weight_version`) that sampled its tokens so far,
        # in order; set by the engine.
        self.weight_versions: tuple[int | str, ...] = ()

    @classmethod
    def rejected(cls, prompt_token_ids: list[int], error: str) -> RequestOutput:
        """The only output of a prompt the engine could not accept."""
        return cls("", prompt_token_ids, [], 0, 0, 0, True, error=error)

    @property
    def new_token_ids(self) -> list[int]:
        return self._tokens[self._new_start : self._end]

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._start : self._end]

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={v!r}" for n, v in zip(_FIELDS, self._values(), strict=True))
        return f"RequestOutput({fields})"


# What an output says, in the order its repr and equality read it.
_FIELDS = (
    "request_id", "prompt_token_ids", "new_token_ids", "output_token_ids", "finished",
    "finish_reason", "text", "num_preemptions", "error", "num_cached_tokens",
    "num_host_cached_tokens",
)  # fmt: skip


@dataclass(slots=True)
class OutputStream:
    """One unfinished request's side of the engine's outputs: how they are built (its
    `RequestOutputKind`, fixed when the request is added), its cache salt and, for
    `DELTA`, the characters of text already sent (each output sends what follows them).
    Every output repeats the cache hits of the request's first admission."""

    delta: bool
    final_only: bool
    cache_salt: str | None = None
    num_sent_chars: int = 0

    @classmethod
    def for_kind(cls, kind: RequestOutputKind, cache_salt: str | None = None) -> OutputStream:
        return cls(
            kind is RequestOutputKind.DELTA, kind is RequestOutputKind.FINAL_ONLY, cache_salt
        )

    def output(
        self,
        request: Request,
        num_new_tokens: int,
        finish_reason: str | None,
        tokenizer: Tokenizer | None = None,
    ) -> RequestOutput:
        """The request's next output: its last `num_new_tokens` output tokens new (0 or
        1), finished when `finish_reason` is given; `text` decoded by `tokenizer` (if
        any)."""
        tokens = request.output_token_ids
        end = len(tokens)
        new_start = 0 if self.final_only else end - num_new_tokens
        text, error = None, None
        if tokenizer is not None:
            try:
                text = tokenizer.decode(tokens)
                if self.delta:
                    text, self.num_sent_chars = text[self.num_sent_chars :], len(text)
            except Exception as failure:  # a tokenizer that cannot decode: tokens still count
                error = f"the tokenizer could not decode the output: {failure}"
        num_cached = request.num_cached_tokens
        return RequestOutput(
            request.request_id, request.prompt_token_ids, tokens,
            new_start if self.delta else 0, new_start, end, finish_reason is not None,
            finish_reason, text, request.num_preemptions, error,
            num_cached if num_cached > 0 else 0, request.num_external_cached_tokens,
        )  # fmt: skip
