"""Paged serving of the decoders gives the dense reference's tokens and logits.

For each family (Gemma 1/2/3, Llama) on a tiny random checkpoint: greedy tokens from the
paged loop (prefill + decode, chunked prefill with tiny chunks, prompts longer than the
sliding window, prefix hit vs miss) are identical to `forward_dense` recomputing the
whole sequence, and the logits agree within float32 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from models_util import family_configs

from jaxkv.models import load_model, save_random_checkpoint
from jaxkv.testing.paged_generate import PagedGenerator, dense_greedy

NUM_NEW = 5


@pytest.fixture(scope="module", params=sorted(family_configs()))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_checkpoint(path, family_configs()[request.param], seed=3)
    return load_model(path)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def check_against_dense(model, batch, outputs, logits) -> None:
    dense = model.dense_fn()
    for prompt, out, out_logits in zip(batch, outputs, logits, strict=True):
        expected, expected_logits = dense_greedy(dense, prompt, NUM_NEW)
        assert out == expected
        np.testing.assert_allclose(np.stack(out_logits), np.stack(expected_logits),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(("chunk_size", "group_by_spec"), [(2, False), (64, True)])
def test_paged_matches_dense(model, chunk_size, group_by_spec):
    """Mixed batch, prompts up to 3x the sliding window (8), tiny or whole-prompt chunks;
    one KV-cache group, or sliding and full layers in groups of their own."""
    batch = prompts(7, [1, 6, 13, 25])
    gen = PagedGenerator(model, block_size=4, max_num_tokens=64, group_by_spec=group_by_spec)
    expected_groups = len(set(model.config.layer_types)) if group_by_spec else 1
    assert len(gen.caches) == expected_groups
    outputs = gen.generate(batch, NUM_NEW, chunk_size=chunk_size)
    assert all(len(o) == NUM_NEW for o in outputs)
    check_against_dense(model, batch, outputs, gen.last_logits)


def test_prefix_hit_gives_the_same_tokens_as_a_miss(model):
    shared = prompts(11, [17])[0]
    first, second = shared + [5, 6, 7], shared + [9]
    gen = PagedGenerator(model, block_size=4, max_num_tokens=64, group_by_spec=True)
    gen.generate([first], NUM_NEW, chunk_size=5)
    assert gen.num_cached_tokens == 0
    hit = gen.generate([second], NUM_NEW, chunk_size=5)
    assert gen.num_cached_tokens == 16  # four full blocks of the shared prefix
    miss = PagedGenerator(model, block_size=4, max_num_tokens=64).generate(
        [second], NUM_NEW, chunk_size=5
    )
    assert hit == miss
    check_against_dense(model, [second], hit, gen.last_logits)
