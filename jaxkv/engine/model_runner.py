"""Glue between the scheduler's output and a model's `forward_paged` (one device call a step).

The runner orchestrates four parts, each its own module:

* `request_rows`: per data rank, the requests' persistent rows (`RequestRows`: block
  tables per KV-cache group, sampling parameters), updated by the scheduler's block-id
  changes; host-only numpy.
* `step_programs`: the step buffer's layout (`step_layout`) and the jitted programs that
  run a step (the fused `step_program`, or `layer_by_layer_program`).
* `block_transfers`: the host tier's block gathers and scatters (`BlockTransfers`).
* the device state it owns: one `PagedKVCache` per KV-cache group (layers with equal
  specs share a group and the pool's block ids), one donated array holding every
  layer's cache (`[num_layers, ...]`, which the model's scanned layer body indexes), and
  for image models the encoder store's array (`encoder_cache`; its layout and programs
  are the `EncoderCacheStore`, its pages the host `EncoderPageAllocator`).

Each step it

1. releases the rows of preempted and finished requests, zeroes freed KV pages
   (optional), copies and loads blocks, frees the store pages of evicted encoder entries,
2. encodes the images the scheduler asked for (each once; shared through the store),
3. prepares every request's host rows (tokens, pending-token sources, checked row
   changes) and only then applies the row changes, so a request whose rows cannot be
   prepared fails alone (`RequestStepError`) and leaves the rows as they were,
4. packs the step into ONE int32 buffer laid out by `step_layout` (per group the
   `StepMetadataPacker` metadata, written straight from the rows' block tables, whose
   ids the rows checked; then token ids, pending-token sources, logits rows, sampling
   parameters and encoder-merge rows) and sends it in one transfer,
5. dispatches the jitted step (forward, sampling) and returns the sampled tokens as a
   device array without waiting for them. A model whose layers are not scanned as one
   body (one stack per layer: the CPU and GPU default, `jaxkv.models.default_scan_layers`) runs
   as a few programs instead, all dispatched at once: the inputs (embeddings), one
   program for every group of a few consecutive layers (`layer_group_sizes`; the first
   layer is data; it alone updates the donated cache), and the head with sampling. So
   a program compiles a few layers however deep the model (`MAX_LAYER_PROGRAMS` bounds
   the programs a step dispatches) and no step slices a layer's weights out of a stack.

On a mesh (`jaxkv.device.make_mesh(data, model)`), KV heads are split over the model axis
and each data rank serves its own requests from its own block pool (block ids local to
the rank, one scheduler per rank): `execute` takes one `SchedulerOutput` per data rank.
The buffer then has one row per rank (its metadata and its token/sampling rows); the
step's token rows, logits and sampled tokens are rank-major.

A model follows the contract of `jaxkv.models` (see `jaxkv/testing/tiny_model.py` for the
smallest one): `kv_cache_specs(block_size, dtype)`, `forward_paged(token_ids, kv_cache,
ctx, inputs_embeds)`, `embed_tokens`, and for images `encode_images`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.block_table import BlockTable
from jaxkv.device import (
    EncoderCacheStore,
    PagedKVCache,
    StepLayout,
    StepMetadataPacker,
    StepRows,
    StepShape,
    default_min_num_tokens,
)
from jaxkv.device.host_inputs import placer
from jaxkv.encoder_pages import EmbedPlacement, EncoderPageAllocator
from jaxkv.engine.block_transfers import BlockTransfers, GatheredBlocks
from jaxkv.engine.request_rows import (
    RequestRows,
    RequestStepError,
    RowChanges,
    RowSampling,
    StepSampling,
)
from jaxkv.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxkv.engine.sizing import KVCachePlan
from jaxkv.engine.step_programs import (
    LayerParams,
    StepFeatures,
    encode_image,
    layer_by_layer_program,
    layer_group_sizes,
    metadata_field,
    step_layout,
    step_program,
)
from jaxkv.kv_cache_interface import KVCacheSpec
from jaxkv.models.base import CausalLM

__all__ = [
    "ImageInputs",
    "ModelRunner",
    "RequestStepError",
    "RowSampling",
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


@dataclass
class _RankStep:
    """One data rank's part of a step, prepared on the host; `rows` is set once the
    row updates are applied."""

    request_ids: list[str] = field(default_factory=list)
    query_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seq_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    changes: RowChanges = field(default_factory=RowChanges)
    placements: list[EmbedPlacement] = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    # (token offset, the prompt token after each) of its prompt-logprobs requests.
    prompt_targets: list[tuple[int, list[int]]] = field(default_factory=list)


_NO_LOGPROBS = RowSampling(0.0, 0, 1.0, 0)
_PLAIN = StepFeatures()  # a step computing tokens only


def _prompt_targets(request, start: int, end: int) -> list[int]:
    """For each of `request`'s tokens `start..end-1`, the prompt token after it (-1 past
    the prompt): the token whose logprob that token's logits give."""
    num_prompt = request.num_prompt_tokens
    targets = request.all_token_ids[start + 1 : min(end + 1, num_prompt)]
    return list(targets) + [-1] * (end - start - len(targets))


