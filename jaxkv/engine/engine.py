"""`LLMEngine`: add requests, step, stream outputs; the scheduler and model runner inside.

A step schedules on the host, dispatches the device step and returns the outputs of the
*previous* step (with `async_scheduling=True`, the default): the host schedules and
packs step N+1 while the device still runs step N, whose sampled tokens step N+1 reads on
device. Nothing blocks on the device until a step's tokens are needed to check stop
conditions. With `async_scheduling=False` each step waits for its own tokens. Both give
the same tokens.

On a mesh (`LLMEngine(model, config, mesh=jaxkv.device.make_mesh(data, model))`, the model
loaded onto the same mesh), attention heads are split over the model axis and requests
over the data axis: each data rank has its own KV cache manager and scheduler (its own
block pool, the encoder cache shared), and a new request goes to the rank holding its
longest cached prefix among the ranks not much busier than the least loaded
(`choose_data_rank`). All ranks step together in one device call. The tokens are the same
on any mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxkv._checks import check_int
from jaxkv.block_pool import check_tenant_block_quotas
from jaxkv.device import compilation_count
from jaxkv.device.attention import default_block_size
from jaxkv.device.compilation_cache import enable_compilation_cache
from jaxkv.encoder_cache_manager import EncoderBudget, EncoderCacheManager
from jaxkv.engine import multihost
from jaxkv.engine.model_runner import (
    ModelRunner,
    RequestStepError,
    RowSampling,
    group_kv_cache_specs,
    image_inputs,
)
from jaxkv.engine.offload import PendingStore, host_offloads, wait_for_a_staging
from jaxkv.engine.outputs import OutputStream, RequestOutput
from jaxkv.engine.sampling import RequestOutputKind, SamplingParams
from jaxkv.engine.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    TokenUpdates,
    stop_token_ids_for,
)
from jaxkv.engine.sizing import size_kv_cache
from jaxkv.engine.stats import EngineStats, StepStats
from jaxkv.hashing import get_hash_fn_by_name, init_none_hash
from jaxkv.host_tier import combined_stats
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_events import DeferredKVCacheEvent, KVCacheEvent, build_events
from jaxkv.kv_events_publisher import (
    EventPublisher,
    EventPublisherFactory,
    KVEventsConfig,
    check_endpoint,
)
from jaxkv.mm_hashing import hash_mm_item
from jaxkv.request import MultiModalFeatureSpec, Request
from jaxkv.request_hashing import get_request_block_hasher
from jaxkv.routing import choose_data_rank

__all__ = ["EngineConfig", "LLMEngine", "choose_data_rank", "fold_seed"]

_INT32_SEEDS = 2**31


def fold_seed(seed: int) -> int:
    """A request's seed as the int32 the step samples with: a seed in `[0, 2**31)` as
    given; any other int (vLLM takes any) folded deterministically by CRC-32 of its
    decimal form into that range. Two folded seeds collide with probability 2**-31."""
    seed = int(seed)
    if 0 <= seed < _INT32_SEEDS:
        return seed
    return zlib.crc32(str(seed).encode()) % _INT32_SEEDS


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine. `encoder_cache_size` / `encoder_compute_budget` count image
    embeddings (None: room for `max_num_batched_tokens`, at least one image).
    The KV cache is sized by `jaxkv.engine.sizing`: `num_blocks` as given, else as many as
    `kv_cache_memory` bytes per device hold (or `memory_utilization` of the device's
    memory, vLLM's `gpu_memory_utilization`, where the device reports its size);
    `max_model_len=None` takes the longest request that pool holds, capped by the
    model's `max_position_embeddings`. `LLMEngine.config` holds the resolved values.
    `kv_cache_dtype` "int8" / "fp8" stores the KV cache quantised, a float32 scale per
    token and head (`jaxkv.device.storage`); "auto" stores it in `dtype`.
    `kv_events_endpoint` (None: off) publishes each step's KV events as vLLM does
    (`jaxkv.kv_events_publisher`), data rank `k` on the endpoint's port + `k`;
    `kv_events_replay_endpoint` adds the replay socket; `kv_events_topic` is the topic
    frame; `kv_events_int_block_hashes=False` sends digest bytes instead of 64-bit ints.
    `kv_offloading_size` (vLLM's name; bytes, None: off) keeps blocks in a host-memory
    tier behind the device pool (`jaxkv.engine.offload`), evicting by
    `kv_offloading_policy` ("lru" or "arc"), with optional per-`cache_salt` byte caps
    `kv_offloading_tenant_quotas` (each at least one block, at most the budget); full
    attention and sliding-window KV-cache groups; each data rank has its own tier of
    that budget, as each has its own device pool. `kv_offloading_store` is when a
    cached block is copied there: "finished" (the default) when a request holding it
    finishes or is preempted, so the tier also holds blocks still in the device pool;
    "evicted" only when the device pool evicts it for reuse (host bytes and copies
    spent only on blocks the device drops). "finished" stays the default: on the
    multi-turn test workload (a device pool of a third of the working set) "evicted"
    served fewer prefix tokens (336 vs 432 of 558 on the one-group model, equal on the
    hybrid one): a block evicted for another request admitted earlier in the same
    `schedule()` is only queued for the tier, in neither tier yet, so a request
    admitted after it in that step recomputes it.
    `device_tenant_block_quotas` (None: off) caps the blocks each listed `cache_salt`
    may hold in the device prefix cache, per data rank (each an int >= 0): a salt at
    its cap gives up its own least recently freed cached block, or leaves the new block
    uncached when all of its cached blocks are in use; it never evicts another salt's
    blocks (`jaxkv.block_pool.BlockPool`). Given (even `{}`), every salt's cached blocks
    are counted for `stats.tenants()`.
    `enable_kv_cache_events` (vLLM's `KVEventsConfig` name) keeps each step's KV events,
    the device pool's and the host tier's (`medium="CPU"`), for `take_kv_events()`,
    with or without an endpoint."""

    block_size: int | None = None  # None: 128 on a TPU, else 16 (`default_block_size`)
    num_blocks: int | None = None  # None: from the memory budget, else 128
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int | None = 256  # None: the longest that fits, at most the model's
    kv_cache_memory: int | None = None  # bytes per device for the KV cache
    memory_utilization: float | None = None  # of the device's memory (memory_stats)
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    zero_freed_blocks: bool = False
    async_scheduling: bool = True
    encoder_cache_size: int | None = None
    encoder_compute_budget: int | None = None
    hash_fn: str = "sha256"
    seed: int = 0
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # vLLM's name: "auto" (= dtype), "int8" or "fp8" (e4m3)
    compilation_cache_dir: str | None = "auto"  # jaxkv.device.compilation_cache
    kv_events_endpoint: str | None = None  # e.g. "tcp://*:5557"
    kv_events_replay_endpoint: str | None = None  # e.g. "tcp://*:5558"
    kv_events_topic: str = ""
    kv_events_int_block_hashes: bool = True
    kv_offloading_size: int | None = None  # bytes of host memory, e.g. 8 * 2**30
    kv_offloading_policy: str = "lru"
    kv_offloading_store: str = "finished"  # or "evicted": when blocks go to the host tier
    kv_offloading_tenant_quotas: Mapping[str, int] | None = None
    device_tenant_block_quotas: Mapping[str, int] | None = None
    enable_kv_cache_events: bool = False


