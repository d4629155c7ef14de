"""Sharded caches on 8 simulated CPU devices give the single-device results.

The checks run in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set
before JAX starts), so the rest of the suite keeps its single CPU device.
`run_layout` is shared with the multi-process test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from eight_devices import call_on_8_devices
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_device_attention import query_kv, random_case, reference_attention, rel_error

from jaxkv.device import (
    DATA_AXIS,
    AttentionOptions,
    KVLayout,
    PagedKVCache,
    StepInputs,
    StepMetadataPacker,
    make_mesh,
)
from jaxkv.kv_cache_interface import FullAttentionSpec


def to_numpy(x: jax.Array) -> np.ndarray:
    """The whole array on the host, also when other processes hold parts of it."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_layout(
    mesh: Mesh, *, num_kv_heads: int, group: int, policy: str, seed: int
) -> tuple[dict, dict[str, np.ndarray]]:
    """One step (write + attention), a block copy and zeroing on `mesh` and on one device.

    Returns metrics (the largest differences between the two, the attention
    error against the float64 reference) and the sharded run's output and
    cache; raises AssertionError on a wrong placement.
    """
    rng = np.random.default_rng(seed)
    spec = FullAttentionSpec(4, num_kv_heads, 8, "float32")
    num_blocks = 32
    sharded = PagedKVCache(spec, num_blocks, mesh=mesh, head_policy=policy)
    single = PagedKVCache(spec, num_blocks, mesh=make_mesh(1, 1, jax.local_devices()[:1]))
    dp = sharded.dp_size
    cases = []
    for _ in range(dp):
        seq = rng.integers(1, 21, size=3)
        q_lens = np.minimum(rng.integers(1, 6, size=3), seq)
        cases.append(
            random_case(
                rng, seq.tolist(), q_lens.tolist(), num_kv_heads=num_kv_heads, group=group,
                num_blocks=num_blocks, pad_tokens=0, cache=single,
            )
        )  # fmt: skip
    packer = StepMetadataPacker(
        max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=5, block_size=4,
        num_blocks=num_blocks,
    )  # fmt: skip
    buf, shape = packer.pack(
        [StepInputs(c.block_tables[:3], c.seq_lens[:3], c.q_lens, c.slots) for c in cases]
    )
    t = shape.num_tokens
    qs, ks, vs = [], [], []
    for c in cases:
        n = int(c.q_lens.sum())
        qp = np.full((t, *c.q.shape[1:]), np.nan, np.float32)
        qp[:n] = c.q[:n]
        k, v = query_kv(c)
        pad = rng.standard_normal((t - n, *k.shape[1:])).astype(np.float32)
        qs.append(qp)
        ks.append(np.concatenate([k, pad]))
        vs.append(np.concatenate([v, pad]))
    pairs = [rng.permutation(np.arange(1, num_blocks))[:6] for _ in range(dp)]  # disjoint
    src = np.concatenate([p[:3] for p in pairs])
    dst = np.concatenate([p[3:] for p in pairs])
    zero = np.concatenate([rng.permutation(np.arange(num_blocks))[:2] for _ in range(dp)])

    initial = np.concatenate([np.asarray(c.kv) for c in cases])
    single_out, single_kv = [], []
    for d, c in enumerate(cases):
        kv, out = single.step(
            c.kv[None], jnp.asarray(qs[d]), jnp.asarray(ks[d]), jnp.asarray(vs[d]),
            packer.put(buf[d : d + 1]), shape, AttentionOptions(sm_scale=0.3),
        )  # fmt: skip
        kv = single.copy_blocks_stacked(kv, src[3 * d : 3 * d + 3], dst[3 * d : 3 * d + 3])
        kv = single.zero_blocks_stacked(kv, zero[2 * d : 2 * d + 2])
        single_out.append(np.asarray(out))
        single_kv.append(np.asarray(kv)[0])

    kv = sharded.put(initial[None], P(None, *sharded.layout.cache_spec))
    kv, out = sharded.step(
        kv,
        sharded.put(np.concatenate(qs)),
        sharded.put(np.concatenate(ks)),
        sharded.put(np.concatenate(vs)),
        packer.put(buf, NamedSharding(sharded.mesh, P(DATA_AXIS))),
        shape,
        AttentionOptions(sm_scale=0.3),
    )
    kv = sharded.copy_blocks_stacked(kv, src, dst)
    kv = sharded.zero_blocks_stacked(kv, zero)
    heads = sharded.layout.kv_heads_per_device
    for shard in kv.addressable_shards:
        assert shard.data.shape == (1, num_blocks, 4, 2 * heads, 8), shard.data.shape
        assert shard.data.nbytes == sharded.bytes_per_device
    assert kv.sharding.is_equivalent_to(sharded.stacked_sharding, 5)
    out_np, kv_np = to_numpy(out), to_numpy(kv)[0]
    errors = []
    for d, c in enumerate(cases):
        n = int(c.q_lens.sum())
        want = reference_attention(c, sm_scale=0.3)
        errors.append(rel_error(out_np[d * t : d * t + n], want[:n]))
    metrics = {
        "dp": dp,
        "model": sharded.layout.model_size,
        "replication": sharded.layout.replication,
        "out_diff": float(np.abs(out_np - np.concatenate(single_out)).max()),
        "kv_diff": float(np.nanmax(np.abs(kv_np - np.concatenate(single_kv)))),
        "kv_nan_match": bool((np.isnan(kv_np) == np.isnan(np.concatenate(single_kv))).all()),
        "ref_err": max(errors),
        "padded_rows_zero": all(
            not out_np[d * t + int(c.q_lens.sum()) : (d + 1) * t].any() for d, c in enumerate(cases)
        ),
    }
    return metrics, {"out": out_np, "kv": kv_np}


