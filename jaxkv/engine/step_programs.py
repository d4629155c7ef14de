"""The step on the device: the packed buffer's layout and the jitted programs that run it.

`step_layout` names the fields of one data rank's row of the step buffer; the host
packs with it and every program below unpacks with the same object, so the two sides
cannot disagree on an offset. `step_program` is the fused step (forward and sampling,
one program) of a model whose layers are scanned as one body; `layer_by_layer_program`
is the same step as 2 + L programs for a model with one stack per layer (inputs, one
program for every run of layers, head and sampling). Both are cached per engine layout
and step shape with every static argument bound, so engines built alike share compiled
programs and a call hashes no static argument (JAX's C++ dispatch path). Only the
program that writes the KV cache takes it donated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.device import StepField, StepLayout, StepShape
from jaxkv.device.encoder_store import merge_rows
from jaxkv.engine.sampling import sample_tokens
from jaxkv.models.base import PagedContext, paged_attend
from jaxkv.models.decoder import apply_layers

__all__ = [
    "SAMPLING_FIELDS",
    "LayerParams",
    "encode_image",
    "layer_by_layer_program",
    "metadata_field",
    "step_layout",
    "step_program",
]


def metadata_field(group: int) -> str:
    """The `step_layout` field holding KV-cache group `group`'s packed metadata."""
    return f"metadata{group}"


# The sampling rows of a step, in `sample_tokens`' argument order; two are float32.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds", "counters")
_FLOAT_ROWS = ("temperature", "top_p")


