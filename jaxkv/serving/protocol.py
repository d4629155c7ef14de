"""The OpenAI API's request bodies, checked field by field, and its response objects.

A bad field is a `ClientError` naming it (`param`) and what is allowed: the server
answers it as OpenAI does, HTTP 400 with `{"error": {"message", "type", "param",
"code"}}`. Fields the server does not use (`user`, `frequency_penalty` left at 0, ...)
are ignored, as vLLM ignores them; `n` samples of one prompt are `n` engine requests
(vLLM's fan-out), seeded `seed + i` when a seed is given.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxkv.models.chat_content import chat_content_format
from jaxkv.sampling_params import RequestOutputKind, SamplingParams
from jaxkv.serving.chat_messages import template_messages
from jaxkv.serving.errors import ClientError
from jaxkv.serving.images import ImageURL, ServedImages

__all__ = ["ClientError", "GenerationRequest", "parse_chat", "parse_completion"]

MAX_N = 128  # samples of one prompt (vLLM leaves it open; each is a request here)


@dataclass
class GenerationRequest:
    """What one completions or chat call asks: prompts (token ids), `n` samples of each,
    each sample's `SamplingParams` (seeded per sample), the response's shape, and a
    chat's images (only a chat has images, and it has one prompt)."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]
    samplings: list[SamplingParams]  # one per sample of a prompt, index i: seed + i
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    return_token_ids: bool = False  # vLLM's: token ids beside the text, prompt's too
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    image_urls: list[ImageURL] = field(default_factory=list)  # a chat's, in prompt order
    image_prompt_tokens: int = 0  # what the engine adds expanding the image tokens
    images: list[np.ndarray] | None = None  # the decoded `image_urls`, once decoded

    @property
    def n(self) -> int:
        return len(self.samplings)

    def num_prompt_tokens(self, index: int) -> int:
        """Prompt `index`'s tokens as the engine serves it (each image token expanded)."""
        return len(self.prompts[index]) + self.image_prompt_tokens