LAYOUTS = {
    # name: (data, model, kv_heads, q-per-kv group, policy)
    "heads_sharded": (1, 8, 8, 2, "auto"),
    "data2_heads4": (2, 4, 4, 1, "auto"),
    "replicated_q_split": (1, 8, 2, 4, "replicate"),
    "replicated_q_replicated": (1, 8, 2, 3, "replicate"),
    "spare_model_to_data": (1, 8, 2, 2, "data_parallel"),
    # The default when the model axis does not divide the KV heads: attention data
    # parallelism, every device its own data rank.
    "attention_dp_kv1": (1, 8, 1, 4, "auto"),
    "attention_dp_kv2": (1, 8, 2, 3, "auto"),
    "attention_dp_kv4": (1, 8, 4, 2, "auto"),
    "attention_dp_data2": (2, 4, 2, 2, "auto"),
}
EXPECTED_PLACEMENT = {  # (dp, model, replication) after planning
    "heads_sharded": (1, 8, 1),
    "data2_heads4": (2, 4, 1),
    "replicated_q_split": (1, 8, 8),
    "replicated_q_replicated": (1, 8, 8),
    "spare_model_to_data": (4, 2, 1),
    "attention_dp_kv1": (8, 8, 1),
    "attention_dp_kv2": (8, 8, 1),
    "attention_dp_kv4": (8, 8, 1),
    "attention_dp_data2": (8, 4, 1),
}
POLICIES = ("auto", "replicate", "data_parallel", "attention_data_parallel")
TOTAL_BLOCKS = 64  # token capacity held equal across policies: dp * num_blocks


def bytes_by_policy(num_kv_heads: int) -> dict[str, dict[str, int]]:
    """Per policy on a 1x8 mesh: bytes per device, replication and the unreplicated
    cache bytes of `TOTAL_BLOCKS` blocks over all data ranks (nothing compiles)."""
    spec = FullAttentionSpec(4, num_kv_heads, 8, "float32")
    out = {}
    for policy in POLICIES:
        dp = KVLayout.plan(make_mesh(1, 8), num_kv_heads, policy).dp_size
        cache = PagedKVCache(spec, TOTAL_BLOCKS // dp, mesh=make_mesh(1, 8), head_policy=policy)
        out[policy] = {
            "dp": cache.dp_size,
            "bytes_per_device": cache.bytes_per_device,
            "replication": cache.replication,
            "cache_bytes": cache.cache_bytes,
            "share": cache.layout.device_share,
        }
    return out


def layout_violations() -> list[str]:
    """Every (data, model) mesh of the 8 devices, 1..8 KV heads, every policy: what breaks
    the layout invariants (empty when none does)."""
    bad = []
    for data in (1, 2, 4, 8):
        for heads in range(1, 9):
            mesh = make_mesh(data, 8 // data)
            for policy in POLICIES:
                lay = KVLayout.plan(mesh, heads, policy)
                name = f"{data}x{8 // data} heads={heads} {policy}"
                per_rank_devices = lay.num_devices // lay.dp_size
                if lay.replication * heads != lay.kv_heads_per_device * per_rank_devices:
                    bad.append(f"{name}: replication does not count the head copies")
                if lay.device_share != lay.replication / 8:
                    bad.append(f"{name}: device_share {lay.device_share}")
                if policy == "auto" and (lay.replication != 1 or lay.mesh is not mesh):
                    bad.append(f"{name}: the default stores KV twice or moves the mesh")
                if lay.heads_sharded and lay.blocks_over_model:
                    bad.append(f"{name}: heads and blocks both over the model axis")
    return bad


def sharded_results(seed: str) -> dict:
    """Under 8 devices: every layout's step against one device, bytes, invariants."""
    assert jax.device_count() == 8, jax.devices()
    seed = int(seed)
    results = {}
    for name, (data, model, heads, group, policy) in LAYOUTS.items():
        results[name], _ = run_layout(
            make_mesh(data, model), num_kv_heads=heads, group=group, policy=policy, seed=seed
        )
    results["bytes"] = {str(heads): bytes_by_policy(heads) for heads in (1, 2, 4)}
    results["violations"] = layout_violations()
    return results


def test_sharded_layouts_match_single_device() -> None:
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    results = call_on_8_devices("test_device_sharding", "sharded_results", seed)
    by_heads = results.pop("bytes")
    assert results.pop("violations") == []
    assert set(results) == set(LAYOUTS)
    for name, r in results.items():
        assert (r["dp"], r["model"], r["replication"]) == EXPECTED_PLACEMENT[name], (name, r)
        assert r["out_diff"] <= 1e-6, (name, seed, r)
        assert r["kv_diff"] == 0.0 and r["kv_nan_match"], (name, seed, r)
        assert r["ref_err"] < 1e-5, (name, seed, r)
        assert r["padded_rows_zero"], (name, seed, r)

    # kv_heads in {1, 2, 4} on 8 devices, equal token capacity: the default layout has the
    # fewest bytes per device (no KV stored twice), and bytes_per_device shows each
    # policy's replication factor times the unreplicated share.
    for heads, policies in by_heads.items():
        least = min(p["bytes_per_device"] for p in policies.values())
        auto = policies["auto"]
        assert auto["bytes_per_device"] == least == auto["cache_bytes"] // 8, (heads, policies)
        assert auto["replication"] == 1 and auto["share"] == 1 / 8, (heads, policies)
        for name, p in policies.items():
            assert p["dp"] * (TOTAL_BLOCKS // p["dp"]) == TOTAL_BLOCKS, (heads, name)
            assert p["bytes_per_device"] == p["replication"] * p["cache_bytes"] // 8, (heads, name)
        assert policies["replicate"]["replication"] == 8
        assert policies["replicate"]["bytes_per_device"] == 8 * least
