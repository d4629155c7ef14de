"""The dense reference: greedy tokens re-derived by a plain forward pass (no paging, no
cache, no batching), the check every engine output must pass under greedy sampling."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["DenseReference", "image_offsets"]


@functools.partial(jax.jit, static_argnames="graphdef")
def _dense_greedy(state, token_ids, embeds, *, graphdef):
    model = nnx.merge(graphdef, state)
    return jnp.argmax(model.forward_dense(token_ids, embeds), axis=-1)


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
    """`expected(prompt, outputs, images)`: the greedy token after every prefix.

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
        predicted = np.asarray(_dense_greedy(self._state, padded, embeds, graphdef=self._graphdef))
        start = len(prompt_token_ids) - 1
        return predicted[start : start + len(output_token_ids)].tolist()


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
