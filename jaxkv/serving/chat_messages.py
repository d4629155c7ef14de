"""A chat request's `messages` as its chat template takes them, as vLLM 0.33 passes them,
and the URLs of its images in prompt order.

A message's `content` is text or a non-empty list of parts: `{"type": "text", "text"}`
(or a bare string), `{"type": "image_url", "image_url": {"url"}}`. The template gets
(`jaxkv.models.chat_content` tells which format it takes):
- "openai": the parts as a list, text as `{"type": "text", "text": ...}` and an image as
  `{"type": "image"}` (the template writes the image token); text content is one part;
- "string": one string, the text parts joined by newlines, after one placeholder (the
  image token's text) per image that the text does not already hold, newline-separated.
  Text holding more placeholders than the message has images is refused.

Images to a model without a vision tower are refused. Every refusal is a `ClientError`
naming the message or part.
"""

from __future__ import annotations

from typing import Any

from jaxkv.models.chat_content import OPENAI
from jaxkv.serving.errors import ClientError
from jaxkv.serving.images import ImageURL, ServedImages

__all__ = ["template_messages"]

_PARTS = '{"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}'


def _role(message: Any, i: int) -> str:
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise ClientError(f"messages[{i}] must be an object with a role", "messages")
    return message["role"]


def _parts(message: dict, i: int) -> list[tuple[str, str]]:
    """The message's parts in order: ("text", text) or ("image", url)."""
    content = message.get("content")
    if isinstance(content, str):
        return [("text", content)]
    if not (isinstance(content, list) and content):
        raise ClientError(
            f"messages[{i}].content must be text or a non-empty list of content parts",
            "messages",
        )
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):  # vLLM takes a bare string as a text part
            parts.append(("text", part))
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str):
                raise ClientError(
                    f"{where}.image_url must be an object with a url (a base64 data URL), "
                    f"got {image_url!r:.80}",
                    f"{where}.image_url",
                )
            parts.append(("image", url))
        else:
            got = kind if kind is not None else type(part).__name__
            raise ClientError(f"{where} must be {_PARTS}, got {got!r:.80}", f"{where}.type")
    return parts


def _as_string(parts: list[tuple[str, str]], placeholder: str, i: int) -> str:
    text = "\n".join(value for kind, value in parts if kind == "text")
    images = sum(kind == "image" for kind, _ in parts)
    missing = images - text.count(placeholder) if images else 0
    if missing < 0:
        raise ClientError(
            f"messages[{i}].content holds more {placeholder!r} placeholders than the "
            f"{images} image(s) it gives",
            "messages",
        )
    return "\n".join([placeholder] * missing + ([text] if text else []))


def template_messages(
    messages: Any, content_format: str, images: ServedImages | None
) -> tuple[list[dict[str, Any]], list[ImageURL]]:
    """`messages` as the chat template's `messages` in `content_format` ("openai" or
    "string"), and their images' URLs in prompt order (module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list of messages", "messages")
    turns, urls = [], []
    for i, message in enumerate(messages):
        role = _role(message, i)
        parts = _parts(message, i)
        for j, (kind, value) in enumerate(parts):
            if kind == "image":
                urls.append(ImageURL(f"messages[{i}].content[{j}].image_url.url", value))
        if urls and images is None:
            raise ClientError(
                f"{urls[0].field}: this model takes text only (it has no vision tower); "
                "images need a LLaVA-style model",
                urls[0].field,
            )
        if content_format == OPENAI:
            content: Any = [
                {"type": "text", "text": value} if kind == "text" else {"type": "image"}
                for kind, value in parts
            ]
        else:
            content = _as_string(parts, images.placeholder if images else "", i)
        turns.append({"role": role, "content": content})
    return turns, urls
