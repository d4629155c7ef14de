"""`jaxkv serve` driven by the official `openai` client: the same tokens as
`LLMEngine.generate`, streaming with usage, OpenAI error objects, vLLM's metrics, client
disconnects that free their blocks, a full server answering 503."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from jaxkv import models
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.models.prompting import PromptEncoder
from jaxkv.models.testing import save_chat_checkpoint
from jaxkv.serving.app import MAX_BODY_BYTES, ServedModel
from jaxkv.serving.engine_loop import EngineLoop, EngineLoopClosed, QueueFull
from jaxkv.serving.images import MAX_IMAGE_BYTES, ServedImages
from jaxkv.serving.process import free_port
from jaxkv.serving.server import Server

CONFIG = EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=128)  # fmt: skip
PROMPTS = ["w5 w6 w7 w8 w9", "w5 w6 w7 w8 w10 w11", "w20"]
HTTP = httpx.Client(timeout=120)  # a new engine's first step compiles: allow for a slow CPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("llama"))


def make_engine(checkpoint, config: EngineConfig = CONFIG) -> tuple[LLMEngine, ServedModel]:
    tokenizer = models.load_tokenizer(checkpoint)
    engine = LLMEngine(models.load_model(checkpoint), config, tokenizer=tokenizer)
    encoder = PromptEncoder.from_dir(checkpoint, tokenizer)
    images = ServedImages.from_dir(checkpoint, tokenizer)
    return engine, ServedModel("tiny", config.max_model_len, tokenizer, encoder, images)


class Running:
    """A `Server` on a free loopback port, in a thread."""

    def __init__(self, checkpoint, config: EngineConfig = CONFIG, **kw) -> None:
        self.engine, self.served = make_engine(checkpoint, config)
        self.port = free_port()
        self.server = Server(self.engine, self.served, port=self.port, grace_s=2.0, **kw)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def running(checkpoint):
    server = Running(checkpoint)
    yield server
    server.stop()


def reference(checkpoint, prompts, max_tokens) -> list[str]:
    engine, served = make_engine(checkpoint)
    ids = [served.encoder.encode(p) for p in prompts]
    outputs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.shutdown()
    return [o.text for o in outputs]


def test_completions_give_generates_text_and_usage(running, checkpoint) -> None:
    response = running.client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in response.choices] == reference(checkpoint, PROMPTS, 6)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.finish_reason for c in response.choices} == {"length"}
    prompt_tokens = sum(len(running.served.encoder.encode(p)) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 18


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(running) -> None:
    messages = [{"role": "system", "content": "w30 w31"}, {"role": "user", "content": "w40 w41"}]
    kw = dict(model="tiny", messages=messages, max_completion_tokens=7, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = running.client.chat.completions.create(**kw)
    chunks = list(running.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_return_token_ids_stream_a_chunk_per_token(running, checkpoint, kind) -> None:
    """vLLM's `return_token_ids`: the prompt's ids once, each chunk's token ids, equal to
    `generate`'s and to the whole answer's; every output with a token is a chunk of its
    own, whatever its text (vLLM's chunking, which its benchmark's TTFT counts on)."""
    engine, served = make_engine(checkpoint)
    if kind == "chat":
        messages = [{"role": "user", "content": "w40 w41"}]
        prompt = served.encoder.encode_chat(messages)
        create = running.client.chat.completions.create
        kw = dict(messages=messages, max_completion_tokens=7)
    else:
        prompt = served.encoder.encode(PROMPTS[1])
        create, kw = running.client.completions.create, dict(prompt=PROMPTS[1], max_tokens=7)
    (expected,) = engine.generate([prompt], SamplingParams(max_tokens=7, ignore_eos=True))
    engine.shutdown()
    extra = {"ignore_eos": True, "return_token_ids": True}
    kw.update(model="tiny", temperature=0, extra_body=extra)
    whole = create(**kw).model_dump()
    chunks = [c.model_dump() for c in create(**kw, stream=True)]
    choices = [c["choices"][0] for c in chunks]
    if kind == "chat":
        assert whole["prompt_token_ids"] == chunks[0]["prompt_token_ids"] == prompt
        assert choices[0]["delta"]["role"] == "assistant" and choices[0].get("token_ids") is None
        choices = choices[1:]
    else:
        assert whole["choices"][0]["prompt_token_ids"] == choices[0]["prompt_token_ids"] == prompt
        assert all(c.get("prompt_token_ids") is None for c in choices[1:])
    assert whole["choices"][0]["token_ids"] == expected.output_token_ids
    assert [c["token_ids"] for c in choices] == [[t] for t in expected.output_token_ids]


def test_n_samples_and_seeds(running) -> None:
    response = running.client.completions.create(
        model="tiny", prompt="w5 w6", max_tokens=5, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    again = running.client.completions.create(
        model="tiny", prompt="w5 w6", max_tokens=5, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [c.text for c in again.choices]
    assert len({c.text for c in response.choices}) > 1, "samples seeded seed + i differ"


def test_stop_strings_and_logprobs_match_the_engine(running, checkpoint) -> None:
    engine, served = make_engine(checkpoint)
    ids = served.encoder.encode(PROMPTS[0])
    (full,) = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))
    engine.shutdown()
    stop = full.text.split()[3]  # a word the greedy answer writes
    response = running.client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert full.text.startswith(choice.text) and stop not in choice.text
    whole = running.client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = [pos[t].logprob for t, pos in zip(full.output_token_ids, full.logprobs, strict=True)]
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-6)
    assert all(len(top) >= 2 for top in whole.choices[0].logprobs.top_logprobs)
    chat = running.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], max_completion_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) >= 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("completion", "echo", True), ("completion", "logit_bias", {"7": 5}),
     ("completion", "prompt_logprobs", 1), ("completion", "guided_regex", "w5"),
     ("chat", "response_format", {"type": "json_object"}), ("chat", "tool_choice", "auto"),
     ("chat", "chat_template", "{{ 'x' * 100 }}" * 20), ("chat", "add_generation_prompt", False),
     ("chat", "chat_template_kwargs", {"enable_thinking": False}),
     ("chat", "skip_special_tokens", False)],
)  # fmt: skip
def test_fields_the_server_does_not_serve_are_refused_not_ignored(running, kind, field, value):
    """An answer that ignored one of these would look right and be wrong: a 400 naming the
    field (its value shown shortened); the field's neutral value is served."""
    if kind == "chat":
        create = running.client.chat.completions.create
        args = {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 2}
    else:
        create, args = running.client.completions.create, {"prompt": "w5", "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as raised:
        create(model="tiny", **args, extra_body={field: value})
    body = raised.value.body
    assert body["param"] == field and "not supported" in body["message"]
    assert len(body["message"]) < 120, body["message"]
    neutral = {"echo": False, "logit_bias": {}, "add_generation_prompt": True}
    if field in neutral:
        assert create(model="tiny", **args, extra_body={field: neutral[field]}).choices


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"temperature": 5}, openai.BadRequestError, "temperature"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"n": 0}, openai.BadRequestError, "n"),
        ({"best_of": 3}, openai.BadRequestError, "best_of"),
        ({"stop": 5}, openai.BadRequestError, "stop"),
        ({"logprobs": 21}, openai.BadRequestError, "logprobs"),
        ({"prompt": []}, openai.BadRequestError, "prompt"),
        ({"prompt": "w1 " * 200}, openai.BadRequestError, "prompt"),
        ({"model": "other"}, openai.NotFoundError, "model"),
    ],
)
def test_bad_requests_are_openai_errors_naming_the_field(running, kwargs, error, param) -> None:
    args = {"model": "tiny", "prompt": "w5", "max_tokens": 2, **kwargs}
    with pytest.raises(error) as raised:
        running.client.completions.create(**args)
    body = raised.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert body["message"]


