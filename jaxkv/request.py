"""The host-side view of one request: its tokens, multimodal items and cache keys.

A `Request` keeps `block_hashes` current: every time tokens are appended, the
optional block hasher is asked for the hashes of the blocks that just became
full. Hashes already computed are never recomputed.
"""

from __future__ import annotations

import array
import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jaxkv._checks import TOKEN_ID_LIMIT, check_bool, check_int, check_str, check_token_ids
from jaxkv.hashing import BlockHash


class BlockHasher(Protocol):
    """What a request needs of its block hasher (`get_request_block_hasher` makes one:
    `jaxkv.request_hashing.RequestBlockHasher`).

    Called with the request once a block has filled, it returns the hashes of every
    full block after the ones in `request.block_hashes`, each `block_size` tokens, the
    chain starting from `none_hash` (both fixed when the hasher is made).
    """

    block_size: int
    none_hash: BlockHash

    def __call__(self, request: Request) -> list[BlockHash]: ...


def _is_block_hasher(obj: object) -> bool:
    """Whether `obj` has what `BlockHasher` names (checked field by field: a runtime
    protocol check costs more than building the rest of a request)."""
    return (
        callable(obj)
        and isinstance(getattr(obj, "block_size", None), int)
        and hasattr(obj, "none_hash")
    )


class RequestStatus(enum.IntEnum):
    """Where a request is. `WAITING_FOR_REMOTE_KVS` (vLLM's name): admitted, its blocks
    allocated, waiting for its KV to be loaded from the host tier before it computes.
    (Added last: the other values keep their numbers.)"""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_REMOTE_KVS = 4


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: the name and path enter the block hashes, the int id the KV events."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class PlaceholderRange:
    """Where a multimodal item sits in the prompt: `[offset, offset + length)` (vLLM's).

    `is_embed`, when given, marks which of those positions receive an encoder
    embedding (the rest are text or break tokens).
    """

    offset: int
    length: int
    is_embed: np.ndarray | None = None


