"""The engine on 1 and 8 simulated devices gives the same tokens.

One mixed workload (shared prefixes, chunked prefill, a pool small enough to preempt,
Gemma-3-style sliding-window layers; LLaVA-style images through the shared encoder
cache, freed blocks zeroed per rank) runs through `LLMEngine` on a 1x1 mesh and on an
8-device 4x2 `(data, model)` mesh (requests over 4 data ranks, each with its own block
pool; weights and KV heads split over 2). Greedy tokens must be identical and equal to
the dense reference on each mesh; the dense logits behind them must agree across
meshes. `jaxkv generate --data-parallel-size 2 --tensor-parallel-size 2` must match the
dense reference too.

The runs happen in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX
starts), so the rest of the suite keeps its single CPU device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from eight_devices import call_on_8_devices

MESHES = [(1, 1), (4, 2)]  # (data, model)
MAX_LEN = 48


def _gemma_workload(rng: np.random.Generator) -> list[list[int]]:
    """Two shared system prompts (3 blocks each) plus private tails, longer than the window."""
    systems = [rng.integers(3, 255, 12).tolist() for _ in range(2)]
    return [systems[i % 2] + rng.integers(3, 255, int(rng.integers(2, 20))).tolist()
            for i in range(8)]  # fmt: skip


def child(workdir: str) -> dict:
    """Runs under 8 devices: per mesh, the engine's outputs, dense logits and counters."""
    import contextlib
    import dataclasses
    import io

    import jax

    from jaxkv import cli
    from jaxkv.device import make_mesh
    from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
    from jaxkv.models import load_model, save_random_checkpoint, tiny_configs
    from jaxkv.testing.reference import DenseReference, image_offsets

    assert len(jax.devices()) == 8
    work = Path(workdir)
    save_random_checkpoint(work / "gemma3", tiny_configs()["gemma3-tiny"], seed=3)
    save_random_checkpoint(work / "llava", tiny_configs()["llava-tiny"], seed=3)
    rng = np.random.default_rng(0)
    prompts = _gemma_workload(rng)
    config = EngineConfig(
        block_size=4, num_blocks=34, max_num_seqs=4, max_num_batched_tokens=16,
        max_model_len=MAX_LEN, long_prefill_token_threshold=6,
    )  # fmt: skip
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    results = {}
    for dp, mp in MESHES:
        mesh = make_mesh(dp, mp, jax.devices()[: dp * mp])
        gemma = load_model(work / "gemma3", mesh=mesh)
        engine = LLMEngine(gemma, config, mesh=mesh)
        outputs = engine.generate(prompts, sampling)
        reference = DenseReference(gemma, MAX_LEN)
        out = {
            "tokens": [o.output_token_ids for o in outputs],
            "dense_tokens": [
                reference.expected(o.prompt_token_ids, o.output_token_ids) for o in outputs
            ],  # fmt: skip
            "logits": [
                reference.logits(o.prompt_token_ids, o.output_token_ids).tolist() for o in outputs
            ],  # fmt: skip
            "preemptions": engine.num_preemptions,
            "prefix_hit_rate": engine.stats.prefix_hit_rate,
            "groups": len(engine.runner.kv_cache_config.kv_cache_groups),
            "cache_spec": str(engine.runner.kv_cache.sharding.spec),
            "free_blocks": engine.num_free_blocks,
            "ranks": len(engine.schedulers),
        }
        llava = load_model(work / "llava", mesh=mesh)
        image_token, n = llava.llava_config.image_token_id, llava.num_image_tokens
        size = llava.llava_config.vision.image_size
        pictures = [rng_img.standard_normal((3, size, size)).astype(np.float32)
                    for rng_img in (np.random.default_rng(s) for s in (5, 6))]  # fmt: skip
        image_prompts = [[3, 4, 5 + i, image_token, 7, 8] for i in range(5)]
        images = [[pictures[i % 2]] for i in range(5)]
        image_config = dataclasses.replace(
            config, num_blocks=48, encoder_cache_size=2 * n, zero_freed_blocks=True
        )
        image_engine = LLMEngine(llava, image_config, mesh=mesh)
        image_outputs = image_engine.generate(image_prompts, sampling, images=images)
        image_reference = DenseReference(llava, MAX_LEN)
        dense = []
        for o, imgs in zip(image_outputs, images, strict=True):
            (offset,) = image_offsets(o.prompt_token_ids, image_token, n)
            dense.append(
                image_reference.expected(
                    o.prompt_token_ids, o.output_token_ids, [(offset, imgs[0])]
                )
            )
        out["image_tokens"] = [o.output_token_ids for o in image_outputs]
        out["image_dense_tokens"] = dense
        out["num_encoded"] = image_engine.runner.num_encoded
        out["image_free_blocks"] = image_engine.num_free_blocks
        results[f"{dp}x{mp}"] = out
    # `jaxkv generate` on a 2x2 mesh, checked against the dense reference on one device.
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        argv = ["generate", "--model", str(work / "gemma3"), "--prompt-token-ids", "5,6,7,8,9",
                "--max-tokens", "4", "--max-model-len", "32", "--json",
                "--data-parallel-size", "2", "--tensor-parallel-size", "2"]  # fmt: skip
        assert cli.main(argv) == 0
    generated = json.loads(text.getvalue().strip().splitlines()[-1])["output_token_ids"]
    single = DenseReference(load_model(work / "gemma3"), MAX_LEN)
    results["cli"] = {"tokens": generated, "dense": single.expected([5, 6, 7, 8, 9], generated)}
    return results


def test_engine_same_tokens_on_1_and_8_devices(tmp_path):
    results = call_on_8_devices("test_engine_sharding", "child", tmp_path)
    cli_run = results.pop("cli")
    assert len(cli_run["tokens"]) == 4 and cli_run["tokens"] == cli_run["dense"]
    one = results["1x1"]
    assert one["groups"] > 1, "sliding-window and full layers in separate KV-cache groups"
    assert results["4x2"]["ranks"] == 4 and "model" in results["4x2"]["cache_spec"]
    assert "data" in results["4x2"]["cache_spec"]
    for name, out in results.items():
        assert out["preemptions"] > 0, f"{name}: the pool is sized to preempt"
        assert out["prefix_hit_rate"] > 0, name
        assert out["tokens"] == out["dense_tokens"], name
        assert out["tokens"] == one["tokens"], name
        np.testing.assert_allclose(out["logits"], one["logits"], rtol=1e-4, atol=1e-4, err_msg=name)
        assert out["image_tokens"] == out["image_dense_tokens"], name
        assert out["image_tokens"] == one["image_tokens"], name
        assert out["num_encoded"] == 2, f"{name}: each distinct image encoded once"
        # Nothing leaked: every rank's pool is free again (block 0 is each rank's null block).
        assert out["free_blocks"] == out["ranks"] * (34 - 1), name
        assert out["image_free_blocks"] == out["ranks"] * (48 - 1), name
