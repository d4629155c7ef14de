"""Glue between the scheduler's output and a model's `forward_paged` (one device call a step).

The runner owns the device state: one `PagedKVCache` and `BlockTable` per KV-cache group
(layers with equal specs share a group and the pool's block ids), every layer's donated
cache array, and for image models an `EncoderCacheStore`. Each step it

1. frees the store pages of evicted encoder entries and zeroes freed KV pages (optional),
2. encodes the images the scheduler asked for (each once; shared through the store),
3. packs the step into ONE int32 buffer (per group: `StepMetadataPacker` metadata; then
   token ids, the previous-step rows that pending tokens come from, the logits rows,
   the sampling parameters and the encoder-store rows to merge) and sends it in one
   transfer,
4. dispatches the jitted step (forward, sampling) and returns the sampled tokens as a
   device array without waiting for them.

On a mesh (`jaxkv.device.make_mesh(data, model)`), KV heads are split over the model axis
and each data rank serves its own requests from its own block pool (block ids local to
the rank, one scheduler per rank): `execute` takes one `SchedulerOutput` per data rank.
The buffer then has one row per rank (its metadata and its token/sampling rows); the
step's token rows, logits and sampled tokens are rank-major.

A model follows the contract of `jaxkv.models` (see `jaxkv/engine/tiny_model.py` for the
smallest one): `kv_cache_specs(block_size, dtype)`, `forward_paged(token_ids, kv_caches,
ctx, inputs_embeds)`, `embed_tokens`, and for images `encode_images`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv.block_table import BlockTable
from jaxkv.device import (
    EmbedPlacement,
    EncoderCacheStore,
    PagedKVCache,
    StepInputs,
    StepMetadataPacker,
    StepShape,
)
from jaxkv.device.storage import check_kv_quant, from_storage
from jaxkv.engine.sampling import sample_tokens
from jaxkv.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxkv.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec, KVCacheTensor
from jaxkv.kv_cache_planning import get_kv_cache_groups
from jaxkv.models.base import PagedContext

__all__ = [
    "ImageInputs",
    "ModelRunner",
    "RequestStepError",
    "RowSampling",
    "group_kv_cache_specs",
    "image_inputs",
]


@dataclass(frozen=True)
class ImageInputs:
    """How a model takes images: placeholder token, embeddings per image, pixel shape."""

    image_token_id: int
    num_image_tokens: int
    pixel_shape: tuple[int, int, int]


def image_inputs(model) -> ImageInputs | None:
    """The model's image interface (LLaVA-style models), None for a text-only model."""
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None or not hasattr(model, "encode_images"):
        return None
    return ImageInputs(int(token_id), int(model.num_image_tokens), tuple(model.image_input_shape))


def group_kv_cache_specs(
    specs: Mapping[str, KVCacheSpec], num_blocks: int
) -> tuple[KVCacheConfig, tuple[int, ...]]:
    """vLLM's KV-cache groups of the model's layers (`get_kv_cache_groups`: one group when
    all layers agree; a hybrid model's sliding and full layers in groups of equal size), on
    one pool of `num_blocks` blocks, every layer its own tensor.

    Returns the config and `layer_to_group` (layer `i` is the `i`-th entry of `specs`).
    """
    if not specs:
        raise ValueError("the model declares no KV-cache layers")
    groups = get_kv_cache_groups(specs)
    for group in groups:
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            raise ValueError(
                f"layers {group.layer_names} have {type(group.kv_cache_spec).__name__}; the "
                "engine serves attention layers of one shape per group"
            )
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    layer_spec = {name: groups[group_of[name]].kv_cache_spec for name in specs}
    tensors = tuple(
        KVCacheTensor(layer_spec[name].page_size_bytes * num_blocks, (name,)) for name in specs
    )
    config = KVCacheConfig(num_blocks, tensors, tuple(groups))
    return config, tuple(group_of[name] for name in specs)


