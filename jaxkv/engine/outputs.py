"""What the engine streams back: one `RequestOutput` per request that changed in a step,
built by the request's `OutputStream`, with vLLM's `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxkv.engine.detokenizer import IncrementalText, Tokenizer
from jaxkv.engine.logprobs import Logprob
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxkv.request import Request


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """vLLM's one sample of a request: its index among the request's `n`, its tokens and
    text, per token its logprobs (None unless asked for) and their sum, and why it
    finished (`finish_reason`; `stop_reason`: the stop string or stop token id that
    stopped it, None for EOS or a length cap)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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

    vLLM's views: `outputs` (one `CompletionOutput` per sample; `output_token_ids`,
    `text`, `logprobs` and `finish_reason` are sample 0's) and `prompt_logprobs` (None
    for the first prompt token, then one dictionary per prompt token; for `DELTA` only on
    the first output). `logprobs` spans the same tokens as `output_token_ids`.

    Both token lists are spans of the request's output tokens, which only ever grow: an
    output keeps that list and its span, and each read returns a new list of the span.
    So a step's outputs copy no tokens, however long their requests have run.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "_tokens", "_start", "_new_start", "_end",
        "finished", "finish_reason", "text", "num_preemptions", "error",
        "num_cached_tokens", "num_host_cached_tokens", "weight_versions", "_logprobs",
        "cumulative_logprob", "stop_reason", "prompt_logprobs", "_completions",
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
        *,
        logprobs: list[PositionLogprobs] | None = None,
        cumulative_logprob: float | None = None,
        stop_reason: int | str | None = None,
        prompt_logprobs: list[PositionLogprobs | None] | None = None,
        completions: list[CompletionOutput] | None = None,
    ) -> None:
        """The output spans `tokens[start:end]`, its new tokens `tokens[new_start:end]`;
        `tokens` may grow later, never change; so may `logprobs` (one per token).
        `completions`: every sample's (None: sample 0 alone, from these fields)."""
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
        self._logprobs = logprobs
        self.cumulative_logprob = cumulative_logprob
        self.stop_reason = stop_reason
        self.prompt_logprobs = prompt_logprobs
        self._completions = completions

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

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        if self._logprobs is None:
            return None
        return self._logprobs[self._start : self._end]

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self._completions is not None:
            return list(self._completions)
        return [self.completion(0)]

    def completion(self, index: int) -> CompletionOutput:
        """This output's sample as a `CompletionOutput` with index `index`."""
        return CompletionOutput(
            index, self.text, self.output_token_ids, self.cumulative_logprob, self.logprobs,
            self.finish_reason, self.stop_reason,
        )  # fmt: skip

    def for_parent(
        self, request_id: str, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        """This output as its parent request's (`n > 1`): the parent's id, `completions`
        as its samples, `finished` when every sample is."""
        return RequestOutput(
            request_id, self.prompt_token_ids, self._tokens, self._start, self._new_start,
            self._end, finished, self.finish_reason, self.text, self.num_preemptions,
            self.error, self.num_cached_tokens, self.num_host_cached_tokens,
            logprobs=self._logprobs, cumulative_logprob=self.cumulative_logprob,
            stop_reason=self.stop_reason, prompt_logprobs=self.prompt_logprobs,
            completions=completions,
        )  # fmt: skip

    def __reduce__(self) -> tuple:
        """What pickles: this output's span alone, not the request's tokens and logprobs
        before it (an engine in another process sends each step's outputs), as the
        constructor's arguments: a flat tuple, which pickles several times faster than a
        state dictionary."""
        start, end = self._start, self._end
        return (
            _unpickle_output,
            (self.request_id, self.prompt_token_ids, self._tokens[start:end],
             self._new_start - start, self.finished, self.finish_reason, self.text,
             self.num_preemptions, self.error, self.num_cached_tokens,
             self.num_host_cached_tokens, self.weight_versions, self.logprobs,
             self.cumulative_logprob, self.stop_reason, self.prompt_logprobs,
             self._completions),
        )  # fmt: skip

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


def _unpickle_output(
    request_id, prompt_token_ids, tokens, new_start, finished, finish_reason, text,
    num_preemptions, error, num_cached_tokens, num_host_cached_tokens, weight_versions,
    logprobs, cumulative_logprob, stop_reason, prompt_logprobs, completions,
) -> RequestOutput:  # fmt: skip
    """`RequestOutput.__reduce__`'s other half: the output spanning all of `tokens`."""
    output = RequestOutput(
        request_id, prompt_token_ids, tokens, 0, new_start, len(tokens), finished,
        finish_reason, text, num_preemptions, error, num_cached_tokens,
        num_host_cached_tokens, logprobs=logprobs, cumulative_logprob=cumulative_logprob,
        stop_reason=stop_reason, prompt_logprobs=prompt_logprobs, completions=completions,
    )  # fmt: skip
    output.weight_versions = weight_versions
    return output


# What an output says, in the order its repr and equality read it.
_FIELDS = (
    "request_id", "prompt_token_ids", "new_token_ids", "output_token_ids", "finished",
    "finish_reason", "text", "num_preemptions", "error", "num_cached_tokens",
    "num_host_cached_tokens", "logprobs", "cumulative_logprob", "stop_reason",
    "prompt_logprobs",
)  # fmt: skip


@dataclass(slots=True)
class OutputStream:
    """One unfinished request's side of the engine's outputs: how they are built (its
    `RequestOutputKind`, fixed when the request is added), its cache salt, its logprobs
    so far (`logprobs`, `prompt_logprobs`: None unless asked for), its stop strings and,
    for `DELTA`, the characters of text already sent (each output sends what follows
    them). Every output repeats the cache hits of the request's first admission.

    Stop strings (vLLM's detokenizer): once past `min_tokens` outputs, the first stop
    string ending in a token's new text stops the request (`match_stop`); its text is cut
    before the string (after it with `include_stop_str_in_output`). Until it finishes, the
    last `max(len(stop)) - 1` characters are held back when the strings are cut."""

    delta: bool
    final_only: bool
    cache_salt: str | None = None
    num_sent_chars: int = 0
    num_logprobs: int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    num_prompt_logprobs: int | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_reason: int | str | None = None
    text_end: int | None = None  # where a stop string cut the text
    num_checked_chars: int = 0
    decoded: IncrementalText = field(default_factory=IncrementalText)

    @classmethod
    def for_kind(cls, kind: RequestOutputKind, cache_salt: str | None = None) -> OutputStream:
        return cls(
            kind is RequestOutputKind.DELTA, kind is RequestOutputKind.FINAL_ONLY, cache_salt
        )

    @classmethod
    def for_params(cls, params: SamplingParams, cache_salt: str | None = None) -> OutputStream:
        """The stream of a request sampled with `params`."""
        stream = cls.for_kind(params.output_kind, cache_salt)
        if params.logprobs is not None:
            stream.num_logprobs, stream.logprobs, stream.cumulative_logprob = (
                params.logprobs,
                [],
                0.0,
            )
        if params.prompt_logprobs is not None:
            stream.num_prompt_logprobs, stream.prompt_logprobs = params.prompt_logprobs, [None]
        stream.stop, stream.include_stop = params.stop, params.include_stop_str_in_output
        stream.min_tokens, stream.stop_token_ids = params.min_tokens, params.stop_token_ids
        return stream

    def add_logprobs(self, entry: PositionLogprobs, token: int) -> None:
        """Record the logprobs of the request's next output token `token`."""
        self.logprobs.append(entry)
        self.cumulative_logprob += entry[token].logprob

    def match_stop(self, tokens: list[int], tokenizer: Tokenizer) -> str | None:
        """The stop string the request's last token completed (its text cut, its
        `stop_reason` set), else None; None too when the tokenizer cannot decode."""
        try:
            text = self.decoded.text(tokens, tokenizer)
        except Exception:  # the output reports the failure
            return None
        checked, self.num_checked_chars = self.num_checked_chars, len(text)
        if len(tokens) <= self.min_tokens:
            return None
        best = None
        for stop in self.stop:  # the one ending first; ties: the first listed
            index = text.find(stop, max(0, checked - len(stop) + 1))
            if index >= 0 and (best is None or index + len(stop) < best[0] + len(best[1])):
                best = (index, stop)
        if best is None:
            return None
        index, self.stop_reason = best
        self.text_end = index + len(best[1]) if self.include_stop else index
        return best[1]

    def _visible_text(self, tokens: list[int], finished: bool, tokenizer: Tokenizer) -> str:
        text = self.decoded.text(tokens, tokenizer, finished)
        if self.text_end is not None:
            return text[: self.text_end]
        hold = 0 if finished or self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        return text[: len(text) - hold]

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
                text = self._visible_text(tokens, finish_reason is not None, tokenizer)
                if self.delta:
                    text, self.num_sent_chars = text[self.num_sent_chars :], len(text)
            except Exception as failure:  # a tokenizer that cannot decode: tokens still count
                error = f"the tokenizer could not decode the output: {failure}"
        prompt_logprobs = self.prompt_logprobs
        if self.delta and prompt_logprobs is not None:  # sent once, as vLLM does
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        num_cached = request.num_cached_tokens
        return RequestOutput(
            request.request_id, request.prompt_token_ids, tokens,
            new_start if self.delta else 0, new_start, end, finish_reason is not None,
            finish_reason, text, request.num_preemptions, error,
            num_cached if num_cached > 0 else 0, request.num_external_cached_tokens,
            logprobs=self.logprobs, cumulative_logprob=self.cumulative_logprob,
            stop_reason=self.stop_reason, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
