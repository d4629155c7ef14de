"""The host-side view of one request: its tokens, multimodal items and cache keys.

A `Request` keeps `block_hashes` current: every time tokens are appended, the
optional block hasher is asked for the hashes of the blocks that just became
full. Hashes already computed are never recomputed.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: the name and path enter the block hashes, the int id the KV events."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    `identifier` is the item's content hash (the `mm_hash`); the item occupies
    prompt positions `[offset, offset + length)`. `is_embed`, when given, marks
    which of those positions receive an encoder embedding (the rest are text or
    break tokens); the item's encoder-cache cost is the number of such positions.
    """

    identifier: str
    offset: int
    length: int
    is_embed: np.ndarray | None = None
    modality: str = "image"

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"multimodal item {self.identifier!r}: offset must be >= 0 and length > 0, "
                f"got offset={self.offset}, length={self.length}"
            )
        if self.is_embed is not None:
            self.is_embed = np.asarray(self.is_embed, dtype=bool)
            if self.is_embed.shape != (self.length,):
                raise ValueError(
                    f"multimodal item {self.identifier!r}: is_embed must have shape "
                    f"({self.length},), got {self.is_embed.shape}"
                )

    @property
    def num_embeds(self) -> int:
        if self.is_embed is None:
            return self.length
        return int(self.is_embed.sum())


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
        if index < 0:
            index += len(self)
        if 0 <= index < num_prompt:
            return self._prompt[index]
        if num_prompt <= index < len(self):
            return self._output[index - num_prompt]
        raise IndexError(f"token index {index} out of range for {len(self)} tokens")

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._prompt, self._output)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"AllTokenIds({list(self)!r})"


BlockHasher = Callable[["Request"], list[bytes]]


@dataclass
class Request:
    """A request as the cache managers see it.

    Invariants: `all_token_ids` is the prompt then the output tokens;
    `num_tokens == len(all_token_ids)`, a counter kept by
    `append_output_token_ids` (the only way outputs grow);
    `block_hashes[i]` is the hash of full block `i` (when a block hasher is set);
    `0 <= num_computed_tokens <= num_tokens`.
    """

    request_id: str
    prompt_token_ids: Sequence[int] | np.ndarray
    max_tokens: int = 16
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    prompt_embeds: np.ndarray | None = None
    block_hasher: BlockHasher | None = None
    skip_reading_prefix_cache: bool = False
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        prompt = self.prompt_token_ids
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        # A list is kept, not copied (as vLLM does): the request never mutates it.
        self.prompt_token_ids = prompt if type(prompt) is list else list(prompt)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.num_prompt_tokens == 0:
            raise ValueError(f"request {self.request_id!r}: the prompt must not be empty")
        if self.prompt_embeds is not None:
            self.prompt_embeds = np.asarray(self.prompt_embeds)
            if self.prompt_embeds.ndim != 2 or len(self.prompt_embeds) != self.num_prompt_tokens:
                raise ValueError(
                    f"request {self.request_id!r}: prompt_embeds must have shape "
                    f"({self.num_prompt_tokens}, hidden), got {self.prompt_embeds.shape}"
                )
        for feature in self.mm_features:
            if feature.offset + feature.length > self.num_prompt_tokens:
                raise ValueError(
                    f"request {self.request_id!r}: multimodal item {feature.identifier!r} "
                    f"spans [{feature.offset}, {feature.offset + feature.length}) but the "
                    f"prompt has {self.num_prompt_tokens} tokens"
                )
        self.mm_features = sorted(self.mm_features, key=lambda f: f.offset)
        self.output_token_ids: list[int] = []
        self.all_token_ids = AllTokenIds(self.prompt_token_ids, self.output_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        # Prompt-embedding digests per (start, end) block range, computed once.
        self.prompt_embeds_digests: dict[tuple[int, int], bytes] = {}
        self.num_tokens = self.num_prompt_tokens
        # Tokens per hashed block ("never" without a hasher), and the token count at
        # which the next block is full.
        self._hash_block_size = (
            getattr(self.block_hasher, "block_size", 1) if self.block_hasher else 1 << 62
        )
        self._next_hash_at = self._hash_block_size
        self._update_block_hashes()

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def lora_int_id(self) -> int | None:
        return self.lora_request.lora_int_id if self.lora_request is not None else None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if type(token_ids) is not int and isinstance(token_ids, (int, np.integer)):
            token_ids = int(token_ids)  # numpy integers stored as plain ints
        if type(token_ids) is int:
            self.output_token_ids.append(token_ids)
            self.num_tokens += 1
        else:
            try:
                token_ids = [operator.index(t) for t in token_ids]
            except TypeError:
                raise ValueError(
                    f"request {self.request_id!r}: output token ids must be integers (one, "
                    f"or a sequence of them), got {token_ids!r}"
                ) from None
            self.output_token_ids.extend(token_ids)
            self.num_tokens += len(token_ids)
        if self.num_tokens >= self._next_hash_at:
            self._update_block_hashes()

    def get_num_encoder_embeds(self, input_id: int) -> int:
        if not 0 <= input_id < len(self.mm_features):
            raise ValueError(
                f"request {self.request_id!r} has {len(self.mm_features)} multimodal "
                f"inputs; input id {input_id} is out of range"
            )
        return self.mm_features[input_id].num_embeds

    def _update_block_hashes(self) -> None:
        # A hasher that states its block size is only called once a block has filled.
        if self.num_tokens >= self._next_hash_at:
            self.block_hashes.extend(self.block_hasher(self))  # type: ignore[misc]
            self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size
