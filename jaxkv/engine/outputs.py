"""What the engine streams back: one `RequestOutput` per request that changed in a step,
built by the request's `OutputStream`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from jaxkv.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from jaxkv.request import Request


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
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
    `num_host_cached_tokens`: the host tier's share.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str | None = None
    num_preemptions: int = 0
    error: str | None = None
    num_cached_tokens: int = field(default=0)
    num_host_cached_tokens: int = 0


@dataclass(slots=True)
class OutputStream:
    """One unfinished request's side of the engine's outputs: how they are built (its
    `RequestOutputKind`, fixed when the request is added), its cache salt, the cache hits
    of its first admission (every later output repeats them) and, for `DELTA`, the
    characters of text already sent (each output sends what follows them)."""

    delta: bool
    final_only: bool
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    num_sent_chars: int = 0

    @classmethod
    def for_kind(cls, kind: RequestOutputKind, cache_salt: str | None = None) -> OutputStream:
        return cls(
            kind is RequestOutputKind.DELTA, kind is RequestOutputKind.FINAL_ONLY, cache_salt
        )

    def output(
        self,
        request: Request,
        new_token_id: int | None,
        finish_reason: str | None,
        tokenizer: Tokenizer | None = None,
    ) -> RequestOutput:
        """The request's next output: `new_token_id` appended (None: none), finished
        when `finish_reason` is given; `text` decoded by `tokenizer` (if any)."""
        outputs = request.output_token_ids
        if self.final_only:  # new since the last output: everything
            new_token_ids = list(outputs)
        else:
            new_token_ids = [] if new_token_id is None else [new_token_id]
        text, error = None, None
        if tokenizer is not None:
            try:
                text = tokenizer.decode(outputs)
                if self.delta:
                    text, self.num_sent_chars = text[self.num_sent_chars :], len(text)
            except Exception as failure:  # a tokenizer that cannot decode: tokens still count
                error = f"the tokenizer could not decode the output: {failure}"
        output_token_ids = list(new_token_ids if self.delta else outputs)
        finished = finish_reason is not None
        return RequestOutput(  # in field order
            request.request_id, request.prompt_token_ids, new_token_ids, output_token_ids,
            finished, finish_reason, text, request.num_preemptions, error,
            self.num_cached_tokens, self.num_host_cached_tokens,
        )  # fmt: skip