def _get(body: dict, name: str, kinds: tuple, default: Any = None, allowed: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # a bool is not a number here
    if not isinstance(value, kinds):
        raise ClientError(f"{name} must be {allowed}, got {body.get(name)!r}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = _get(body, name, (int, float), default, f"a number in [{low}, {high}]")
    if not (math.isfinite(value) and low <= value <= high):
        raise ClientError(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _prompt_ids(prompt: Any, encoder, name: str = "prompt") -> list[list[int]]:
    """`prompt` as OpenAI takes it: text, a list of texts, token ids, or lists of ids."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ClientError(f"{name} must be text, token ids or a non-empty list of them", name)
    out = []
    for item in prompts:
        if isinstance(item, str):
            if encoder is None:
                raise ClientError(f"{name}: text needs the model's tokenizer.json", name)
            out.append(encoder.encode(item))
        elif isinstance(item, list) and item and all(type(t) is int and t >= 0 for t in item):
            out.append(list(item))
        else:
            raise ClientError(f"{name} items must be text or non-empty lists of token ids", name)
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ClientError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    return [s for s in stops if s]


def _logprobs(body: dict, kind: str) -> int | None:
    """The top logprobs asked per position (None: none). Completions: `logprobs` (an int);
    chat: `logprobs` (a bool) with `top_logprobs` (an int)."""
    if kind == "completion":
        return _get(body, "logprobs", (int,), None, "an int >= 0")
    if not _get(body, "logprobs", (bool,), False, "a bool"):
        if body.get("top_logprobs") is not None:
            raise ClientError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return _get(body, "top_logprobs", (int,), 0, "an int >= 0")


def _samplings(
    body: dict, max_tokens: int, max_tokens_name: str, kind: str
) -> list[SamplingParams]:
    n = _get(body, "n", (int,), 1, f"an int in [1, {MAX_N}]")
    if not 1 <= n <= MAX_N:
        raise ClientError(f"n must be an int in [1, {MAX_N}], got {n!r}", "n")
    seed = _get(body, "seed", (int,), None, "an int")
    top_k = _get(body, "top_k", (int,), 0, "an int >= -1")
    stop_ids = _get(body, "stop_token_ids", (list,), [], "a list of token ids")
    kwargs = dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k,
        ignore_eos=_get(body, "ignore_eos", (bool,), False, "a bool"),
        stop_token_ids=stop_ids,
        stop=_stop(body),
        include_stop_str_in_output=_get(
            body, "include_stop_str_in_output", (bool,), False, "a bool"
        ),
        logprobs=_logprobs(body, kind),
        min_tokens=_get(body, "min_tokens", (int,), 0, "an int >= 0"),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-9, 1e9),
        output_kind=RequestOutputKind.DELTA,
    )
    out = []
    for i in range(n):
        try:
            out.append(SamplingParams(**kwargs, seed=None if seed is None else seed + i))
        except ValueError as error:  # "SamplingParams.<field> must be ..."
            param = str(error).split(" ", 1)[0].removeprefix("SamplingParams.")
            param = max_tokens_name if param == "max_tokens" else param
            raise ClientError(str(error).removeprefix("SamplingParams."), param) from None
    return out


# Fields of vLLM's requests whose meaning this server does not serve, and the values that
# ask nothing of it: anything else is refused, never silently ignored (an answer that
# ignored `echo`, `logit_bias` or a grammar would look right and be wrong). `chat_template`
# is refused as vLLM refuses it without `--trust-request-chat-template`.
_NOT_SERVED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "skip_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}


def _refuse_unserved(body: dict) -> None:
    for name, neutral in _NOT_SERVED.items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) for v in neutral) and value is not None:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
            raise ClientError(f"{name}={shown} is not supported by this server yet", name)


def _common(body: Any, kind: str, served_model: str) -> tuple[str, bool, bool, str | None]:
    if not isinstance(body, dict):
        raise ClientError("the request body must be a JSON object")
    model = _get(body, "model", (str,), served_model, "a string")
    if model != served_model:
        raise ClientError(
            f"the model {model!r} does not exist; this server serves {served_model!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    stream = _get(body, "stream", (bool,), False, "a bool")
    options = _get(body, "stream_options", (dict,), {}, "an object")
    include_usage = _get(options, "include_usage", (bool,), False, "a bool")
    salt = _get(body, "cache_salt", (str,), None, "a string")
    _refuse_unserved(body)
    return model, stream, include_usage, salt


def _max_tokens(body: dict, names: tuple[str, ...], default: int) -> tuple[int, str]:
    for name in names:
        if body.get(name) is not None:
            return _get(body, name, (int,), None, "an int >= 1"), name
    return default, names[0]


def _return_token_ids(body: dict) -> bool:
    return _get(body, "return_token_ids", (bool,), False, "a bool")


def parse_completion(body: Any, served_model: str, encoder, max_model_len: int):
    """A `/v1/completions` body as a `GenerationRequest`; text prompts encoded by the
    checkpoint's `PromptEncoder` (ClientError naming the field)."""
    model, stream, include_usage, salt = _common(body, "completion", served_model)
    if "prompt" not in body:
        raise ClientError("prompt is required", "prompt")
    prompts = _prompt_ids(body["prompt"], encoder)
    max_tokens, name = _max_tokens(body, ("max_tokens",), 16)
    return GenerationRequest(
        "completion",
        model,
        prompts,
        _samplings(body, max_tokens, name, "completion"),
        stream,
        include_usage,
        salt,
        return_token_ids=_return_token_ids(body),
        id=f"cmpl-{uuid.uuid4().hex}",
    )


def parse_chat(
    body: Any, served_model: str, encoder, max_model_len: int, images: ServedImages | None = None
) -> GenerationRequest:
    """A `/v1/chat/completions` body as a `GenerationRequest`: the messages through the
    checkpoint's chat template in the content format it takes, their images' URLs
    (`images`: how the model takes them, None for a text-only model) left to decode
    (ClientError naming the field)."""
    model, stream, include_usage, salt = _common(body, "chat", served_model)
    template = None if encoder is None else encoder.chat_template
    turns, urls = template_messages(body.get("messages"), chat_content_format(template), images)
    if template is None:
        why = "" if encoder is None else f" ({encoder.template_source})"
        raise ClientError(f"this model has no chat template{why}; use /v1/completions", "messages")
    try:
        prompt = encoder.encode_chat(turns)
    except ValueError as error:
        raise ClientError(str(error), "messages") from None
    expanded = len(urls) * (images.num_image_tokens - 1) if urls else 0
    default = max(max_model_len - len(prompt) - expanded, 1)
    max_tokens, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), default)
    return GenerationRequest(
        "chat",
        model,
        [prompt],
        _samplings(body, max_tokens, name, "chat"),
        stream,
        include_usage,
        salt,
        return_token_ids=_return_token_ids(body),
        id=f"chatcmpl-{uuid.uuid4().hex}",
        image_urls=urls,
        image_prompt_tokens=expanded,
    )
