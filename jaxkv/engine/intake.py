"""Request intake and outputs: what `LLMEngine` holds per unfinished request.

`RequestTable` checks a new request (prompt, images, sampling, id, salt) before anything
changes, turns it into a `Request` and, once a scheduler has taken it, keeps its data
rank, its sampling row, its output stream and its images until it finishes; it makes
each request's outputs, queues those of requests finished outside a step (aborted or
failed) for the next step, and forgets a finished request.

Invariant: the ids in `rank_of`, `sampling` and `streams` are the same set, the
unfinished requests; `images[h]` is held while `image_refs[h] > 0` requests use image `h`.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.engine.logprobs import HostLogprobs
from jaxkv.engine.model_runner import ImageInputs, RowSampling
from jaxkv.engine.outputs import OutputStream, RequestOutput
from jaxkv.engine.sampling import MAX_LOGPROBS, MAX_MIN_TOKENS_STOPS, SamplingParams
from jaxkv.engine.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerOutput,
    TokenUpdates,
    stop_token_ids_for,
)
from jaxkv.engine.stats import EngineStats
from jaxkv.mm_hashing import hash_mm_item
from jaxkv.request import MultiModalFeatureSpec, Request

__all__ = ["BYTES_TYPES", "NewRequest", "RequestTable", "fold_seed"]

_INT32_SEEDS = 2**31

# Prompts that iterate as ints but are not token ids (`token_ids` refuses them).
BYTES_TYPES = (bytes, bytearray, memoryview)


def fold_seed(seed: int) -> int:
    """A request's seed as the int32 the step samples with: a seed in `[0, 2**31)` as
    given; any other int (vLLM takes any) folded deterministically by CRC-32 of its
    decimal form into that range. Two folded seeds collide with probability 2**-31."""
    seed = int(seed)
    if 0 <= seed < _INT32_SEEDS:
        return seed
    return zlib.crc32(str(seed).encode()) % _INT32_SEEDS


@dataclass
class NewRequest:
    """A checked request not yet taken by a scheduler: its `Request`, its sampling, its
    stop token ids and its images' features with their pixels (in prompt order)."""

    request: Request
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    features: list[MultiModalFeatureSpec]
    pixels: list[np.ndarray]


