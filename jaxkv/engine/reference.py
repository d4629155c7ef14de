"""The dense reference: greedy tokens re-derived by a plain forward pass (no paging, no
cache, no batching), the check every engine output must pass under greedy sampling."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["DenseReference", "image_offsets"]


class DenseReference:
    """`expected(prompt, outputs, images)`: the greedy token after every prefix.

    Sequences are padded to `max_len` (causal attention ignores the padding), so one
    program serves every length.
    """

    def __init__(self, model, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        graphdef, self._state = nnx.split(model)

        @jax.jit
        def greedy(state, token_ids, embeds):
            model = nnx.merge(graphdef, state)
            return jnp.argmax(model.forward_dense(token_ids, embeds), axis=-1)

        @jax.jit
        def embed(state, token_ids):
            return nnx.merge(graphdef, state).embed_tokens(token_ids)

        self._greedy, self._embed = greedy, embed
        self._encode = None
        if getattr(model.config, "image_token_id", None) is not None:
            self._encode = jax.jit(lambda state, px: nnx.merge(graphdef, state).encode_images(px))

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
            embeds = self._embed(self._state, jnp.asarray(padded))
            for offset, pixels in images:
                rows = self._encode(self._state, jnp.asarray(pixels, jnp.float32)[None])[0]
                embeds = embeds.at[offset : offset + rows.shape[0]].set(rows)
        predicted = np.asarray(self._greedy(self._state, jnp.asarray(padded), embeds))
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
