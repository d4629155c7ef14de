"""Differential test: random hybrid traces through jaxkv and vLLM's hybrid coordinator.

vLLM runs in a subprocess under `REPO_ROOT/.venv-vllm/bin/python` (it has no
JAX; `tests/hybrid_trace.py` never imports it); skipped when that environment
is absent. Every hit length and every block id returned or held must match.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
from hybrid_trace import replay

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not PEER_PYTHON.exists(), reason=f"no vLLM peer environment at {PEER_PYTHON}"
)


# Group kinds: full, sliding-window, chunked-local, R-SWA, sink full attention, circular buffer.
KINDS = ["full", "sw", "chunked", "rswa", "sink", "circ"]


def random_cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        num_groups = rng.randint(1, 4)
        kinds = [rng.choice(KINDS) for _ in range(num_groups)]
        if num_groups > 1 and all(kind == "circ" for kind in kinds):
            kinds[0] = "full"  # a hybrid needs a prefix-cacheable group
        same_size = "chunked" in kinds  # chunked local needs hits on its own block size
        groups = []
        for kind in kinds:
            block_size = 4 if same_size else rng.choice([4, 8])
            param = {
                "full": 0,
                "circ": 0,
                "sw": rng.choice([3, 5, 8, 13, 20]),
                "rswa": rng.choice([3, 8, 13]),
                "sink": block_size * rng.choice([1, 2]),
                "chunked": rng.choice([8, 12, 16]),
            }[kind]
            groups.append((kind, block_size, param))
        scheduler_block_size = max(bs for _, bs, _ in groups)
        retention = None
        if any(kind == "sw" for kind, _, _ in groups):
            retention = rng.choice([None, None, 0, 2 * scheduler_block_size])
        cases.append(
            {
                "groups": groups,
                "num_blocks": rng.randint(8, 40),
                "max_model_len": 48,
                "seed": seed * 1000 + i,
                "num_steps": 120,
                # EAGLE: not with chunked local attention (vLLM asserts).
                "use_eagle": "chunked" not in kinds and rng.random() < 0.4,
                "lookahead": rng.choice([0, 0, 1, 3]),
                "retention": retention,
            }
        )
    return cases


def run_vllm(cases: list[dict]) -> list:
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}")
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"  # events carry the bytes, as jaxkv's
    out = subprocess.run(
        [str(PEER_PYTHON), str(REPO_ROOT / "tests" / "hybrid_trace.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def assert_traces_match(cases: list[dict]) -> list[list]:
    """Replay `cases` in both; every log entry must match. Returns jaxkv's logs."""
    expected = run_vllm(cases)
    logs = []
    for case, want in zip(cases, expected, strict=True):
        got = replay("jaxkv", case)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"case {case} diverges at log entry {i}: jaxkv {g} vs vLLM {w}"
        assert len(got) == len(want)
        logs.append(got)
    return logs


def test_random_hybrid_traces_match_vllm():
    cases = random_cases(60, seed=11)
    num_hits = 0
    for got in assert_traces_match(cases):
        num_hits += sum(1 for e in got if e[0] == "hit" and e[2] > 0)
    assert num_hits > 50  # the traces exercise prefix hits, not just misses


def test_random_traces_with_kv_connector_tokens_match_vllm():
    """Admissions whose tokens after the hit come partly from a KV connector
    (`num_external_computed_tokens`): the blocks each group gets for them (only inside
    its window), the new blocks after them, what is cached and the free queue all match
    vLLM's two-phase allocation."""
    cases = [dict(case, external=True) for case in random_cases(40, seed=21)]
    num_external = 0
    for got in assert_traces_match(cases):
        num_external += sum(1 for e in got if e[0] == "admit" and e[2] and e[3] is not None)
    assert num_external > 100  # admitted with connector tokens, across the mixes


def test_host_tier_lookups_as_connector_tokens_match_vllm():
    """The host tier (`HostKVTier`) beside each manager: freed requests' blocks stored,
    an admission's blocks after the device hit looked up and passed as
    `num_external_computed_tokens` (whole blocks), as the engine's offload does. Same
    tokens from the tier, same block ids, cached blocks and free queue as vLLM's."""
    cases = [
        dict(case, groups=[("full", 4, 0)], host_tier=True, use_eagle=False, retention=None)
        for case in random_cases(30, seed=23)
    ]
    num_external = 0
    for got in assert_traces_match(cases):
        num_external += sum(1 for e in got if e[0] == "admit" and e[2] and e[3] is not None)
    assert num_external > 20  # admissions served by the tier


