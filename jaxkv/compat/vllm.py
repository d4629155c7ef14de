"""vLLM's call shapes and private views, for code and tests written against vLLM.

The core (`jaxkv` and its modules) never imports this module. It holds what exists
only so that vLLM's own unit tests (`tools/vllm_core_yardstick.py`) and callers
written for vLLM's exact signatures work:

- `Request`: `jaxkv.request.Request` taking vLLM's full positional signature; the
  arguments jaxkv has no use for (`client_index`, `prompt_is_token_ids`,
  `trace_headers`, `resumable`, `session_id`, `reasoning_ended`,
  `reasoning_parser_kwargs`, `abort_immediately`, `kv_hints`) are accepted and
  ignored (`client_index` is kept as an attribute, as vLLM's scheduler reads it).
- `VLLMCacheView`: `BlockHashToBlockMap` in the shape of vLLM's private `_cache` dict;
  `install_private_views()` makes it readable as `BlockHashToBlockMap._cache`, as
  vLLM's tests read and edit it.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np

from jaxkv.block_pool import BlockHashToBlockMap
from jaxkv.blocks import KVCacheBlock
from jaxkv.hashing import BlockHashWithGroupId, get_block_hash, get_group_id
from jaxkv.request import BlockHasher, LoRARequest, MultiModalFeatureSpec
from jaxkv.request import Request as _Request

__all__ = ["Request", "VLLMCacheView", "install_private_views"]


class Request(_Request):
    """A `jaxkv.request.Request` built from vLLM's positional signature, in its order.

    Every argument means what it means in jaxkv's `Request`; the ones jaxkv has no
    use for are accepted and ignored (see the module docstring).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray | None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: np.ndarray | None = None,
        prompt_is_token_ids: Sequence[bool] | None = None,
        mm_features: Sequence[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Any = None,
        block_hasher: BlockHasher | None = None,
        resumable: bool = False,
        session_id: str | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
        abort_immediately: bool = False,
        kv_hints: Any = None,
        *,
        max_tokens: int | None = None,
        skip_reading_prefix_cache: bool | None = None,
    ) -> None:
        super().__init__(
            request_id,
            prompt_token_ids,  # type: ignore[arg-type]
            sampling_params,
            pooling_params,
            arrival_time=arrival_time,
            prompt_embeds=prompt_embeds,
            mm_features=mm_features,
            lora_request=lora_request,
            cache_salt=cache_salt,
            priority=priority,
            block_hasher=block_hasher,
            max_tokens=max_tokens,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        )
        self.client_index = client_index


class VLLMCacheView(MutableMapping):
    """`BlockHashToBlockMap` in the shape of vLLM's `_cache` dict (see `install_private_views`)."""

    def __init__(self, cache: BlockHashToBlockMap) -> None:
        self._map = cache

    def __getitem__(self, key: BlockHashWithGroupId) -> KVCacheBlock | dict[int, KVCacheBlock]:
        blocks = self._map.blocks_of(get_block_hash(key), get_group_id(key))
        if not blocks:
            raise KeyError(key)
        return blocks[0] if len(blocks) == 1 else {b.block_id: b for b in blocks}

    def __setitem__(
        self, key: BlockHashWithGroupId, value: KVCacheBlock | dict[int, KVCacheBlock]
    ) -> None:
        if key in self:
            del self[key]
        for block in value.values() if isinstance(value, dict) else (value,):
            self._map.insert(key, block)

    def __delitem__(self, key: BlockHashWithGroupId) -> None:
        block_hash, group_id = get_block_hash(key), get_group_id(key)
        blocks = self._map.blocks_of(block_hash, group_id)
        if not blocks:
            raise KeyError(key)
        for block in blocks:
            self._map.pop(block_hash, group_id, block.block_id)

    def __iter__(self) -> Iterator[BlockHashWithGroupId]:
        return (key for key, _ in list(self._map.items()))

    def __len__(self) -> int:
        return len(self._map)

    def __copy__(self) -> dict:
        return dict(self.items())

    def clear(self) -> None:
        self._map.clear()


def _cache_view(cache: BlockHashToBlockMap) -> VLLMCacheView:
    """vLLM's internal dict (combined key -> block, or {block_id: block} for several), as
    a live view."""
    return VLLMCacheView(cache)


def install_private_views() -> None:
    """Make `BlockHashToBlockMap._cache` a live `VLLMCacheView`, as vLLM's own tests read
    and edit it. For test harnesses only (idempotent); jaxkv itself never reads it."""
    BlockHashToBlockMap._cache = property(_cache_view)  # type: ignore[attr-defined]