@functools.cache
def step_layout(shapes: tuple[StepShape, ...], merges_embeds: bool) -> StepLayout:
    """One data rank's row of the step buffer for the groups' bucket `shapes` (`T` tokens,
    `R` requests each): every KV-cache group's metadata (its `StepShape.layout`), then

    * `token_ids [T]`: the host's token ids (0 where the token is pending),
    * `token_src [T]`: the previous step's output row a pending token is read from, -1
      for a host token,
    * `logits_indices [R]`: each request's last token row among all ranks' `dp * T`,
    * `temperature [R]` (float32), `top_k [R]`, `top_p [R]` (float32), `seeds [R]`,
      `counters [R]` (the output index of the token sampled): sampling rows,
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
        for name in SAMPLING_FIELDS
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
        donate_argnames="kv_cache",
        out_shardings=_cache_out(static["paged"], 0),
    )


def _cache_out(paged, index: int):
    """`out_shardings` of a program returning a pair with the cache at `index`: on a TPU the
    cache's format there (`PagedKVCache.stacked_format`: row-major in every program),
    else None (unconstrained)."""
    if paged[0].platform != "tpu":
        return None
    return tuple(paged[0].stacked_format if i == index else None for i in range(2))


def _context(fields: dict, *, paged, shapes, layer_to_group) -> PagedContext:
    """The model's view of an unpacked step buffer: every rank's rows, rank-major."""
    return PagedContext(
        caches=paged, shapes=shapes, layer_to_group=layer_to_group,
        metadata=tuple(fields[metadata_field(g)] for g in range(len(shapes))),
        logits_indices=fields["logits_indices"].reshape(-1),
    )  # fmt: skip


def _step_tokens(model, store, fields: dict, prev_sampled, store_dtype):
    """The step's token ids (pending rows take the last step's sampled token) and, with
    an encoder store, their embeddings with the stored image rows merged (else None)."""
    src, host_ids = fields["token_src"].reshape(-1), fields["token_ids"].reshape(-1)
    token_ids = jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], host_ids)
    if store is None:
        return token_ids, None
    embeds = model.embed_tokens(token_ids)
    merge_src, merge_dst = fields["merge_src"].reshape(-1), fields["merge_dst"].reshape(-1)
    return token_ids, merge_rows(embeds, store, merge_src, merge_dst, store_dtype)


def _sampled_rows(logits, fields: dict, max_num_seqs: int):
    """The tokens sampled from `logits` by the step's sampling rows, padded to
    `max_num_seqs` per rank (`[dp * max_num_seqs]`, rank-major)."""
    dp, r = fields["temperature"].shape
    sampled = sample_tokens(
        logits, *(fields[name].reshape(-1) for name in SAMPLING_FIELDS)
    ).reshape(dp, r)
    return jnp.zeros((dp, max_num_seqs), jnp.int32).at[:, :r].set(sampled).reshape(-1)


def _paged_step(
    params, kv_cache, store, buffer, prev_sampled, *, graphdef, state_def, paged, layer_to_group,
    store_dtype, max_num_seqs, shapes, layout,
):  # fmt: skip
    """Forward + sampling of one packed step, unpacked by `layout` (`step_layout`)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    fields = layout.unpack(buffer)
    ctx = _context(fields, paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    token_ids, embeds = _step_tokens(model, store, fields, prev_sampled, store_dtype)
    logits, kv_cache = model.forward_paged(token_ids, kv_cache, ctx, embeds)
    return kv_cache, _sampled_rows(logits, fields, max_num_seqs)


@dataclass(frozen=True)
class LayerParams:
    """A layer-by-layer model's parameters as its step programs take them (each a flat
    list of arrays, as `ModelRunner` flattens them): the whole model's (`model`:
    embeddings, final norm, head) and each run of layers' own (`runs[i]`, first layer
    `first_layers[i]`, a device int32 scalar)."""

    model: list[jax.Array]
    runs: tuple[list[jax.Array], ...]
    first_layers: tuple[jax.Array, ...]


def _inputs_step(params, store, buffer, prev_sampled, *, graphdef, state_def, layout, store_dtype):
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    token_ids, embeds = _step_tokens(model, store, layout.unpack(buffer), prev_sampled, store_dtype)
    return model.input_embeddings(token_ids, embeds)


def _layers_step(
    run_params, x, kv_cache, buffer, first_layer, *, run_graphdef, run_def, config, paged,
    layer_to_group, shapes, layout,
):  # fmt: skip
    ctx = _context(layout.unpack(buffer), paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    run = nnx.merge(run_graphdef, jax.tree.unflatten(run_def, run_params))
    return apply_layers(
        run, x, ctx.token_positions(), first_layer, paged_attend(config, ctx), kv_cache
    )


def _sample_step(
    params, x, buffer, *, graphdef, state_def, paged, layer_to_group, max_num_seqs, shapes, layout
):  # fmt: skip
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    fields = layout.unpack(buffer)
    ctx = _context(fields, paged=paged, shapes=shapes, layer_to_group=layer_to_group)
    return _sampled_rows(model.paged_logits(x, ctx), fields, max_num_seqs)


@dataclass(frozen=True)
class _LayerByLayerStep:
    """One step as programs dispatched from the host, in order: the inputs, each run of
    layers (one program for every run: the layer number is data), the sampling. Called
    and lowered as the fused `step_program` is, with `LayerParams` for the parameters;
    only the layer program updates the (donated) KV cache."""

    inputs: object
    layers: object
    sample: object

    def __call__(self, params: LayerParams, kv_cache, store, buffer, prev_sampled):
        x = self.inputs(params.model, store, buffer, prev_sampled)
        for run, first_layer in zip(params.runs, params.first_layers, strict=True):
            x, kv_cache = self.layers(run, x, kv_cache, buffer, first_layer)
        return kv_cache, self.sample(params.model, x, buffer)

    def lower(self, params: LayerParams, kv_cache, store, buffer, prev_sampled):
        """The layer program (the one that writes the cache), lowered."""
        x = jax.eval_shape(self.inputs, params.model, store, buffer, prev_sampled)
        return self.layers.lower(params.runs[0], x, kv_cache, buffer, params.first_layers[0])


@functools.lru_cache(maxsize=512)
def layer_by_layer_program(
    *, graphdef, state_def, run_graphdef, run_def, config, paged, layer_to_group, store_dtype,
    max_num_seqs, shapes, layout,
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
            out_shardings=_cache_out(paged, 1),
        ),
        jax.jit(functools.partial(_sample_step, **model, max_num_seqs=max_num_seqs, **common)),
    )


@functools.partial(jax.jit, static_argnames="graphdef")
def encode_image(state, pixel_values, *, graphdef):
    """One image's encoder output `[num_image_tokens, hidden]` (one program)."""
    return nnx.merge(graphdef, state).encode_images(pixel_values[None])[0]
