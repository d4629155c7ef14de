"""Building `LLMEngine`'s parts from its config: the mesh, the resolved sizes (block size,
KV-cache blocks, longest request), the model runner, the KV cache managers and the
schedulers, one of each per data rank.

Invariants: nothing is allocated on the device before the config and the mesh are
checked; `LLMEngine.config` holds the resolved values (no None left for `block_size`,
`num_blocks`, `max_model_len`); every data rank has the same sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding

from jaxkv.device.attention import default_block_size
from jaxkv.encoder_cache_manager import EncoderBudget, EncoderCacheManager
from jaxkv.engine.config import EngineConfig
from jaxkv.engine.model_runner import ImageInputs, ModelRunner
from jaxkv.engine.offload import HostOffload
from jaxkv.engine.scheduler import Scheduler, SchedulerConfig
from jaxkv.engine.sizing import KVCachePlan, plan_kv_cache
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = [
    "check_mesh",
    "encoder_budget",
    "make_managers",
    "make_runner",
    "make_schedulers",
    "model_mesh",
    "resolve_sizes",
]


def model_mesh(model) -> Mesh | None:
    """The mesh the model's parameters are placed on (None: not on a named mesh)."""
    from flax import nnx

    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def check_mesh(model, mesh: Mesh | None) -> Mesh | None:
    """`mesh`, or the model's; TypeError / ValueError when it is not a mesh or not the
    mesh the model's weights are on."""
    weights_mesh = model_mesh(model)
    if mesh is None:
        return weights_mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if weights_mesh is not None and weights_mesh != mesh:
        raise ValueError(
            f"mesh {dict(mesh.shape)} is not the mesh the model's weights are on "
            f"({dict(weights_mesh.shape)}); load the model with the same mesh"
        )
    return mesh


def encoder_budget(c: EngineConfig, images: ImageInputs | None) -> EncoderBudget | None:
    """The image-embedding budget (None: the model takes text only): as configured, else
    room for `max_num_batched_tokens`, at least one image."""
    if images is None:
        return None
    default = max(c.max_num_batched_tokens, images.num_image_tokens)
    return EncoderBudget(
        compute_budget=c.encoder_compute_budget or default,
        cache_size=c.encoder_cache_size or default,
    )


def resolve_sizes(c: EngineConfig, model, mesh: Mesh | None) -> tuple[EngineConfig, KVCachePlan]:
    """The config with `block_size`, `num_blocks` and `max_model_len` resolved, and the
    KV-cache plan they come from (`jaxkv.engine.sizing.plan_kv_cache`, which the runner,
    the host tier and `jaxkv plan` share)."""
    if c.block_size is None:
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        c = dataclasses.replace(c, block_size=default_block_size(platform))
    plan = plan_kv_cache(
        model.kv_cache_specs(c.block_size, c.dtype), c, mesh,
        getattr(model.config, "max_position_embeddings", None),
    )  # fmt: skip
    c = dataclasses.replace(c, num_blocks=plan.num_blocks, max_model_len=plan.max_model_len)
    return c, plan


def make_runner(
    model, c: EngineConfig, plan: KVCachePlan, budget: EncoderBudget | None
) -> ModelRunner:
    """The model runner of the resolved config `c` and its KV-cache `plan` (it allocates
    the KV cache)."""
    return ModelRunner(
        model, plan, max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        zero_freed_blocks=c.zero_freed_blocks,
        encoder_cache_size=budget.cache_size if budget else 0, logprobs_mode=c.logprobs_mode,
    )  # fmt: skip


def make_managers(
    c: EngineConfig,
    runner: ModelRunner,
    device_quotas: Mapping[str, int] | None,
    events_on: bool,
) -> list[KVCacheManager]:
    """One KV cache manager per data rank, each with its own block pool."""
    return [
        KVCacheManager(
            kv_cache_config=runner.kv_cache_config,
            max_model_len=c.max_model_len,
            enable_caching=c.enable_prefix_caching,
            log_stats=True,
            track_freed_block_ids=True,
            enable_kv_cache_events=events_on,
            tenant_block_quotas=device_quotas,
        )
        for _ in range(runner.dp_size)
    ]


def make_schedulers(
    c: EngineConfig,
    managers: list[KVCacheManager],
    budget: EncoderBudget | None,
    offloads: list[HostOffload],
) -> list[Scheduler]:
    """One scheduler per data rank over its manager and host tier; the encoder cache is
    shared by the ranks."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=c.max_model_len,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
    )
    encoder_cache = EncoderCacheManager(budget.cache_size) if budget else None
    return [
        Scheduler(
            manager,
            scheduler_config,
            encoder_cache_manager=encoder_cache,
            encoder_budget=budget,
            offload=offloads[rank] if offloads else None,
        )  # fmt: skip
        for rank, manager in enumerate(managers)
    ]