class RequestStepError(Exception):
    """Preparing one request's part of a step failed on the host (`cause`); nothing of the
    step has run on the device yet beyond idempotent page zeroing, copies and encoding,
    so the step can be packed again without that request."""

    def __init__(self, request_id: str, cause: Exception) -> None:
        super().__init__(f"request {request_id!r}: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of one scheduled request row."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


@functools.cache
def _shared_paged_cache(
    spec: KVCacheSpec, num_blocks: int, mesh: Mesh | None, kv_quant: str | None
) -> PagedKVCache:
    """One `PagedKVCache` per (spec, pool size, mesh, quantisation): engines built alike
    share compiled programs."""
    return PagedKVCache(spec, num_blocks, mesh=mesh, kv_quant=kv_quant)


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "paged",
        "layer_to_group",
        "max_num_seqs",
        "shapes",
        "store_dtype",
    ),
    donate_argnames="kv_caches",
)
def _paged_step(
    state, kv_caches, store, buffer, prev_sampled, *, graphdef, paged, layer_to_group, store_dtype,
    max_num_seqs, shapes,
):  # fmt: skip
    """Forward + sampling of one packed step (see `ModelRunner._pack` for the layout)."""
    model = nnx.merge(graphdef, state)
    t, r = shapes[0].num_tokens, shapes[0].num_reqs
    dp = buffer.shape[0]
    offset, metadata = 0, []
    for shape in shapes:
        metadata.append(buffer[:, offset : offset + shape.length])
        offset += shape.length

    def take(n: int) -> jax.Array:
        """The next `n` entries of every rank's row, rank-major."""
        nonlocal offset
        offset += n
        return buffer[:, offset - n : offset].reshape(-1)

    tokens, src, logits_indices = take(t), take(t), take(r)
    temperature = jax.lax.bitcast_convert_type(take(r), jnp.float32)
    top_k = take(r)
    top_p = jax.lax.bitcast_convert_type(take(r), jnp.float32)
    seeds, counters = take(r), take(r)
    token_ids = jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], tokens)
    ctx = PagedContext(
        caches=paged, shapes=shapes, layer_to_group=layer_to_group,
        metadata=tuple(metadata), logits_indices=logits_indices,
    )  # fmt: skip
    embeds = None
    if store is not None:
        merge_src, merge_dst = take(t), take(t)
        embeds = model.embed_tokens(token_ids)
        rows = store.reshape(-1, store.shape[-1]).at[merge_src].get(mode="fill", fill_value=0)
        rows = from_storage(rows, store_dtype)  # the store may hold bf16 as uint16 bits
        embeds = embeds.at[merge_dst].set(rows.astype(embeds.dtype), mode="drop")
    logits, kv_caches = model.forward_paged(token_ids, kv_caches, ctx, embeds)
    sampled = sample_tokens(logits, temperature, top_k, top_p, seeds, counters).reshape(dp, r)
    return kv_caches, jnp.zeros((dp, max_num_seqs), jnp.int32).at[:, :r].set(sampled).reshape(-1)


@contextlib.contextmanager
def _attributed_to(scheduled: ScheduledRequest) -> Iterator[None]:
    """Re-raise a failure while preparing `scheduled`'s rows as that request's
    `RequestStepError`."""
    try:
        yield
    except Exception as error:
        raise RequestStepError(scheduled.request.request_id, error) from error


@functools.partial(jax.jit, static_argnames="graphdef")
def _encode_images(state, pixel_values, *, graphdef):
    return nnx.merge(graphdef, state).encode_images(pixel_values)