class RequestTable:
    """The engine's unfinished requests (see the module docstring for the invariant)."""

    def __init__(
        self,
        schedulers: list[Scheduler],
        *,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        images: ImageInputs | None,
        seed: int,
        block_hasher,
        stats: EngineStats,
    ) -> None:
        self.schedulers, self.tokenizer, self.stats = schedulers, tokenizer, stats
        self.vocab_size, self.eos_token_ids, self.image_inputs = vocab_size, eos_token_ids, images
        self.seed, self.block_hasher = seed, block_hasher
        self.rank_of: dict[str, int] = {}  # unfinished request id -> its data rank
        self.sampling: dict[str, RowSampling] = {}  # unfinished request id -> its row
        self.streams: dict[str, OutputStream] = {}  # unfinished request id -> its outputs
        self.images: dict[str, np.ndarray] = {}  # image hash -> pixels
        self.image_refs: dict[str, int] = {}  # image hash -> unfinished requests using it
        self.final_outputs: list[RequestOutput] = []  # aborted or failed, for the next step
        self.weight_version: int | str | None = None  # new requests' block-hash key
        self._ids = itertools.count()

    # -- intake -------------------------------------------------------------------------

    def check(
        self,
        prompt: str | Sequence[int],
        images: Sequence[np.ndarray] | None,
        sampling: SamplingParams | None,
        request_id: str | None,
        cache_salt: str | None,
        lora_request: object | None,
    ) -> NewRequest:
        """The request `add_request` was given, checked (ValueError/TypeError naming the
        bad argument; nothing changes) and built; a new id when `request_id` is None."""
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is None:
            request_id = self.new_request_id()
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.sampling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if lora_request is not None:
            raise ValueError("lora_request must be None: this engine serves no LoRA adapters")
        self.check_sampling(sampling)
        ids = self.token_ids(prompt)
        features, pixels = [], []
        if images:
            ids, features, pixels = self.image_features(request_id, ids, images)
        max_tokens = sampling.max_tokens
        if max_tokens is None:  # vLLM's: up to the model length
            max_tokens = max(1, self.schedulers[0].config.max_model_len - len(ids))
        # The penalty state counts the tokens a request feeds: it must feed all of them.
        skip = sampling.skip_reading_prefix_cache or sampling.uses_penalties
        request = Request(
            request_id, ids, sampling, mm_features=features, block_hasher=self.block_hasher,
            cache_salt=cache_salt, weight_version=self.weight_version, max_tokens=max_tokens,
            skip_reading_prefix_cache=skip,
        )  # fmt: skip
        stop = stop_token_ids_for(sampling, self.eos_token_ids)
        return NewRequest(request, sampling, stop, features, pixels)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def check_sampling(self, sampling: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: the logprob counts against the
        engine's limit, stop strings against the tokenizer, the stop tokens banned
        before `min_tokens` against a row's room. `n` must be 1 (the engine fans out)."""
        limit = min(MAX_LOGPROBS, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(sampling, name)
            if count is not None and (count == -1 and self.vocab_size > limit or count > limit):
                raise ValueError(
                    f"SamplingParams.{name}={count}: the engine returns at most {limit} "
                    "logprobs per position (vLLM's default max_logprobs)"
                )
        if sampling.stop and self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.stop={sampling.stop!r} needs text: the engine has no tokenizer"
            )
        if len(self.min_tokens_stops(sampling)) > MAX_MIN_TOKENS_STOPS:
            raise ValueError(
                f"SamplingParams.min_tokens={sampling.min_tokens} bans "
                f"{len(self.min_tokens_stops(sampling))} stop tokens; at most "
                f"{MAX_MIN_TOKENS_STOPS} are supported"
            )
        if sampling.n != 1:
            raise ValueError(f"SamplingParams.n={sampling.n}: a request samples once here")

    def min_tokens_stops(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The tokens a request may not sample before `min_tokens` outputs: its stop
        token ids and the EOS ids (vLLM's `all_stop_token_ids`, EOS even with
        `ignore_eos`)."""
        if not sampling.min_tokens:
            return ()
        eos = () if sampling.eos_token_id is None else (sampling.eos_token_id,)
        return tuple(dict.fromkeys((*sampling.stop_token_ids, *self.eos_token_ids, *eos)))

    def admit(self, new: NewRequest, rank: int) -> None:
        """Hand `new` to data rank `rank`'s scheduler (which checks it before changing
        anything) and hold its host state until it finishes."""
        request = new.request
        self.schedulers[rank].add_request(request, new.stop_token_ids)
        request_id, sampling = request.request_id, new.sampling
        self.rank_of[request_id] = rank
        self.sampling[request_id] = self.row_sampling(sampling, request_id)
        self.streams[request_id] = OutputStream.for_params(sampling, request.cache_salt)
        for feature, image in zip(new.features, new.pixels, strict=True):
            self.images.setdefault(feature.identifier, image)
            self.image_refs[feature.identifier] = self.image_refs.get(feature.identifier, 0) + 1

    def token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: text through the tokenizer, or a non-empty sequence of
        ids in the vocabulary. Bytes are refused as vLLM refuses them: they iterate as
        ints, so would silently be served as token ids."""
        if isinstance(prompt, BYTES_TYPES):
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

    def image_features(
        self, request_id: str, ids: list[int], images: Sequence[np.ndarray]
    ) -> tuple[list[int], list[MultiModalFeatureSpec], list[np.ndarray]]:
        """Expand each image token into the image's placeholder tokens."""
        if self.image_inputs is None:
            raise ValueError(f"request {request_id!r} has images but the model takes text only")
        image_token_id = self.image_inputs.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token_id]
        if len(positions) != len(images):
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(positions)} image tokens "
                f"(id {image_token_id}) but {len(images)} images were given"
            )
        want, n = self.image_inputs.pixel_shape, self.image_inputs.num_image_tokens
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

    def row_sampling(self, sampling: SamplingParams, request_id: str) -> RowSampling:
        """The request's sampling row as the step's int32/float32 buffer holds it: the seed
        folded (`fold_seed`), top-k disabled (0) for `-1` or any k covering the vocabulary."""
        seed = sampling.seed
        if seed is None:
            seed = zlib.crc32(f"{self.seed}/{request_id}".encode()) & 0x7FFFFFFF
        top_k = int(sampling.top_k)
        if top_k < 0 or top_k >= self.vocab_size:
            top_k = 0
        return RowSampling(
            float(sampling.temperature), top_k, float(sampling.top_p), fold_seed(seed),
            min_p=sampling.min_p, presence=sampling.presence_penalty,
            frequency=sampling.frequency_penalty, repetition=sampling.repetition_penalty,
            min_tokens=sampling.min_tokens, stop_ids=self.min_tokens_stops(sampling),
            logprobs=sampling.logprobs is not None,
            prompt_logprobs=sampling.prompt_logprobs is not None,
        )  # fmt: skip

    def record_logprobs(
        self, out: SchedulerOutput, update: TokenUpdates, host: HostLogprobs, rank: int
    ) -> None:
        """Add the logprobs a step computed to data rank `rank`'s requests' streams: of
        each token `update` appended, and of the prompt tokens each prompt-logprobs
        request's chunk predicted (a position recomputed after preemption is not added
        twice). Rows are rank-major: each rank has an equal share of each array."""
        decode, num_ranks = self._decode_one, len(self.schedulers)
        if host.sampled is not None:
            first = rank * (host.sampled[0].shape[0] // num_ranks)
            rows = {s.request.request_id: i for i, s in enumerate(out.scheduled)}
            for request in update.requests:
                stream = self.streams.get(request.request_id)
                if stream is not None and stream.logprobs is not None:
                    token = request.output_token_ids[-1]
                    row = first + rows[request.request_id]
                    entry = host.position(False, row, token, stream.num_logprobs, decode)
                    stream.add_logprobs(entry, token)
        if host.prompt is None:
            return
        row = rank * (host.prompt[0].shape[0] // num_ranks)
        for s in out.scheduled:
            stream = self.streams.get(s.request.request_id)
            if stream is not None and stream.prompt_logprobs is not None:
                prompt, done = s.request.prompt_token_ids, stream.prompt_logprobs
                for position in range(
                    s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
                ):
                    if position + 1 == len(done) < len(prompt):  # predicts prompt[position + 1]
                        token = prompt[position + 1]
                        num = stream.num_prompt_logprobs
                        done.append(
                            host.position(
                                True, row + position - s.num_computed_tokens, token, num, decode
                            )
                        )
            row += s.num_new_tokens

    def _decode_one(self, token: int) -> str | None:
        """One token's text for a `Logprob` (None without a tokenizer or when it fails)."""
        if self.tokenizer is None:
            return None
        try:
            return self.tokenizer.decode([token])
        except Exception:
            return None

    # -- outputs and finishing ----------------------------------------------------------

    def output(self, request: Request, reason: FinishReason | None) -> RequestOutput | None:
        """The output of a request given a token this step (`reason`: it stopped with
        it; it is forgotten); None for a `FINAL_ONLY` request that is not finished. Its
        first token records its admission in the stats."""
        stream = self.streams[request.request_id]
        if request.num_output_tokens == 1:
            self.stats.record_admission(
                stream.cache_salt,
                request.num_prompt_tokens,
                request.num_cached_tokens,
                request.num_external_cached_tokens,
            )
        if reason is None and stream.stop and self.tokenizer is not None:
            if stream.match_stop(request.output_token_ids, self.tokenizer) is not None:
                reason = FinishReason.STOP  # finished here: a token in flight is dropped
                self.schedulers[self.rank_of[request.request_id]].finish_request(
                    request.request_id, reason
                )
        elif reason is FinishReason.STOP and request.output_token_ids[-1] in stream.stop_token_ids:
            stream.stop_reason = request.output_token_ids[-1]  # vLLM's: not for EOS
        if reason is None and stream.final_only:
            return None
        output = stream.output(request, 1, None if reason is None else str(reason), self.tokenizer)
        if reason is not None:
            self.forget(request)
        return output

    def fail(self, request_id: str, error: str) -> None:
        """Finish one request with `finish_reason="error"`; the others go on."""
        rank = self.rank_of[request_id]
        request = self.schedulers[rank].finish_request(request_id, FinishReason.ERROR)
        self.finish_now(request, FinishReason.ERROR, error)

    def finish_now(self, request: Request, reason: FinishReason, error: str | None = None):
        """Queue the final output of a request finished outside a step's token update."""
        stream = self.streams[request.request_id]
        self.final_outputs.append(stream.output(request, 0, str(reason), self.tokenizer))
        if error is not None:
            self.final_outputs[-1].error = error
        self.forget(request)

    def take_final_outputs(self) -> list[RequestOutput]:
        """The queued final outputs, oldest first; the queue is emptied."""
        outputs, self.final_outputs = self.final_outputs, []
        return outputs

    def forget(self, request: Request) -> None:
        """Drop a finished request's host state (and its images no other request uses)."""
        self.sampling.pop(request.request_id, None)
        self.rank_of.pop(request.request_id, None)
        self.streams.pop(request.request_id, None)
        for feature in request.mm_features:
            refs = self.image_refs[feature.identifier] - 1
            if refs:
                self.image_refs[feature.identifier] = refs
            else:
                del self.image_refs[feature.identifier]
                del self.images[feature.identifier]
