"""`jaxkv serve`'s HTTP API: the OpenAI endpoints `vllm serve` has, over one `EngineLoop`.

Every handler runs on the event loop and only talks to the engine through the loop's
queue. A client's mistake is HTTP 400 (404 for an unknown model) with OpenAI's error
object, never a 500; a full server is 503 with `Retry-After`; a client that goes away
aborts its requests (their blocks are freed at the next step).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxkv.serving.engine_loop import EngineLoop, EngineLoopClosed, QueueFull, RequestStream
from jaxkv.serving.images import ServedImages
from jaxkv.serving.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from jaxkv.serving.protocol import ClientError, GenerationRequest, parse_chat, parse_completion

__all__ = ["ServedModel", "build_app"]

RETRY_AFTER_S = 1
# A request body's bound: room for its images' base64 (`MAX_IMAGE_BYTES` decoded, 4/3 of
# that encoded) and for text.
MAX_BODY_BYTES = 36 * 2**20


@dataclass
class ServedModel:
    """What the server needs of the model besides the engine: its name, its longest
    sequence, its tokenizer (None: token ids only), prompt encoder (chat templates) and
    how it takes images (None: text only)."""

    name: str
    max_model_len: int
    tokenizer: object | None = None
    encoder: object | None = None
    images: ServedImages | None = None


def _error(error: ClientError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _body_too_large() -> ClientError:
    return ClientError(
        f"the request body is larger than {MAX_BODY_BYTES} bytes ({MAX_BODY_BYTES >> 20} MiB)",
        status=413,
    )


async def _json_body(request: Request) -> object:
    """The body as JSON; a 413 once it passes `MAX_BODY_BYTES` (read no further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _body_too_large()
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise _body_too_large()
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ClientError(f"the request body is not valid JSON ({error})") from None


def build_app(loop: EngineLoop, model: ServedModel, metrics: ServerMetrics) -> FastAPI:
    """The FastAPI app serving `model` through `loop` (module docstring)."""
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None)
    generation = _Generation(loop, model, metrics)

    @app.exception_handler(ClientError)
    async def client_error(_request: Request, error: ClientError) -> JSONResponse:
        return _error(error)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if loop.failure else 200)

    @app.get("/version")
    async def version() -> dict:
        from importlib.metadata import version as package_version

        return {"version": package_version("jaxkv")}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "jaxkv",
            "root": model.name,
            "max_model_len": model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _json_body(request)
        tokens = _tokenize(body, model)
        return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _json_body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ClientError("tokens must be a list of token ids", "tokens")
        if model.tokenizer is None:
            raise ClientError("detokenizing needs the model's tokenizer.json", "tokens")
        return {"prompt": model.tokenizer.decode(tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            reset = await loop.call("reset_prefix_cache")
        except EngineLoopClosed as error:
            raise ClientError(str(error), status=503) from None
        return Response(status_code=200 if reset else 409)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        parsed = parse_completion(body, model.name, model.encoder, model.max_model_len)
        return await generation.respond(parsed, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        parsed = parse_chat(body, model.name, model.encoder, model.max_model_len, model.images)
        if parsed.image_urls:  # decoding and resizing take a while: off the event loop
            parsed.images = await asyncio.to_thread(model.images.pixels, parsed.image_urls)
        return await generation.respond(parsed, request)

    return app


def _tokenize(body: object, model: ServedModel) -> list[int]:
    if not isinstance(body, dict):
        raise ClientError("the request body must be a JSON object")
    if model.tokenizer is None:
        raise ClientError("tokenizing needs the model's tokenizer.json")
    if "messages" in body:
        parsed = parse_chat(
            {"messages": body["messages"]}, model.name, model.encoder, model.max_model_len,
            model.images,
        )  # fmt: skip
        return parsed.prompts[0]
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ClientError("prompt must be text (or give messages)", "prompt")
    add_special = body.get("add_special_tokens", True)
    if model.encoder is not None and add_special is True:
        return model.encoder.encode(prompt)
    return list(model.tokenizer.encode(prompt, add_special_tokens=bool(add_special)).ids)


class _Generation:
    """Runs one completions or chat call: its requests (prompt × sample) through the
    loop, the response whole or as server-sent events."""

    def __init__(self, loop: EngineLoop, model: ServedModel, metrics: ServerMetrics) -> None:
        self.loop, self.model, self.metrics = loop, model, metrics

    async def respond(self, parsed: GenerationRequest, request: Request) -> Response:
        streams = await self._submit(parsed)
        if parsed.stream:
            return StreamingResponse(self._events(parsed, streams), media_type="text/event-stream")
        watcher = asyncio.ensure_future(_disconnected(request))
        collected = asyncio.ensure_future(self._collect(parsed, streams))
        done, _ = await asyncio.wait({watcher, collected}, return_when=asyncio.FIRST_COMPLETED)
        if collected not in done:  # the client went away: stop its requests
            for stream in streams:
                self.loop.abort(stream.request_id)
            collected.cancel()
            return Response(status_code=499)
        watcher.cancel()
        return JSONResponse(collected.result())

    async def _submit(self, parsed: GenerationRequest) -> list[RequestStream]:
        """One request per prompt and sample, in choice order, their outputs on one
        queue; all or none."""
        streams: list[RequestStream] = []
        queue: asyncio.Queue = asyncio.Queue()
        try:
            for prompt in parsed.prompts:
                for sampling in parsed.samplings:
                    stream = await self.loop.submit(
                        prompt, queue, sampling=sampling, cache_salt=parsed.cache_salt,
                        images=parsed.images,
                    )  # fmt: skip
                    streams.append(stream)
        except BaseException as error:
            for stream in streams:
                self.loop.abort(stream.request_id)
            raise _as_client_error(
                error, "messages" if parsed.kind == "chat" else "prompt"
            ) from None
        return streams

    async def _outputs(self, parsed: GenerationRequest, streams: list[RequestStream]):
        """Lists of (choice index, output): what has come on the streams' shared queue
        since the last list, in order."""
        index_of = {stream.request_id: i for i, stream in enumerate(streams)}
        timers = [
            RequestTimer(self.metrics, stream.arrival, parsed.num_prompt_tokens(i // parsed.n))
            for i, stream in enumerate(streams)
        ]
        unfinished = set(range(len(streams)))
        try:
            while unfinished:
                batch = []
                for at, output in await streams[0].get_ready():
                    index = index_of[output.request_id]
                    timers[index].tokens(at, len(output.new_token_ids))
                    if output.finished:
                        timers[index].finished(at)
                        unfinished.discard(index)
                    batch.append((index, output))
                yield batch
        finally:  # also when the consumer stops early (a client that went away)
            for index in unfinished:
                self.loop.abort(streams[index].request_id)

    async def _collect(self, parsed: GenerationRequest, streams: list[RequestStream]) -> dict:
        choices = [
            {"token_ids": [], "text": [], "finish_reason": None, "stop_reason": None,
             "logprobs": [] if parsed.samplings[0].logprobs is not None else None,
             "prompt_token_ids": None}
            for _ in streams
        ]  # fmt: skip
        async for batch in self._outputs(parsed, streams):
            for index, output in batch:
                choice = choices[index]
                choice["token_ids"] += output.new_token_ids
                choice["prompt_token_ids"] = output.prompt_token_ids
                choice["text"].append(output.text or "")
                if choice["logprobs"] is not None:
                    pairs = zip(output.new_token_ids, output.logprobs or (), strict=False)
                    choice["logprobs"] += pairs
                choice["stop_reason"] = output.stop_reason
                if output.finished:
                    _check_failed(output)
                    choice["finish_reason"] = _finish_reason(output)
        return _response(parsed, choices)

    async def _events(
        self, parsed: GenerationRequest, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        """Server-sent events as vLLM streams them: a chunk per output that brings tokens
        (its text may be empty: a character still incomplete) or the finish (the events
        of outputs that queued up while the client's connection was busy go in one
        write); a chat's role chunks come with the first output, as its first token is
        ready; the usage chunk when asked, then `data: [DONE]`."""
        tokens = [0] * len(streams)
        started = [False] * len(streams)
        async for batch in self._outputs(parsed, streams):
            events = []
            for index, output in batch:
                first = not started[index] and bool(output.new_token_ids or output.finished)
                if first:
                    started[index] = True
                    events.append(_first_event(parsed, index, output))
                tokens[index] += len(output.new_token_ids)
                events.append(_event(parsed, index, output, first))
            if text := "".join(events):
                yield text
        if parsed.include_usage:
            yield _sse(
                {**_envelope(parsed, chunk=True), "choices": [], "usage": _usage(parsed, tokens)}
            )
        yield "data: [DONE]\n\n"


def _first_event(parsed: GenerationRequest, index: int, output) -> str:
    """What comes before a choice's first output: a chat's role chunk (with the prompt's
    token ids when asked, as vLLM's first chunk has them); nothing for a completion,
    whose first chunk carries them."""
    if parsed.kind != "chat":
        return ""
    chunk = _chunk(parsed, index, {"role": "assistant", "content": ""}, None)
    if parsed.return_token_ids:
        chunk["prompt_token_ids"] = output.prompt_token_ids
    return _sse(chunk)


def _event(parsed: GenerationRequest, index: int, output, first: bool = False) -> str:
    """One output's server-sent event ("" for an output with no tokens that does not
    finish: a prefill chunk); `first`: the choice's first event."""
    if output.finished and output.finish_reason == "error":
        return _sse(ClientError(output.error or "the request failed", status=500).body())
    reason = _finish_reason(output) if output.finished else None
    if not output.new_token_ids and reason is None:
        return ""
    text = output.text or ""
    delta = {"content": text} if parsed.kind == "chat" else text
    logprobs = None
    if parsed.samplings[0].logprobs is not None:
        pairs = zip(output.new_token_ids, output.logprobs or (), strict=False)
        logprobs = _logprobs_object(parsed.kind, list(pairs))
    chunk = _chunk(parsed, index, delta, reason, logprobs, output.stop_reason)
    if parsed.return_token_ids:
        choice = chunk["choices"][0]
        choice["token_ids"] = list(output.new_token_ids)
        if parsed.kind == "completion" and first:
            choice["prompt_token_ids"] = output.prompt_token_ids
    return _sse(chunk)


def _as_client_error(error: BaseException, param: str) -> BaseException:
    """The engine's refusal of a request (bad input) as a 400 naming `param` (or the
    sampling field it names); a full or closing loop as a 503; anything else unchanged."""
    if isinstance(error, ClientError):
        return error
    if isinstance(error, QueueFull | EngineLoopClosed):
        return ClientError(f"the server is busy: {error}", status=503)
    if isinstance(error, ValueError | TypeError | KeyError):
        message = str(error).strip("'\"")
        if message.startswith("SamplingParams."):  # "SamplingParams.<field>=... / must ..."
            param = re.split(r"[=\s]", message.removeprefix("SamplingParams."), maxsplit=1)[0]
        return ClientError(message, param)
    return error


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _check_failed(output) -> None:
    if output.finish_reason == "error":
        raise ClientError(output.error or "the request failed", status=500)


def _finish_reason(output) -> str:
    return output.finish_reason or "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _envelope(parsed: GenerationRequest, chunk: bool) -> dict:
    kind = {"completion": "text_completion", "chat": "chat.completion"}[parsed.kind]
    if chunk and parsed.kind == "chat":
        kind = "chat.completion.chunk"
    return {"id": parsed.id, "object": kind, "created": parsed.created, "model": parsed.model}


def _token_text(token_id: int, entry) -> str:
    text = getattr(entry, "decoded_token", None)
    return f"token_id:{token_id}" if text is None else text


def _logprobs_object(kind: str, pairs: list) -> dict:
    """OpenAI's logprobs of the (token id, position dictionary) pairs: completions'
    `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, or chat's `content`."""
    if kind == "chat":
        content = []
        for token_id, position in pairs:
            text = _token_text(token_id, position.get(token_id))
            tops = [{"token": _token_text(t, e), "logprob": e.logprob,
                     "bytes": list(_token_text(t, e).encode())}
                    for t, e in position.items() if t != token_id or e.rank == 1]  # fmt: skip
            content.append({"token": text, "logprob": position[token_id].logprob,
                            "bytes": list(text.encode()), "top_logprobs": tops})  # fmt: skip
        return {"content": content}
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for token_id, position in pairs:
        text = _token_text(token_id, position.get(token_id))
        tokens.append(text)
        values.append(position[token_id].logprob)
        tops.append({_token_text(t, e): e.logprob for t, e in position.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def _chunk(
    parsed: GenerationRequest, index: int, delta, reason: str | None,
    logprobs: dict | None = None, stop_reason=None,
) -> dict:  # fmt: skip
    if parsed.kind == "chat":
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stop_reason}  # fmt: skip
    return {**_envelope(parsed, chunk=True), "choices": [choice]}


def _usage(parsed: GenerationRequest, tokens: list[int]) -> dict:
    prompt = sum(parsed.num_prompt_tokens(i) for i in range(len(parsed.prompts)))
    completion = sum(tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _response(parsed: GenerationRequest, choices: list[dict]) -> dict:
    out = []
    for index, choice in enumerate(choices):
        text = "".join(choice["text"])
        pairs = choice["logprobs"]
        logprobs = None if pairs is None else _logprobs_object(parsed.kind, pairs)
        reason = choice["finish_reason"]
        if parsed.kind == "chat":
            message = {"role": "assistant", "content": text}
            out.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": reason})  # fmt: skip
        else:
            out.append({"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": reason, "stop_reason": choice["stop_reason"]})  # fmt: skip
        if parsed.return_token_ids:
            out[-1]["token_ids"] = choice["token_ids"]
            if parsed.kind == "completion":
                out[-1]["prompt_token_ids"] = choice["prompt_token_ids"]
    usage = _usage(parsed, [len(c["token_ids"]) for c in choices])
    response = {**_envelope(parsed, chunk=False), "choices": out, "usage": usage}
    if parsed.return_token_ids and parsed.kind == "chat":
        response["prompt_token_ids"] = choices[0]["prompt_token_ids"]
    return response
