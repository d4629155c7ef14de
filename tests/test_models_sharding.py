"""1 vs 8 simulated devices: the models give the same tokens with their weights split over
the model axis (heads, MLP units) and replicated over the data axis.

The checks run in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX
starts), so the rest of the suite keeps its single CPU device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from eight_devices import call_on_8_devices

MESHES = [(1, 1), (1, 2), (1, 8), (2, 4)]  # (data, model)


def child(workdir: str) -> dict:
    """Runs under 8 devices: tokens, logits and weight layouts per mesh."""
    import jax
    import jax.numpy as jnp

    from jaxkv.device import make_mesh
    from jaxkv.models import load_model, save_random_checkpoint, tiny_configs
    from jaxkv.testing.paged_generate import PagedGenerator

    assert len(jax.devices()) == 8
    work = Path(workdir)
    save_random_checkpoint(work / "gemma3", tiny_configs()["gemma3-tiny"], seed=12)
    save_random_checkpoint(work / "llava", tiny_configs()["llava-tiny"], seed=12)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 14)]
    pixels = jnp.asarray(rng.standard_normal((2, 3, 16, 16)), jnp.float32)
    results = {}
    for dp, mp in MESHES:
        mesh = make_mesh(dp, mp, jax.devices()[: dp * mp])
        gemma = load_model(work / "gemma3", mesh=mesh)
        layer = gemma.decoder.layers[0]  # stacked: the layer axis is never split
        out = {
            "q_spec": str(layer.q_proj.weight[...].sharding.spec),
            "gate_spec": str(layer.gate_proj.weight[...].sharding.spec),
            "dense": np.asarray(gemma.dense_fn()(jnp.arange(1, 20, dtype=jnp.int32))).tolist(),
        }
        llava = load_model(work / "llava", mesh=mesh)
        out["image_features"] = np.asarray(llava.encode_images(pixels)).tolist()
        if (dp, mp) != (1, 2):  # 1x2 only checks the weight layout and the dense forward
            # Requests spread over the data ranks (one rank per device), sliding/full groups.
            gen = PagedGenerator(
                gemma, block_size=4, max_num_tokens=16, mesh=mesh, group_by_spec=True
            )
            out["tokens"] = gen.generate(prompts, 4, chunk_size=5)
            out["kv"] = [gen.dp, gen.caches[0].replication, gen.caches[0].layout.policy]
        results[f"{dp}x{mp}"] = out
    return results


def test_same_tokens_on_1_and_8_devices(tmp_path):
    results = call_on_8_devices("test_models_sharding", "child", tmp_path)
    one = results["1x1"]
    # 4 query heads split over 2 devices, kept whole (replicated) over 8; 128 MLP units split.
    assert "model" in results["1x2"]["q_spec"] and "model" not in results["1x8"]["q_spec"]
    assert "model" in results["1x8"]["gate_spec"]
    for name, out in results.items():
        np.testing.assert_allclose(out["dense"], one["dense"], rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(
            out["image_features"], one["image_features"], rtol=1e-5, atol=1e-5, err_msg=name
        )
        if "tokens" in out:
            assert out["tokens"] == one["tokens"], name
    assert "tokens" in results["1x8"] and "tokens" in results["2x4"]
    # 2 KV heads: split over a model axis of 2; on 8 devices (and on 2x4) the default is
    # attention data parallelism, one data rank per device, no KV stored twice.
    assert results["1x8"]["kv"] == [8, 1, "attention_data_parallel"]
    assert results["2x4"]["kv"] == [8, 1, "attention_data_parallel"]
    assert results["1x1"]["kv"] == [1, 1, "auto"]
