"""`preprocess_image`: a PIL image -> `[C, H, W]` float32 pixels, as a checkpoint's
`preprocessor_config.json` says (the steps of Hugging Face's CLIP/SigLIP image processors);
`load_image`: an image file or stream, decoded in full (ValueError naming it otherwise);
`image_pixels`: both, what `jaxkv generate --image` and `jaxkv serve` give the engine.

Steps, each switched by its `do_*` field: convert to RGB; resize (`size.shortest_edge`:
the short side to that length, the long side scaled and truncated; `size.height/width`:
exactly that size) with the PIL filter `resample` (bicubic by default); center crop to
`crop_size`; rescale by `rescale_factor` (1/255); normalize by `image_mean`/`image_std`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from jaxkv.models.checkpoint import read_json

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def _size(value: Any, name: str) -> dict[str, int]:
    if isinstance(value, int):
        return {"height": value, "width": value}
    if isinstance(value, Mapping) and (
        "shortest_edge" in value or ("height" in value and "width" in value)
    ):
        return {k: int(v) for k, v in value.items() if v is not None}
    raise ValueError(
        f"preprocessor_config {name}={value!r}: expected an int, "
        "{'shortest_edge': N} or {'height': H, 'width': W}"
    )


def load_image(
    source: str | Path | BinaryIO, *, name: str | None = None, max_pixels: int | None = None
) -> Image.Image:
    """The image in file (or binary stream) `source`, decoded in full (so a truncated
    file fails here).

    ValueError naming it (`name`, else `source`) when it is missing, a directory, not an
    image PIL reads in full (PNG, JPEG, ...), or, given `max_pixels`, larger than that:
    the size is checked from the header, before the pixels are decoded.
    """
    name = str(source) if name is None else name
    try:
        with Image.open(source) as image:
            pixels = image.width * image.height
            if max_pixels is None or pixels <= max_pixels:
                image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        # PIL: UnidentifiedImageError / "image file is truncated" (OSError), "broken PNG
        # file" (SyntaxError); the OS: FileNotFoundError, IsADirectoryError. PIL's message
        # may hold a stream's repr, which says nothing (`name` says which image it is).
        detail = str(error)
        if not isinstance(source, str | Path):
            detail = detail.replace(f" {source!r}", "")
        raise ValueError(
            f"{name}: not an image file PIL can read in full, e.g. a PNG or JPEG ({detail})"
        ) from None
    if max_pixels is not None and pixels > max_pixels:
        raise ValueError(
            f"{name}: the image is {image.width}x{image.height} = {pixels} pixels; the limit "
            f"is {max_pixels} pixels"
        )
    return image


def load_preprocessor_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint's `preprocessor_config.json` (how to preprocess its images), None
    when it has none; ValueError naming the file when it is not a JSON object."""
    path = Path(model_dir) / PREPROCESSOR_CONFIG
    if not path.is_file():
        return None
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def image_pixels(
    source: str | Path | BinaryIO,
    preprocessor_config: Mapping[str, Any],
    *,
    name: str | None = None,
    max_pixels: int | None = None,
) -> np.ndarray:
    """The image in `source` (`load_image`) as the engine takes it: RGB, preprocessed
    (`preprocess_image`) into `[C, H, W]` float32 pixels."""
    image = load_image(source, name=name, max_pixels=max_pixels)
    return preprocess_image(image.convert("RGB"), preprocessor_config)


def resized_size(height: int, width: int, size: Mapping[str, int]) -> tuple[int, int]:
    """The (height, width) a resize to `size` gives an image of `height x width`."""
    if "shortest_edge" in size:
        short, long = sorted((height, width))
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)
    return size["height"], size["width"]


def preprocess_image(image: Image.Image, preprocessor_config: Mapping[str, Any]) -> np.ndarray:
    """Pixels `[C, H, W]` float32 of `image` (see the module docstring)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"image must be a PIL.Image.Image, got {type(image).__name__}")
    cfg = preprocessor_config
    if cfg.get("do_convert_rgb", True):
        image = image.convert("RGB")
    if cfg.get("do_resize", True):
        size = _size(cfg.get("size", {"shortest_edge": 224}), "size")
        h, w = resized_size(image.height, image.width, size)
        resample = Image.Resampling(int(cfg.get("resample", Image.Resampling.BICUBIC)))
        image = image.resize((w, h), resample=resample, reducing_gap=None)
    pixels = np.asarray(image, dtype=np.float32)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if cfg.get("do_center_crop", False):
        crop = _size(cfg.get("crop_size", 224), "crop_size")
        ch, cw = crop["height"], crop["width"]
        h, w = pixels.shape[:2]
        if ch > h or cw > w:
            pad_h, pad_w = max(ch - h, 0), max(cw - w, 0)
            pixels = np.pad(
                pixels, ((pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
            )
            h, w = pixels.shape[:2]
        top, left = (h - ch) // 2, (w - cw) // 2
        pixels = pixels[top : top + ch, left : left + cw]
    if cfg.get("do_rescale", True):
        pixels = pixels * np.float32(cfg.get("rescale_factor", 1 / 255))
    if cfg.get("do_normalize", True):
        mean = np.asarray(cfg.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), np.float32)
        std = np.asarray(cfg.get("image_std", [0.26862954, 0.26130258, 0.27577711]), np.float32)
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