def evict_cases(n: int, seed: int) -> list[dict]:
    """Full-attention, sliding-window, R-SWA and circular-buffer mixes of two or three
    groups, always with two block sizes or more (hashed at their GCD: full-attention groups
    coarser than it key their prompt's partial tail), KV events on, and `evict_blocks` as a
    KV connector calls it after a failed load, on held and free blocks (`hybrid_trace.
    _evicted_ids`); half the cases also take connector tokens at admission."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        groups: list = []
        while len({block_size for _, block_size, _ in groups}) < 2:
            groups = []
            for _ in range(rng.randint(2, 3)):
                kind = rng.choice(["full", "full", "sw", "sw", "rswa", "circ"])
                param = {"full": 0, "circ": 0, "sw": rng.choice([3, 5, 8, 13, 20])}.get(
                    kind, rng.choice([3, 8, 13])
                )
                groups.append((kind, rng.choice([4, 8, 16]), param))
            if all(kind == "circ" for kind, _, _ in groups):
                groups[0] = ("full", groups[0][1], 0)  # a hybrid needs a prefix-cacheable group
        retention = None
        if any(kind == "sw" for kind, _, _ in groups):
            scheduler_block_size = math.lcm(*(block_size for _, block_size, _ in groups))
            retention = rng.choice([None, None, 0, 2 * scheduler_block_size])
        cases.append(
            {
                "groups": groups,
                "num_blocks": rng.randint(8, 40),
                "max_model_len": 48,
                "seed": seed * 1000 + i,
                "num_steps": 120,
                "use_eagle": rng.random() < 0.4,
                "lookahead": rng.choice([0, 0, 1, 3]),
                "retention": retention,
                "external": rng.random() < 0.5,
                "events": True,
                "evict": True,
            }
        )
    return cases


def test_random_traces_with_evict_blocks_and_kv_events_match_vllm():
    """`evict_blocks` on held and free blocks of groups with different block sizes: the
    KV events (in order: one eviction's `BlockRemoved`s block by block, each block's own
    key before a partial tail's), the held blocks, the free queue and what is cached after
    every step all match vLLM, including a prompt's partial tail keyed again at the
    step after `evict_blocks` dropped it from a block its request still holds."""
    cases = evict_cases(60, seed=41)
    num_recached = num_mixed_removals = 0
    for case, got in zip(cases, assert_traces_match(cases), strict=True):
        block_sizes = [block_size for _, block_size, _ in case["groups"]]
        held: set = set()  # the blocks running requests held after the last step
        held_now: set = set()
        evicted: set = set()
        for entry in got:
            if entry[0] == "evict":
                evicted = held & set(entry[1])
            elif entry[0] == "held":
                held_now.update(i for table in entry[2] for i in table)
            elif entry[0] == "free":
                num_recached += bool(evicted & set(entry[3]))  # held, cached again
                held, held_now, evicted = held_now, set(), set()
            elif entry[0] == "events":
                removed = {block_sizes[e[2]] for e in entry[1] if e[0] == "BlockRemoved"}
                num_mixed_removals += len(removed) > 1
    # The traces evict partial tails that their requests key again, and evict (or reuse)
    # blocks of several block sizes at once.
    assert num_recached > 15 and num_mixed_removals > 150


def mamba_cases(
    n: int, seed: int, eagle_share: float = 0.4, sparse_retention: bool = False
) -> list[dict]:
    """Full attention, sliding window and Mamba "align" mixes, mostly hashed finer than the
    Mamba block, so hits may end inside a block (partial hits, copy-on-write), with and
    without prefill checkpoint blocks, with and without lookahead tokens; with `sparse_retention`, a
    `prefix_cache_retention_interval` of 0, one or two scheduler blocks. Chunks end where
    vLLM's scheduler ends them for Mamba (`hybrid_trace._chunk`); every step is reported
    (`new_step_starts`) and its copies drained, as a synchronous engine does."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        mamba_block_size = rng.choice([8, 16])
        kinds = ["full", "mamba"] + [rng.choice(["full", "mamba", "sw"])] * rng.randint(0, 1)
        eagle = rng.random() < eagle_share
        # Hashed per Mamba block a third of the time: partial hits off, states cached on
        # the scheduler grid.
        hash_block_size = mamba_block_size if rng.random() < 0.3 else 4
        groups = []
        for kind in kinds:
            if kind == "mamba":
                groups.append(("mamba", mamba_block_size, 0))
            elif kind == "full":
                sizes = [4, 8, mamba_block_size] if hash_block_size == 4 else [8, 16, 32]
                groups.append(("full", max(rng.choice(sizes), hash_block_size), 0))
            else:
                groups.append(("sw", hash_block_size, rng.choice([5, 8])))
        cases.append(
            {
                "groups": groups,
                "num_blocks": rng.randint(10, 40),
                "max_model_len": 48,
                "seed": seed * 1000 + i,
                "num_steps": 120,
                "hash_block_size": hash_block_size,
                "report_steps": True,
                "mamba_block_size": mamba_block_size,
                "tail_unit": hash_block_size,
                # EAGLE, and with it the Mamba state at a shared-prefix junction.
                "use_eagle": eagle,
                "shared_prefix_checkpoint": eagle and rng.random() < 0.8,
                # A backend exporting prefill checkpoints (a spare state block per chunk).
                "checkpoint_alignment": rng.choice([None, hash_block_size, 2 * hash_block_size]),
                # Lookahead slots: attention groups get them, Mamba "align" does not.
                "lookahead": rng.choice([0, 0, 1, 3]),
            }
        )
        if sparse_retention:
            scheduler_block_size = math.lcm(*(block_size for _, block_size, _ in groups))
            cases[-1]["retention"] = scheduler_block_size * rng.choice([0, 1, 2])
    return cases


def test_random_mamba_align_traces_with_partial_hits_match_vllm():
    cases = mamba_cases(48, seed=5) + mamba_cases(24, seed=6, eagle_share=1.0)
    num_partial_hits = num_copies = 0
    for case, got in zip(cases, assert_traces_match(cases), strict=True):
        mamba_block_size = case["mamba_block_size"]
        num_partial_hits += sum(1 for e in got if e[0] == "hit" and e[2] % mamba_block_size)
        num_copies += sum(len(e[1]) for e in got if e[0] == "copies")
    # The traces exercise hits inside Mamba blocks and their copies.
    assert num_partial_hits > 40 and num_copies > 80


def test_random_mamba_align_traces_with_sparse_retention_match_vllm():
    """Sparse retention over Mamba "align": with an interval of 0 a prefill checkpoint is
    reserved only on the chunk reaching the prefill end; a state at the prompt's tail (or
    a junction) on a block boundary is keyed even where the retention mask drops its
    block."""
    cases = mamba_cases(48, seed=15, sparse_retention=True)
    num_thinned = 0
    for case, got in zip(cases, assert_traces_match(cases), strict=True):
        num_thinned += got != replay("jaxkv", dict(case, retention=None))
    # In most traces retention changes what is cached (and so what later hits).
    assert num_thinned > len(cases) // 3


def test_long_rswa_traces_match_vllm():
    """Longer decodes with an R-SWA group in every case: its gap releases (null blocks
    between the prompt's and the window's) must match vLLM's block for block."""
    cases = []
    for i, case in enumerate(random_cases(30, seed=12)):
        case["groups"][0] = ("rswa", case["groups"][0][1], (3, 8, 13)[i % 3])
        if not any(kind == "sw" for kind, _, _ in case["groups"]):
            case["retention"] = None  # retention needs a sliding-window group
        case.update(max_model_len=96, num_steps=200, num_blocks=2 * case["num_blocks"])
        cases.append(case)
    num_gaps = 0
    for case, got in zip(cases, assert_traces_match(cases), strict=True):
        rswa_groups = [i for i, g in enumerate(case["groups"]) if g[0] == "rswa"]
        for entry in got:
            if entry[0] == "held":
                tables = [entry[2][i] for i in rswa_groups]
                num_gaps += any(0 in t and t[0] != 0 for t in tables)
    assert num_gaps > 50  # the traces release gaps, not just prompts