@dataclass
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    `identifier` is the item's content hash (the `mm_hash`); the item occupies
    prompt positions `[offset, offset + length)`. `is_embed`, when given, marks
    which of those positions receive an encoder embedding (the rest are text or
    break tokens); the item's encoder-cache cost is the number of such positions.
    vLLM's form, `MultiModalFeatureSpec(data=..., modality=..., identifier=...,
    mm_position=PlaceholderRange(...))`, is accepted by keyword; `mm_position`
    is always available.
    """

    identifier: str
    offset: int | None = None
    length: int | None = None
    is_embed: np.ndarray | None = None
    modality: str = "image"
    mm_position: PlaceholderRange | None = None
    data: Any = None
    mm_hash: str | None = None

    def __post_init__(self) -> None:
        check_str("identifier", self.identifier)
        position = self.mm_position
        if position is not None:
            if self.offset is not None or self.length is not None or self.is_embed is not None:
                raise ValueError(
                    f"multimodal item {self.identifier!r}: give mm_position or "
                    "offset/length/is_embed, not both"
                )
            self.offset, self.length, self.is_embed = (
                position.offset,
                position.length,
                position.is_embed,
            )
        if self.offset is None or self.length is None:
            raise TypeError(
                f"multimodal item {self.identifier!r}: offset and length (or mm_position) "
                "are required"
            )
        self.offset = check_int("offset", self.offset)
        self.length = check_int("length", self.length)
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"multimodal item {self.identifier!r}: offset must be >= 0 and length > 0, "
                f"got offset={self.offset}, length={self.length}"
            )
        if self.is_embed is not None:
            is_embed = np.asarray(self.is_embed)
            if is_embed.dtype != np.bool_ or is_embed.shape != (self.length,):
                raise ValueError(
                    f"multimodal item {self.identifier!r}: is_embed must be a bool mask of "
                    f"shape ({self.length},), got {is_embed.dtype} {is_embed.shape}"
                )
            self.is_embed = is_embed
        self.mm_position = PlaceholderRange(self.offset, self.length, self.is_embed)

    @property
    def num_embeds(self) -> int:
        if self.is_embed is None:
            return self.length  # type: ignore[return-value]
        return int(self.is_embed.sum())


def _offset(feature: MultiModalFeatureSpec) -> int:
    return feature.offset  # type: ignore[return-value]


class AllTokenIds(Sequence[int]):
    """Read-only view of a request's prompt followed by its output tokens.

    Nothing is copied: the view reads the prompt and output lists it was given,
    so it stays current as tokens are appended (like vLLM's `ConstantList` over
    its token list, without keeping a second copy of the prompt).
    """

    __slots__ = ("_num_prompt", "_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt = prompt
        self._output = output
        self._num_prompt = len(prompt)

    def __len__(self) -> int:
        return self._num_prompt + len(self._output)

    def __getitem__(self, index):  # type: ignore[override]
        num_prompt = self._num_prompt
        if type(index) is slice:
            start, stop, step = index.indices(num_prompt + len(self._output))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= num_prompt:
                return self._prompt[start:stop]
            if start >= num_prompt:
                return self._output[start - num_prompt : stop - num_prompt]
            return self._prompt[start:] + self._output[: stop - num_prompt]
        num_tokens = num_prompt + len(self._output)
        if index < 0:
            index += num_tokens
        if 0 <= index < num_prompt:
            return self._prompt[index]
        if num_prompt <= index < num_tokens:
            return self._output[index - num_prompt]
        raise IndexError(f"token index {index} out of range for {num_tokens} tokens")

    def span(self, start: int, stop: int) -> list[int]:
        """`self[start:stop]` for `0 <= start <= stop <= len(self)`, as a list (a cached
        block's tokens, for its `BlockStored` event)."""
        num_prompt = self._num_prompt
        if start >= num_prompt:
            return self._output[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self._prompt[start:stop]
        return self._prompt[start:] + self._output[: stop - num_prompt]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._prompt, self._output)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"AllTokenIds({list(self)!r})"


def _max_tokens(max_tokens: Any, sampling_params: Any, pooling_params: Any) -> int:
    """`max_tokens` as given, else from the params (1 for pooling, 16 without params)."""
    if max_tokens is None:
        if pooling_params is not None:
            max_tokens = 1
        elif sampling_params is not None:
            max_tokens = sampling_params.max_tokens
        else:
            max_tokens = 16
    if type(max_tokens) is not int or max_tokens < 0:
        max_tokens = check_int("max_tokens", max_tokens, min_value=0)
    return max_tokens


def _skip_reading_prefix_cache(skip: Any, sampling_params: Any, pooling_params: Any) -> bool:
    """`skip_reading_prefix_cache` as given, else the first params' that set it, else False."""
    if skip is None:
        for params in (sampling_params, pooling_params):
            if params is not None and skip is None:
                skip = getattr(params, "skip_reading_prefix_cache", None)
    return skip is not None and check_bool("skip_reading_prefix_cache", skip)


def _checked_mm_features(
    request_id: str, mm_features: Sequence[MultiModalFeatureSpec] | None, num_prompt_tokens: int
) -> list[MultiModalFeatureSpec]:
    """The multimodal items as a list sorted by offset, each checked to lie in the prompt."""
    features = [] if not mm_features else list(mm_features)
    for feature in features:
        if not isinstance(feature, MultiModalFeatureSpec):
            raise TypeError(
                f"request {request_id!r}: mm_features must hold MultiModalFeatureSpec "
                f"items, got {feature!r}"
            )
        if feature.offset + feature.length > num_prompt_tokens:
            raise ValueError(
                f"request {request_id!r}: multimodal item {feature.identifier!r} "
                f"spans [{feature.offset}, {feature.offset + feature.length}) but the "
                f"prompt has {num_prompt_tokens} tokens"
            )
    return sorted(features, key=_offset) if features else features


class Request:
    """A request as the cache managers see it.

    Invariants: `all_token_ids` is the prompt then the output tokens;
    `num_tokens == len(all_token_ids)` and `num_output_tokens ==
    len(output_token_ids)`, counters kept by `append_output_token_ids` (the only
    way outputs grow); every token id is an int in [0, 2**63);
    `block_hashes[i]` is the hash of full block `i` of
    `hash_block_size` tokens (when a block hasher is set), chained from the
    hasher's `none_hash`; `0 <= num_computed_tokens <= num_tokens`.

    The first four positions are vLLM's (`request_id, prompt_token_ids,
    sampling_params, pooling_params`), the rest keyword-only; vLLM's full
    positional shape, with the arguments jaxkv has no use for, is
    `jaxkv.compat.vllm.Request`. A prompt
    given only as `prompt_embeds` (`prompt_token_ids=None`) gets token id 0 at every
    position, as in vLLM (its blocks are told apart by the embeddings' digests).
    `max_tokens` and `skip_reading_prefix_cache` come from `sampling_params`
    (or `pooling_params`) unless given as keywords.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling_params: Any = None,
        pooling_params: Any = None,
        *,
        arrival_time: float | None = None,
        prompt_embeds: np.ndarray | None = None,
        mm_features: Sequence[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        block_hasher: BlockHasher | None = None,
        max_tokens: int | None = None,
        skip_reading_prefix_cache: bool | None = None,
        weight_version: int | str | None = None,
    ) -> None:
        if type(request_id) is not str:
            check_str("request_id", request_id)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.priority = priority
        self.arrival_time = 0.0 if arrival_time is None else arrival_time
        self.max_tokens = _max_tokens(max_tokens, sampling_params, pooling_params)
        self.skip_reading_prefix_cache = _skip_reading_prefix_cache(
            skip_reading_prefix_cache, sampling_params, pooling_params
        )
        self._set_prompt(request_id, prompt_token_ids, prompt_embeds)
        self.mm_features = _checked_mm_features(request_id, mm_features, self.num_prompt_tokens)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {lora_request!r}")
        self.lora_request = lora_request
        if cache_salt is not None and type(cache_salt) is not str:
            check_str("cache_salt", cache_salt, allow_none=True)
        # Normalised here, once: "" means no salt, as in vLLM; later stages (the engine's
        # streams, the block hashes) take `cache_salt` as it is.
        self.cache_salt = cache_salt or None
        if block_hasher is not None and not _is_block_hasher(block_hasher):
            raise TypeError(
                "block_hasher must come from get_request_block_hasher (it declares the block "
                f"size and NONE_HASH the hashes chain from), got {block_hasher!r}"
            )
        self.block_hasher = block_hasher
        self.output_token_ids: list[int] = []
        self.all_token_ids = AllTokenIds(self.prompt_token_ids, self.output_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prompt tokens served from a cache at its first admission (the prefix cache or a
        # KV connector such as the host tier), -1 until then; of them, the connector's.
        self.num_cached_tokens = -1
        self.num_external_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        # Prompt-embedding digests per (start, end) block range, computed once.
        self.prompt_embeds_digests: dict[tuple[int, int], bytes] = {}
        self.num_tokens = self.num_prompt_tokens
        # Kept beside `num_tokens` (an attribute, not a property: schedulers read it for
        # every running request every step).
        self.num_output_tokens = 0
        # Tokens per hashed block (None without a hasher), and the token count at which
        # the next block is full.
        self.hash_block_size: int | None = block_hasher.block_size if block_hasher else None
        self._next_hash_at = self.hash_block_size or 1 << 62
        # The weights its blocks are keyed under (jaxkv's; None: the engine's initial
        # weights, no key, so hashes and events stay vLLM's).
        self.weight_version = weight_version
        self._update_block_hashes()

    def set_weight_version(self, weight_version: int | str | None) -> None:
        """Key the request's blocks under `weight_version` (its hashes are recomputed):
        a request that will compute its KV under new weights must not hit blocks
        computed under older ones."""
        self.weight_version = weight_version
        self.block_hashes = []
        self._next_hash_at = self.hash_block_size or 1 << 62
        self._update_block_hashes()

    def _set_prompt(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray | None,
        prompt_embeds: np.ndarray | None,
    ) -> None:
        """Sets `prompt_token_ids` (checked), its packed copy `_prompt_packed`,
        `num_prompt_tokens` and `prompt_embeds` (checked against the prompt's length)."""
        # A list is kept, not copied (as vLLM does): the request never mutates it. Its
        # ids are checked by packing them into the array the block hasher reads:
        # uint32 when they fit, else int64 (rejecting floats, strings, nested lists, and
        # ids outside [0, 2**63)).
        if type(prompt_token_ids) is not list:
            if prompt_token_ids is None and prompt_embeds is not None:
                # vLLM's embeddings-only prompt: one placeholder id 0 per embedding row.
                prompt_token_ids = [0] * len(prompt_embeds)
            prompt_token_ids = check_token_ids("prompt_token_ids", prompt_token_ids)
        try:
            self._prompt_packed = array.array("I", prompt_token_ids)
        except TypeError:
            check_token_ids("prompt_token_ids", prompt_token_ids)  # raises, naming the id
            raise
        except OverflowError:
            check_token_ids("prompt_token_ids", prompt_token_ids)  # raises if out of range
            self._prompt_packed = array.array("q", prompt_token_ids)
        self.prompt_token_ids: list[int] = prompt_token_ids
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.num_prompt_tokens == 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if prompt_embeds is not None:
            prompt_embeds = np.asarray(prompt_embeds)
            if prompt_embeds.ndim != 2 or len(prompt_embeds) != self.num_prompt_tokens:
                raise ValueError(
                    f"request {request_id!r}: prompt_embeds must have shape "
                    f"({self.num_prompt_tokens}, hidden), got {prompt_embeds.shape}"
                )
        self.prompt_embeds = prompt_embeds

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"status={self.status.name})"
        )

    @property
    def prompt_token_array(self) -> np.ndarray:
        """The prompt's ids as a read-only numpy array (uint32 when they fit, else int64)."""
        packed = self._prompt_packed
        return np.frombuffer(packed, dtype=np.uint32 if packed.typecode == "I" else np.int64)

    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append one token id or a sequence of them; a bad id raises before anything changes."""
        # One plain int in range is taken as is; anything else is checked (and converted).
        if type(token_ids) is int and 0 <= token_ids < TOKEN_ID_LIMIT:
            self.output_token_ids.append(token_ids)
            self.num_tokens += 1
            self.num_output_tokens += 1
        else:
            token_ids = self._check_appended(token_ids)
            self.output_token_ids.extend(token_ids)
            self.num_tokens += len(token_ids)
            self.num_output_tokens += len(token_ids)
        if self.num_tokens >= self._next_hash_at:
            self._update_block_hashes()

    def _check_appended(self, token_ids: object) -> list[int]:
        """`append_output_token_ids`'s argument as a checked list of ids (numpy ints become
        ints); TypeError/ValueError naming the request otherwise."""
        if isinstance(token_ids, (int, np.integer)) and not isinstance(token_ids, (bool, np.bool_)):
            token_ids = [int(token_ids)]
        elif isinstance(token_ids, (bool, np.bool_)):
            raise TypeError(
                f"request {self.request_id!r}: token_ids must be integers, got {token_ids!r}"
            )
        try:
            return check_token_ids("token_ids", token_ids)
        except (TypeError, ValueError) as error:
            raise type(error)(f"request {self.request_id!r}: {error}") from None

    def get_num_encoder_embeds(self, input_id: int) -> int:
        if type(input_id) is not int:
            input_id = check_int("input_id", input_id)
        if not 0 <= input_id < len(self.mm_features):
            raise ValueError(
                f"request {self.request_id!r} has {len(self.mm_features)} multimodal "
                f"inputs; input_id {input_id} is out of range"
            )
        return self.mm_features[input_id].num_embeds

    def _update_block_hashes(self) -> None:
        # The hasher is only called once a block has filled.
        if self.num_tokens >= self._next_hash_at:
            self.block_hashes.extend(self.block_hasher(self))  # type: ignore[misc]
            self._next_hash_at = (len(self.block_hashes) + 1) * self.hash_block_size  # type: ignore[operator]
