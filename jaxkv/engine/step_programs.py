"""The step on the device: the packed buffer's layout and the jitted programs that run it.

`step_layout` names the fields of one data rank's row of the step buffer; the host
packs with it and every program below unpacks with the same object, so the two sides
cannot disagree on an offset. `step_program` is the fused step (forward and sampling,
one program) of a model whose layers are scanned as one body; `layer_by_layer_program`
is the same step as a few programs for a model with one stack per layer (inputs, one
program for every group of consecutive layers, `layer_group_sizes`, then head and
sampling). Both are cached per engine layout and step shape with every static argument
bound, so engines built alike share compiled programs and a call hashes no static
argument (JAX's C++ dispatch path). Only the program that writes the KV cache takes it
donated.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.device import StepField, StepLayout, StepShape
from jaxkv.device.encoder_store import merge_rows
from jaxkv.engine.sampling import (
    MAX_LOGPROBS,
    MAX_MIN_TOKENS_STOPS,
    gather_logprobs,
    logprob_scores,
    sample_and_score,
    update_penalty_state,
)
from jaxkv.models.base import PagedContext, paged_attend
from jaxkv.models.decoder import apply_layers

__all__ = [
    "SAMPLING_FIELDS",
    "LayerParams",
    "StepFeatures",
    "encode_image",
    "layer_by_layer_program",
    "layer_group_sizes",
    "metadata_field",
    "step_layout",
    "step_program",
]


def metadata_field(group: int) -> str:
    """The `step_layout` field holding KV-cache group `group`'s packed metadata."""
    return f"metadata{group}"


# The sampling rows of a step, in `sample_and_score`'s argument order, then the rows of
# `min_p` and the penalties; the float32 ones are `_FLOAT_ROWS`.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds", "counters")
_PENALTY_ROWS = ("presence", "frequency", "repetition")
_FLOAT_ROWS = ("temperature", "top_p", "min_p", *_PENALTY_ROWS)


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes beyond forward and sampling (static: each combination is
    its own program, so a step using none compiles nothing more): the penalties (the
    program takes and returns the penalty state, `update_penalty_state`), the sampled
    tokens' logprobs, the prompt tokens' logprobs (logits of every token row), and what
    those logprobs hold (`logprobs_mode`, one of `LOGPROBS_MODES`; the engine sets it
    only on a step computing logprobs, so a step without them has one program whatever
    the engine's mode)."""

    penalties: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False
    logprobs_mode: str = "raw_logprobs"


@functools.cache
def step_layout(shapes: tuple[StepShape, ...], merges_embeds: bool) -> StepLayout:
    """One data rank's row of the step buffer for the groups' bucket `shapes` (`T` tokens,
    `R` requests each): every KV-cache group's metadata (its `StepShape.layout`), then

    * `token_ids [T]`: the host's token ids (0 where the token is pending),
    * `token_src [T]`: the previous step's output row a pending token is read from, -1
      for a host token,
    * `logits_indices [R]`: each request's last token row among all ranks' `dp * T`,
    * `temperature [R]` (float32), `top_k [R]`, `top_p [R]` (float32), `seeds [R]`,
      `counters [R]` (the output index of the token sampled), `min_p [R]`, `presence [R]`,
      `frequency [R]`, `repetition [R]` (float32): sampling rows,
    * `stop_ids [R * MAX_MIN_TOKENS_STOPS]`: each request's tokens banned this step (a
      request short of its `min_tokens`), -1 padded,
    * `penalty_rows [R]`: each request's penalty-state row (-1: none) and `penalty_slots
      [T]`: where each token goes in that state (`update_penalty_state`),
    * `prompt_targets [T]`: for a prompt-logprobs request's token, the prompt token after
      it (whose logprob that row gives), else -1,
    * with an encoder store (`merges_embeds`), `merge_src [T]` / `merge_dst [T]`: store
      rows to merge into token rows (destination `dp * T`: none).
    """
    t, r = shapes[0].num_tokens, shapes[0].num_reqs
    f32 = np.dtype(np.float32)
    fields = [StepField(metadata_field(g), shape.length) for g, shape in enumerate(shapes)]
    fields += [
        StepField("token_ids", t),
        StepField("token_src", t),
        StepField("logits_indices", r),
    ]
    fields += [
        StepField(name, r, f32) if name in _FLOAT_ROWS else StepField(name, r)
        for name in (*SAMPLING_FIELDS, "min_p", *_PENALTY_ROWS)
    ]
    fields += [
        StepField("stop_ids", r * MAX_MIN_TOKENS_STOPS),
        StepField("penalty_rows", r),
        StepField("penalty_slots", t),
        StepField("prompt_targets", t),
    ]
    if merges_embeds:
        fields += [StepField("merge_src", t), StepField("merge_dst", t)]
    return StepLayout(tuple(fields))


@functools.lru_cache(maxsize=512)
def step_program(**static):
    """The jitted step with its static arguments bound (one per engine layout and step
    shape; engines with equal layouts share it, and so its compiled programs). A call
    then hashes no static argument: the dispatch is JAX's C++ fast path."""
    return jax.jit(
        functools.partial(_paged_step, **static),
        donate_argnames=("kv_cache", "penalty_state"),
        out_shardings=_cache_out(static["paged"], 0, 3),
    )


def _cache_out(paged, index: int, num_outputs: int):
    """`out_shardings` of a program returning `num_outputs` values with the cache at
    `index`: on a TPU the cache's format there (`PagedKVCache.stacked_format`: row-major
    in every program), else None (unconstrained)."""
    if paged[0].platform != "tpu":
        return None
    return tuple(paged[0].stacked_format if i == index else None for i in range(num_outputs))


def _context(fields: dict, *, paged, shapes, layer_to_group) -> PagedContext:
    """The model's view of an unpacked step buffer: every rank's rows, rank-major."""
    return PagedContext(
        caches=paged, shapes=shapes, layer_to_group=layer_to_group,
        metadata=tuple(fields[metadata_field(g)] for g in range(len(shapes))),
        logits_indices=fields["logits_indices"].reshape(-1),
    )  # fmt: skip


def _token_ids(fields: dict, prev_sampled):
    """The step's token ids: pending rows take the last step's sampled token."""
    src, host_ids = fields["token_src"].reshape(-1), fields["token_ids"].reshape(-1)
    return jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], host_ids)


