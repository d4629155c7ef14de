"""The dense reference: greedy tokens re-derived by a plain forward pass (no paging, no
cache, no batching), the check every engine output must pass under greedy sampling."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

__all__ = ["DenseReference", "image_offsets"]


@functools.partial(jax.jit, static_argnames="graphdef")
def _dense_logits(state, token_ids, embeds, *, graphdef):
    return nnx.merge(graphdef, state).forward_dense(token_ids, embeds)


@functools.partial(jax.jit, static_argnames="graphdef")
def _embed_with_images(state, token_ids, pixel_values, offsets, *, graphdef):
    """Token embeddings with image `i`'s features written at rows `offsets[i]...`."""
    model = nnx.merge(graphdef, state)
    embeds = model.embed_tokens(token_ids)
    features = model.encode_images(pixel_values)
    for i in range(pixel_values.shape[0]):
        embeds = jax.lax.dynamic_update_slice_in_dim(
            embeds, features[i].astype(embeds.dtype), offsets[i], axis=0
        )
    return embeds


class DenseReference:
    """`expected(prompt, outputs, images)`: the greedy token after every prefix;
    `logits(...)`: the logits it is chosen from.

    Sequences are padded to `max_len` (causal attention ignores the padding), so one
    program serves every length.
    """

    def __init__(self, model, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        self._graphdef, self._state = nnx.split(model)

    def expected(
        self,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        images: Sequence[tuple[int, np.ndarray]] = (),
    ) -> list[int]:
        """Greedy tokens the model predicts for each output position.

        `images`: `(offset, pixel_values)` of each image's placeholder run in the prompt.
        """
        return self.logits(prompt_token_ids, output_token_ids, images).argmax(-1).tolist()

    def logits(
        self,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        images: Sequence[tuple[int, np.ndarray]] = (),
    ) -> np.ndarray:
        """`[len(output_token_ids), vocab]` float32: the logits after the prompt and each
        output token but the last (the rows output token `i` is chosen from)."""
        tokens = list(prompt_token_ids) + list(output_token_ids)
        if len(tokens) > self.max_len:
            raise ValueError(f"{len(tokens)} tokens exceed the reference's max_len={self.max_len}")
        padded = np.zeros(self.max_len, np.int32)
        padded[: len(tokens)] = tokens
        embeds = None
        if images:
            pixels = np.stack([np.asarray(p, np.float32) for _, p in images])
            offsets = np.array([o for o, _ in images], np.int32)
            embeds = _embed_with_images(
                self._state, padded, pixels, offsets, graphdef=self._graphdef
            )
        logits = np.asarray(_dense_logits(self._state, padded, embeds, graphdef=self._graphdef))
        start = len(prompt_token_ids) - 1
        return logits[start : start + len(output_token_ids)]


def image_offsets(prompt_token_ids: Sequence[int], image_token_id: int, length: int) -> list[int]:
    """Start of each run of `length` image placeholder tokens (as the engine expands them)."""
    offsets, i = [], 0
    while i < len(prompt_token_ids):
        if prompt_token_ids[i] == image_token_id:
            offsets.append(i)
            i += length
        else:
            i += 1
    return offsets