def test_non_json_and_non_object_bodies_are_400(running) -> None:
    for content in (b"{", b"[1, 2]", b"\xff"):
        response = HTTP.post(f"{running.url}/v1/completions", content=content)
        assert response.status_code == 400 and "message" in response.json()["error"]


def test_a_body_past_the_bound_is_413_declared_or_streamed(running) -> None:
    """A body over `MAX_BODY_BYTES` is refused whether its length is declared (nothing is
    read) or it comes chunked (reading stops at the bound): the server's memory is bounded
    by the limit, not by what a client sends; the largest images a request may carry
    fit as base64."""
    assert MAX_BODY_BYTES > 4 * MAX_IMAGE_BYTES // 3 + 2**20
    big = b'{"prompt": "' + b"w5 " * (MAX_BODY_BYTES // 3 + 1) + b'"}'
    declared = HTTP.post(f"{running.url}/v1/completions", content=big)
    chunked = HTTP.post(
        f"{running.url}/v1/completions",
        content=(big[i : i + 2**20] for i in range(0, len(big), 2**20)),
    )
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert f"larger than {MAX_BODY_BYTES} bytes" in response.json()["error"]["message"]
    assert running.client.completions.create(model="tiny", prompt="w5", max_tokens=1).choices


def test_small_endpoints(running) -> None:
    assert HTTP.get(f"{running.url}/health").status_code == 200
    assert HTTP.get(f"{running.url}/version").json()["version"]
    models_list = running.client.models.list()
    assert [m.id for m in models_list.data] == ["tiny"]
    tokens = HTTP.post(f"{running.url}/tokenize", json={"prompt": "w5 w6"}).json()
    assert tokens["tokens"] == running.served.encoder.encode("w5 w6") and tokens["count"] == 3
    text = HTTP.post(f"{running.url}/detokenize", json={"tokens": tokens["tokens"][1:]}).json()
    assert text["prompt"] == "w5 w6"
    assert HTTP.post(f"{running.url}/reset_prefix_cache").status_code == 200
    running.client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=3)
    metrics = HTTP.get(f"{running.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "jaxkv:host_tier_hit_tokens_total",
    ):
        assert f"\n{name}" in metrics, name
    assert 'vllm:generation_tokens_total{model_name="tiny"} 0.0' not in metrics