def _step_tokens(model, store, fields: dict, prev_sampled, store_dtype):
    """The step's token ids (`_token_ids`) and, with an encoder store, their embeddings
    with the stored image rows merged (else None)."""
    token_ids = _token_ids(fields, prev_sampled)
    if store is None:
        return token_ids, None
    embeds = model.embed_tokens(token_ids)
    merge_src, merge_dst = fields["merge_src"].reshape(-1), fields["merge_dst"].reshape(-1)
    return token_ids, merge_rows(embeds, store, merge_src, merge_dst, store_dtype)


def _every_row(ctx: PagedContext, features: StepFeatures) -> PagedContext:
    """`ctx` asking for the logits of every token row when the step computes prompt
    logprobs, else `ctx`."""
    if not features.prompt_logprobs:
        return ctx
    return dataclasses.replace(ctx, logits_indices=jnp.arange(ctx.token_positions().shape[0]))


def _sample_outputs(logits, fields: dict, ctx, token_ids, penalty_state, max_num_seqs, features):
    """The tokens sampled from `logits` (of every token row when `features` asks for
    prompt logprobs, else of each request's row) by the step's sampling rows, padded to
    `max_num_seqs` per rank (`[dp * max_num_seqs]`, rank-major), and what else `features`
    asks for, by name: the updated `penalty_state`, the sampled tokens' `logprobs` (rows
    as the tokens) and the token rows' `prompt_logprobs` (`gather_logprobs`' four arrays).
    Prompt tokens are never sampled, so their values are of the raw logits in every
    `logprobs_mode` (as vLLM's)."""
    dp, r = fields["temperature"].shape
    k = min(MAX_LOGPROBS, logits.shape[-1])
    mode = features.logprobs_mode
    extras = {}
    if features.prompt_logprobs:
        targets = fields["prompt_targets"].reshape(-1)
        extras["prompt_logprobs"] = gather_logprobs(logprob_scores(logits, mode), targets, k)
        logits = logits[fields["logits_indices"].reshape(-1)]
    rows = {name: fields[name].reshape(-1) for name in fields}
    penalties = None
    if features.penalties:
        state = update_penalty_state(
            *penalty_state, rows["penalty_slots"], token_ids, ctx.token_positions()
        )
        extras["penalty_state"] = state
        at = jnp.maximum(rows["penalty_rows"], 0)  # -1: neutral penalties, any row
        penalties = (state[0][at], state[1][at], *(rows[name] for name in _PENALTY_ROWS))
    sampled, scores = sample_and_score(
        logits, *(rows[name] for name in SAMPLING_FIELDS), min_p=rows["min_p"],
        stop_ids=rows["stop_ids"].reshape(dp * r, -1), penalties=penalties,
        logprobs_mode=mode if features.logprobs else None,
    )  # fmt: skip

    def padded(values):
        out = jnp.zeros((dp, max_num_seqs, *values.shape[1:]), values.dtype)
        return (
            out.at[:, :r]
            .set(values.reshape(dp, r, *values.shape[1:]))
            .reshape(dp * max_num_seqs, *values.shape[1:])
        )

    if features.logprobs:
        extras["logprobs"] = tuple(padded(a) for a in gather_logprobs(scores, sampled, k))
    return padded(sampled), extras