# Prompts that iterate as ints but are not token ids (`_token_ids` refuses them).
_BYTES_TYPES = (bytes, bytearray, memoryview)


@dataclass
class _InFlight:
    outputs: list[SchedulerOutput]  # one per data rank
    sampled: jax.Array


def model_mesh(model) -> Mesh | None:
    """The mesh the model's parameters are placed on (None: not on a named mesh)."""
    from flax import nnx

    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


class LLMEngine:
    """Serve a model (the `jaxkv.models` contract) with continuous batching and paged KV.

    Bad input to `add_request` raises ValueError/TypeError naming it before anything
    changes; the engine keeps serving the other requests.

    `mesh` (default: the mesh the model's weights are on, else one device): a
    `(data, model)` mesh from `jaxkv.device.make_mesh`. `schedulers[k]` and
    `kv_cache_managers[k]` serve data rank `k`, each with `config.num_blocks` blocks;
    `scheduler` and `kv_cache_manager` are rank 0's (the only ones on one data rank).

    Several processes (`jaxkv.engine.multihost.initialize` first, the same model, config
    and mesh on each, checked at construction): requests enter on process 0; the others
    call `follow()` until process 0's `shutdown()`. Every process holds the same host state.
    """

    def __init__(
        self, model, config: EngineConfig | None = None, tokenizer=None, *, mesh: Mesh | None = None
    ) -> None:
        self.config = c = config or EngineConfig()
        for name in (
            "block_size", "kv_cache_memory", "num_blocks", "max_model_len", "encoder_cache_size",
            "encoder_compute_budget",
        ):  # fmt: skip
            value = getattr(c, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1
            ):
                raise ValueError(
                    f"EngineConfig.{name} must be a positive int or None, got {value!r}"
                )
        if c.memory_utilization is not None and not 0 < c.memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig.memory_utilization must be in (0, 1], got {c.memory_utilization!r}"
            )
        if not isinstance(c.enable_kv_cache_events, bool):
            raise TypeError(
                f"EngineConfig.enable_kv_cache_events must be a bool, got "
                f"{c.enable_kv_cache_events!r}"
            )
        device_quotas = check_tenant_block_quotas(
            c.device_tenant_block_quotas, "EngineConfig.device_tenant_block_quotas"
        )
        if c.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {c.kv_cache_dtype!r}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(c, name) is not None:  # before the device memory is allocated
                check_endpoint(getattr(c, name), f"EngineConfig.{name}")
        self.model = model
        self.tokenizer = tokenizer
        self.compilation_cache_dir = enable_compilation_cache(c.compilation_cache_dir)
        mcfg = model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (getattr(mcfg, "eos_token_ids", ()) or ()))
        self.images = image_inputs(model)
        encoder_budget = None
        if self.images is not None:
            default = max(c.max_num_batched_tokens, self.images.num_image_tokens)
            encoder_budget = EncoderBudget(
                compute_budget=c.encoder_compute_budget or default,
                cache_size=c.encoder_cache_size or default,
            )
        mesh = self._check_mesh(mesh)
        if c.block_size is None:
            platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
            self.config = c = dataclasses.replace(c, block_size=default_block_size(platform))
        kv_quant = None if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        probe, layer_to_group = group_kv_cache_specs(model.kv_cache_specs(c.block_size, c.dtype), 2)
        self.kv_cache_sizing = size_kv_cache(
            c, probe, layer_to_group, getattr(mcfg, "max_position_embeddings", None), mesh,
            kv_quant,
        )  # fmt: skip
        self.config = c = dataclasses.replace(
            c, num_blocks=self.kv_cache_sizing.num_blocks,
            max_model_len=self.kv_cache_sizing.max_model_len,
        )  # fmt: skip
        self.runner = ModelRunner(
            model, num_blocks=c.num_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
            dtype=c.dtype, kv_quant=kv_quant,
            zero_freed_blocks=c.zero_freed_blocks,
            encoder_cache_size=encoder_budget.cache_size if encoder_budget else 0,
            mesh=mesh,
        )  # fmt: skip
        self.mesh = self.runner.mesh
        scheduler_config = SchedulerConfig(
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
        )
        encoder_cache = EncoderCacheManager(encoder_budget.cache_size) if encoder_budget else None
        self._events_on = c.kv_events_endpoint is not None or c.enable_kv_cache_events
        # Each rank's events kept for `take_kv_events` (None: not kept).
        self._kept_events: list[list[KVCacheEvent | DeferredKVCacheEvent]] | None = None
        self.kv_cache_managers = [
            KVCacheManager(
                kv_cache_config=self.runner.kv_cache_config,
                max_model_len=c.max_model_len,
                enable_caching=c.enable_prefix_caching,
                log_stats=True,
                track_freed_block_ids=True,
                enable_kv_cache_events=self._events_on,
                tenant_block_quotas=device_quotas,
            )
            for _ in range(self.runner.dp_size)
        ]
        # One host tier per data rank (none: off); `offload` is rank 0's.
        self.offloads = host_offloads(c, self.runner)
        self.offload = self.offloads[0] if self.offloads else None
        for rank, offload in enumerate(self.offloads):
            if offload.store_at == "evicted":  # stores at the pool's evictions
                self.kv_cache_managers[rank].block_pool.on_evict = offload.blocks_evicted
        self.kv_event_publishers: list[EventPublisher] = self._event_publishers(c)
        self.schedulers = [
            Scheduler(
                manager,
                scheduler_config,
                encoder_cache_manager=encoder_cache,
                encoder_budget=encoder_budget,
                offload=self.offloads[rank] if self.offloads else None,
            )  # fmt: skip
            for rank, manager in enumerate(self.kv_cache_managers)
        ]
        self.kv_cache_manager, self.scheduler = self.kv_cache_managers[0], self.schedulers[0]
        self._stream: multihost.RequestStream | None = None  # several processes: replay
        if jax.process_count() > 1:
            multihost.check_same_everywhere(self._settings(), "engine settings")
            self._stream = multihost.RequestStream()
        self._rank_of: dict[str, int] = {}  # unfinished request id -> its data rank
        hash_fn = get_hash_fn_by_name(c.hash_fn)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(
            self.kv_cache_manager.hash_block_size, hash_fn
        )
        self._sampling: dict[str, RowSampling] = {}  # unfinished request id -> its row
        self._images: dict[str, np.ndarray] = {}
        self._image_refs: dict[str, int] = {}
        self._in_flight: _InFlight | None = None
        self._streams: dict[str, OutputStream] = {}  # unfinished request id -> its outputs
        self._final_outputs: list[RequestOutput] = []  # aborted or failed, for the next step
        self._ids = itertools.count()
        self.stats = EngineStats(tier_snapshot=self._tier_snapshot)
        if c.enable_kv_cache_events:
            self._kept_events = [[] for _ in self.kv_cache_managers]
        self.num_steps = 0

    def _settings(self) -> dict[str, str]:
        """What every process of a multi-process engine must agree on, in order."""
        from importlib.metadata import version

        settings = {"jaxkv version": version("jaxkv")}
        for f in dataclasses.fields(self.config):
            settings[f"EngineConfig.{f.name}"] = repr(getattr(self.config, f.name))
        settings["model config"] = multihost.digest(repr(self.model.config))
        settings["mesh"] = repr(None if self.mesh is None else dict(self.mesh.shape))
        return settings

    def _event_publishers(self, c: EngineConfig) -> list[EventPublisher]:
        """One publisher per data rank when `kv_events_endpoint` is set, else none (and
        none on processes other than 0: process 0 publishes every rank's events)."""
        if c.kv_events_endpoint is None or jax.process_index() != 0:
            return []
        events_config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=c.kv_events_endpoint,
            replay_endpoint=c.kv_events_replay_endpoint,
            topic=c.kv_events_topic,
            int_block_hashes=c.kv_events_int_block_hashes,
        )
        publishers: list[EventPublisher] = []
        try:
            for rank in range(len(self.kv_cache_managers)):
                publishers.append(EventPublisherFactory.create(events_config, rank))
        except ValueError:
            for publisher in publishers:
                publisher.shutdown()
            raise
        return publishers

    def _publish_events(self, awaited: jax.Array | None = None) -> None:
        """Hand each rank's pending KV events (its device pool's, then its host tier's) to
        its publisher and, with `enable_kv_cache_events`, keep them for `take_kv_events`;
        otherwise (events off, or processes other than 0 without publishers) they are
        dropped.

        The publishers' threads build, encode and send the events while this thread
        waits for `awaited`, the device result the step waits for next (the wait lets go
        of the GIL). When there is no such wait (`awaited` None or already computed: the
        host is the bottleneck), this thread sends them itself unless the publishing
        thread is sending: a thread woken to send would take the GIL from the step loop in
        the middle of its work."""
        offloads, publishers, kept = self.offloads, self.kv_event_publishers, self._kept_events
        if not self._events_on and not publishers:
            for offload in offloads:  # events off: nothing records them (dropped)
                offload.tier.take_events()
            return
        send_here = None
        for rank, manager in enumerate(self.kv_cache_managers):
            events = manager.take_events(deferred=True)  # built by whoever sends them
            if offloads:
                events += offloads[rank].tier.take_events()
            if not events:
                continue
            if publishers:
                if send_here is None:  # looked at once, for the first rank with events
                    send_here = awaited is None or awaited.is_ready()
                publishers[rank].publish(events, in_background=not send_here)
            if kept is not None:
                kept[rank] += events

    def take_kv_events(self, data_rank: int = 0) -> list[KVCacheEvent]:
        """Data rank `data_rank`'s KV events since the last call, in order: the device
        pool's (`medium="GPU"`), then its host tier's (`medium="CPU"`), with
        `AllBlocksCleared` from `reset_prefix_cache`; the same events an endpoint
        publishes. Needs `EngineConfig(enable_kv_cache_events=True)`."""
        if self._kept_events is None:
            raise ValueError(
                "take_kv_events needs EngineConfig(enable_kv_cache_events=True) (the events "
                "are not kept otherwise)"
            )
        data_rank = check_int(
            "data_rank", data_rank, min_value=0, max_value=len(self._kept_events) - 1
        )
        events, self._kept_events[data_rank] = self._kept_events[data_rank], []
        return build_events(events)

    def _tier_snapshot(self):
        """Device cached blocks per salt (all ranks; None: not counted), the device caps
        (None: off) and the host tiers' stats summed over the ranks (None: off), for
        `stats.tenants()`."""
        pools = [manager.block_pool for manager in self.kv_cache_managers]
        caps = pools[0].tenant_block_quotas
        device: dict[str, int] | None = None
        if caps is not None:
            device = {}
            for pool in pools:
                for salt, n in pool.tenant_cached_blocks().items():
                    device[salt] = device.get(salt, 0) + n
        host = combined_stats([o.tier.stats() for o in self.offloads]) if self.offloads else None
        return device, caps, host

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's prefix cache (vLLM's `reset_prefix_cache`); False, changing
        nothing on the ranks still holding blocks, while requests run. The host tier is
        cleared with the device pool (its `AllBlocksCleared` has `medium="CPU"`). The
        `AllBlocksCleared` events go out now, not with the next step."""
        if self._stream is not None:
            self._stream.check_source("reset_prefix_cache")
            self._stream.record(("reset_prefix_cache",))
        reset = all([manager.reset_prefix_cache() for manager in self.kv_cache_managers])
        if reset and self.offloads:
            reset = all([offload.reset() for offload in self.offloads])
        self._publish_events()
        return reset

    def shutdown(self) -> None:
        """Flush and close the KV event publishers (nothing else holds resources); on
        process 0 of several, release the others from `follow()`."""
        if self._stream is not None and self._stream.is_source:
            self._stream.stop()
            self._stream = None
        for publisher in self.kv_event_publishers:
            publisher.shutdown()

    def _check_mesh(self, mesh: Mesh | None) -> Mesh | None:
        """`mesh`, or the model's; ValueError when they differ."""
        weights_mesh = model_mesh(self.model)
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

    # -- requests ---------------------------------------------------------------------

    def warm_up(self) -> int:
        """Compile every step shape now, so serving compiles nothing; returns the count."""
        count = self.runner.warm_up()
        if self.offloads:
            self.runner.warm_up_transfers(self.offloads[0].layers_per_block)
        return count

    def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: text through the tokenizer, or a non-empty sequence of
        ids in the vocabulary. Bytes are refused as vLLM refuses them: they iterate as
        ints, so would silently be served as token ids."""
        if isinstance(prompt, _BYTES_TYPES):
            raise TypeError(
                f"prompt must be text (str) or a sequence of token ids, got "
                f"{type(prompt).__name__}; decode bytes to str first"
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(
                    "prompt is text but the engine has no tokenizer; pass token ids instead"
                )
            return list(self.tokenizer.encode(prompt).ids)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be text or a sequence of token ids, got {prompt!r}")
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise TypeError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t} is out of range [0, {self.vocab_size}) of the model"
                )
        return [int(t) for t in ids]

    def _image_features(
        self, request_id: str, ids: list[int], images: Sequence[np.ndarray]
    ) -> tuple[list[int], list[MultiModalFeatureSpec], list[np.ndarray]]:
        """Expand each image token into the image's placeholder tokens."""
        if self.images is None:
            raise ValueError(f"request {request_id!r} has images but the model takes text only")
        image_token_id = self.images.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token_id]
        if len(positions) != len(images):
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(positions)} image tokens "
                f"(id {image_token_id}) but {len(images)} images were given"
            )
        want, n = self.images.pixel_shape, self.images.num_image_tokens
        expanded, features, pixels = [], [], []
        last = 0
        for pos, image in zip(positions, images, strict=True):
            image = np.asarray(image, np.float32)
            if image.shape != want:
                raise ValueError(
                    f"request {request_id!r}: image has shape {image.shape}; the model "
                    f"takes preprocessed pixel values of shape {want}"
                )
            expanded += ids[last:pos]
            mm_hash = hash_mm_item(image)
            features.append(MultiModalFeatureSpec(mm_hash, len(expanded), n))
            expanded += [image_token_id] * n
            pixels.append(image)
            last = pos + 1
        return expanded + ids[last:], features, pixels

    def add_request(
        self,
        prompt: str | Sequence[int],
        images: Sequence[np.ndarray] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: object | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises (changing nothing) on bad input.

        `cache_salt` (vLLM's meaning): requests share prefix-cache blocks only with
        requests of the same salt; `""` is the same as no salt. A tenant's salt keeps
        other tenants from learning, through cache hits, which prompts it sent.
        `lora_request`: the engine serves no LoRA adapters, so anything but None is
        refused (vLLM's behaviour without `enable_lora`).
        """
        if self._stream is not None:
            self._stream.check_source("add_request")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._sampling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if lora_request is not None:
            raise ValueError("lora_request must be None: this engine serves no LoRA adapters")
        if sampling.prompt_logprobs is not None:
            raise ValueError(
                "SamplingParams.prompt_logprobs must be None: the engine returns no logprobs"
            )
        ids = self._token_ids(prompt)
        features, pixels = [], []
        if images:
            ids, features, pixels = self._image_features(request_id, ids, images)
        request = Request(
            request_id, ids, sampling, mm_features=features, block_hasher=self._block_hasher,
            cache_salt=cache_salt,
        )  # fmt: skip
        stop = stop_token_ids_for(sampling, self.eos_token_ids)
        rank = 0
        if len(self.schedulers) > 1:
            rank = choose_data_rank(
                [s.num_unfinished_requests for s in self.schedulers],
                lambda k: self._num_cached_tokens(k, request),
                max(1, self.config.max_num_seqs // 4) if self.config.enable_prefix_caching else 0,
            )
        self.schedulers[rank].add_request(request, stop)  # validates before changing anything
        self._rank_of[request_id] = rank
        self._sampling[request_id] = self._row_sampling(sampling, request_id)
        self._streams[request_id] = OutputStream.for_kind(sampling.output_kind, request.cache_salt)
        for feature, image in zip(features, pixels, strict=True):
            self._images.setdefault(feature.identifier, image)
            self._image_refs[feature.identifier] = self._image_refs.get(feature.identifier, 0) + 1
        if self._stream is not None:
            self._stream.record(("add", prompt, images, sampling, request_id, cache_salt))
        return request_id

    def _row_sampling(self, sampling: SamplingParams, request_id: str) -> RowSampling:
        """The request's sampling row as the step's int32/float32 buffer holds it: the seed
        folded (`fold_seed`), top-k disabled (0) for `-1` or any k covering the vocabulary."""
        seed = sampling.seed
        if seed is None:
            seed = zlib.crc32(f"{self.config.seed}/{request_id}".encode()) & 0x7FFFFFFF
        top_k = int(sampling.top_k)
        if top_k < 0 or top_k >= self.vocab_size:
            top_k = 0
        return RowSampling(
            float(sampling.temperature), top_k, float(sampling.top_p), fold_seed(seed)
        )

    def abort(self, request_id: str) -> None:
        """Stop a request now; KeyError naming it when no unfinished request has that id.
        Its final output (`finish_reason="abort"`) comes with the next `step()`."""
        if self._stream is not None:
            self._stream.check_source("abort")
        rank = self._rank_of.get(request_id)
        if rank is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        if self._stream is not None:
            self._stream.record(("abort", request_id))
        request = self.schedulers[rank].abort_request(request_id)
        self._finish_now(request, FinishReason.ABORT)

    def _num_cached_tokens(self, rank: int, request: Request) -> int:
        """Tokens of `request`'s prefix data rank `rank` holds, in its device pool or its
        host tier (the more of the two): what routing a new request weighs."""
        device = self.kv_cache_managers[rank].get_num_cached_prefix_tokens(request)
        if not self.offloads:
            return device
        return max(device, self.offloads[rank].num_cached_tokens(request))

    def _fail(self, request_id: str, error: str) -> None:
        """Finish one request with `finish_reason="error"`; the others go on."""
        rank = self._rank_of[request_id]
        request = self.schedulers[rank].finish_request(request_id, FinishReason.ERROR)
        self._finish_now(request, FinishReason.ERROR, error)

    def _finish_now(self, request: Request, reason: FinishReason, error: str | None = None):
        """Queue the final output of a request finished outside a step's token update."""
        stream = self._streams[request.request_id]
        self._final_outputs.append(stream.output(request, 0, str(reason), self.tokenizer))
        if error is not None:
            self._final_outputs[-1].error = error
        self._forget(request)

    def _forget(self, request: Request) -> None:
        self._sampling.pop(request.request_id, None)
        self._rank_of.pop(request.request_id, None)
        self._streams.pop(request.request_id, None)
        for feature in request.mm_features:
            refs = self._image_refs[feature.identifier] - 1
            if refs:
                self._image_refs[feature.identifier] = refs
            else:
                del self._image_refs[feature.identifier]
                del self._images[feature.identifier]

    def has_unfinished_requests(self) -> bool:
        return bool(self._rank_of) or self._in_flight is not None or bool(self._final_outputs)

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far, all data ranks."""
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks, all data ranks."""
        return sum(m.num_free_blocks for m in self.kv_cache_managers)

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that got a token or finished,
        as each one's `SamplingParams.output_kind` asks (none before the last for
        `FINAL_ONLY`).

        One request never fails the step for the others: a request whose part of the step
        cannot be prepared or applied on the host finishes with `finish_reason="error"`
        (its blocks and encoder entries freed) and the step goes on without it.

        Several processes: process 0's calls since the last step are replayed on the others
        first (`multihost.RequestStream`), so every process schedules the same step.
        """
        if self._stream is None:
            return self._step()
        with multihost.peers_alive(self._stream):
            self._stream.replay(self._stream.exchange() or [], self._apply)
            return self._step()

    def follow(self) -> None:
        """On a process other than 0: step with process 0 until it shuts its engine down."""
        if self._stream is None or self._stream.is_source:
            raise RuntimeError(
                "follow() is for the processes other than 0 of a multi-process engine"
            )
        with multihost.peers_alive(self._stream):
            while (ops := self._stream.exchange()) is not None:
                self._stream.replay(ops, self._apply)
                self._step()

    def _apply(self, op: multihost.Op) -> None:
        """Replay one of process 0's calls (`RequestStream.record`)."""
        if op[0] == "add":
            prompt, images, sampling, request_id, cache_salt = op[1:]
            self.add_request(prompt, images, sampling, request_id, cache_salt=cache_salt)
        elif op[0] == "abort":
            self.abort(op[1])
        else:
            self.reset_prefix_cache()

    def _step(self) -> list[RequestOutput]:
        compiled = compilation_count()
        t0 = time.perf_counter()
        # Gathers of two steps ago were dispatched before the step just waited for; an
        # idle engine has nothing to overlap the others with, so it waits for them too.
        before_step = None if not self.has_unfinished_requests() else self.num_steps - 1
        for offload in self.offloads:
            offload.complete_stores(before_step=before_step)
        outs = [scheduler.schedule() for scheduler in self.schedulers]
        self._store_freed_blocks()  # before this step can write into a freed or evicted block
        empty = all(out.is_empty for out in outs)
        if empty and self._in_flight is None:
            self._fail_unschedulable()
        sampled = self._execute(outs)
        empty = all(out.is_empty for out in outs)
        current = _InFlight(outs, sampled) if not empty else None
        done = self._in_flight if self.config.async_scheduling else current
        self._in_flight = current if self.config.async_scheduling else None
        # The events of the step's schedule (the blocks it caches are written by the step
        # just dispatched, before any later step runs), sent while the host waits for
        # `done` when it will.
        self._publish_events(None if done is None else done.sampled)
        wait_s = 0.0
        if current is None and done is None and self.offloads:
            # Nothing runs until a pending host-tier load is staged: wait for one (the
            # next step takes it) rather than step empty meanwhile.
            t_wait = time.perf_counter()
            wait_for_a_staging(self.offloads)
            wait_s = time.perf_counter() - t_wait
        updates: list[TokenUpdates] = []
        if done is not None:
            t_wait = time.perf_counter()
            tokens = multihost.host_tokens(done.sampled)  # the one place the host waits
            wait_s = time.perf_counter() - t_wait
            width = self.runner.max_num_seqs
            for rank, (scheduler, out) in enumerate(
                zip(self.schedulers, done.outputs, strict=True)
            ):
                rows = tokens[rank * width : (rank + 1) * width]
                updates.append(scheduler.update_from_output(out, rows))
        self._store_freed_blocks()
        outputs, self._final_outputs = self._final_outputs, []
        for update in updates:
            reasons = update.finish_reasons
            for request in update.requests:
                reason = reasons.get(request.request_id) if reasons else None
                output = self._output(request, reason)
                if output is not None:
                    outputs.append(output)
        self._record(outs, updates, time.perf_counter() - t0 - wait_s, wait_s, compiled)
        return outputs

    def _store_freed_blocks(self) -> None:
        """Start copying the blocks queued for each rank's host tier (freed requests' or,
        with `kv_offloading_store="evicted"`, those `schedule()` just evicted; one gather
        for all ranks, dispatched now, so it reads them before this or any later step
        writes there); see `HostOffload.take_stores`."""
        if not self.offloads:
            return
        stores = [offload.take_stores() for offload in self.offloads]
        if not any(store.block_ids for store in stores):
            return
        gathered = self.runner.gather_blocks(
            [store.block_ids for store in stores], [store.layers for store in stores]
        )
        for offload, store, blocks in zip(self.offloads, stores, gathered, strict=True):
            if store.block_ids:
                offload.pending_stores.append(
                    PendingStore(store.keys, store.slots, store.digests, blocks, self.num_steps)
                )

    def _fail_unschedulable(self) -> None:
        """With nothing running, loading or in flight, a waiting request that still cannot
        be scheduled never will be: it finishes with an error instead of stalling the
        engine."""
        for scheduler in self.schedulers:
            if scheduler.waiting and not scheduler.running and not scheduler.loading:
                request = scheduler.waiting[0]
                self._fail(
                    request.request_id,
                    f"{request.num_tokens} tokens do not fit the "
                    f"{scheduler.kv_cache_manager.num_free_blocks} free KV blocks",
                )

    def _execute(self, outs: list[SchedulerOutput]) -> jax.Array:
        """Dispatch the step; a request whose rows cannot be prepared is failed and taken
        out of `outs` (in place), and the step is packed again without it."""
        while True:
            try:
                return self.runner.execute(outs, self._sampling, self._images)
            except RequestStepError as error:
                self._fail(error.request_id, str(error))
                for out in outs:
                    out.scheduled = [
                        s for s in out.scheduled if s.request.request_id != error.request_id
                    ]

    def _output(self, request: Request, reason: FinishReason | None) -> RequestOutput | None:
        """The output of a request given a token this step (`reason`: it stopped with
        it); None for a `FINAL_ONLY` request that is not finished."""
        stream = self._streams[request.request_id]
        if request.num_output_tokens == 1:
            self.stats.record_admission(
                stream.cache_salt,
                request.num_prompt_tokens,
                request.num_cached_tokens,
                request.num_external_cached_tokens,
            )
        if reason is None and stream.final_only:
            return None
        output = stream.output(request, 1, None if reason is None else str(reason), self.tokenizer)
        if reason is not None:
            self._forget(request)
        return output

    def _record(self, outs: list[SchedulerOutput], updates, host_s, wait_s, compiled) -> None:
        """One step's stats, summed over the data ranks (KV usage: their mean)."""
        prefix = [m.make_prefix_cache_stats() for m in self.kv_cache_managers]
        host = Counter()
        for offload in self.offloads:
            host.update(offload.take_stats())
        self.stats.record(
            StepStats(
                step=self.num_steps,
                num_scheduled_tokens=sum(o.num_scheduled_tokens for o in outs),
                num_scheduled_requests=sum(len(o.scheduled) for o in outs),
                num_running=sum(len(s.running) for s in self.schedulers),
                num_waiting=sum(len(s.waiting) for s in self.schedulers),
                num_loading=sum(len(s.loading) for s in self.schedulers),
                num_generated_tokens=sum(len(u.requests) for u in updates),
                prefix_queries=sum(p.queries + p.preempted_queries for p in prefix),
                prefix_hits=sum(p.hits + p.preempted_hits for p in prefix),
                encoder_hits=sum(o.num_encoder_hits for o in outs),
                encoder_misses=sum(o.num_encoder_misses for o in outs),
                kv_usage=sum(m.usage for m in self.kv_cache_managers) / len(self.kv_cache_managers),
                num_preemptions=sum(len(o.preempted_request_ids) for o in outs),
                num_freed_blocks=sum(int(o.freed_block_ids.size) for o in outs),
                host_s=host_s,
                wait_s=wait_s,
                compilations=compilation_count() - compiled,
                **{f"host_{name}": value for name, value in host.items()},
            )
        )
        self.num_steps += 1

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[Sequence[np.ndarray] | None] | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Serve `prompts` to completion; one final output per prompt, in order.

        A prompt the engine cannot accept gets an output with `error` set; the others
        are served. `on_step` sees each step's streamed outputs. `cache_salt`: every
        prompt's (see `add_request`).
        """
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if on_step is None:  # nobody sees the streamed outputs: make none (as vLLM's LLM)
            sampling = [
                params
                if not isinstance(params, SamplingParams | None)
                else dataclasses.replace(
                    params or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY
                )
                for params in sampling
            ]
        if images is None:
            images = [None] * len(prompts)
        if not len(sampling) == len(images) == len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(sampling)} sampling params and "
                f"{len(images)} image lists; they must match"
            )
        results: dict[str, RequestOutput] = {}
        order: list[str | RequestOutput] = []
        for prompt, params, imgs in zip(prompts, sampling, images, strict=True):
            try:
                order.append(self.add_request(prompt, imgs, params, cache_salt=cache_salt))
            except (ValueError, TypeError) as error:
                # The ids as given, where they are a sequence (not text, bytes, or junk).
                is_ids = isinstance(prompt, Sequence | np.ndarray) and not isinstance(
                    prompt, (str, *_BYTES_TYPES)
                )
                ids = list(prompt) if is_ids else []
                order.append(RequestOutput.rejected(ids, str(error)))
        pending = {rid for rid in order if isinstance(rid, str)}
        while pending:
            outputs = self.step()
            if on_step is not None:
                on_step(outputs)
            for o in outputs:
                if o.finished and o.request_id in pending:
                    results[o.request_id] = o
                    pending.discard(o.request_id)
        return [results[rid] if isinstance(rid, str) else rid for rid in order]
