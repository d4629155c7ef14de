"""Mamba "align" hybrids: partial (sub-block) prefix hits with copy-on-write, exact numbers.

As vLLM: where `partial_hash_hits_enabled` holds (a Mamba "align" group coarser than
the hash unit), a hit may end inside a block; that shared block is redirected to a
private copy before the request writes into it, and `take_kv_cache_block_copies()`
hands the copies (and their retained endpoints) to the device side. The last test runs
the copies through `PagedKVCache` under the engine's `Scheduler` and checks every
request's KV against a dense reference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_hybrid_managers import SHA, check_invariants, full, mamba

from jaxkv import (
    BlockPool,
    KVCacheBlockCopy,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    get_request_block_hasher,
)
from jaxkv.engine.scheduler import Scheduler, SchedulerConfig
from jaxkv.hashing import make_block_hash_with_group_id
from jaxkv.kv_cache_interface import (
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)

pytestmark = pytest.mark.usefixtures("fixed_none_hash")

PREFIX = [(7 * i) % 5 for i in range(48)]


def manager_for(*specs, num_blocks=40, hash_block_size=16, **kwargs) -> KVCacheManager:
    config = KVCacheConfig.from_groups([(s, (f"l{i}",)) for i, s in enumerate(specs)], num_blocks)
    return KVCacheManager(config, 256, hash_block_size=hash_block_size, **kwargs)


def request(rid, tokens, max_tokens=None) -> Request:
    return Request(
        rid, list(tokens), block_hasher=get_request_block_hasher(16, SHA), max_tokens=max_tokens
    )


def admit(m: KVCacheManager, req: Request, num_new: int | None = None):
    blocks, num_hit, _ = m.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    new = m.allocate_slots(req, num_new, num_hit, blocks)
    assert new is not None
    req.num_computed_tokens = num_hit + num_new
    return num_hit, new.get_block_ids()


def step(m: KVCacheManager, req: Request, num_new: int):
    new = m.allocate_slots(req, num_new)
    assert new is not None
    req.num_computed_tokens += num_new
    return new.get_block_ids()


def drain(m: KVCacheManager) -> list[KVCacheBlockCopy]:
    """Run the copies (here: nothing to run) and release their endpoints."""
    copies, retained = m.take_kv_cache_block_copies()
    assert [b.block_id for b in retained] == [i for c in copies for i in c]
    m.block_pool.free_blocks(retained)
    return copies


def test_checkpoint_position_and_validity_rules():
    # Leaves one token for the logits; EAGLE one hash unit lower.
    assert get_mamba_prefill_checkpoint_position(57, 16, False) == 48
    assert get_mamba_prefill_checkpoint_position(48, 16, False) == 32
    assert get_mamba_prefill_checkpoint_position(57, 16, True) == 32
    assert get_mamba_prefill_checkpoint_position(10, 16, True) == 0
    assert get_mamba_prefill_checkpoint_position(40, 16, False, num_hash_lookahead_tokens=9) == 16
    # A step [0, 100) on Mamba blocks of 32 can export a state at 48 (column 2 > -1).
    assert is_mamba_prefill_checkpoint_valid(0, 100, 48, 16, 32, 16)
    assert not is_mamba_prefill_checkpoint_valid(0, 100, 48, 16, 32, None)  # no backend
    assert not is_mamba_prefill_checkpoint_valid(32, 60, 48, 16, 32, 16)  # no column past 32
    assert not is_mamba_prefill_checkpoint_valid(8, 100, 48, 16, 32, 16)  # start off-grid
    assert not is_mamba_prefill_checkpoint_valid(32, 100, 40, 16, 32, 8)  # < one hash unit in
    assert not is_mamba_prefill_checkpoint_valid(0, 100, 48, 16, 32, 32)  # misaligned
    with pytest.raises(ValueError, match="checkpoint_alignment must be positive"):
        is_mamba_prefill_checkpoint_valid(0, 100, 48, 16, 32, 0)


def test_full_attention_partial_tail_hit_is_copied_on_write():
    # Full attention and Mamba both at block 32, hashed per 16: hits at 16-token units.
    m = manager_for(full(32), mamba(32))
    assert m.coordinator.enable_partial_hash_hits
    a = request("a", [*PREFIX, 1, 1, 1, 1, 1, 1, 1, 1])  # 56 tokens: tail boundary 48
    # A first chunk of 48 ends at the tail: attention block 2 (idx 1, holding tokens
    # 32..47 so far) and Mamba's running state (block 3) are keyed at 48.
    assert admit(m, a, 48) == (0, ([1, 2], [3]))
    pool = m.block_pool
    assert pool.partial_entry_tokens(pool.blocks[2]) == 48
    assert pool.partial_entry_tokens(pool.blocks[3]) == 48
    assert drain(m) == []
    # a's next chunk fills nothing new in attention (it keeps appending to block 2) but
    # keeps updating its Mamba state in place: that key moves to a copy (block 4).
    assert step(m, a, 8) == ([], [])
    assert drain(m) == [KVCacheBlockCopy(3, 4)]
    assert pool.blocks[3].block_hash is None and pool.partial_entry_tokens(pool.blocks[4]) == 48

    b = request("b", [*PREFIX, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    blocks, num_hit, boundary = m.get_computed_blocks(b)
    assert (num_hit, boundary) == (48, 0)
    assert blocks.get_block_ids() == ([1, 2], [0, 4])
    # b's hit ends inside both groups' second block: both are copied before b writes.
    assert m.allocate_slots(b, 10, 48, blocks).get_block_ids() == ([5], [6])
    b.num_computed_tokens = 58
    assert m.get_block_ids("b") == ([1, 5], [0, 6])
    copies, retained = m.take_kv_cache_block_copies()
    assert copies == [KVCacheBlockCopy(2, 5), KVCacheBlockCopy(4, 6)]
    # Retained: 2 is a's and held for its copy; 5 and 6 are b's; 4 only for its copy.
    assert [(blk.block_id, blk.ref_cnt) for blk in retained] == [(2, 2), (5, 2), (4, 1), (6, 2)]
    pool.free_blocks(retained)
    check_invariants(m)
    # Block 5 is b's own; its prompt's tail (48) lies in it too, so it is keyed there, and
    # under its full key once full.
    assert pool.partial_entry_tokens(pool.blocks[5]) == 48
    b.append_output_token_ids([3] * 6)
    step(m, b, 6)  # 64 tokens: block 5 is full
    assert pool.blocks[5].block_hash == make_block_hash_with_group_id(b.block_hashes[3], 0)
    for req in (a, b):
        m.free(req)
    check_invariants(m)
    assert pool.get_num_free_blocks() == 39


def test_partial_entry_promoted_when_its_block_fills_and_kept_as_a_further_key():
    m = manager_for(full(32), mamba(32))
    pool = m.block_pool
    a = request("a", [*PREFIX, 1])  # 49 tokens: tail boundary 48
    admit(m, a)
    assert pool.partial_entry_tokens(pool.blocks[2]) == 48
    key48 = make_block_hash_with_group_id(a.block_hashes[2], 0)
    assert pool.blocks[2].block_hash == key48
    a.append_output_token_ids([0] * 15)
    step(m, a, 15)  # 64 tokens: block 2 is full, its key now names all 64
    assert pool.blocks[2].block_hash == make_block_hash_with_group_id(a.block_hashes[3], 0)
    assert pool.partial_entry_tokens(pool.blocks[2]) is None
    # The prompt's tail stays reachable: a further key of the full block (vLLM's set of
    # keys per block), so a sibling diverging at 48 still finds block 2 there.
    assert pool.get_one_block(key48) is pool.blocks[2]
    d = request("d", [*PREFIX, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])
    blocks, num_hit, boundary = m.get_computed_blocks(d)
    # Attention could serve 48, but Mamba has no state there (a's step ended at 49).
    assert (num_hit, boundary) == (0, 48)
    m.evict_blocks([2])  # both keys go
    assert pool.get_one_block(key48) is None
    assert pool.get_one_block(make_block_hash_with_group_id(a.block_hashes[3], 0)) is None
    m.free(a)
    check_invariants(m)
    assert pool.get_num_free_blocks() == 39


def test_secondary_partial_key_and_eviction():
    pool = BlockPool(8, True, 16, enable_kv_cache_events=True)
    req = request("r", [*PREFIX, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 32, 0)  # keys at 32 and 64
    full_key = blocks[1].block_hash
    key48 = pool.cache_partial_block(req, blocks[1], 48, 0, 32)
    assert key48 == make_block_hash_with_group_id(req.block_hashes[2], 0)
    assert blocks[1].block_hash == full_key  # its own key is kept
    assert pool.get_one_block(key48) is blocks[1] and pool.get_one_block(full_key) is blocks[1]
    assert pool.cache_partial_block(req, blocks[1], 48, 0, 32) == key48  # idempotent
    events = pool.take_events()
    assert [e.block_hashes for e in events][-1] == [req.block_hashes[2]]
    pool.evict_blocks([blocks[1].block_id])
    assert pool.get_one_block(key48) is None and pool.get_one_block(full_key) is None
    # Both keys removed, its own first (vLLM's order).
    assert [e.block_hashes for e in pool.take_events()] == [
        [req.block_hashes[3]],
        [req.block_hashes[2]],
    ]
    assert pool.cache_partial_block(req, pool.null_block, 48, 0, 32) is None
    with pytest.raises(ValueError, match="positive multiple of the hash block size"):
        pool.cache_partial_block(req, blocks[2], 40, 0, 32)
    with pytest.raises(ValueError, match="needs 9"):
        pool.cache_partial_block(req, blocks[2], 144, 0, 32)


def test_one_eviction_removes_keys_block_by_block_each_blocks_own_key_first():
    """vLLM's `BlockRemoved` order when one allocation evicts several cached blocks,
    some with a further (partial) key: block by block in queue order, each block's own
    key, then its further keys."""
    pool = BlockPool(8, True, 16, enable_kv_cache_events=True)
    req = request("r", [*PREFIX, *range(16)])  # 64 tokens: four 16-token hashes
    wide = pool.get_new_blocks(2)  # 32-token blocks, group 0
    narrow = pool.get_new_blocks(2)  # 16-token blocks, group 1
    pool.cache_full_blocks(req, wide, 0, 2, 32, 0)
    pool.cache_full_blocks(req, narrow, 0, 2, 16, 1)
    pool.cache_partial_block(req, wide[1], 48, 0, 32)  # a further key of wide[1]
    pool.free_blocks([wide[1], narrow[1], wide[0], narrow[0]])
    pool.take_events()
    assert len(pool.get_new_blocks(7)) == 7  # every free block: all four are evicted
    assert [(e.block_hashes, e.group_idx) for e in pool.take_events()] == [
        ([req.block_hashes[3]], 0),
        ([req.block_hashes[2]], 0),
        ([req.block_hashes[1]], 1),
        ([req.block_hashes[1]], 0),
        ([req.block_hashes[0]], 1),
    ]


def test_partial_hit_of_a_request_freed_before_its_copy_ran_leaks_nothing():
    m = manager_for(full(32), mamba(32))
    a = request("a", [*PREFIX, 1, 1, 1])
    admit(m, a, 48)
    step(m, a, 3)
    drain(m)
    b = request("b", [*PREFIX, 2, 2])
    num_hit, _ = admit(m, b)
    assert num_hit == 48
    m.free(b)  # preempted in the same step: the pending copies keep both endpoints
    m.free(a)
    check_invariants(m)
    assert m.block_pool.get_num_free_blocks() < 39
    assert len(drain(m)) == 2
    check_invariants(m)
    assert m.block_pool.get_num_free_blocks() == 39


def test_partial_hits_off_without_a_coarser_mamba_group():
    # Mamba at the hash unit: nothing is ever inside a block, no copies.
    m = manager_for(full(16), mamba(16))
    assert not m.coordinator.enable_partial_hash_hits
    a = request("a", [*PREFIX, 1, 1])
    admit(m, a)
    assert drain(m) == []


def test_partial_hits_through_the_scheduler_match_a_dense_reference():
    """The engine's scheduler drives a hybrid manager; the attention group's KV lives in a
    `PagedKVCache`, the step's copies run before its writes. Every running request's KV,
    read back through its block table, equals a dense reference of its tokens (a shared
    block written without its copy would corrupt the request that owns it)."""
    from jaxkv.device import PagedKVCache

    m = manager_for(full(32), mamba(32), num_blocks=24)
    sched = Scheduler(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48,
                                         max_model_len=128))  # fmt: skip
    paged = PagedKVCache(m.kv_cache_config.kv_cache_groups[0].kv_cache_spec, 24)
    kv = paged.allocate_stacked(1)
    bs = paged.block_size

    def value(tokens, positions):
        x = np.asarray(tokens, np.float32)[:, None, None] * 1000 + positions[:, None, None] + 1
        return np.broadcast_to(x, (len(positions), paged.num_kv_heads, paged.head_size))

    def slots(req, positions):
        table = np.asarray(m.get_block_ids(req.request_id)[0])
        return table[positions // bs] * bs + positions % bs

    sched.add_request(request("a", [*PREFIX, 1, 1, 1, 1, 1, 1, 1, 1], max_tokens=6))
    copies_run = []
    for i in range(12):
        if i == 2:  # a has moved past the shared prefix: b and c hit it
            sched.add_request(request("b", [*PREFIX, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], max_tokens=8))
            sched.add_request(request("c", [*PREFIX, 3, 3, 3], max_tokens=8))
        out = sched.schedule()
        if out.kv_cache_block_copies:
            src = [c.src_block_id for c in out.kv_cache_block_copies]
            dst = [c.dst_block_id for c in out.kv_cache_block_copies]
            kv = paged.copy_blocks_stacked(kv, src, dst)
            copies_run.extend(out.kv_cache_block_copies)
        for s in out.scheduled:
            pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
            val = jnp.asarray(value(s.request.all_token_ids[pos[0] : pos[-1] + 1], pos))
            kv = paged.write_kv(kv, val, -val, slots(s.request, pos))
        sched.update_from_output(out, [4] * len(out.scheduled))
        for req in sched.running:
            pos = np.arange(req.num_computed_tokens)
            k, v = paged.read_kv(kv, slots(req, pos))
            want = value(req.all_token_ids[: len(pos)], pos)
            np.testing.assert_array_equal(np.asarray(k), want, err_msg=f"{req.request_id} K")
            np.testing.assert_array_equal(np.asarray(v), -want, err_msg=f"{req.request_id} V")
    assert sched.num_admitted_hit_tokens == 96  # b and c hit the 48-token prefix
    attention_copies = [c for c in copies_run if c.src_block_id == 2]  # a's block 2
    assert len(attention_copies) == 2
    assert not sched.has_unfinished_requests()
    assert m.block_pool.get_num_free_blocks() == 23


@pytest.mark.parametrize("enabled", [False, True])
def test_shared_prefix_checkpoint_keys_the_state_at_the_junction(enabled: bool):
    m = manager_for(
        full(32), mamba(32), use_eagle=True, enable_mamba_shared_prefix_checkpoint=enabled
    )
    assert m.mamba_shared_prefix_checkpoint == enabled
    tail = [1] * 16
    a = request("a", [*PREFIX, *tail, *[7] * 10])
    admit(m, a)  # attention caches 64 tokens; Mamba keeps no state (its step ended at 74)
    b = request("b", [*PREFIX, *tail, *[9] * 30])
    blocks, num_hit, boundary = m.get_computed_blocks(b)
    # Attention matches 64, drops a hash unit for EAGLE: 48; Mamba has nothing there.
    assert (num_hit, boundary) == (0, 48)
    b.shared_prefix_boundary = boundary
    admit(m, b, 48)  # b's first chunk stops at the junction (as vLLM's scheduler does)
    state = m.get_blocks("b").blocks[1][-1]
    assert m.block_pool.partial_entry_tokens(state) == (48 if enabled else None)
    step(m, b, 10)
    assert drain(m) == ([KVCacheBlockCopy(7, 8)] if enabled else [])
    assert state.block_id == 7
    c = request("c", [*PREFIX, *tail, *[5] * 20])
    assert m.get_computed_blocks(c)[1] == (48 if enabled else 0)
    for req in (a, b):
        m.free(req)
    check_invariants(m)


def test_shared_prefix_checkpoint_narrowed_as_vllm():
    # Without EAGLE (or without partial hits) the flag is accepted and has no effect.
    assert not manager_for(
        full(32), mamba(32), enable_mamba_shared_prefix_checkpoint=True
    ).mamba_shared_prefix_checkpoint
    assert not manager_for(
        full(16), mamba(16), use_eagle=True, enable_mamba_shared_prefix_checkpoint=True
    ).mamba_shared_prefix_checkpoint
    with pytest.raises(TypeError, match="enable_mamba_shared_prefix_checkpoint must be a bool"):
        manager_for(full(32), mamba(32), enable_mamba_shared_prefix_checkpoint=1)


def mamba_with_checkpoints(alignment, bs=32):
    return MambaSpec(
        bs,
        shapes=((4, 8),),
        dtypes=("float32",),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=alignment,
    )


@pytest.mark.parametrize("alignment", [16, 32])
def test_prefill_checkpoint_block_keyed_at_the_prompts_last_boundary(alignment: int):
    m = manager_for(full(32), mamba_with_checkpoints(alignment))
    a = request("a", [*PREFIX, *[1] * 9])  # 57 tokens: the prompt's checkpoint is 48
    exported = alignment == 16  # 48 tokens from the step's start: a multiple of 16 only
    # One step computes the whole prompt; the backend exports the state at 48 into a
    # spare block (Mamba block 3, the column before the state's) when it can.
    assert admit(m, a) == (0, ([1, 2], [3, 4] if exported else [3]))
    assert m.get_block_ids("a")[1] == ([3, 4] if exported else [0, 3])
    pool = m.block_pool
    if exported:
        assert pool.partial_entry_tokens(pool.blocks[3]) == 48
        assert pool.blocks[4].block_hash is None  # the running state at 57
    b = request("b", [*PREFIX, 2, 2, 2, 2, 2])
    blocks, num_hit, boundary = m.get_computed_blocks(b)
    if not exported:  # attention could serve 48, Mamba has no state there
        assert (num_hit, boundary) == (0, 48)
        return
    assert (num_hit, boundary) == (48, 0) and blocks.get_block_ids() == ([1, 2], [0, 3])
    assert m.allocate_slots(b, 5, 48, blocks).get_block_ids() == ([5], [6])
    assert drain(m) == [KVCacheBlockCopy(2, 5), KVCacheBlockCopy(3, 6)]
    # a's next step: the checkpoint block (before the state) is released, still cached.
    a.append_output_token_ids([0])
    step(m, a, 1)
    assert m.get_block_ids("a")[1] == [0, 4]
    assert pool.blocks[3].ref_cnt == 0 and pool.partial_entry_tokens(pool.blocks[3]) == 48
    m.free(a)
    m.free(b)
    check_invariants(m)
    assert pool.get_num_free_blocks() == 39


def test_transient_checkpoint_is_not_cached():
    # A chunk ending before the prompt's end exports its own last boundary's state; it is
    # kept only where a later request can resume (the prompt's checkpoint, a retained
    # block boundary, the junction).
    m = manager_for(full(32), mamba_with_checkpoints(16))
    a = request("a", [*PREFIX, *PREFIX, 1])  # 97 tokens: prompt checkpoint 96
    admit(m, a, 90)  # exports the state at 80 (inside a block) into block idx 1
    ckpt = m.get_blocks("a").blocks[1][1]
    assert not ckpt.is_null and ckpt.block_hash is None
    assert m.block_pool.get_one_block(make_block_hash_with_group_id(a.block_hashes[4], 1)) is None
    b = request("b", [*PREFIX, *PREFIX, 2])
    admit(m, b, 80)  # the state at 64 ends a block: retained (dense retention), keyed
    ckpt = m.get_blocks("b").blocks[1][1]
    assert m.block_pool.partial_entry_tokens(ckpt) == 64
    m.free(a)
    m.free(b)
    check_invariants(m)


def test_checkpoint_spec_fields_are_checked():
    spec = mamba_with_checkpoints(16)
    assert spec.max_memory_usage_bytes(256, 64) == 3 * spec.page_size_bytes
    with pytest.raises(ValueError, match="num_prefill_checkpoint_blocks must be >= 0"):
        MambaSpec(32, shapes=((2,),), dtypes=("float32",), num_prefill_checkpoint_blocks=-1)
    with pytest.raises(ValueError, match="prefill_checkpoint_alignment must be a positive int"):
        MambaSpec(32, shapes=((2,),), dtypes=("float32",), prefill_checkpoint_alignment=0)


def retention_manager(retention: int | None, *specs, hash_block_size=16, **kwargs):
    config = KVCacheConfig.from_groups(
        [(s, (f"l{i}",)) for i, s in enumerate(specs)], 40, retention
    )
    return KVCacheManager(config, 256, hash_block_size=hash_block_size, **kwargs)


@pytest.mark.parametrize("retention", [None, 0])
def test_retention_zero_reserves_a_checkpoint_only_on_the_chunk_reaching_the_prefill_end(
    retention: int | None,
):
    # vLLM: with `prefix_cache_retention_interval` 0 only the reachable states are
    # kept, so a chunk short of the prefill's end exports no checkpoint and reserves no
    # spare block; the chunk reaching it still does.
    m = retention_manager(retention, full(32), mamba_with_checkpoints(16))
    a = request("a", [*PREFIX, *PREFIX, 1])  # 97 tokens: prompt checkpoint 96
    admit(m, a, 64 + 16)  # [0, 80): could export the state at 64 into Mamba block idx 1
    mamba_table = m.get_block_ids("a")[1]
    assert mamba_table[1] != 0 if retention is None else mamba_table[1] == 0
    assert len(mamba_table) == 3 and mamba_table[0] == 0
    m.free(a)
    b = request("b", [*PREFIX, *PREFIX, 1])
    blocks, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == (64 if retention is None else 0)
    m.free(b)
    c = request("c", [(3 * i) % 7 for i in range(97)])  # no hit
    assert admit(m, c, 64)[0] == 0
    step(m, c, 33)  # [64, 97) reaches the prefill end: its checkpoint at 96 (idx 2)
    table = m.get_block_ids("c")[1]
    assert table[2] != 0 and m.block_pool.partial_entry_tokens(m.block_pool.blocks[table[2]]) == 96
    m.free(c)
    check_invariants(m)
    assert m.block_pool.get_num_free_blocks() == 39


def test_tail_state_on_a_block_boundary_is_kept_where_retention_drops_its_block():
    # EAGLE, hash unit 4, Mamba block 8, retention 32: a 20-token prompt's tail state (16:
    # one hash unit below its last boundary) ends Mamba block 1, which the mask drops (its
    # segment ends at 32, the replay boundary is 8). vLLM keys it anyway.
    m = retention_manager(32, full(8), mamba(8), hash_block_size=4, use_eagle=True)
    hasher = get_request_block_hasher(4, SHA)
    a = Request("a", PREFIX[:20], block_hasher=hasher)
    admit(m, a, 16)  # the scheduler stops at the tail
    step(m, a, 4)
    pool = m.block_pool
    state_16 = pool.blocks[m.get_block_ids("a")[1][1]]
    assert pool.partial_entry_tokens(state_16) == 16
    m.free(a)
    b = Request("b", [*PREFIX[:20], 3], block_hasher=hasher)
    _, num_hit, _ = m.get_computed_blocks(b)
    assert num_hit == 16  # EAGLE drops one unit of the 20 that match
    check_invariants(m)


def test_a_chunk_running_on_from_inside_a_block_leaves_that_block_uncached():
    # b resumes at 4 (a copy of a's state there, in Mamba block 0) and one chunk exporting
    # a checkpoint runs on to its prompt's end. Block 0 then still holds the state at 4:
    # keyed as the state at 8 (vLLM does so) it would resume a later request wrongly.
    m = retention_manager(
        None, full(8), mamba_with_checkpoints(4, bs=8), hash_block_size=4, use_eagle=True
    )
    hasher = get_request_block_hasher(4, SHA)
    a = Request("a", PREFIX[:9], block_hasher=hasher)
    admit(m, a, 4)  # the scheduler stops at the prompt's tail, 4 (EAGLE)
    step(m, a, 4)
    step(m, a, 1)
    b = Request("b", [*PREFIX[:8], *[3] * 10], block_hasher=hasher)
    assert admit(m, b)[0] == 4  # [4, 18): exports the state at 12 into Mamba block 1
    drain(m)
    pool = m.block_pool
    cow_block, checkpoint, _ = (pool.blocks[i] for i in m.get_block_ids("b")[1])
    assert cow_block.block_hash is None
    assert pool.partial_entry_tokens(checkpoint) == 12
    c = Request("c", [*PREFIX[:8], *[3] * 10, 1], block_hasher=hasher)
    assert m.get_computed_blocks(c)[1] == 12  # from the checkpoint, not a stale 8
    m.free(a)
    m.free(b)
    check_invariants(m)


def test_lookahead_tokens_get_attention_slots_but_no_mamba_state_slot():
    # vLLM: draft models have no Mamba layers, so a Mamba "align" group allocates for
    # the main model's tokens only; attention groups hold the lookahead slots too.
    m = manager_for(full(32), mamba(32))
    # 60 prompt tokens (PREFIX has only 48): computed tokens never pass the request's.
    a = request("a", [(7 * i) % 5 for i in range(60)])
    new = m.allocate_slots(a, 60, num_lookahead_tokens=8)
    assert new.get_block_ids() == ([1, 2, 3], [4])  # 68 attention slots; state at 60
    assert m.get_block_ids("a") == ([1, 2, 3], [0, 4])
    a.num_computed_tokens = 60
    a.append_output_token_ids([1] * 4)
    # 64 tokens end Mamba block 1 (the state stays there); attention already holds 96.
    assert m.allocate_slots(a, 4, num_lookahead_tokens=8).get_block_ids() == ([], [])
    a.num_computed_tokens = 64
    a.append_output_token_ids([1])
    assert m.allocate_slots(a, 1, num_lookahead_tokens=8).get_block_ids() == ([], [5])
    assert m.get_block_ids("a") == ([1, 2, 3], [0, 4, 5])
    m.free(a)
    check_invariants(m)