def _paged_step(
    params, kv_cache, store, buffer, prev_sampled, penalty_state, *, graphdef, state_def, paged,
    layer_to_group, store_dtype, max_num_seqs, shapes, layout, features,
):  # fmt: skip
    """Forward + sampling of one packed step, unpacked by `layout` (`step_layout`)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    fields = layout.unpack(buffer)
    ctx = _context(fields, paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    token_ids, embeds = _step_tokens(model, store, fields, prev_sampled, store_dtype)
    logits, kv_cache = model.forward_paged(token_ids, kv_cache, _every_row(ctx, features), embeds)
    sampled, extras = _sample_outputs(
        logits, fields, ctx, token_ids, penalty_state, max_num_seqs, features
    )
    return kv_cache, sampled, extras


@dataclass(frozen=True)
class LayerParams:
    """A layer-by-layer model's parameters as its step programs take them (each a flat
    list of arrays, as `ModelRunner` flattens them): the whole model's (`model`:
    embeddings, final norm, head) and its runs of layers in groups, one layer program
    call per group (`groups[i]`: consecutive runs' parameter lists, the group's first
    layer `first_layers[i]`, a device int32 scalar)."""

    model: list[jax.Array]
    groups: tuple[tuple[list[jax.Array], ...], ...]
    first_layers: tuple[jax.Array, ...]


def _inputs_step(params, store, buffer, prev_sampled, *, graphdef, state_def, layout, store_dtype):
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    token_ids, embeds = _step_tokens(model, store, layout.unpack(buffer), prev_sampled, store_dtype)
    return model.input_embeddings(token_ids, embeds)


def _layers_step(
    group_params, x, kv_cache, buffer, first_layer, *, run_graphdef, run_def, config, paged,
    layer_to_group, shapes, layout,
):  # fmt: skip
    """A group of consecutive runs of layers (unrolled: each run's weights are the
    program's own arguments, none sliced out of a stack), from layer `first_layer`."""
    ctx = _context(layout.unpack(buffer), paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    positions, attend, layer = ctx.token_positions(), paged_attend(config, ctx), first_layer
    for run_params in group_params:
        run = nnx.merge(run_graphdef, jax.tree.unflatten(run_def, run_params))
        x, kv_cache = apply_layers(run, x, positions, layer, attend, kv_cache)
        layer = layer + run.num_layers
    return x, kv_cache


def _sample_step(
    params, x, buffer, prev_sampled, penalty_state, *, graphdef, state_def, paged,
    layer_to_group, max_num_seqs, shapes, layout, features,
):  # fmt: skip
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    fields = layout.unpack(buffer)
    ctx = _context(fields, paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    logits = model.paged_logits(x, _every_row(ctx, features))
    token_ids = _token_ids(fields, prev_sampled)
    return _sample_outputs(logits, fields, ctx, token_ids, penalty_state, max_num_seqs, features)


@dataclass(frozen=True)
class _LayerByLayerStep:
    """One step as programs dispatched from the host, in order: the inputs, each group of
    runs of layers (one program for every group of a size: the layer number is data),
    the sampling. Called and lowered as the fused `step_program` is, with `LayerParams`
    for the parameters; only the layer program updates the (donated) KV cache."""

    inputs: object
    layers: object
    sample: object

    def __call__(self, params: LayerParams, kv_cache, store, buffer, prev_sampled, penalty_state):
        x = self.inputs(params.model, store, buffer, prev_sampled)
        for group, first_layer in zip(params.groups, params.first_layers, strict=True):
            x, kv_cache = self.layers(group, x, kv_cache, buffer, first_layer)
        return kv_cache, *self.sample(params.model, x, buffer, prev_sampled, penalty_state)

    def lower(self, params: LayerParams, kv_cache, store, buffer, prev_sampled, penalty_state):
        """The layer program (the one that writes the cache), lowered."""
        x = jax.eval_shape(self.inputs, params.model, store, buffer, prev_sampled)
        return self.layers.lower(params.groups[0], x, kv_cache, buffer, params.first_layers[0])


# A step run layer by layer is then at most 12 programs, so two steps fit in the 32
# computations XLA's CPU client keeps in flight per device: the host packs and
# dispatches step N+1 while step N runs instead of blocking in the dispatch. Fewer,
# larger programs also cost less to launch; each compiles its layers unrolled.
MAX_LAYER_PROGRAMS = 10


def layer_group_sizes(num_runs: int) -> tuple[int, ...]:
    """How many consecutive runs of layers each layer program call of a step takes:
    at most `MAX_LAYER_PROGRAMS` groups of the fewest runs that allows, sizes differing
    by at most one (so a step shape compiles at most two layer programs)."""
    per_group = -(-num_runs // MAX_LAYER_PROGRAMS)
    groups = -(-num_runs // per_group)
    smaller, larger_groups = divmod(num_runs, groups)
    return (smaller + 1,) * larger_groups + (smaller,) * (groups - larger_groups)


@functools.lru_cache(maxsize=512)
def layer_by_layer_program(
    *, graphdef, state_def, run_graphdef, run_def, config, paged, layer_to_group, store_dtype,
    max_num_seqs, shapes, layout, features,
):  # fmt: skip
    """`step_program`'s counterpart for a model run layer by layer (`_LayerByLayerStep`)."""
    common = dict(paged=paged, layer_to_group=layer_to_group, shapes=shapes, layout=layout)
    model = dict(graphdef=graphdef, state_def=state_def)
    return _LayerByLayerStep(
        jax.jit(functools.partial(_inputs_step, **model, layout=layout, store_dtype=store_dtype)),
        jax.jit(
            functools.partial(
                _layers_step, run_graphdef=run_graphdef, run_def=run_def, config=config, **common
            ),
            donate_argnames="kv_cache",
            out_shardings=_cache_out(paged, 1, 2),
        ),
        jax.jit(
            functools.partial(
                _sample_step, **model, max_num_seqs=max_num_seqs, features=features, **common
            ),
            donate_argnames="penalty_state",
        ),
    )


@functools.partial(jax.jit, static_argnames="graphdef")
def encode_image(state, pixel_values, *, graphdef):
    """One image's encoder output `[num_image_tokens, hidden]` (one program)."""
    return nnx.merge(graphdef, state).encode_images(pixel_values[None])[0]
