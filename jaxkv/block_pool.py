"""The block pool: every KV-cache page, the free queue and the prefix-cache map (SPEC §4).

The prefix-cache map itself (`BlockHashToBlockMap`) is `jaxkv.block_hash_map`, the
deferred `BlockStored` event `jaxkv.block_events`; both are still importable from here
(tests, `jaxkv.compat.vllm` and benchmarks/bench_kv_events.py use these names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from jaxkv._checks import (
    DEFAULT_TENANT_QUOTA_KEY,
    check_bool,
    check_int,
    check_num_blocks,
    check_tenant_quota_key,
)
from jaxkv.block_events import _NO_SPEC, DeferredBlockStored
from jaxkv.block_hash_map import BlockHashToBlockMap
from jaxkv.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    make_block_hash_with_group_id,
)
from jaxkv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DeferredKVCacheEvent,
    KVCacheEvent,
    build_events,
    to_event_extra_keys,
)
from jaxkv.request_hashing import generate_block_hash_extra_keys

if TYPE_CHECKING:
    from jaxkv.request import Request


def check_tenant_block_quotas(
    quotas: Mapping[str, int] | None, name: str = "tenant_block_quotas"
) -> dict[str, int] | None:
    """`quotas` (cache_salt -> most cached blocks, each an int >= 0) as a dict, or None;
    TypeError/ValueError naming `name` and the entry otherwise."""
    if quotas is None:
        return None
    if not isinstance(quotas, Mapping):
        raise TypeError(
            f"{name} must map cache_salt (str) to a block count, or be None; got {quotas!r}"
        )
    checked = {}
    for salt, cap in quotas.items():
        check_tenant_quota_key(name, salt)
        checked[salt] = check_int(f"{name}[{salt!r}]", cap, min_value=0)
    return checked


class BlockPool:
    """All KV-cache pages of one pool.

    Invariants: block 0 is the null block (never handed out, cached or freed);
    every other block is either in the free queue (`ref_cnt == 0`) or held
    (`ref_cnt > 0`), never both; a block is in the hash map iff it has a hash
    key, and a cached block stays findable while free until it is popped for
    reuse.

    `tenant_block_quotas` (None: off) caps the blocks each listed `cache_salt` may hold
    in the prefix cache (cached blocks, held or free). Caching a block of a salt at its
    cap first evicts that salt's least recently freed cached free block (a normal
    eviction: hash dropped, `BlockRemoved`); when all of its cached blocks are held, the
    block (and the rest of that caching call) stays uncached. A salt never holds more
    than its cap and never evicts another salt's blocks for it. With quotas given (even
    `{}`), every salted block is counted: `tenant_cached_blocks()`.

    `on_evict` (an attribute, None: off) is called with the cached free blocks about to
    be evicted for reuse, still keyed and holding their bytes (the host tier's store at
    eviction, `jaxkv.engine.offload`); other hash drops (`evict_blocks`, a reset, a
    partial entry replaced) are not reported.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
        metrics_collector: object = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = "GPU",
        *,
        track_freed_block_ids: bool = False,
        tenant_block_quotas: Mapping[str, int] | None = None,
    ) -> None:
        """vLLM's positional order; `metrics_collector` and `medium` are accepted and
        unused, `num_hash_lookahead_tokens` must be 0. Integer arguments may be numpy
        integers (stored as ints). `tenant_block_quotas`: see the class docstring."""
        num_gpu_blocks = check_num_blocks("num_gpu_blocks", num_gpu_blocks)
        check_bool("enable_caching", enable_caching)
        if hash_block_size is not None:
            hash_block_size = check_int("hash_block_size", hash_block_size, min_value=1)
        check_bool("enable_kv_cache_events", enable_kv_cache_events)
        if check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, min_value=0):
            raise ValueError(
                f"num_hash_lookahead_tokens={num_hash_lookahead_tokens} is not supported (0 only)"
            )
        check_bool("track_freed_block_ids", track_freed_block_ids)
        self.medium = medium
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent | DeferredKVCacheEvent] = []
        # (spec kind, sliding window) per KV cache group, stamped on this pool's
        # `BlockStored` events; set by the KV cache manager (empty: left None).
        self.event_group_specs: Sequence[tuple[str | None, int | None]] = ()
        self.track_freed_block_ids = track_freed_block_ids
        self._freed_block_ids: set[int] = set()
        # Grows whenever a block loses its hash: a manager's remembered lookup result is
        # still a set of cached blocks iff this has not changed since.
        self.num_hash_removals = 0
        # Blocks keyed by a partial entry (`cache_partial_block`): block id -> (the hash it
        # is stamped with, the prefix length it names). An entry is current only while the
        # block is still stamped with that very hash object (eviction leaves it stale).
        self._partial_entries: dict[int, tuple[BlockHash, int]] = {}
        # A block's further keys beside the one it is stamped with (vLLM keeps a set per
        # block): block id -> [(block hash, group id)], partial entries registered on a
        # block that already had a longer key. Dropped with the block's own key.
        self._secondary_keys: dict[int, list[tuple[BlockHash, int]]] = {}
        # Per-tenant caps (`tenant_block_quotas`; None: off, nothing below is touched).
        self._tenant_caps: dict[str, int] | None = None
        self._default_tenant_cap: int | None = None  # the caps' DEFAULT_TENANT_QUOTA_KEY
        self._tenant_of: dict[int, str] = {}  # block id -> salt, for cached salted blocks
        self._tenant_cached: dict[str, int] = {}  # salt -> its cached blocks
        # salt -> its cached free blocks, in free-queue order (least recently freed first)
        self._tenant_free: dict[str, dict[int, KVCacheBlock]] = {}
        # Told of cached free blocks about to lose their hash to be reused (`get_new_blocks`,
        # a tenant cap's victims), still keyed, their bytes intact: a lower tier may copy
        # them before anything writes there (None: nobody listens, nothing is done).
        self.on_evict: Callable[[Sequence[KVCacheBlock]], None] | None = None
        if tenant_block_quotas is not None:
            self.set_tenant_block_quotas(tenant_block_quotas)

    # -- per-tenant caps -----------------------------------------------------

    def set_tenant_block_quotas(
        self, quotas: Mapping[str, int] | None, name: str = "tenant_block_quotas"
    ) -> None:
        """Cap each salt's cached blocks (see the class docstring); None: off. Only while
        nothing is cached. Bad input: TypeError/ValueError naming `name`, nothing changed."""
        quotas = check_tenant_block_quotas(quotas, name)
        if any(block._block_hash is not None for block in self.blocks):
            raise ValueError(f"{name} can be set only while no block is cached")
        self._tenant_caps = quotas
        self._default_tenant_cap = None if quotas is None else quotas.get(DEFAULT_TENANT_QUOTA_KEY)
        self._tenant_of.clear()
        self._tenant_cached.clear()
        self._tenant_free.clear()

    @property
    def tenant_block_quotas(self) -> dict[str, int] | None:
        return None if self._tenant_caps is None else dict(self._tenant_caps)

    def tenant_block_quota(self, salt: str) -> int | None:
        """The cap on `salt`'s cached blocks: its own, else the default key's (None: none)."""
        if self._tenant_caps is None:
            return None
        return self._tenant_caps.get(salt, self._default_tenant_cap)

    def tenant_cached_blocks(self) -> dict[str, int]:
        """Salt -> blocks it holds in the prefix cache (held or free); empty when
        `tenant_block_quotas` is None (nothing is counted then)."""
        return {salt: n for salt, n in self._tenant_cached.items() if n}

    def _admit_tenant_blocks(self, salt: str, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Count `blocks`, just stamped for `salt`, against its cap: its least recently
        freed cached free blocks are evicted to make room; the blocks past what fits are
        unstamped. Returns the blocks kept (a prefix of `blocks`)."""
        cap = self._tenant_caps.get(salt, self._default_tenant_cap)  # type: ignore[union-attr]
        count = self._tenant_cached.get(salt, 0)
        if cap is not None and count + len(blocks) > cap:
            free = self._tenant_free.get(salt)
            if free:
                victims = list(islice(free.values(), count + len(blocks) - cap))
                if self.on_evict is not None:
                    self.on_evict(victims)
                self._evict_cached_blocks(victims)
                for victim in victims:  # nothing left to lose: reused first
                    self.free_block_queue.remove(victim)
                self.free_block_queue.prepend_n(victims)
                count = self._tenant_cached[salt]
            room = max(cap - count, 0)
            if room < len(blocks):
                KVCacheBlock.reset_hashes(blocks[room:])
                blocks = blocks[:room]
        self._tenant_cached[salt] = count + len(blocks)
        tenant_of = self._tenant_of
        for block in blocks:
            tenant_of[block.block_id] = salt
            if block.ref_cnt == 0:  # cached while free (not the managers' way)
                self._tenant_free.setdefault(salt, {})[block.block_id] = block
        return blocks

    def _forget_tenant_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Blocks losing their hash leave their salt's counts."""
        tenant_of, tenant_free = self._tenant_of, self._tenant_free
        for block in blocks:
            salt = tenant_of.pop(block.block_id, None)
            if salt is None:
                continue
            self._tenant_cached[salt] -= 1
            free = tenant_free.get(salt)
            if free:
                free.pop(block.block_id, None)

    def _tenant_blocks_freed(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Blocks that reached `ref_cnt` 0, in the order they joined the queue's tail."""
        tenant_of, tenant_free = self._tenant_of, self._tenant_free
        for block in blocks:
            if block.ref_cnt:
                continue
            salt = tenant_of.get(block.block_id)
            if salt is not None:
                free = tenant_free.setdefault(salt, {})
                free.pop(block.block_id, None)  # a block freed twice over: its last place
                free[block.block_id] = block

    # -- lookups -------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        cached = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(block_hash, group_id)
            if block is None:
                return None
            cached.append(block)
        return cached

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """The cached block for vLLM's combined key (block hash + group id), or None."""
        if not isinstance(key, bytes) or len(key) <= 4:
            raise TypeError(
                f"key must be a block hash with group id (bytes from "
                f"make_block_hash_with_group_id), got {key!r}"
            )
        return self.cached_block_hash_to_block.get_one_block(key)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_gpu_blocks - 1)

    # -- allocation ----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their old hashes.

        `num_blocks` may be a numpy integer; a refusal (more than are free) changes nothing."""
        if type(num_blocks) is not int:
            num_blocks = check_int("num_blocks", num_blocks)
        if num_blocks > self.free_block_queue.num_free_blocks or num_blocks < 0:
            raise ValueError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} are free"
            )
        blocks, stamped = self.free_block_queue.popleft_n_for_holders(num_blocks)
        if stamped:
            if self.on_evict is not None:
                self.on_evict(stamped)
            self._evict_cached_blocks(stamped, were_free=True)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock] | Iterable[Sequence[KVCacheBlock]]) -> None:
        """Take a reference on cache hits; free ones leave the queue.

        `blocks` is vLLM's flat sequence of blocks, or one sequence per KV cache
        group (the form the managers use): the flat form is the one whose first element
        is a `KVCacheBlock`. Every block must be one of this pool's (checked first:
        TypeError/ValueError, nothing changed)."""
        items = list(blocks)
        if items and isinstance(items[0], KVCacheBlock):
            groups = [items]
        else:
            try:
                groups = [list(group_blocks) for group_blocks in items]
            except TypeError:
                raise TypeError(
                    "touch takes a sequence of KVCacheBlocks or one sequence of them per "
                    f"KV cache group, got {items!r}"
                ) from None
        for group_blocks in groups:
            for block in group_blocks:
                if not self.is_own_block(block):
                    raise ValueError(f"touch takes this pool's KVCacheBlocks, got {block!r}")
        self.touch_checked(groups)

    def is_own_block(self, block: object) -> bool:
        """Whether `block` is one of this pool's `KVCacheBlock`s (the very object)."""
        block_id = getattr(block, "block_id", None)
        return (
            type(block_id) is int
            and 0 <= block_id < len(self.blocks)
            and self.blocks[block_id] is block
        )

    def touch_checked(self, blocks: Iterable[Sequence[KVCacheBlock]]) -> None:
        """`touch` for blocks the caller has checked are this pool's (the manager's hits)."""
        if self._tenant_of:
            blocks = [list(group_blocks) for group_blocks in blocks]
            tenant_of, tenant_free = self._tenant_of, self._tenant_free
            for group_blocks in blocks:
                for block in group_blocks:
                    salt = tenant_of.get(block.block_id) if block.ref_cnt == 0 else None
                    if salt is not None:
                        tenant_free.get(salt, {}).pop(block.block_id, None)
        remove = self.free_block_queue.remove
        for group_blocks in blocks:
            for block in group_blocks:
                if block.is_null:
                    continue
                if block.ref_cnt == 0:
                    remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free.

        `ordered_blocks` is in eviction order (a request passes its blocks
        reversed, so its chain tail is evicted before its prefix). Unhashed
        blocks go to the head of the queue (nothing to lose), hashed ones to the
        tail.
        """
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        blocks = list(ordered_blocks)
        i = 0
        try:
            for i, block in enumerate(blocks):  # noqa: B007 (i names the refused block)
                if block.is_null:
                    continue
                if block.ref_cnt <= 0:
                    raise ValueError(f"block {block.block_id} is already free (ref_cnt 0)")
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    (unhashed if block._block_hash is None else hashed).append(block)
        except (AttributeError, ValueError) as error:
            for done in blocks[:i]:  # leave no state changed
                if not done.is_null:
                    done.ref_cnt += 1
            if isinstance(error, AttributeError):
                raise TypeError(f"free_blocks takes KVCacheBlock objects, got {block!r}") from None
            raise
        self._queue_freed(unhashed, hashed)

    def free_held_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """`free_blocks` for blocks the caller holds a reference on (a manager freeing its
        own table, null blocks skipped), without the checks that guard outside callers."""
        if self._tenant_of:
            ordered_blocks = list(ordered_blocks)
            unhashed = self.free_block_queue.release_held(ordered_blocks)
            self._tenant_blocks_freed(ordered_blocks)
        else:
            unhashed = self.free_block_queue.release_held(ordered_blocks)
        if unhashed and self.track_freed_block_ids:
            self._freed_block_ids.update(b.block_id for b in unhashed)

    def _queue_freed(self, unhashed: list[KVCacheBlock], hashed: list[KVCacheBlock]) -> None:
        """Queue blocks that reached `ref_cnt` 0: unhashed at the head, hashed at the tail."""
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
            if self.track_freed_block_ids:
                self._freed_block_ids.update(b.block_id for b in unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)
            if self._tenant_of:
                self._tenant_blocks_freed(hashed)

    # -- caching -------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Stamp `blocks[num_cached_blocks:num_full_blocks]` with their hash keys.

        `block_mask` (one entry per block in that range): blocks marked False are
        skipped like null blocks (a sliding-window group caches only the blocks
        that can end a hit). The integer arguments may be numpy integers.
        """
        if not (
            type(num_cached_blocks) is type(num_full_blocks) is int
            and 0 <= num_cached_blocks
            and 0 <= num_full_blocks <= len(blocks)
        ):
            num_cached_blocks = check_int("num_cached_blocks", num_cached_blocks, min_value=0)
            num_full_blocks = check_int(
                "num_full_blocks", num_full_blocks, min_value=0, max_value=len(blocks)
            )
        if type(block_size) is not int or type(kv_cache_group_id) is not int:
            block_size = check_int("block_size", block_size)
            kv_cache_group_id = check_int("kv_cache_group_id", kv_cache_group_id)
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = (
            request.block_hashes  # the common case, without a call
            if block_size == self.hash_block_size
            else self._block_hashes_at(request, block_size)
        )
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(block_hashes)} block hashes of size "
                f"{block_size} but {num_full_blocks} full blocks to cache; give the request a "
                "block hasher with the manager's hash block size"
            )
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        if block_mask is not None:
            if len(block_mask) != len(new_blocks):
                raise ValueError(
                    f"block_mask has {len(block_mask)} entries for {len(new_blocks)} blocks "
                    f"[{num_cached_blocks}, {num_full_blocks})"
                )
            new_blocks = [block for block, kept in zip(new_blocks, block_mask, strict=True) if kept]
            new_hashes = [h for h, kept in zip(new_hashes, block_mask, strict=True) if kept]
        if self._partial_entries:
            for block in new_blocks:
                if self.partial_entry_tokens(block) is not None:
                    self._drop_partial_entry(block)  # filled up: promoted to its full key
        stamped = KVCacheBlock.try_set_hashes(new_blocks, new_hashes, kv_cache_group_id)
        if not stamped:
            return
        capped = False
        if self._tenant_caps is not None and request.cache_salt is not None:
            num_stamped = len(stamped)
            stamped = self._admit_tenant_blocks(request.cache_salt, stamped)
            if not stamped:
                return
            capped = len(stamped) < num_stamped
        self.cached_block_hash_to_block.insert_stamped(stamped, kv_cache_group_id)
        if self.enable_kv_cache_events:
            indices: Sequence[int] = range(num_cached_blocks, num_full_blocks)
            if len(stamped) < len(indices):  # some were cached already: the stamped ones
                stamped_ids = set(map(id, stamped))
                indices = [i for i in indices if id(blocks[i]) in stamped_ids]
            if capped:  # the event's tokens end with the last block cached
                num_full_blocks = indices[-1] + 1
            self.kv_event_queue.append(
                DeferredBlockStored(
                    request,
                    block_hashes,
                    indices,
                    num_cached_blocks,
                    num_full_blocks,
                    block_size,
                    kv_cache_group_id,
                    self.event_group_specs,
                )
            )

    def partial_entry_tokens(self, block: KVCacheBlock) -> int | None:
        """The prefix length `block`'s partial entry names (vLLM's `block_hash_num_tokens`
        for a block keyed inside itself), or None when it has none."""
        entry = self._partial_entries.get(block.block_id)
        if entry is None:
            return None
        if entry[0] is not block._block_hash:  # evicted (and maybe re-keyed) since
            del self._partial_entries[block.block_id]
            return None
        return entry[1]

    def _drop_partial_entry(self, block: KVCacheBlock) -> None:
        """Remove `block`'s partial entry from the prefix cache (a `BlockRemoved` event)."""
        del self._partial_entries[block.block_id]
        self._evict_cached_blocks((block,))

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make `block` reachable from the prefix boundary `num_tokens` inside it (vLLM's
         partial entry): its key is the request's hash at that boundary.

        Returns the key, or None when the block is the null block or already holds a
        full-block key (jaxkv keeps one key per block; vLLM adds a second one). An older,
        shorter partial entry of the block is replaced, and with
        `replace_existing_hashes` any key (the block's contents were replaced).
        """
        if block.is_null:
            return None
        num_tokens = check_int("num_tokens", num_tokens)
        kv_cache_group_id = check_int("kv_cache_group_id", kv_cache_group_id)
        block_size = check_int("block_size", block_size)
        hash_block_size = self.hash_block_size or block_size
        if num_tokens <= 0 or num_tokens % hash_block_size or block_size % hash_block_size:
            raise ValueError(
                f"num_tokens={num_tokens} must be a positive multiple of the hash block size "
                f"({hash_block_size}), which must divide block_size={block_size}"
            )
        num_hashes = num_tokens // hash_block_size
        if num_hashes > len(request.block_hashes):
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes; "
                f"a partial entry at {num_tokens} tokens needs {num_hashes}"
            )
        block_hash = request.block_hashes[num_hashes - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        secondary = self._secondary_keys.get(block.block_id, ())
        if block._block_hash is not None:
            if (block._block_hash == block_hash and block._group_id == kv_cache_group_id) or (
                (block_hash, kv_cache_group_id) in secondary
            ):
                if not replace_existing_hashes:
                    return key  # already keyed here
            tokens = self.partial_entry_tokens(block)
            if replace_existing_hashes or (tokens is not None and tokens < num_tokens):
                if tokens is not None:
                    del self._partial_entries[block.block_id]
                self._evict_cached_blocks((block,))
            else:  # the block's key names a longer prefix: this one is a further key
                self.cached_block_hash_to_block.insert(block_hash, kv_cache_group_id, block)
                self._secondary_keys.setdefault(block.block_id, []).append(
                    (block_hash, kv_cache_group_id)
                )
                self._partial_block_stored(request, block_hash, num_tokens, kv_cache_group_id)
                return key
        block.set_hash(block_hash, kv_cache_group_id)
        if (
            self._tenant_caps is not None
            and request.cache_salt is not None
            and not self._admit_tenant_blocks(request.cache_salt, [block])
        ):
            return None  # the salt is at its cap, all its cached blocks held
        self.cached_block_hash_to_block.insert_stamped((block,), kv_cache_group_id)
        self._partial_entries[block.block_id] = (block_hash, num_tokens)
        self._partial_block_stored(request, block_hash, num_tokens, kv_cache_group_id)
        return key

    def _partial_block_stored(
        self, request: Request, block_hash: BlockHash, num_tokens: int, kv_cache_group_id: int
    ) -> None:
        """The `BlockStored` event of a partial entry: its last hash unit's tokens."""
        if not self.enable_kv_cache_events:
            return
        hash_block_size = self.hash_block_size or num_tokens
        num_hashes = num_tokens // hash_block_size
        lora = request.lora_request
        start = num_tokens - hash_block_size
        keys, _ = generate_block_hash_extra_keys(request, start, num_tokens, 0)
        specs = self.event_group_specs
        spec_kind, sliding_window = (
            specs[kv_cache_group_id] if kv_cache_group_id < len(specs) else _NO_SPEC
        )
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=request.block_hashes[num_hashes - 2] if num_hashes > 1 else None,
                token_ids=request.all_token_ids[start:num_tokens],
                block_size=hash_block_size,
                lora_id=request.lora_int_id,
                lora_name=lora.lora_name if lora is not None else None,
                extra_keys=to_event_extra_keys([keys]),
                group_idx=kv_cache_group_id,
                kv_cache_spec_kind=spec_kind,
                kv_cache_spec_sliding_window=sliding_window,
            )
        )

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-key `src_block`'s prefix-cache entry to `dst_block` (no events: the entry stays
        live). The request owning `src_block` keeps writing into it; the cache holds
        `dst_block`, a private copy, under the same key instead."""
        if dst_block._block_hash is not None or dst_block.is_null:
            raise ValueError(f"move_block_hashes needs an unkeyed destination, got {dst_block!r}")
        block_hash, group_id = src_block._block_hash, src_block._group_id
        if block_hash is None:
            return
        partial = self._partial_entries.pop(src_block.block_id, None)
        secondary = self._secondary_keys.pop(src_block.block_id, None)
        cache = self.cached_block_hash_to_block
        cache.pop_stamped((src_block,))
        for other_hash, other_group in secondary or ():
            cache.pop(other_hash, other_group, src_block.block_id)
        src_block.reset_hash()
        self.num_hash_removals += 1
        dst_block.set_hash(block_hash, group_id)
        cache.insert_stamped((dst_block,), group_id)
        if secondary:
            for other_hash, other_group in secondary:
                cache.insert(other_hash, other_group, dst_block)
            self._secondary_keys[dst_block.block_id] = secondary
        if partial is not None and partial[0] is block_hash:
            self._partial_entries[dst_block.block_id] = partial
        salt = self._tenant_of.pop(src_block.block_id, None) if self._tenant_of else None
        if salt is not None:  # the salt's count is unchanged: the entry only moved
            self._tenant_free.get(salt, {}).pop(src_block.block_id, None)
            self._tenant_of[dst_block.block_id] = salt
            self._tenant_blocks_freed((dst_block,))

    def emit_cached_block_events(
        self, request: Request, num_cached_blocks: int, block_size: int, kv_cache_group_id: int
    ) -> None:
        """One `BlockStored` for the request's first `num_cached_blocks` blocks, served from
        the prefix cache, so routers learn of reused blocks; no block changes (vLLM's)."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        block_size = check_int("block_size", block_size)
        kv_cache_group_id = check_int("kv_cache_group_id", kv_cache_group_id)
        block_hashes = self._block_hashes_at(request, block_size)
        num_cached_blocks = check_int(
            "num_cached_blocks", num_cached_blocks, min_value=0, max_value=len(block_hashes)
        )
        self.kv_event_queue.append(
            DeferredBlockStored(
                request,
                block_hashes,
                range(num_cached_blocks),
                0,
                num_cached_blocks,
                block_size,
                kv_cache_group_id,
                self.event_group_specs,
            )
        )

    def _block_hashes_at(self, request: Request, block_size: int) -> Sequence[BlockHash]:
        """The request's block hashes for blocks of `block_size` tokens."""
        if self.hash_block_size is not None and block_size != self.hash_block_size:
            return BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block_size, block_size
            )
        return request.block_hashes

    def _evict_cached_blocks(self, blocks: Sequence[KVCacheBlock], were_free: bool = False) -> None:
        """Drop cached blocks from the prefix cache (their hashes are reset). `were_free`:
        they were all free pages (taken for allocation), so their contents are garbage.

        The `BlockRemoved` events follow vLLM's order: block by block, each block's
        own key, then its further keys (`_secondary_keys`) in the order they were added."""
        self.cached_block_hash_to_block.pop_stamped(blocks)
        if self._tenant_of:
            self._forget_tenant_blocks(blocks)
        # A page some request still holds (evict_blocks on a live block) is not garbage:
        # it is reported once it is freed, unhashed.
        if self.track_freed_block_ids:
            self._freed_block_ids.update(b.block_id for b in blocks if were_free or b.ref_cnt == 0)
        if self._secondary_keys:  # only with partial entries on full blocks
            self._drop_with_secondary_keys(blocks)
        elif self.enable_kv_cache_events:
            self.kv_event_queue.extend(
                BlockRemoved(block_hashes=[b._block_hash], group_idx=b._group_id)  # type: ignore[list-item]
                for b in blocks
            )
        KVCacheBlock.reset_hashes(blocks)
        self.num_hash_removals += len(blocks)

    def _drop_with_secondary_keys(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`_evict_cached_blocks`' map and events when some block may have further keys:
        those leave the map, and each block's events are its own key's, then theirs."""
        events = self.kv_event_queue if self.enable_kv_cache_events else None
        for block in blocks:
            if events is not None:
                key = block._block_hash
                events.append(BlockRemoved(block_hashes=[key], group_idx=block._group_id))  # type: ignore[list-item]
            secondary = self._secondary_keys.pop(block.block_id, None)
            if secondary is None:
                continue
            for block_hash, group_id in secondary:
                self.cached_block_hash_to_block.pop(block_hash, group_id, block.block_id)
                if events is not None:
                    events.append(BlockRemoved(block_hashes=[block_hash], group_idx=group_id))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache only (their KV turned out to be bad): every
        key of each cached one, `BlockRemoved` events in the order given; held or free,
        the blocks keep their place (ref counts, free queue). Ids outside
        `1 .. num_gpu_blocks - 1` are refused (ValueError) before any is evicted, as is
        a `block_ids` that is not an iterable of ids (TypeError: `evict_blocks(5)`)."""
        try:  # a str iterates, but over characters: not ids
            ids = None if isinstance(block_ids, (str, bytes)) else list(block_ids)
        except TypeError:
            ids = None
        if ids is None:
            raise TypeError(
                f"block_ids must be an iterable of block ids (e.g. [5] for one block), "
                f"got {block_ids!r} ({type(block_ids).__name__})"
            )
        for block_id in ids:
            if not (
                isinstance(block_id, (int, np.integer))
                and not isinstance(block_id, bool)
                and 1 <= block_id < self.num_gpu_blocks
            ):
                raise ValueError(
                    f"block id {block_id!r} is out of range; valid ids are "
                    f"1..{self.num_gpu_blocks - 1}"
                )
        for block_id in ids:
            block = self.blocks[block_id]
            if block._block_hash is not None:
                self._evict_cached_blocks((block,))

    def evict_cached_free_blocks_first(self) -> int:
        """Move every cached free block to the front of the free queue, in queue order:
        they stay findable (no event) but are reused before any other block. After a
        weight update their KV is an older version's, which no new request can hit (the
        version keys its hashes). Returns how many moved."""
        queue = self.free_block_queue
        cached = [b for b in queue.get_all_free_blocks() if b._block_hash is not None]
        for block in cached:
            queue.remove(block)
        queue.prepend_n(cached)
        return len(cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed (True) when all blocks are free."""
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        if self.track_freed_block_ids:  # their pages lost their hashes: garbage now
            self._freed_block_ids.update(
                b.block_id for b in self.blocks if b._block_hash is not None
            )
        self.cached_block_hash_to_block.clear()
        self._secondary_keys.clear()
        self._partial_entries.clear()
        self._tenant_of.clear()
        self._tenant_cached.clear()
        self._tenant_free.clear()
        KVCacheBlock.reset_hashes(self.blocks)
        self.num_hash_removals += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- hand-offs -----------------------------------------------------------

    def take_events(self, deferred: bool = False) -> list[KVCacheEvent | DeferredKVCacheEvent]:
        """The events queued since the last call, in order. `deferred`: the `BlockStored`
        events of cached blocks may come unbuilt (`DeferredKVCacheEvent`), for whoever
        reads them to build."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events if deferred else build_events(events)

    def take_freed_block_ids(self) -> np.ndarray:
        """Sorted int32 ids whose contents became garbage since the last call.

        A block qualifies when it was freed without a hash or lost its hash
        (eviction). The device side may zero these pages before the step's
        writes so no page leaks one tenant's KV to another. Requires
        `track_freed_block_ids=True`.
        """
        if not self.track_freed_block_ids:
            raise ValueError("construct the pool with track_freed_block_ids=True to record them")
        ids = np.fromiter(
            sorted(self._freed_block_ids), dtype=np.int32, count=len(self._freed_block_ids)
        )
        self._freed_block_ids.clear()
        return ids
