"""What the engine streams back: one `RequestOutput` per request that changed in a step."""

from __future__ import annotations

from dataclasses import dataclass, field


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
