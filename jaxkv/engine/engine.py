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

`LLMEngine` keeps the step loop and the public API; its other jobs are parts it calls,
one module each: `config` (the config and its checks), `build` (the runner, managers and
schedulers), `intake` (checking requests, their host state and outputs), `events` (KV
events to the publishers' queues), `tiers` (the host tiers' stores and loads),
`recording` (each step's stats), `replay` (several processes) and `weights` (new
weights written in place, `update_weights`).

Weight versions: `weight_version` is 0 for the weights the engine was built with, and
each `update_weights` sets a new one. A request's blocks are keyed under the version it
was admitted (or, never having run, re-keyed) under, joined to its first block's hash
extra keys as the cache salt is, so every later hash in its chain carries it, in the
device prefix cache and the host tier alike; with the initial weights there is no key
(hashes and KV events are vLLM's). So no request admitted after an update hits a block
computed under older weights; the requests running across it follow
`EngineConfig.weight_update_policy`. Each `RequestOutput.weight_versions` lists the
versions that sampled its request's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from jaxkv.device import compilation_count
from jaxkv.device.compilation_cache import enable_compilation_cache
from jaxkv.engine import build, multihost
from jaxkv.engine.config import EngineConfig, check_config
from jaxkv.engine.events import EngineEvents, make_publishers
from jaxkv.engine.fanout import FanOut, child_requests
from jaxkv.engine.intake import BYTES_TYPES, RequestTable
from jaxkv.engine.logprobs import HostLogprobs
from jaxkv.engine.model_runner import RequestStepError, image_inputs
from jaxkv.engine.offload import host_offloads
from jaxkv.engine.outputs import RequestOutput
from jaxkv.engine.recording import step_stats
from jaxkv.engine.replay import ProcessReplay, engine_settings
from jaxkv.engine.sampling import RequestOutputKind, SamplingParams
from jaxkv.engine.scheduler import FinishReason, SchedulerOutput, TokenUpdates
from jaxkv.engine.stats import EngineStats
from jaxkv.engine.tiers import EngineTiers
from jaxkv.engine.weights import Weights, WeightUpdater, WeightVersions
from jaxkv.hashing import get_hash_fn_by_name, init_none_hash
from jaxkv.kv_events import KVCacheEvent
from jaxkv.kv_events_publisher import EventPublisher
from jaxkv.request_hashing import get_request_block_hasher
from jaxkv.routing import choose_data_rank

__all__ = ["LLMEngine", "choose_data_rank"]


@dataclass
class _InFlight:
    """A step dispatched whose tokens are not applied yet."""

    outputs: list[SchedulerOutput]  # one per data rank
    sampled: jax.Array
    weight_version: int | str  # the weights it runs with
    logprobs: dict  # its logprob arrays by name (`ModelRunner.step_logprobs`)


class LLMEngine:
    """Serve a model (the `jaxkv.models` contract) with continuous batching and paged KV.

    Bad input to `add_request` raises ValueError/TypeError naming it before anything
    changes; the engine keeps serving the other requests.

    `mesh` (default: the mesh the model's weights are on, else one device): a
    `(data, model)` mesh from `jaxkv.device.make_mesh`. `schedulers[k]` and
    `kv_cache_managers[k]` serve data rank `k`, each with `config.num_blocks` blocks;
    `scheduler` and `kv_cache_manager` are rank 0's (the only ones on one data rank).
    `kv_cache_sizing` is the one KV-cache plan (`jaxkv.engine.sizing.KVCachePlan`) the
    runner, the managers and the host tiers are built from.

    Several processes (`jaxkv.engine.multihost.initialize` first, the same model, config
    and mesh on each, checked at construction): requests enter on process 0; the others
    call `follow()` until process 0's `shutdown()`. Every process holds the same host state.

    Shut down is a state: after `shutdown()` (idempotent) every call that would change
    or run the engine (`add_request`, `abort`, `step`, `generate`, `follow`,
    `reset_prefix_cache`, `take_kv_events`, `warm_up`) raises RuntimeError before it
    changes anything; what was running stays as it was (its blocks included), readable
    through `stats`, `num_free_blocks`, `has_unfinished_requests()` and the managers.
    """

    def __init__(
        self, model, config: EngineConfig | None = None, tokenizer=None, *, mesh: Mesh | None = None
    ) -> None:
        config = config or EngineConfig()
        device_quotas = check_config(config)  # before the device memory is allocated
        self.model = model
        self.tokenizer = tokenizer
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
        mcfg = model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (getattr(mcfg, "eos_token_ids", ()) or ()))
        self.images = image_inputs(model)
        budget = build.encoder_budget(config, self.images)
        mesh = build.check_mesh(model, mesh)
        self.config, self.kv_cache_sizing = build.resolve_sizes(config, model, mesh)
        self.runner = build.make_runner(model, self.config, self.kv_cache_sizing, budget)
        self.mesh = self.runner.mesh
        self._build_ranks(device_quotas, budget)
        self._replay = ProcessReplay(lambda: engine_settings(self.config, self.model, self.mesh))
        hash_fn = get_hash_fn_by_name(self.config.hash_fn)
        init_none_hash(hash_fn)
        self._in_flight: _InFlight | None = None
        self.stats = EngineStats(
            window_steps=int(self.config.stats_window_steps), tier_snapshot=self._tiers.snapshot
        )
        self._requests = RequestTable(
            self.schedulers,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            images=self.images,
            seed=self.config.seed,
            block_hasher=get_request_block_hasher(self.kv_cache_manager.hash_block_size, hash_fn),
            stats=self.stats,
        )
        self._fanout = FanOut()  # the parents of `n > 1` requests
        self.num_steps = 0
        self.is_shut_down = False
        self._weights = WeightUpdater(self.runner)
        self._versions = WeightVersions()
        # Outputs and token updates of a step applied outside `step()` (a weight update
        # waits for the step in flight): they go with the next step.
        self._drained_outputs: list[RequestOutput] = []
        self._drained_updates: list[TokenUpdates] = []
        self._token_versions: dict[str, tuple[int | str, ...]] = {}  # by unfinished request

    def _check_open(self, call: str) -> None:
        """RuntimeError naming `call` once the engine is shut down (see the class)."""
        if self.is_shut_down:
            raise RuntimeError(
                f"LLMEngine.{call}: the engine is shut down (shutdown() was called); "
                "build a new LLMEngine to serve again"
            )

    def _build_ranks(self, device_quotas, budget) -> None:
        """Each data rank's KV cache manager, host tier, event publisher and scheduler
        (`kv_cache_manager`, `offload`, `scheduler`: rank 0's)."""
        c = self.config
        events_on = c.kv_events_endpoint is not None or c.enable_kv_cache_events
        self.kv_cache_managers = build.make_managers(c, self.runner, device_quotas, events_on)
        # One host tier per data rank (none: off), laid out as the runner's KV-cache plan.
        self.offloads = host_offloads(c, self.kv_cache_sizing, self.runner)
        self.offload = self.offloads[0] if self.offloads else None
        self._tiers = EngineTiers(self.offloads, self.runner, self.kv_cache_managers)
        self._events = EngineEvents(
            self.kv_cache_managers, self.offloads, make_publishers(c, len(self.kv_cache_managers)),
            recorded=events_on, keep=c.enable_kv_cache_events,
        )  # fmt: skip
        self.schedulers = build.make_schedulers(c, self.kv_cache_managers, budget, self.offloads)
        self.kv_cache_manager, self.scheduler = self.kv_cache_managers[0], self.schedulers[0]

    @property
    def kv_event_publishers(self) -> list[EventPublisher]:
        """Each data rank's KV event publisher (empty: not publishing)."""
        return self._events.publishers

    @kv_event_publishers.setter
    def kv_event_publishers(self, publishers: list[EventPublisher]) -> None:
        self._events.publishers = publishers

    def take_kv_events(self, data_rank: int = 0) -> list[KVCacheEvent]:
        """Data rank `data_rank`'s KV events since the last call, in order: the device
        pool's (`medium="GPU"`), then its host tier's (`medium="CPU"`), with
        `AllBlocksCleared` from `reset_prefix_cache`; the same events an endpoint
        publishes. Needs `EngineConfig(enable_kv_cache_events=True)`."""
        self._check_open("take_kv_events")
        return self._events.take(data_rank)

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's prefix cache (vLLM's `reset_prefix_cache`); False, changing
        nothing on the ranks still holding blocks, while requests run. The host tier is
        cleared with the device pool (its `AllBlocksCleared` has `medium="CPU"`). The
        `AllBlocksCleared` events go out now, not with the next step."""
        self._check_open("reset_prefix_cache")
        self._replay.check("reset_prefix_cache")
        self._replay.record("reset_prefix_cache")
        reset = all([manager.reset_prefix_cache() for manager in self.kv_cache_managers])
        if reset and self.offloads:
            reset = self._tiers.reset()
        self._events.publish()
        return reset

    def shutdown(self) -> None:
        """Flush and close the KV event publishers (nothing else holds resources); on
        process 0 of several, release the others from `follow()`. The engine refuses
        every further call that would change or run it (see the class); a second
        `shutdown()` does nothing."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._replay.stop()
        self._events.shutdown()

    # -- requests ---------------------------------------------------------------------

    def warm_up(self) -> int:
        """Compile every step shape now, so serving compiles nothing; returns the count."""
        self._check_open("warm_up")
        count = self.runner.warm_up()
        self._tiers.warm_up()
        self._weights.warm_up()
        return count

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
        self._check_open("add_request")
        self._replay.check("add_request")
        args = (prompt, images, sampling, request_id, cache_salt, lora_request)
        if isinstance(sampling, SamplingParams) and sampling.n > 1:
            request_id = self._add_parent(*args)
        else:
            new = self._requests.check(*args)
            self._admit(new)
            request_id = new.request.request_id
        self._replay.record("add", prompt, images, sampling, request_id, cache_salt)
        return request_id

    def _add_parent(self, prompt, images, sampling, request_id, cache_salt, lora_request) -> str:
        """Add an `n > 1` request as its `n` children (`jaxkv.engine.fanout`), every one
        checked before any is added; returns the parent's id. When the children can read
        the prefix cache, child 0 goes first and the others wait for its prompt's blocks
        (one prefill for all)."""
        if request_id is None:
            request_id = self._requests.new_request_id()
        if self._fanout.is_parent(request_id) or request_id in self._requests.rank_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = child_requests(request_id, sampling)
        news = [
            self._requests.check(prompt, images, params, child_id, cache_salt, lora_request)
            for child_id, params in children
        ]
        if any(child_id in self._requests.rank_of for child_id, _ in children):
            raise ValueError(f"request id {request_id!r}: a child's id is already in use")
        shared = self.config.enable_prefix_caching and not news[0].request.skip_reading_prefix_cache
        held = news[1:] if shared else []
        for new in news[: len(news) - len(held)]:
            self._admit(new)
        self._fanout.add(request_id, sampling, [child_id for child_id, _ in children], held)
        return request_id

    def _admit(self, new) -> None:
        """Hand a checked request to the data rank holding most of its prefix among the
        least busy (the scheduler checks it before changing anything)."""
        rank = 0
        if len(self.schedulers) > 1:
            rank = choose_data_rank(
                [s.num_unfinished_requests for s in self.schedulers],
                lambda k: self._tiers.num_cached_tokens(k, new.request),
                max(1, self.config.max_num_seqs // 4) if self.config.enable_prefix_caching else 0,
            )
        self._requests.admit(new, rank)

    def abort(self, request_id: str) -> None:
        """Stop a request now; KeyError naming it when no unfinished request has that id.
        Its final output (`finish_reason="abort"`) comes with the next `step()`. A request
        whose final output is already due (it finished in the step an `update_weights`
        completed, or was aborted) is left as it is: that output still comes."""
        self._check_open("abort")
        self._replay.check("abort")
        if self._fanout.is_parent(request_id):
            # Every child still running or held; one aborted or failed already (its final
            # output due with the next step) is done, as vLLM's parent forgets it.
            children = self._fanout.children(request_id)
            for new in self._fanout.release_siblings(children[0]):
                self._admit(new)
            for child_id in children:
                if child_id in self._requests.rank_of:
                    self.abort(child_id)
            return
        for new in self._fanout.release_siblings(request_id):  # a held child is admitted first
            self._admit(new)
        rank = self._requests.rank_of.get(request_id)
        if rank is None:
            due = (*self._drained_outputs, *self._requests.final_outputs)
            if any(output.request_id == request_id for output in due):
                return
            raise KeyError(f"no unfinished request with id {request_id!r}")
        self._replay.record("abort", request_id)
        request = self.schedulers[rank].abort_request(request_id)
        self._requests.finish_now(request, FinishReason.ABORT)

    def step_running(self) -> bool:
        """Whether the step dispatched last still runs on the device (with async
        scheduling one outlives its `step()` call): host work done meanwhile costs the
        device nothing."""
        return self._in_flight is not None and not self._in_flight.sampled.is_ready()

    def has_unfinished_requests(self) -> bool:
        requests = self._requests
        return (
            bool(requests.rank_of)
            or self._in_flight is not None
            or bool(requests.final_outputs)
            or bool(self._drained_outputs)
        )

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
        self._check_open("step")
        return self._replay.step(self._step, self._apply)

    def follow(self) -> None:
        """On a process other than 0: step with process 0 until it shuts its engine down."""
        self._check_open("follow")
        self._replay.follow(self._step, self._apply)

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
        """Schedule and dispatch a step; wait for and apply the tokens of the step due
        (the previous one with async scheduling, else this one); publish the events of
        the schedule (queued only: the publishing thread sends them) and record stats."""
        compiled = compilation_count()
        t0 = time.perf_counter()
        # Gathers of two steps ago were dispatched before the step just waited for; an
        # idle engine has nothing to overlap the others with, so it waits for them too.
        before_step = None if not self.has_unfinished_requests() else self.num_steps - 1
        self._tiers.complete_stores(before_step)
        outs = [scheduler.schedule() for scheduler in self.schedulers]
        # Before this step can write into a freed or evicted block.
        self._tiers.store_freed_blocks(self.num_steps)
        if self._in_flight is None and all(out.is_empty for out in outs):
            self._fail_unschedulable()
        sampled = self._execute(outs)
        current = None
        if not all(out.is_empty for out in outs):
            current = _InFlight(
                outs, sampled, self._versions.current, self.runner.step_logprobs
            )
        done = self._in_flight if self.config.async_scheduling else current
        self._in_flight = current if self.config.async_scheduling else None
        # The events of the step's schedule (the blocks it caches are written by the step
        # just dispatched, before any later step runs).
        self._events.publish()
        wait_s = 0.0
        if current is None and done is None:
            # Nothing runs until a pending host-tier load is staged: wait for one.
            wait_s = self._tiers.wait_for_a_staging()
        versioned = []
        if done is not None:
            t_wait = time.perf_counter()
            versioned = self._complete(done)  # the one place the host waits
            wait_s = time.perf_counter() - t_wait
        self._tiers.store_freed_blocks(self.num_steps)
        outputs, self._drained_outputs = self._drained_outputs, []
        updates, self._drained_updates = self._drained_updates, []
        outputs += self._outputs(versioned)
        updates += [update for _, update in versioned]
        self.stats.record(step_stats(
            self.num_steps, outs, updates, self.schedulers, self.kv_cache_managers,
            self._tiers.take_stats(), host_s=time.perf_counter() - t0 - wait_s, wait_s=wait_s,
            compilations=compilation_count() - compiled,
        ))  # fmt: skip
        self.num_steps += 1
        given = [r.request_id for update in updates for r in update.requests]
        finished = [output.request_id for output in outputs]  # e.g. failed before a token
        for new in self._fanout.release(given + finished):  # their leader's prompt is cached
            self._admit(new)
        return self._fanout.merge(outputs)

    def _complete(self, done: _InFlight) -> list[tuple[int | str, TokenUpdates]]:
        """Wait for a dispatched step's tokens (and logprobs) and apply them, rank by
        rank; each rank's updates with the weight version that sampled them."""
        tokens = multihost.host_tokens(done.sampled)
        logprobs = HostLogprobs.fetch(done.logprobs, multihost.host_tokens)
        width = self.runner.max_num_seqs
        versioned = []
        for rank, (scheduler, out) in enumerate(zip(self.schedulers, done.outputs, strict=True)):
            update = scheduler.update_from_output(out, tokens[rank * width : (rank + 1) * width])
            if logprobs is not None:
                self._requests.record_logprobs(out, update, logprobs, rank)
            versioned.append((done.weight_version, update))
        return versioned

    def _outputs(self, versioned: list[tuple[int | str, TokenUpdates]]) -> list[RequestOutput]:
        """The outputs of the requests finished outside a step, then of those given
        tokens, each with the weight versions that sampled its tokens."""
        versions = self._token_versions
        outputs = self._requests.take_final_outputs()
        for output in outputs:
            output.weight_versions = versions.pop(output.request_id, ())
        for version, update in versioned:
            reasons = update.finish_reasons
            for request in update.requests:
                request_id = request.request_id
                seen = versions.get(request_id, ())
                if not seen or seen[-1] != version:
                    versions[request_id] = seen = (*seen, version)
                reason = reasons.get(request_id) if reasons else None
                if reason is not None:
                    del versions[request_id]
                output = self._requests.output(request, reason)
                if output is not None:
                    output.weight_versions = seen
                    outputs.append(output)
        return outputs

    # -- weights ------------------------------------------------------------------------

    @property
    def weight_version(self) -> int | str:
        """The version of the weights serving now: 0 for those the engine was built with,
        then each `update_weights`' (ints counting up by default)."""
        return self._versions.current

    def update_weights(self, weights: Weights, *, weight_version: int | str | None = None):
        """Serve with new weights from now on; returns the new `weight_version`.

        `weights`: a checkpoint directory, a mapping of Hugging Face tensor names to
        arrays, or the model's `nnx.State`, each with the running model's shapes, dtypes
        and placements (`jaxkv.engine.weights`); anything else raises ValueError/TypeError
        naming the tensor and changes nothing. `weight_version`: an int or str never used
        before (None: the next int). The new weights are copied into the model's device
        buffers (donated: no new allocation) by a program `warm_up` compiled.

        The step in flight finishes first (its tokens, sampled by the old weights, come
        with the next `step()`). Then the requests holding KV follow
        `EngineConfig.weight_update_policy`, the waiting ones are keyed under the new
        version, the cached free blocks (all computed under older weights) go to the
        front of the free queue (evicted first), and the encoder cache is emptied (its
        embeddings came from the old weights). One process only.
        """
        self._check_open("update_weights")
        self._replay.check("update_weights")
        if self._replay.stream is not None:
            raise RuntimeError("update_weights is not supported on several processes")
        version = self._versions.check_new(weight_version)
        update = self._weights.prepare(weights)
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            versioned = self._complete(done)
            self._drained_outputs += self._outputs(versioned)
            self._drained_updates += [update for _, update in versioned]
        self._weights.apply(update)
        self._versions.advance(version)
        self._requests.weight_version = self._versions.key
        policy = self.config.weight_update_policy
        for scheduler in self.schedulers:
            for request_id in scheduler.update_weights(policy, version):
                self._requests.finish_now(scheduler.abort_request(request_id), FinishReason.ABORT)
            scheduler.kv_cache_manager.block_pool.evict_cached_free_blocks_first()
        for new in self._fanout.held():  # waiting too, though no scheduler has them yet
            new.request.set_weight_version(version)
        encoder_cache = self.scheduler.encoder_cache_manager
        if encoder_cache is not None:
            encoder_cache.reset()  # no request holds an entry now
            self.runner.flush_encoder_store()
        return version

    def _fail_unschedulable(self) -> None:
        """With nothing running, loading or in flight, a waiting request that still cannot
        be scheduled never will be: it finishes with an error instead of stalling the
        engine."""
        for scheduler in self.schedulers:
            if scheduler.waiting and not scheduler.running and not scheduler.loading:
                request = scheduler.waiting[0]
                self._requests.fail(
                    request.request_id,
                    f"{request.num_tokens} tokens do not fit the "
                    f"{scheduler.kv_cache_manager.num_free_blocks} free KV blocks",
                )

    def _execute(self, outs: list[SchedulerOutput]) -> jax.Array:
        """Dispatch the step; a request whose rows cannot be prepared is failed and taken
        out of `outs` (in place), and the step is packed again without it."""
        while True:
            try:
                return self.runner.execute(outs, self._requests.sampling, self._requests.images)
            except RequestStepError as error:
                self._requests.fail(error.request_id, str(error))
                for out in outs:
                    out.scheduled = [
                        s for s in out.scheduled if s.request.request_id != error.request_id
                    ]

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
        prompt's (see `add_request`). RuntimeError, serving nothing, once shut down.
        """
        self._check_open("generate")
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
                    prompt, (str, *BYTES_TYPES)
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
