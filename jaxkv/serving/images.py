"""Images in chat requests for LLaVA-style models: `image_url` content parts whose URL is
a base64 `data:` URL, decoded and preprocessed as the checkpoint says (the same
`image_pixels` as `jaxkv generate --image`, so the engine hashes, caches and reuses an
image alike from either).

The server fetches nothing: an http(s) URL, a file path or any other scheme is refused.
Every problem with an image is a `ClientError` (HTTP 400) naming its field
(`messages[i].content[j].image_url.url`) and what is allowed, never a 500. Bounds: all
the images of one request decode to at most `MAX_IMAGE_BYTES` bytes (checked from the
encoded lengths before anything is decoded) and each has at most `MAX_IMAGE_PIXELS`
pixels (checked from its header before its pixels are decoded).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from jaxkv.models.checkpoint import read_config
from jaxkv.models.config import LlavaConfig, parse_model_config
from jaxkv.models.image import (
    PREPROCESSOR_CONFIG,
    image_pixels,
    load_preprocessor_config,
    preprocess_image,
)
from jaxkv.serving.errors import ClientError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "ImageURL", "ServedImages"]

MAX_IMAGE_BYTES = 20 * 2**20  # decoded, all images of a request together
MAX_IMAGE_PIXELS = 4096 * 4096  # per image: a LLaVA tower sees a few hundred pixels square
_EXAMPLE = "data:image/png;base64,iVBORw0KGgo..."


@dataclass(frozen=True)
class ImageURL:
    """One `image_url` part of a request: where it is (`field`, for errors) and its URL."""

    field: str
    url: str


def _payload(image: ImageURL) -> str:
    """The base64 text of a `data:[<media type>][;<param>]*;base64,<data>` URL (RFC 2397,
    as vLLM reads it: the media type is not checked, PIL decides what the bytes are)."""
    url, field = image.url, image.field
    if url[:5].lower() != "data:":
        raise ClientError(
            f"{field}: the server does not fetch images, got {url[:40]!r}; send the image "
            f"inline as a base64 data URL ({_EXAMPLE})",
            field,
        )
    spec, comma, data = url[5:].partition(",")
    if not comma:
        raise ClientError(f"{field}: a data URL needs a ',' before its data ({_EXAMPLE})", field)
    if spec.rpartition(";")[2].strip().lower() != "base64":
        raise ClientError(
            f"{field}: only base64 data URLs are supported ({_EXAMPLE}), got {url[:40]!r}", field
        )
    return data


def _decode(image: ImageURL, data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        message = f"{image.field}: the data URL is not valid base64 ({error})"
        raise ClientError(message, image.field) from None


@dataclass(frozen=True)
class ServedImages:
    """How the served LLaVA-style model takes images: the text of its image token (the
    placeholder a "string" chat template gets), the prompt tokens each image becomes and
    the checkpoint's `preprocessor_config.json` (None: it has none, and image requests
    are refused saying so)."""

    placeholder: str
    num_image_tokens: int
    preprocessor_config: dict[str, Any] | None
    checkpoint: str

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer | None) -> ServedImages | None:
        """The image interface of checkpoint `path`, None for a model without a vision
        tower. ValueError naming the file when its `preprocessor_config.json` does not
        produce the pixels the model takes (checked on a blank image)."""
        config = parse_model_config(read_config(path), f"{Path(path) / 'config.json'}")
        if not isinstance(config, LlavaConfig):
            return None
        token = tokenizer.id_to_token(config.image_token_id) if tokenizer is not None else None
        vision = config.vision
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        preprocessor = load_preprocessor_config(path)
        if preprocessor is not None:
            got = preprocess_image(Image.new("RGB", (8, 8)), preprocessor).shape
            if got != shape:
                raise ValueError(
                    f"{Path(path) / PREPROCESSOR_CONFIG}: makes pixels of shape {got}; the "
                    f"model takes {shape}"
                )
        return cls(token or "<image>", config.num_image_tokens, preprocessor, str(path))

    def pixels(self, images: list[ImageURL]) -> list[np.ndarray]:
        """The images as the engine takes them (`[C, H, W]` float32), in order: every URL
        and the total size checked before any image is decoded. Slow (decodes and
        resizes): run it off the event loop."""
        if self.preprocessor_config is None:
            raise ClientError(
                f"{images[0].field}: this model cannot take images: its checkpoint "
                f"{self.checkpoint} has no {PREPROCESSOR_CONFIG}",
                images[0].field,
            )
        payloads = [_payload(image) for image in images]
        size = sum(len(data) // 4 * 3 for data in payloads)  # decoded, within 2 bytes each
        if size > MAX_IMAGE_BYTES:
            raise ClientError(
                f"{images[0].field}: the request's {len(images)} image(s) are {size} bytes "
                f"decoded; the limit is {MAX_IMAGE_BYTES} bytes ({MAX_IMAGE_BYTES >> 20} MiB)",
                images[0].field,
            )
        out = []
        for image, data in zip(images, payloads, strict=True):
            stream = io.BytesIO(_decode(image, data))
            config, bound = self.preprocessor_config, MAX_IMAGE_PIXELS
            try:
                out.append(image_pixels(stream, config, name=image.field, max_pixels=bound))
            except ValueError as error:
                raise ClientError(str(error), image.field) from None
        return out