def test_a_client_that_disconnects_frees_its_blocks(running) -> None:
    free = running.engine.num_free_blocks
    with HTTP.stream("POST", f"{running.url}/v1/completions", json={
        "model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 100, "stream": True,
        "ignore_eos": True,
    }) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while running.engine.num_free_blocks != free or running.server.loop.num_pending:
        assert time.monotonic() < deadline, "the request kept its blocks"
        time.sleep(0.05)


def test_a_full_server_answers_503_with_retry_after(checkpoint) -> None:
    server = Running(checkpoint, max_pending=1)
    step = server.engine.step
    server.engine.step = lambda: time.sleep(0.05) or step()  # the first request stays pending
    try:
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 100, "ignore_eos": True}
        with HTTP.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}
        ) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
            next(lines)
            busy = HTTP.post(f"{server.url}/v1/completions", json=body)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["type"] == "server_error"
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):
        HTTP.get(f"{server.url}/health")


def test_the_engine_loop_bounds_pending_requests_and_refuses_after_close(checkpoint) -> None:
    engine, _ = make_engine(checkpoint)
    loop = EngineLoop(engine, max_pending=1)

    async def scenario() -> None:
        stream = await loop.submit([5, 6], sampling=SamplingParams(max_tokens=3))
        with pytest.raises(QueueFull):
            await loop.submit([5, 6])
        output = None
        while output is None or not output.finished:
            _, output = await stream.get()
        assert len(output.output_token_ids) == 3
        while loop.num_pending:  # released by the stepping thread after the put
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="empty"):
            await loop.submit([])  # the engine's refusal, and nothing stays pending
        assert loop.num_pending == 0

    asyncio.run(scenario())
    loop.close(grace_s=1.0, timeout_s=30)
    with pytest.raises(EngineLoopClosed):
        asyncio.run(loop.submit([5]))
    assert engine.is_shut_down


def test_the_readmes_client_example_runs_against_the_server(running) -> None:
    import contextlib
    import io
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "OpenAI(" in b]
    block = block.replace("http://localhost:8000/v1", f"{running.url}/v1")
    block = block.replace("path/to/SmolLM2-135M-Instruct", "tiny")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    assert out.getvalue().strip()


def test_chat_content_may_be_a_list_of_text_parts(running) -> None:
    kw = dict(model="tiny", max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = running.client.chat.completions.create(
        messages=[{"role": "user", "content": "w40 w41\nw42"}], **kw
    )
    parts = [{"type": "text", "text": "w40 w41"}, {"type": "text", "text": "w42"}]
    as_parts = running.client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **kw
    )
    assert as_parts.choices[0].message.content == plain.choices[0].message.content
    assert as_parts.usage.prompt_tokens == plain.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(openai.BadRequestError, match="takes text only") as raised:
        running.client.chat.completions.create(
            messages=[{"role": "user", "content": [image]}], **kw
        )
    assert raised.value.body["param"] == "messages[0].content[0].image_url.url"


def test_begin_close_aborts_what_outlives_the_grace_period(checkpoint) -> None:
    engine, _ = make_engine(checkpoint)
    loop = EngineLoop(engine)

    async def scenario() -> None:
        sampling = SamplingParams(max_tokens=120, ignore_eos=True)
        stream = await loop.submit([5, 6], sampling=sampling)
        await stream.get()  # running
        loop.begin_close(grace_s=0.0)
        with pytest.raises(EngineLoopClosed):
            await loop.submit([5])
        output = None
        while output is None or not output.finished:
            _, output = await stream.get()
        assert output.finish_reason == "abort" and len(output.output_token_ids) < 120

    asyncio.run(scenario())
    loop.close(grace_s=0.0, timeout_s=30)
    assert loop.num_pending == 0 and engine.is_shut_down
