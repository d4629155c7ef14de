"""What one scheduler step says: its limits (`SchedulerConfig`), its plan
(`SchedulerOutput`, a `ScheduledRequest` per request), what applying its sampled tokens
did (`TokenUpdates`), and why a request finished (`FinishReason`).

Data only (host, no JAX): the model runner, the engine and the recordings read these
without the scheduling policy (`jaxkv.engine.scheduler`, which re-exports them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxkv.kv_cache_utils import KVCacheBlockCopy

if TYPE_CHECKING:
    from jaxkv.request import Request


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached, or max_model_len
    STOP = "stop"  # an EOS or stop token id
    ABORT = "abort"
    ERROR = "error"  # preparing or applying the request's part of a step failed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step: requests, tokens, and a request's tokens per chunk (0: no cap);
    `num_lookahead_tokens` extra slots reserved per scheduled request (speculative tokens)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        for name in ("long_prefill_token_threshold", "num_lookahead_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 0, got {value!r}")


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: positions `[num_computed_tokens, +num_new_tokens)`.

    Positions `>= num_known_tokens` hold tokens sampled by the previous step, still on the
    device. `samples`: the step's last token of this request yields a sampled token.
    `encoder_input_ids`: inputs whose encoder output must be computed before the step.
    `new_block_ids`: per KV-cache group, the block ids this step's allocation added, to
    append to the request's row; `num_null_blocks`: per group, how many leading blocks of
    the row are now the null block (they left an attention window), applied after the
    append. With `resets_row` (a new or resumed request) `new_block_ids` is the whole
    row. Either way the row then equals the manager's `get_block_ids`. Each is `()` when
    it changes nothing (always, with `with_block_ids=False`).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    num_known_tokens: int
    samples: bool
    encoder_input_ids: tuple[int, ...] = ()
    new_block_ids: tuple[list[int], ...] = ()
    num_null_blocks: tuple[int, ...] = ()
    resets_row: bool = False


@dataclass
class SchedulerOutput:
    """Everything the device step needs from the host, plus what happened while planning."""

    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]
    freed_block_ids: np.ndarray  # pages that became garbage since the last step
    freed_mm_hashes: list[str]  # encoder-cache entries evicted since the last step
    num_encoder_hits: int = 0
    num_encoder_misses: int = 0
    # Page copies to run before the step (a partial prefix hit's copy-on-write).
    kv_cache_block_copies: list[KVCacheBlockCopy] = field(default_factory=list)
    # Requests finished (stopped, aborted, failed) since the previous `schedule()`.
    finished_request_ids: list[str] = field(default_factory=list)
    # Host-tier loads to run before the step (after zeroing and copies): blocks
    # `[n, m, *page_shape]` onto the layers `kv_load_layers` (`[n, m]`, `L`: padding) of
    # device blocks `kv_load_block_ids` (rank-local).
    kv_load_block_ids: list[int] = field(default_factory=list)
    kv_load_blocks: np.ndarray | None = None
    kv_load_layers: np.ndarray | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenUpdates:
    """What `update_from_output` did: the requests it appended a token to, in the step's
    order (each one's token is now the last of its `output_token_ids`), and the reason
    each of those that stopped with its token stopped."""

    requests: list[Request] = field(default_factory=list)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
