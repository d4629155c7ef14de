"""Device hand-off for a hybrid model: one block table per KV-cache group.

A global (full attention) layer and a sliding-window layer, each reading its
own group's table, driven by the host `KVCacheManager` through prefix hits,
chunked prefill, decode past the window (the sliding group's old blocks turn
into the null block and are reused by another request) and a new request.
Every step's attention output of both layers is checked against a dense
float64 reference computed from all the tokens' K/V.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_device_attention import rel_error

from jaxkv import (
    BlockTable,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    Request,
    SlidingWindowSpec,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from jaxkv.device import AttentionOptions, PagedKVCache, StepInputs, StepMetadataPacker

pytestmark = pytest.mark.usefixtures("fixed_none_hash")

BS, WINDOW, HEADS, Q_HEADS, D = 4, 6, 2, 4, 8
MAX_LEN, ROWS = 32, 2
SCALE = 0.35


def token_kv(layer: int, position: int, token: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V of a token: a function of (layer, position, token) only, so requests sharing a
    prefix share its K/V (what a prefix hit relies on)."""
    rng = np.random.default_rng([layer, position, token])
    return rng.standard_normal((HEADS, D)), rng.standard_normal((HEADS, D))


def dense_reference(tokens, q, start, layer, window):
    """float64 causal attention of queries at positions start.. over every token's K/V."""
    kv = [token_kv(layer, p, t) for p, t in enumerate(tokens)]
    k = np.repeat(np.stack([a for a, _ in kv]), Q_HEADS // HEADS, axis=1)
    v = np.repeat(np.stack([b for _, b in kv]), Q_HEADS // HEADS, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * SCALE
    q_pos = (start + np.arange(len(q)))[:, None]
    k_pos = np.arange(len(tokens))[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    logits = np.where(visible[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


class HybridModel:
    """Host manager + one paged cache, table and packer per group (global, sliding)."""

    def __init__(self, num_blocks: int = 24) -> None:
        full = FullAttentionSpec(BS, HEADS, D, "float32")
        sliding = SlidingWindowSpec(BS, HEADS, D, "float32", sliding_window=WINDOW)
        config = KVCacheConfig.from_groups([(full, ("global",)), (sliding, ("local",))], num_blocks)
        self.manager = KVCacheManager(config, MAX_LEN)
        self.windows = (None, WINDOW)
        self.caches = [PagedKVCache(spec, num_blocks) for spec in (full, sliding)]
        self.kv = [cache.allocate_stacked(1) for cache in self.caches]
        width = MAX_LEN // BS
        self.tables = [BlockTable(BS, ROWS, width, num_blocks) for _ in self.caches]
        self.packer = StepMetadataPacker(
            max_num_tokens=MAX_LEN, max_num_reqs=ROWS, max_blocks_per_req=width,
            block_size=BS, num_blocks=num_blocks,
        )  # fmt: skip
        self.hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256_cbor"))
        self.rows: dict[str, int] = {}
        self.rng = np.random.default_rng(0)

    def add(self, rid: str, tokens: list[int], row: int) -> tuple[Request, int]:
        req = Request(rid, tokens, block_hasher=self.hasher)
        self.rows[rid] = row
        blocks, num_hit, _ = self.manager.get_computed_blocks(req)
        req._hits = (blocks, num_hit)
        return req, num_hit

    def step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Allocate, hand each group its own table and slots, run both layers, check them."""
        for req, n in scheduled:
            hits = getattr(req, "_hits", None)
            if hits is not None:
                blocks, num_hit = hits
                new = self.manager.allocate_slots(req, n, num_hit, blocks)
                req.num_computed_tokens = num_hit
                del req._hits
            else:
                new = self.manager.allocate_slots(req, n)
            assert new is not None
        for layer, (cache, table, window) in enumerate(
            zip(self.caches, self.tables, self.windows, strict=True)
        ):
            rows, positions, tokens, k_new, v_new = [], [], [], [], []
            for req, n in scheduled:
                row = self.rows[req.request_id]
                table.add_row(self.manager.get_block_ids(req.request_id)[layer], row)
                start = req.num_computed_tokens
                for p in range(start, start + n):
                    k, v = token_kv(layer, p, req.all_token_ids[p])
                    rows.append(row)
                    positions.append(p)
                    k_new.append(k)
                    v_new.append(v)
                tokens.append(n)
            slots = table.compute_slot_mapping(np.array(rows), np.array(positions))
            order = [self.rows[r.request_id] for r, _ in scheduled]
            step = StepInputs(
                table.get_numpy_array()[order],
                np.array([r.num_computed_tokens + n for r, n in scheduled]),
                np.array(tokens),
                slots,
            )
            buf, shape = self.packer.pack(step)
            pad = shape.num_tokens - len(slots)
            q = self.rng.standard_normal((len(slots), Q_HEADS, D))

            def padded(x, width, pad=pad):
                return jnp.asarray(np.concatenate([x, np.zeros((pad, width, D))]), jnp.float32)

            self.kv[layer], out = cache.step(
                self.kv[layer], padded(q, Q_HEADS), padded(np.stack(k_new), HEADS),
                padded(np.stack(v_new), HEADS), self.packer.put(buf), shape,
                AttentionOptions(sm_scale=SCALE, sliding_window=window),
            )  # fmt: skip
            out = np.asarray(out, np.float64)
            offset = 0
            for req, n in scheduled:
                start = req.num_computed_tokens
                want = dense_reference(
                    req.all_token_ids[: start + n], q[offset : offset + n], start, layer, window
                )
                assert rel_error(out[offset : offset + n], want) < 1e-5, (req.request_id, layer)
                offset += n
        for req, n in scheduled:
            req.num_computed_tokens += n


def test_two_group_step_matches_dense_reference():
    model = HybridModel()
    m = model.manager
    a, hit = model.add("a", [5, 1, 7, 2, 9, 3, 3, 8, 1, 4, 6, 2, 7, 7], row=0)
    assert hit == 0
    model.step([(a, 9)])  # chunked prefill
    model.step([(a, 5)])
    a.append_output_token_ids(3)
    b, hit = model.add("b", [5, 1, 7, 2, 9, 3, 3, 8, 1, 4, 6, 2, 0, 1, 2], row=1)
    assert hit == 12  # window 6 needs 2 blocks ending at 12: both cached
    a_blocks = m.get_block_ids("a")
    model.step([(a, 1), (b, 3)])
    # b's hit: the global blocks a wrote; in the sliding group the 2 blocks ending at 12
    # (token 6 onwards is in the window of token 12), the first one null.
    b_blocks = m.get_block_ids("b")
    assert b_blocks[0][:3] == a_blocks[0][:3]
    assert b_blocks[1][:3] == [0, *a_blocks[1][1:3]]
    for _ in range(6):  # decode past the window: the sliding table fills with null blocks
        for r in (a, b):
            r.append_output_token_ids(int(r.num_tokens % 5))
        model.step([(a, 1), (b, 1)])
    # 20 computed before the last step: 20 - 6 + 1 = 15 tokens left the window.
    sliding_a = m.get_block_ids("a")[1]
    assert sliding_a[:3] == [0, 0, 0] and all(sliding_a[3:])
    m.free(a)
    c, hit = model.add("c", [2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6], row=0)
    assert hit == 0
    b.append_output_token_ids(1)
    free_before = {b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()}
    model.step([(c, 13), (b, 1)])  # c reuses freed pages; stale KV must never be read
    c_ids = set(m.get_block_ids("c")[0]) | set(m.get_block_ids("c")[1])
    assert c_ids <= free_before and c_ids & set(sliding_a)


def test_device_caches_allocate_from_the_planned_tensors():
    from jaxkv import get_kv_cache_config

    full = FullAttentionSpec(BS, HEADS, D, "bfloat16")
    sliding = SlidingWindowSpec(BS, HEADS, D, "bfloat16", sliding_window=WINDOW)
    specs = {"l0": sliding, "l1": full, "l2": sliding, "l3": full}
    config = get_kv_cache_config(specs, 40 * 2 * full.page_size_bytes, MAX_LEN, 8)
    assert config.num_blocks == 40 and len(config.kv_cache_tensors) == 2
    for tensor in config.kv_cache_tensors:
        for layer in tensor.shared_by:
            cache = PagedKVCache(specs[layer], tensor.size // specs[layer].page_size_bytes)
            assert cache.num_blocks == config.num_blocks and cache.cache_bytes == tensor.size
            kv = cache.allocate_stacked(1)
            assert kv.shape == (1, *cache.shape) and kv.nbytes == tensor.size