class ModelRunner:
    """Device state and the jitted step of one model (see the module docstring).

    Invariants: `kv_caches[i]` has the shape of its group's `PagedKVCache`; every data
    rank has its own block tables and block ids in `[0, num_blocks)`; the step compiles
    once per `(token bucket, request bucket)` pair, nothing else in `execute` compiles
    after `warm_up()`.
    """

    def __init__(
        self,
        model,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        dtype: str = "float32",
        kv_quant: str | None = None,
        zero_freed_blocks: bool = False,
        encoder_cache_size: int = 0,
        encoder_page_size: int = 16,
        mesh: Mesh | None = None,
    ) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.zero_freed_blocks = zero_freed_blocks
        specs = model.kv_cache_specs(block_size, dtype)
        self.kv_cache_config, self.layer_to_group = group_kv_cache_specs(specs, num_blocks)
        groups = self.kv_cache_config.kv_cache_groups
        self.paged = tuple(
            _shared_paged_cache(g.kv_cache_spec, num_blocks, mesh, check_kv_quant(kv_quant))
            for g in groups
        )
        self.mesh = self.paged[0].mesh
        self.dp_size = self.paged[0].dp_size
        self.kv_caches: list[jax.Array] = [None] * len(self.layer_to_group)  # type: ignore
        for g, cache in enumerate(self.paged):
            layers = [i for i, lg in enumerate(self.layer_to_group) if lg == g]
            for i, arr in zip(layers, cache.allocate(len(layers)), strict=True):
                self.kv_caches[i] = arr
        self.packers, self.tables = [], []  # tables[g][rank]
        for g in groups:
            bs = g.kv_cache_spec.block_size
            width = -(-max_model_len // bs)
            self.packers.append(
                StepMetadataPacker(
                    max_num_tokens=max_num_batched_tokens,
                    max_num_reqs=max_num_seqs,
                    max_blocks_per_req=width,
                    block_size=bs,
                    num_blocks=num_blocks,
                )  # fmt: skip
            )
            self.tables.append(
                [BlockTable(bs, max_num_seqs, width, num_blocks) for _ in range(self.dp_size)]
            )
        self.hidden_size = int(model.config.hidden_size)
        self.encoder_store: EncoderCacheStore | None = None
        self.images = image_inputs(model)
        if encoder_cache_size and self.images is not None:
            pages = EncoderCacheStore.pages_needed(
                encoder_cache_size, encoder_page_size, self.images.num_image_tokens
            )
            self.encoder_store = EncoderCacheStore(
                max(pages, 1), encoder_page_size, self.hidden_size, dtype=jnp.float32,
                mesh=None if mesh is None else self.mesh,
            )  # fmt: skip
        self._graphdef, self._state = nnx.split(model)
        # The last step's tokens (`[dp * max_num_seqs]`, rank-major), on device, placed as
        # the step places its output (so the first step compiles the same program as the
        # others).
        self.sampled = self._replicated(np.zeros(self.dp_size * max_num_seqs, np.int32))
        self._rows: dict[str, int] = {}  # request id -> its row of `self.sampled`
        self.num_encoded = 0

    def _replicated(self, arr: np.ndarray) -> jax.Array:
        return self.paged[0].put(arr, P())

    def _step(self, buffer: np.ndarray, shapes: tuple[StepShape, ...]):
        store = self.encoder_store
        return _paged_step(
            self._state, self.kv_caches, None if store is None else store.cache,
            self.paged[0].put(buffer), self.sampled,
            graphdef=self._graphdef, paged=self.paged, layer_to_group=self.layer_to_group,
            max_num_seqs=self.max_num_seqs, shapes=shapes,
            store_dtype=None if store is None else store.dtype,
        )  # fmt: skip

    def _encode(self, pixel_values: np.ndarray) -> jax.Array:
        return _encode_images(self._state, self._replicated(pixel_values), graphdef=self._graphdef)

    # -- host side ----------------------------------------------------------------------

    def _pack(
        self, outs: Sequence[SchedulerOutput], sampling: Sequence[Sequence[RowSampling]]
    ) -> tuple[np.ndarray, tuple[StepShape, ...]]:
        """The step's `[dp, length]` buffer: per rank its groups' metadata, then its rows."""
        ranks = []  # per rank: scheduled, query_lens, cu
        steps_per_group: list[list[StepInputs]] = [[] for _ in self.packers]
        for rank, out in enumerate(outs):
            scheduled = out.scheduled
            n = len(scheduled)
            query_lens = np.array([s.num_new_tokens for s in scheduled], np.int64)
            starts = np.array([s.num_computed_tokens for s in scheduled], np.int64)
            total = int(query_lens.sum())
            rows = np.repeat(np.arange(n), query_lens)
            cu = np.concatenate([[0], np.cumsum(query_lens)])
            positions = np.repeat(starts, query_lens) + (
                np.arange(total) - np.repeat(cu[:-1], query_lens)
            )
            for g, tables in enumerate(self.tables):
                table = tables[rank]
                for i, s in enumerate(scheduled):
                    with _attributed_to(s):
                        table.add_row(s.block_ids[g], i)
                steps_per_group[g].append(
                    StepInputs(
                        block_tables=table.get_numpy_array()[:n],
                        seq_lens=starts + query_lens,
                        query_lens=query_lens,
                        slot_mapping=table.compute_slot_mapping(rows, positions),
                    )
                )
            ranks.append((scheduled, cu))
        parts, shapes = [], []
        for packer, steps in zip(self.packers, steps_per_group, strict=True):
            metadata, shape = packer.pack(steps)
            parts.append(metadata)
            shapes.append(shape)
        t, r = shapes[0].num_tokens, shapes[0].num_reqs
        rows = [
            self._rank_rows(rank, scheduled, cu, params, t, r, outs[rank])
            for rank, ((scheduled, cu), params) in enumerate(zip(ranks, sampling, strict=True))
        ]
        parts.append(np.stack(rows))
        return np.concatenate(parts, axis=1).astype(np.int32), tuple(shapes)

    def _rank_rows(
        self, rank: int, scheduled, cu: np.ndarray, sampling: Sequence[RowSampling], t: int,
        r: int, out: SchedulerOutput,
    ) -> np.ndarray:  # fmt: skip
        """One rank's token ids, pending-token sources, logits rows (into all ranks'
        `dp * t` token rows), sampling parameters and encoder-merge rows."""
        tokens = np.zeros(t, np.int32)
        src = np.full(t, -1, np.int32)
        n = len(scheduled)
        logits_indices = np.zeros(r, np.int32)
        logits_indices[:n] = rank * t + cu[1:] - 1
        temperature = np.zeros(r, np.float32)
        top_k, seeds, counters = (np.zeros(r, np.int32) for _ in range(3))
        top_p = np.ones(r, np.float32)
        for i, (s, p) in enumerate(zip(scheduled, sampling, strict=True)):
            with _attributed_to(s):
                lo, end = int(cu[i]), s.num_computed_tokens + s.num_new_tokens
                known_end = min(end, s.num_known_tokens)
                known = s.request.all_token_ids[s.num_computed_tokens : known_end]
                tokens[lo : lo + len(known)] = known
                if end > known_end:  # the token sampled by the previous step, on device
                    if end - known_end != 1 or s.request.request_id not in self._rows:
                        raise RuntimeError(
                            f"needs {end - known_end} tokens from a previous step that did "
                            "not sample them"
                        )
                    src[lo + len(known)] = self._rows[s.request.request_id]
                temperature[i], top_k[i], top_p[i], seeds[i] = (
                    p.temperature, p.top_k, p.top_p, p.seed,
                )  # fmt: skip
                counters[i] = end - s.request.num_prompt_tokens
        parts = [tokens, src, logits_indices, temperature.view(np.int32), top_k,
                 top_p.view(np.int32), seeds, counters]  # fmt: skip
        if self.encoder_store is not None:
            parts += self._merge_rows(rank, out, cu, t)
        return np.concatenate(parts)

    def _merge_rows(
        self, rank: int, out: SchedulerOutput, cu: np.ndarray, t: int
    ) -> list[np.ndarray]:
        """Store rows to merge into this rank's token rows; unused entries point past all
        `dp * t` rows (dropped)."""
        placements = []
        for i, s in enumerate(out.scheduled):
            with _attributed_to(s):
                for f in s.request.mm_features:
                    end = s.num_computed_tokens + s.num_new_tokens
                    if f.offset < end and f.offset + f.length > s.num_computed_tokens:
                        self.encoder_store.pages_of(f.identifier)  # stored, or this fails
                        placements.append(
                            EmbedPlacement(
                                f.identifier,
                                f,
                                s.num_computed_tokens,
                                s.num_new_tokens,
                                int(cu[i]),
                            )  # fmt: skip
                        )
        merge_src = np.zeros(t, np.int32)
        merge_dst = np.full(t, self.dp_size * t, np.int32)
        if placements:
            src, dst = self.encoder_store.merge_indices(placements, t)
            count = min(len(src), t)
            merge_src[:count] = src[:count]
            merge_dst[:count] = np.where(dst[:count] < t, rank * t + dst[:count], self.dp_size * t)
        return [merge_src, merge_dst]

    def _run_encoder(
        self, outs: Sequence[SchedulerOutput], images: Mapping[str, np.ndarray]
    ) -> None:
        """Free evicted entries (all ranks share the encoder cache), then encode new items."""
        store = self.encoder_store
        stale = [h for out in outs for h in out.freed_mm_hashes if h in store]
        if stale:
            store.free(stale)
        for out in outs:
            for s in out.scheduled:
                for input_id in s.encoder_input_ids:
                    mm_hash = s.request.mm_features[input_id].identifier
                    if mm_hash in store:
                        continue  # same content already encoded (e.g. twice in one step)
                    store.put(mm_hash, self._encode(images[mm_hash][None])[0])
                    self.num_encoded += 1

    def _zero_freed(self, outs: Sequence[SchedulerOutput]) -> None:
        """Zero each rank's freed blocks (ranks with fewer pad with the null block 0)."""
        freed = [out.freed_block_ids for out in outs]
        width = max(ids.size for ids in freed)
        if not width:
            return
        ids = np.zeros((len(freed), width), np.int32)
        for rank, rank_ids in enumerate(freed):
            ids[rank, : rank_ids.size] = rank_ids
        self.kv_caches = [
            self.paged[g].zero_blocks(kv, ids.reshape(-1))
            for kv, g in zip(self.kv_caches, self.layer_to_group, strict=True)
        ]

    def _copy_blocks(self, outs: Sequence[SchedulerOutput]) -> None:
        """Run each rank's page copies (`kv_cache_block_copies`) in every layer, one call per
        group. Block ids are unique over the groups, so a copy in another group's layers
        only moves pages no request of that group reads. Ranks with fewer pad."""
        copies = [out.kv_cache_block_copies for out in outs]
        width = max(len(c) for c in copies)
        if not width:
            return
        num_blocks = self.paged[0].num_blocks
        src = np.zeros((len(copies), width), np.int32)
        dst = np.full((len(copies), width), num_blocks, np.int32)
        for rank, rank_copies in enumerate(copies):
            for i, copy in enumerate(rank_copies):
                src[rank, i], dst[rank, i] = copy.src_block_id, copy.dst_block_id
        for g, paged in enumerate(self.paged):
            layers = [i for i, lg in enumerate(self.layer_to_group) if lg == g]
            for i, kv in zip(
                layers,
                paged.copy_blocks_all(
                    [self.kv_caches[i] for i in layers],
                    src.ravel(),
                    dst.ravel(),
                    allow_padding=True,
                ),
                strict=True,
            ):
                self.kv_caches[i] = kv

    def execute(
        self,
        outs: SchedulerOutput | Sequence[SchedulerOutput],
        sampling: Sequence[RowSampling] | Sequence[Sequence[RowSampling]],
        images: Mapping[str, np.ndarray] | None = None,
    ) -> jax.Array:
        """Dispatch one step: `outs[k]`, `sampling[k]` for data rank `k` (a single output
        and its rows without data parallelism). Returns the sampled tokens
        `[dp * max_num_seqs]` (row `k * max_num_seqs + i` for `outs[k].scheduled[i]`) as a
        device array, not waited for."""
        if isinstance(outs, SchedulerOutput):
            outs, sampling = [outs], [sampling]
        if len(outs) != self.dp_size or len(sampling) != self.dp_size:
            raise ValueError(
                f"got {len(outs)} scheduler outputs and {len(sampling)} sampling lists; the "
                f"mesh has {self.dp_size} data ranks, one each"
            )
        if self.zero_freed_blocks:
            self._zero_freed(outs)
        self._copy_blocks(outs)  # after zeroing: a copy's destination may be a freed page
        if self.encoder_store is not None:
            self._run_encoder(outs, images or {})
        if all(out.is_empty for out in outs):
            return self.sampled
        buffer, shapes = self._pack(outs, sampling)
        self.kv_caches, self.sampled = self._step(buffer, shapes)
        self._rows = {
            s.request.request_id: rank * self.max_num_seqs + i
            for rank, out in enumerate(outs)
            for i, s in enumerate(out.scheduled)
        }
        return self.sampled

    # -- warm-up ------------------------------------------------------------------------

    def _empty_buffer(self, shapes: Sequence[StepShape]) -> np.ndarray:
        """An all-padding step buffer of `shapes`: it changes no cache entry."""
        dp = self.dp_size
        t, r = shapes[0].num_tokens, shapes[0].num_reqs
        parts = [p.empty(s, dp) for p, s in zip(self.packers, shapes, strict=True)]
        rows = [np.zeros(t, np.int32), np.full(t, -1, np.int32)]
        rows += [np.zeros(r, np.int32)] * 2 + [np.zeros(r, np.int32)]
        rows += [np.ones(r, np.float32).view(np.int32)] + [np.zeros(r, np.int32)] * 2
        if self.encoder_store is not None:
            rows += [np.zeros(t, np.int32), np.full(t, dp * t, np.int32)]
        parts.append(np.tile(np.concatenate(rows), (dp, 1)))
        return np.concatenate(parts, axis=1).astype(np.int32)

    def lowered_programs(self) -> dict[str, tuple[jax.stages.Lowered, list]]:
        """Every kind of program `execute` runs on the donated caches, lowered (not run):
        name -> (lowered program, the cache buffers it donates, as abstract values).

        The step for the smallest and the largest step shape, block zeroing and block
        copies per KV-cache group at their largest id bucket, and the encoder store's
        write. `jaxkv.device.in_place.check_in_place` says whether each updates its
        caches in place.
        """
        programs: dict[str, tuple[jax.stages.Lowered, list]] = {}
        caches = [jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=kv.sharding)
                  for kv in self.kv_caches]  # fmt: skip
        all_shapes = list(zip(*[p.all_shapes() for p in self.packers], strict=True))
        store = self.encoder_store
        for shapes in (all_shapes[0], all_shapes[-1]):
            lowered = _paged_step.lower(
                self._state, caches, None if store is None else store.cache,
                self.paged[0].put(self._empty_buffer(shapes)), self.sampled,
                graphdef=self._graphdef, paged=self.paged, layer_to_group=self.layer_to_group,
                max_num_seqs=self.max_num_seqs, shapes=tuple(shapes),
                store_dtype=None if store is None else store.dtype,
            )  # fmt: skip
            programs[f"step tokens={shapes[0].num_tokens} reqs={shapes[0].num_reqs}"] = (
                lowered, caches,
            )  # fmt: skip
        for g, paged in enumerate(self.paged):
            group_caches = [c for c, lg in zip(caches, self.layer_to_group, strict=True) if lg == g]
            for op in ("zero", "copy"):
                lowered = paged.lower_blocks_all(op, len(group_caches))
                programs[f"{op}_blocks group={g}"] = (lowered, group_caches)
        if store is not None:
            lowered, store_struct = store.lower_write()
            programs["encoder_store write"] = (lowered, [store_struct])
        return programs

    def warm_up(self) -> int:
        """Compile every step shape and every zeroing bucket now; returns the shape count."""
        dp = self.dp_size
        shapes_per_group = [p.all_shapes() for p in self.packers]
        for shapes in zip(*shapes_per_group, strict=True):
            self.kv_caches, self.sampled = self._step(self._empty_buffer(shapes), tuple(shapes))
        if self.encoder_store is not None:
            pixels = np.zeros((1, *self.images.pixel_shape), np.float32)
            self.encoder_store.put("warm-up", self._encode(pixels)[0])
            self.encoder_store.free(["warm-up"])
        if self.zero_freed_blocks:
            for size in self.paged[0].id_buckets:
                ids = np.ones(size * dp, np.int32)
                self.kv_caches = [
                    self.paged[g].zero_blocks(kv, ids)
                    for kv, g in zip(self.kv_caches, self.layer_to_group, strict=True)
                ]
        jax.block_until_ready(self.kv_caches)
        return len(shapes_per_group[0])
