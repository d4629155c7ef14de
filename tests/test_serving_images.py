"""`jaxkv serve` takes images as base64 data URLs for a LLaVA-style model (vLLM's chat
format): the official `openai` client gets `LLMEngine`'s tokens for the rendered prompt
and image, a repeated image is served from the prefix cache, and every bad image is a
400 naming its field; the "string" content format places images as vLLM does."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re

import numpy as np
import pytest
from PIL import Image
from test_serving import HTTP, Running

from jaxkv import models
from jaxkv.engine import SamplingParams
from jaxkv.models.image import image_pixels
from jaxkv.models.prompting import PromptEncoder
from jaxkv.models.testing import CHAT_TEMPLATE, TINY_PREPROCESSOR, save_chat_checkpoint
from jaxkv.serving.errors import ClientError
from jaxkv.serving.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageURL, ServedImages
from jaxkv.serving.protocol import parse_chat

IMAGE_TOKEN = 255  # tiny_configs()["llava-tiny"]["image_token_index"]
IMAGE_TOKENS = 16  # the tiny tower's features per image
URL_FIELD = "messages[0].content[1].image_url.url"
KW = dict(model="tiny", max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("llava"), "llava-tiny")


@pytest.fixture(scope="module")
def running(checkpoint):
    server = Running(checkpoint)
    yield server
    server.stop()


def png(seed: int, size: tuple[int, int] = (20, 30)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    stream = io.BytesIO()
    Image.fromarray(pixels).save(stream, format="PNG")
    return stream.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(text: str, *images: bytes) -> list[dict]:
    """One user message: the text, then the images."""
    parts = [{"type": "text", "text": text}] + [image_part(data_url(i)) for i in images]
    return [{"role": "user", "content": parts}]


def engine_output(running: Running, prompt: list[int], image: bytes, max_tokens: int):
    """`LLMEngine.generate` of `prompt` with `image` (preprocessed as `jaxkv generate
    --image` does) on the server's own engine (its compiled programs, a cold prefix
    cache), run on the stepping thread while the server is idle."""
    pixels = image_pixels(io.BytesIO(image), TINY_PREPROCESSOR)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def generate(engine):
        assert engine.reset_prefix_cache()
        (out,) = engine.generate([prompt], sampling, images=[[pixels]])
        return out

    return asyncio.run(running.server.loop.call(generate))


def prefix_cache_hits(running: Running) -> float:
    text = HTTP.get(f"{running.url}/metrics").text
    (value,) = re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def test_an_image_chat_gives_the_engines_tokens(running) -> None:
    image = png(0)
    response = running.client.chat.completions.create(messages=ask("w40 w41", image), **KW)
    # The template writes a message's images before its text (LLAVA_CHAT_TEMPLATE).
    tokenizer = running.served.tokenizer
    rendered = "<bos><turn> user <image> w40 w41 <end> <turn>"
    prompt = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert prompt.count(IMAGE_TOKEN) == 1
    expected = engine_output(running, prompt, image, 6)
    assert expected.error is None and len(expected.output_token_ids) == 6
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.prompt_tokens == len(prompt) + IMAGE_TOKENS - 1


def test_the_same_image_again_is_served_from_the_prefix_cache(running) -> None:
    image, other = png(1), png(2)
    first = running.client.chat.completions.create(messages=ask("w50 w51", image), **KW)
    before = prefix_cache_hits(running)
    # The same prompt, its text in two parts (joined as one by the template).
    parts = [{"type": "text", "text": "w50"}, image_part(data_url(image))]
    parts.append({"type": "text", "text": "w51"})
    again = running.client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **KW
    )
    hits = prefix_cache_hits(running) - before
    assert again.choices[0].message.content == first.choices[0].message.content
    assert hits >= IMAGE_TOKENS, "the image's blocks were not reused"
    running.client.chat.completions.create(messages=ask("w50 w51", other), **KW)
    # Another image: its first block (it holds the image's first token) differs.
    assert prefix_cache_hits(running) - before == hits


def _bomb() -> bytes:
    """A small PNG of more pixels than the server decodes."""
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    stream = io.BytesIO()
    Image.new("1", (side, side)).save(stream, format="PNG")
    return stream.getvalue()


@pytest.mark.parametrize(
    ("part", "param", "match"),
    [
        (image_part("https://example.com/cat.png"), URL_FIELD, "does not fetch images"),
        (image_part("/etc/passwd"), URL_FIELD, "does not fetch images"),
        (image_part("file:///etc/passwd"), URL_FIELD, "does not fetch images, got 'file:"),
        (image_part("data:image/png;base64"), URL_FIELD, "needs a ','"),
        (image_part("data:image/png,abc"), URL_FIELD, "only base64 data URLs"),
        (image_part("data:image/png;base64,@@@@"), URL_FIELD, "not valid base64"),
        (image_part(data_url(b"not an image")), URL_FIELD, "not an image file PIL can read"),
        (image_part(data_url(png(0)[:60])), URL_FIELD, "not an image file PIL can read"),
        (image_part(data_url(_bomb())), URL_FIELD, f"the limit is {MAX_IMAGE_PIXELS} pixels"),
        (
            image_part("data:image/png;base64," + "A" * (MAX_IMAGE_BYTES // 3 * 4 + 4)),
            URL_FIELD,
            "decoded; the limit is 20971520 bytes \\(20 MiB\\)",
        ),
        ({"type": "image_url", "image_url": {}}, "messages[0].content[1].image_url", "a url"),
        ({"type": "input_audio"}, "messages[0].content[1].type", "'input_audio'"),
    ],
    ids=[
        "https",
        "path",
        "file",
        "no-comma",
        "not-base64-url",
        "bad-base64",
        "not-an-image",
        "truncated",
        "too-many-pixels",
        "oversized",
        "no-url",
        "unknown-part",
    ],  # fmt: skip
)
def test_a_bad_image_is_a_400_naming_its_field(running, part, param, match) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "w40"}, part]}]
    response = HTTP.post(
        f"{running.url}/v1/chat/completions", json={"model": "tiny", "messages": messages}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert re.search(match, error["message"]), error["message"]
    assert running.server.loop.num_pending == 0


def test_more_images_than_the_model_length_holds_is_the_engines_400(running) -> None:
    """Eight images take 128 prompt tokens: with the text, past max_model_len=128."""
    images = [png(10 + i, (8, 8)) for i in range(8)]
    response = HTTP.post(
        f"{running.url}/v1/chat/completions",
        json={"model": "tiny", "messages": ask("w40", *images)},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "max_model_len=128" in error["message"], error
    assert running.server.loop.num_pending == 0


# ---------------------------------------------------------------- without a server


@pytest.fixture(scope="module")
def served_images(checkpoint) -> ServedImages:
    return ServedImages.from_dir(checkpoint, models.load_tokenizer(checkpoint))


def test_a_string_template_gets_placeholders_before_the_text_as_vllm(checkpoint, served_images):
    """vLLM's "string" content format: the text parts joined by newlines, after a
    placeholder per image the text does not already hold."""
    tokenizer = models.load_tokenizer(checkpoint)
    encoder = PromptEncoder(tokenizer, {"bos_token": "<bos>"}, CHAT_TEMPLATE)
    image = image_part(data_url(png(0)))

    def prompt(*parts) -> list[int]:
        body = {"messages": [{"role": "user", "content": list(parts)}]}
        return parse_chat(body, "tiny", encoder, 128, served_images).prompts[0]

    def encoded(text: str) -> list[int]:
        rendered = f"<bos><turn> user {text} <end> <turn>"
        return tokenizer.encode(rendered, add_special_tokens=False).ids

    text = {"type": "text", "text": "w40"}
    assert prompt(text, image, {"type": "text", "text": "w41"}) == encoded("<image>\nw40\nw41")
    assert prompt(image, image) == encoded("<image>\n<image>")
    assert prompt({"type": "text", "text": "w40 <image> w41"}, image) == encoded("w40 <image> w41")
    with pytest.raises(ClientError, match="more '<image>' placeholders than the 1 image"):
        prompt({"type": "text", "text": "<image> <image>"}, image)


def test_images_to_a_checkpoint_without_a_preprocessor_config_are_refused(served_images):
    bare = ServedImages(served_images.placeholder, IMAGE_TOKENS, None, "ckpt")
    with pytest.raises(ClientError, match="ckpt has no preprocessor_config.json") as raised:
        bare.pixels([ImageURL(URL_FIELD, data_url(png(0)))])
    assert raised.value.param == URL_FIELD


def test_a_preprocessor_config_of_other_pixels_fails_at_startup(tmp_path) -> None:
    path = save_chat_checkpoint(tmp_path, "llava-tiny")
    config = {**TINY_PREPROCESSOR, "crop_size": {"height": 32, "width": 32}, "size": 32}
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"shape \(3, 32, 32\); the model takes \(3, 16, 16\)"):
        ServedImages.from_dir(path, models.load_tokenizer(path))