@functools.cache
def _shared_paged_cache(
    spec: KVCacheSpec, num_blocks: int, mesh: Mesh | None, kv_quant: str | None
) -> PagedKVCache:
    """One `PagedKVCache` per (spec, pool size, mesh, quantisation): engines built alike
    share compiled programs."""
    return PagedKVCache(spec, num_blocks, mesh=mesh, kv_quant=kv_quant)


class ModelRunner:
    """Device state and the jitted step of one model (see the module docstring).

    Invariants: `kv_cache[i]` (layer `i`) has the page shape every group's `PagedKVCache`
    shares; every data
    rank has its own request rows (`rows[k]`) and block ids in `[0, num_blocks)`; the
    step compiles once per token bucket (`StepMetadataPacker`), nothing else in
    `execute` compiles after `warm_up()`; a call of `execute` that raises
    `RequestStepError` left every request row as it was.

    The KV cache is `plan`'s (`jaxkv.engine.sizing.plan_kv_cache`): its groups, pool size,
    `max_model_len`, mesh and quantisation, taken as they are (the engine, its host tier
    and `jaxkv plan` share the same plan).

    `allocate=False` allocates no KV cache (`kv_cache` is its abstract value) and takes
    a model whose parameters may be abstract too (`jaxkv.models.loading.abstract_model`):
    such a runner lowers its programs (`lower_step`, `lowered_programs`) for ahead-of-time
    planning and never executes.
    """

    def __init__(
        self,
        model,
        plan: KVCachePlan,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        zero_freed_blocks: bool = False,
        encoder_cache_size: int = 0,
        encoder_page_size: int = 16,
        allocate: bool = True,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model = model
        self.logprobs_mode = logprobs_mode  # what logprobs hold (`StepFeatures`)
        self.max_num_seqs = max_num_seqs
        self.zero_freed_blocks = zero_freed_blocks
        self.kv_cache_config, self.layer_to_group = plan.kv_cache_config, plan.layer_to_group
        num_blocks, max_model_len = plan.num_blocks, plan.max_model_len
        groups = self.kv_cache_config.kv_cache_groups
        self.paged = tuple(
            _shared_paged_cache(g.kv_cache_spec, num_blocks, plan.mesh, plan.kv_quant)
            for g in groups
        )
        self.mesh = self.paged[0].mesh
        self.dp_size = self.paged[0].dp_size
        shapes = {(p.shape, p.storage_dtype, p.stacked_sharding) for p in self.paged}
        if len(shapes) != 1:
            raise ValueError(
                "the engine stacks every layer's KV cache in one array: every layer needs "
                f"the same page shape, dtype and sharding, got {sorted(map(str, shapes))}"
            )
        num_layers = len(self.layer_to_group)
        self.kv_cache = (
            self.paged[0].allocate_stacked(num_layers)
            if allocate
            else self.paged[0].stacked_struct(num_layers)
        )
        self.transfers = BlockTransfers(self.paged[0], self.dp_size, num_layers)
        widths = [-(-max_model_len // g.kv_cache_spec.block_size) for g in groups]
        self.packers = [
            StepMetadataPacker(
                max_num_tokens=max_num_batched_tokens,
                max_num_reqs=max_num_seqs,
                max_blocks_per_req=width,
                block_size=g.kv_cache_spec.block_size,
                num_blocks=num_blocks,
                min_num_tokens=default_min_num_tokens(self.paged[0].platform),
            )  # fmt: skip
            for g, width in zip(groups, widths, strict=True)
        ]
        self.rows = [
            RequestRows(
                [
                    BlockTable(g.kv_cache_spec.block_size, max_num_seqs, width, num_blocks)
                    for g, width in zip(groups, widths, strict=True)
                ]
            )
            for _ in range(self.dp_size)
        ]
        self.hidden_size = int(model.config.hidden_size)
        self.images = image_inputs(model)
        self._init_encoder_store(encoder_cache_size, encoder_page_size, allocate)
        self._init_params(model)
        # The last step's tokens (`[dp * max_num_seqs]`, rank-major), on device, placed as
        # the step places its output (so the first step compiles the same program as the
        # others).
        self.sampled = self._replicated(np.zeros(self.dp_size * max_num_seqs, np.int32))
        # Each rank's request ids of the last step, row `k * max_num_seqs + i` of
        # `self.sampled` holding the token sampled for `_last_step_request_ids[k][i]`.
        self._last_step_request_ids: list[list[str]] = []
        self._sampled_row: dict[str, int] | None = {}  # their map (None: not built yet)
        self.num_encoded = 0
        self._step_fns: dict[tuple[tuple[StepShape, ...], StepFeatures], object] = {}
        # Per request row, its output token counts and prompt tokens for the penalties
        # (`update_penalty_state`); allocated when a step first uses penalties.
        self.penalty_state: tuple[jax.Array, jax.Array] | None = None
        # The last step's logprob arrays by name (`_sample_outputs`), on device.
        self.step_logprobs: dict[str, tuple[jax.Array, ...]] = {}
        self._place_step = placer(NamedSharding(self.mesh, P(self.paged[0].layout.rank_axis)))

    def _init_encoder_store(self, cache_size: int, page_size: int, allocate: bool) -> None:
        """The encoder store of an image model given an encoder cache (`cache_size`
        embeddings in pages of `page_size`); else all three are None."""
        self.encoder_store: EncoderCacheStore | None = None
        self.encoder_pages: EncoderPageAllocator | None = None
        self.encoder_cache: jax.Array | None = None  # the store's array, donated per write
        if cache_size and self.images is not None:
            pages = max(
                EncoderPageAllocator.pages_needed(
                    cache_size, page_size, self.images.num_image_tokens
                ),
                1,
            )
            self.encoder_store = EncoderCacheStore(
                pages, page_size, self.hidden_size, dtype=jnp.float32,
                mesh=self.mesh,
            )  # fmt: skip
            self.encoder_pages = EncoderPageAllocator(pages, page_size)
            self.encoder_cache = (
                self.encoder_store.allocate() if allocate else self.encoder_store.struct()
            )

    def _init_params(self, model) -> None:
        """`_params`, what the step programs take, and the static halves they bind."""
        self._graphdef, state = nnx.split(model)
        # A model whose layers are not scanned as one body (one stack per layer, the CPU
        # default) runs layer by layer; `_params` is what the step programs take. They
        # take parameters as flat lists of arrays, their tree structures (`_state_def`,
        # `_run_def`) bound statically: JAX flattens a list of arrays in C++ on each call,
        # an `nnx.State` in Python.
        self._run_graphdef = self._run_def = None
        self._runs = model.decoder.layers if isinstance(model, CausalLM) else ()
        if len(self._runs) > 1:
            self._run_graphdef = nnx.graphdef(self._runs[0])
            # Group g takes runs _group_bounds[g]:_group_bounds[g + 1].
            self._group_bounds = np.cumsum([0, *layer_group_sizes(len(self._runs))])
            run_starts = np.cumsum([0, *(run.num_layers for run in self._runs)])
            first_layers = run_starts[self._group_bounds[:-1]]
            self._first_layers = tuple(self._replicated(np.int32(i)) for i in first_layers)
        self._set_state(state)

    def _set_state(self, state: nnx.State) -> None:
        """Take `state` (the model's, as `nnx.split` gives it) as the step's parameters."""
        self._state = state
        self._params, self._state_def = jax.tree.flatten(state)
        if self._run_graphdef is not None:
            flat_runs = [jax.tree.flatten(nnx.state(run)) for run in self._runs]
            self._run_def = flat_runs[0][1]  # every run has the first's structure (and graphdef)
            run_params = [params for params, _ in flat_runs]
            groups = tuple(
                tuple(run_params[a:b]) for a, b in itertools.pairwise(self._group_bounds)
            )
            self._params = LayerParams(self._params, groups, self._first_layers)

    @property
    def weight_leaves(self) -> list:
        """The model's state as flat leaves (`jax.tree.flatten` order of `nnx.state`)."""
        return jax.tree.leaves(self._state)

    @property
    def weight_treedef(self):
        """The tree structure of the model's state (`weight_leaves` unflatten with it)."""
        return self._state_def

    def set_weight_leaves(self, leaves: Sequence) -> None:
        """Make `leaves` (`weight_leaves`' structure, shapes and shardings) the model's
        state: the model object's variables and the arrays the steps take."""
        state = jax.tree.unflatten(self._state_def, leaves)
        nnx.update(self.model, state)
        self._set_state(state)

    def flush_encoder_store(self) -> None:
        """Free every stored encoder output (their embeddings came from old weights)."""
        if self.encoder_pages is not None and len(self.encoder_pages):
            self.encoder_pages.free(self.encoder_pages.stored_hashes())

    @property
    def programs_per_step(self) -> int:
        """Programs one step shape compiles: the step buffer's placement (`placer`) and
        the fused step, or for a model run layer by layer the inputs, a layer program
        for each size of layer group, and head with sampling."""
        if self._run_graphdef is None:
            return 2
        return 3 + len(set(np.diff(self._group_bounds)))

    def max_compilations(self, host_tier: bool) -> int:
        """At most how many programs serving compiles: `programs_per_step` for each step
        shape, block zeroing at each id bucket (when freed blocks are zeroed), with a host
        tier (`host_tier`) a gather and a scatter at each transfer bucket, and for an
        image model the image encoder and the encoder store's write (every image has the
        same number of embeddings: one page bucket)."""
        paged = self.paged[0]
        return (
            len(self.packers[0].all_shapes()) * self.programs_per_step
            + (len(paged.id_buckets) if self.zero_freed_blocks else 0)
            + (2 * len(paged.transfer_buckets) if host_tier else 0)
            + (2 if self.encoder_store is not None else 0)
        )

    def _replicated(self, arr: np.ndarray) -> jax.Array | jax.ShapeDtypeStruct:
        """`arr` on every device; its abstract value on a runner that allocates nothing (a
        compile-only TPU topology has no memory to put it in)."""
        if isinstance(self.kv_cache, jax.ShapeDtypeStruct):
            sharding = NamedSharding(self.mesh, P())
            return jax.ShapeDtypeStruct(np.shape(arr), np.asarray(arr).dtype, sharding=sharding)
        return self.paged[0].put(arr, P())

    def _layout(self, shapes: tuple[StepShape, ...]) -> StepLayout:
        return step_layout(shapes, self.encoder_store is not None)

    def _step_fn(self, shapes: tuple[StepShape, ...], features: StepFeatures = _PLAIN):
        fn = self._step_fns.get((shapes, features))
        if fn is None:
            store = self.encoder_store
            static = dict(
                graphdef=self._graphdef, state_def=self._state_def, paged=self.paged,
                layer_to_group=self.layer_to_group,
                max_num_seqs=self.max_num_seqs, shapes=shapes, layout=self._layout(shapes),
                store_dtype=None if store is None else store.dtype, features=features,
            )  # fmt: skip
            if self._run_graphdef is None:
                fn = step_program(**static)
            else:
                fn = layer_by_layer_program(
                    run_graphdef=self._run_graphdef, run_def=self._run_def,
                    config=self.model.config, **static,
                )  # fmt: skip
            self._step_fns[shapes, features] = fn
        return fn

    def _step(
        self, buffer: np.ndarray, shapes: tuple[StepShape, ...], features=_PLAIN
    ) -> tuple[jax.Array, jax.Array]:
        """Run the step program of `shapes` and `features` on `buffer`: the new KV cache
        and sampled tokens (the penalty state and the logprob arrays kept here)."""
        state = None
        if features.penalties:
            if self.penalty_state is None:
                rows = (self.dp_size * self.max_num_seqs, int(self.model.config.vocab_size))
                self.penalty_state = (
                    self._replicated(np.zeros(rows, np.int32)),
                    self._replicated(np.zeros(rows, bool)),
                )
            state = self.penalty_state
        kv_cache, sampled, extras = self._step_fn(shapes, features)(
            self._params, self.kv_cache, self.encoder_cache, self._place_step(buffer),
            self.sampled, state,
        )  # fmt: skip
        if features.penalties:
            self.penalty_state = extras.pop("penalty_state")
        self.step_logprobs = extras
        return kv_cache, sampled

    def _encode(self, pixel_values: np.ndarray) -> jax.Array:
        return encode_image(self._state, self._replicated(pixel_values), graphdef=self._graphdef)

    # -- host side ----------------------------------------------------------------------

    def _prepare(
        self, rank: int, scheduled: Sequence[ScheduledRequest], sampling: Mapping[str, RowSampling]
    ) -> _RankStep:
        """One rank's host rows and checked row changes; changes nothing. Whatever fails
        while preparing request `i`'s part is raised as its `RequestStepError`."""
        rows = self.rows[rank]
        encoder_pages = self.encoder_pages
        step = _RankStep(changes=RowChanges.empty(rows))
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        pending_rows: list[int] = []
        pending_src: list[int] = []
        try:
            for s in scheduled:
                request = s.request
                request_id = request.request_id
                start = s.num_computed_tokens
                num_new = s.num_new_tokens
                end = start + num_new
                offset = len(token_ids)
                if end <= s.num_known_tokens:
                    if num_new == 1:  # a decode
                        token_ids.append(request.all_token_ids[start])
                    else:
                        token_ids += request.all_token_ids[start:end]
                else:  # the last token is the one sampled by the previous step, on device
                    known_end = s.num_known_tokens
                    sampled_row = self._sampled_row_of(request_id)
                    if end - known_end != 1 or sampled_row is None:
                        raise RuntimeError(
                            f"needs {end - known_end} tokens from a previous step that did "
                            "not sample them"
                        )
                    token_ids += request.all_token_ids[start:known_end]
                    pending_rows.append(len(token_ids))
                    pending_src.append(sampled_row)
                    token_ids.append(0)
                rows.record(step.changes, s, sampling)
                if sampling.get(request_id, _NO_LOGPROBS).prompt_logprobs:
                    step.prompt_targets.append((offset, _prompt_targets(request, start, end)))
                if encoder_pages is not None:
                    step.placements += self._placements(s, offset)
                step.request_ids.append(request_id)
                query_lens.append(num_new)
                seq_lens.append(end)
        except Exception as error:
            raise RequestStepError(s.request.request_id, error) from error
        rows.check(step.changes)
        step.query_lens = np.array(query_lens, np.int64)
        step.seq_lens = np.array(seq_lens, np.int64)
        step.token_ids = np.array(token_ids, np.int32)
        step.pending_rows = np.array(pending_rows, np.int64)
        step.pending_src = np.array(pending_src, np.int32)
        return step

    def _sampled_row_of(self, request_id: str) -> int | None:
        """The row of `self.sampled` holding the token the last step sampled for
        `request_id` (None: it sampled none for it); the map is built on first use."""
        if self._sampled_row is None:
            self._sampled_row = {}
            for k, request_ids in enumerate(self._last_step_request_ids):
                first = k * self.max_num_seqs
                rows = range(first, first + len(request_ids))
                self._sampled_row.update(zip(request_ids, rows, strict=True))
        return self._sampled_row.get(request_id)

    def _placements(self, s: ScheduledRequest, offset: int) -> list[EmbedPlacement]:
        """The encoder outputs `s`'s tokens (from token row `offset`) take (each stored,
        or this fails)."""
        end = s.num_computed_tokens + s.num_new_tokens
        placements = []
        for f in s.request.mm_features:
            if f.offset < end and f.offset + f.length > s.num_computed_tokens:
                self.encoder_pages.pages_of(f.identifier)  # stored, or this fails
                placements.append(
                    EmbedPlacement(
                        f.identifier, f, s.num_computed_tokens, s.num_new_tokens, offset
                    )  # fmt: skip
                )
        return placements

    def _pack(
        self, steps: Sequence[_RankStep], shapes: tuple[StepShape, ...] | None = None
    ) -> tuple[np.ndarray, tuple[StepShape, ...], StepFeatures]:
        """The step's `[dp, length]` buffer (`step_layout`) of every rank's prepared step
        (its row updates applied) and what it computes beyond the tokens; `shapes`: the
        groups' bucket shapes to pack into (None: the smallest that hold the step)."""
        if shapes is None:
            shapes = self.step_shapes(max(step.token_ids.size for step in steps))
        layout, t = self._layout(shapes), shapes[0].num_tokens
        buffer = np.zeros((len(steps), layout.length), np.int32)
        fields = layout.unpack(buffer)
        for g, packer in enumerate(self.packers):
            tables = [rows.tables[g].block_table for rows in self.rows]
            packer.pack_rows_into(
                [
                    StepRows(table, step.rows, step.seq_lens, step.query_lens)
                    for table, step in zip(tables, steps, strict=True)
                ],
                shapes[g],
                fields[metadata_field(g)],
            )
        for name in ("token_src", "stop_ids", "penalty_rows", "penalty_slots", "prompt_targets"):
            fields[name][:] = -1  # none
        fields["top_p"][:] = fields["repetition"][:] = 1.0
        penalties = logprobs = False
        num_state_rows = self.dp_size * self.max_num_seqs
        for k, (rows, step) in enumerate(zip(self.rows, steps, strict=True)):
            n = len(step.request_ids)
            fields["token_ids"][k, : step.token_ids.size] = step.token_ids
            fields["token_src"][k, step.pending_rows] = step.pending_src
            fields["logits_indices"][k, :n] = k * t + np.cumsum(step.query_lens) - 1
            used = rows.pack_sampling(
                fields, k, StepSampling(step.rows, step.seq_lens, step.query_lens, num_state_rows),
                k * self.max_num_seqs,
            )  # fmt: skip
            penalties, logprobs = penalties or used[0], logprobs or used[1]
            for offset, targets in step.prompt_targets:
                fields["prompt_targets"][k, offset : offset + len(targets)] = targets
        if self.encoder_store is not None:
            fields["merge_src"][:], fields["merge_dst"][:] = self._merge_rows(steps, t)
        prompt_logprobs = any(step.prompt_targets for step in steps)
        mode = self.logprobs_mode if logprobs or prompt_logprobs else _PLAIN.logprobs_mode
        return buffer, shapes, StepFeatures(penalties, logprobs, prompt_logprobs, mode)

    def _merge_rows(self, steps: Sequence[_RankStep], t: int) -> tuple[np.ndarray, np.ndarray]:
        """Store rows to merge into each rank's token rows; unused entries point past all
        `dp * t` rows (dropped)."""
        dp = len(steps)
        merge_src = np.zeros((dp, t), np.int32)
        merge_dst = np.full((dp, t), dp * t, np.int32)
        for k, step in enumerate(steps):
            if step.placements:
                src, dst = self.encoder_pages.merge_indices(step.placements, t)
                count = min(len(src), t)
                merge_src[k, :count] = src[:count]
                merge_dst[k, :count] = np.where(dst[:count] < t, k * t + dst[:count], dp * t)
        return merge_src, merge_dst

    def _run_encoder(
        self, outs: Sequence[SchedulerOutput], images: Mapping[str, np.ndarray]
    ) -> None:
        """Free evicted entries (all ranks share the encoder cache), then encode new items."""
        pages = self.encoder_pages
        stale = [h for out in outs for h in out.freed_mm_hashes if h in pages]
        if stale:
            pages.free(stale)
        for out in outs:
            for s in out.scheduled:
                for input_id in s.encoder_input_ids:
                    mm_hash = s.request.mm_features[input_id].identifier
                    if mm_hash in pages:
                        continue  # same content already encoded (e.g. twice in one step)
                    self._store_encoded(mm_hash, self._encode(images[mm_hash]))
                    self.num_encoded += 1

    def _store_encoded(self, mm_hash: str, embeds: jax.Array) -> None:
        """Give `mm_hash` store pages and write its encoder output there (in place)."""
        pages = self.encoder_pages.allocate(mm_hash, embeds.shape[0])
        self.encoder_cache = self.encoder_store.write(self.encoder_cache, embeds, pages)

    def _zero_freed(self, outs: Sequence[SchedulerOutput]) -> None:
        """Zero each rank's freed blocks (ranks with fewer pad with the null block 0)."""
        freed = [out.freed_block_ids for out in outs]
        width = max(ids.size for ids in freed)
        if not width:
            return
        ids = np.zeros((len(freed), width), np.int32)
        for rank, rank_ids in enumerate(freed):
            ids[rank, : rank_ids.size] = rank_ids
        self.kv_cache = self.paged[0].zero_blocks_stacked(self.kv_cache, ids.reshape(-1))

    def _copy_blocks(self, outs: Sequence[SchedulerOutput]) -> None:
        """Run each rank's page copies (`kv_cache_block_copies`) in every layer, one call.
        Block ids are unique over the groups, so a copy in another group's layers only
        moves pages no request of that group reads. Ranks with fewer pad."""
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
        self.kv_cache = self.paged[0].copy_blocks_stacked(
            self.kv_cache, src.ravel(), dst.ravel(), allow_padding=True
        )

    def gather_blocks(
        self, block_ids: Sequence[Sequence[int]], layers: Sequence[np.ndarray]
    ) -> list[GatheredBlocks]:
        """Start copying device blocks to host memory (`BlockTransfers.gather` of the
        cache as it is now); waits for nothing."""
        return self.transfers.gather(self.kv_cache, block_ids, layers)

    def execute(
        self,
        outs: SchedulerOutput | Sequence[SchedulerOutput],
        sampling: Mapping[str, RowSampling],
        images: Mapping[str, np.ndarray] | None = None,
    ) -> jax.Array:
        """Dispatch one step: `outs[k]` for data rank `k` (a single output without data
        parallelism); `sampling[request_id]` is read when a request's row is (re)set.
        Returns the sampled tokens `[dp * max_num_seqs]` (row `k * max_num_seqs + i` for
        `outs[k].scheduled[i]`) as a device array, not waited for."""
        if isinstance(outs, SchedulerOutput):
            outs = [outs]
        if len(outs) != self.dp_size:
            raise ValueError(
                f"got {len(outs)} scheduler outputs; the mesh has {self.dp_size} data ranks, "
                "one each"
            )
        for rows, out in zip(self.rows, outs, strict=True):
            rows.release(out.preempted_request_ids)
            rows.release(out.finished_request_ids)
        if self.zero_freed_blocks:
            self._zero_freed(outs)
        self._copy_blocks(outs)  # after zeroing: a copy's destination may be a freed page
        self.kv_cache = self.transfers.load(self.kv_cache, outs)  # after zeroing, too
        if self.encoder_store is not None:
            self._run_encoder(outs, images or {})
        if all(out.is_empty for out in outs):
            return self.sampled
        steps = [self._prepare(k, out.scheduled, sampling) for k, out in enumerate(outs)]
        for rows, step in zip(self.rows, steps, strict=True):
            rows.apply(step.changes)
            step.rows = np.array([rows.index[i] for i in step.request_ids], np.intp)
        buffer, shapes, features = self._pack(steps)
        self.kv_cache, self.sampled = self._step(buffer, shapes, features)
        self._last_step_request_ids = [step.request_ids for step in steps]
        self._sampled_row = None
        return self.sampled

    # -- warm-up ------------------------------------------------------------------------

    def _empty_buffer(self, shapes: tuple[StepShape, ...]) -> np.ndarray:
        """An all-padding step buffer of `shapes`: it changes no cache entry."""
        return self._pack([_RankStep() for _ in range(self.dp_size)], shapes)[0]

    def step_shapes(self, num_tokens: int) -> tuple[StepShape, ...]:
        """The groups' bucket shapes of a step of `num_tokens` tokens per data rank."""
        return tuple(packer.shape_for(num_tokens) for packer in self.packers)

    def lower_step(self, shapes: tuple[StepShape, ...]) -> jax.stages.Lowered:
        """The step of bucket `shapes` (`step_shapes`), lowered on abstract values of the
        stacked KV cache and the step buffer (placed as `execute` places them) with the
        runner's parameters (abstract ones allowed): nothing large is allocated."""
        paged = self.paged[0]
        rank_sharding = NamedSharding(self.mesh, P(paged.layout.rank_axis))
        buffer = jax.ShapeDtypeStruct(
            (self.dp_size, self._layout(shapes).length), jnp.int32, sharding=rank_sharding
        )
        return self._step_fn(shapes).lower(
            self._params, paged.stacked_struct(len(self.layer_to_group)), self.encoder_cache,
            buffer, self.sampled, None,
        )  # fmt: skip

    def lowered_programs(self) -> dict[str, tuple[jax.stages.Lowered, list]]:
        """Every kind of program `execute` runs on the donated caches, lowered (not run):
        name -> (lowered program, the cache buffers it donates, as abstract values).

        The step for the smallest and the largest step shape, block zeroing, block
        copies and host-tier loads (block scatter) at their largest id bucket, and the
        encoder store's write. `jaxkv.device.in_place.check_in_place` says whether each updates its
        caches in place.
        """
        programs: dict[str, tuple[jax.stages.Lowered, list]] = {}
        num_layers = len(self.layer_to_group)
        caches = [self.paged[0].stacked_struct(num_layers)]
        all_shapes = list(zip(*[p.all_shapes() for p in self.packers], strict=True))
        store = self.encoder_store
        for shapes in (all_shapes[0], all_shapes[-1]):
            programs[f"step tokens={shapes[0].num_tokens} reqs={shapes[0].num_reqs}"] = (
                self.lower_step(shapes), caches,
            )  # fmt: skip
        for op in ("zero", "copy", "scatter"):
            programs[f"{op}_blocks"] = (self.paged[0].lower_blocks_stacked(op, num_layers), caches)
        if store is not None:
            lowered, store_struct = store.lower_write()
            programs["encoder_store write"] = (lowered, [store_struct])
        return programs

    def warm_up(self) -> int:
        """Compile every step shape and every zeroing bucket now; returns the shape count."""
        dp = self.dp_size
        shapes_per_group = [p.all_shapes() for p in self.packers]
        for shapes in zip(*shapes_per_group, strict=True):
            self.kv_cache, self.sampled = self._step(self._empty_buffer(shapes), shapes)
        if self.encoder_store is not None:
            pixels = np.zeros(self.images.pixel_shape, np.float32)
            self._store_encoded("warm-up", self._encode(pixels))
            self.encoder_pages.free(["warm-up"])
        if self.zero_freed_blocks:
            for size in self.paged[0].id_buckets:
                ids = np.ones(size * dp, np.int32)
                self.kv_cache = self.paged[0].zero_blocks_stacked(self.kv_cache, ids)
        jax.block_until_ready(self.kv_cache)
        return len(shapes_per_group[0])

    def warm_up_transfers(self, layers_per_block: int) -> None:
        """Compile the host-tier block gather and scatter of `layers_per_block` layers a
        block for every transfer bucket (`BlockTransfers.warm_up`: no block changes)."""
        self.kv_cache = self.transfers.warm_up(self.kv_cache, layers_per_block)
