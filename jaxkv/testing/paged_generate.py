"""A model-test harness: greedy generation over `CausalLM.forward_paged`, logits kept.

Not a serving loop (serving, examples included, is `jaxkv.engine`): it checks a model's
paged forward pass against its dense one at the logits level, which the engine does not
return. `PagedGenerator` batches every request of a `generate` call into each step:
prompts are prefilled in chunks of at most `chunk_size` tokens, then decoded one token
per step. Each request owns fresh blocks (the pool is never recycled: size it for the
run); full blocks are remembered by their token prefix, so a later request whose prompt
starts with the same tokens reuses those blocks (a prefix hit: the test that a hit
gives the same logits as a miss). By default all layers form one KV-cache group with
full-attention block tables and sliding layers pass their window to the attention
(correct, just no block release); `group_by_spec=True` gives each distinct
`kv_cache_specs` entry its own group, cache and block ids (the hybrid layout: sliding vs
full layers), packed per group into one `PagedContext`. On a mesh with several data
ranks the requests are spread over them (request i on rank i mod dp, blocks local to
its rank). `dense_greedy` is the dense side of the comparison.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxkv.device import PagedKVCache, StepInputs, StepMetadataPacker
from jaxkv.kv_cache_interface import FullAttentionSpec
from jaxkv.models.base import CausalLM, PagedContext


@dataclasses.dataclass
class _Sequence:
    tokens: list[int]
    num_prompt: int
    blocks: list[list[int]]  # per KV-cache group, ids local to the data rank
    rank: int = 0  # the data rank serving the request
    num_computed: int = 0
    embeds: np.ndarray | None = None  # [num_prompt, hidden] input embeddings (LLaVA)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # per output token

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class PagedGenerator:
    """Greedy generation through paged KV caches (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        max_model_len: int = 128,
        max_num_tokens: int = 64,
        max_num_reqs: int = 8,
        mesh: Mesh | None = None,
        dtype: str | None = None,
        group_by_spec: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        dtype = dtype or str(model.decoder.dtype)  # default: the model's dtype
        layer_specs = list(model.kv_cache_specs(block_size, dtype).values())
        if not group_by_spec:
            full = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=cfg.num_key_value_heads,
                head_size=cfg.head_dim,
                dtype=dtype,
            )
            layer_specs = [full] * len(layer_specs)
        group_specs = list(dict.fromkeys(layer_specs))  # distinct, in layer order
        self.layer_to_group = tuple(group_specs.index(spec) for spec in layer_specs)
        self.caches = tuple(PagedKVCache(spec, num_blocks, mesh=mesh) for spec in group_specs)
        self.kv_cache = self.caches[0].allocate_stacked(len(layer_specs))
        self.packer = StepMetadataPacker(
            max_num_tokens=max_num_tokens,
            max_num_reqs=max_num_reqs,
            max_blocks_per_req=-(-max_model_len // block_size),
            block_size=block_size,
            num_blocks=num_blocks,
        )
        self.step_fn = model.paged_step_fn()
        self.num_blocks = num_blocks
        self.dp = self.caches[0].dp_size
        self.num_started = 0
        # Free block ids per (group, data rank); block 0 is the null block. Odd groups
        # hand theirs out from the top, so group tables differ and a mix-up shows.
        ids = list(range(1, num_blocks))
        self.free_blocks = {
            (g, r): ids[::-1] if g % 2 == 0 else ids[:]
            for g in range(len(self.caches))
            for r in range(self.dp)
        }
        # (rank, token prefix) -> the blocks holding its last `block_size` tokens, per group
        self.prefix_blocks: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        self.num_cached_tokens = 0  # prompt tokens served by prefix hits, over all calls

    def _new_block(self, group: int, rank: int) -> int:
        free = self.free_blocks[group, rank]
        if not free:
            raise ValueError(f"PagedGenerator ran out of its {self.num_blocks} blocks")
        return free.pop()

    def _start(self, prompt: list[int], embeds: np.ndarray | None) -> _Sequence:
        rank = self.num_started % self.dp  # requests spread over the data ranks
        self.num_started += 1
        seq = _Sequence(list(prompt), len(prompt), [[] for _ in self.caches], rank, embeds=embeds)
        bs, hits = self.block_size, 0
        # Reuse cached full blocks, always leaving the last prompt token to compute. Keys
        # are token ids only: prompts with their own embeddings never hit.
        while embeds is None and (hits + 1) * bs < len(prompt):
            blocks = self.prefix_blocks.get((rank, tuple(prompt[: (hits + 1) * bs])))
            if blocks is None:
                break
            for group, block in enumerate(blocks):
                seq.blocks[group].append(block)
            hits += 1
        seq.num_computed = hits * bs
        self.num_cached_tokens += seq.num_computed
        return seq

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        prompt_embeds: list[np.ndarray | None] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of `prompts`, `max_new_tokens` each.

        `prompt_embeds[i]` (optional) replaces request i's prompt token embeddings
        (e.g. with image features merged in); generated tokens use the token embeddings.
        `last_logits[i][j]` keeps the float32 logits that chose request i's token j.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if len(prompts) > self.max_num_reqs * self.dp:
            raise ValueError(
                f"{len(prompts)} prompts exceed max_num_reqs={self.max_num_reqs} per data rank"
            )
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(f"prompt + max_new_tokens = {longest} exceeds max_model_len")
        chunk = chunk_size or self.max_num_tokens
        embeds = prompt_embeds or [None] * len(prompts)
        seqs = [self._start(list(p), e) for p, e in zip(prompts, embeds, strict=True)]
        self.last_logits = [s.logits for s in seqs]
        while any(len(s.output) < max_new_tokens for s in seqs):
            budgets, scheduled = [self.max_num_tokens] * self.dp, []
            for s in seqs:
                n = min(len(s.tokens) - s.num_computed, chunk, budgets[s.rank])
                if len(s.output) < max_new_tokens and n > 0:
                    scheduled.append((s, n))
                    budgets[s.rank] -= n
            self._step(scheduled)
        return [s.output for s in seqs]

    def _pack_group(self, group: int, by_rank: list[list[tuple[_Sequence, int]]]):
        """Group `group`'s block tables and slots of this step, one `StepInputs` per data
        rank, packed (new blocks allocated as needed)."""
        bs = self.block_size
        steps = []
        for rank, scheduled in enumerate(by_rank):
            tables = np.zeros((len(scheduled), self.packer.max_blocks_per_req), np.int32)
            slots = [np.zeros(0, np.int64)]
            for row, (s, n) in enumerate(scheduled):
                end, blocks = s.num_computed + n, s.blocks[group]
                while len(blocks) * bs < end:
                    blocks.append(self._new_block(group, rank))
                tables[row, : len(blocks)] = blocks
                positions = np.arange(s.num_computed, end)
                slots.append(np.asarray(blocks)[positions // bs] * bs + positions % bs)
            steps.append(
                StepInputs(
                    block_tables=tables,
                    seq_lens=np.array([s.num_computed + n for s, n in scheduled], np.int64),
                    query_lens=np.array([n for _, n in scheduled], np.int64),
                    slot_mapping=np.concatenate(slots),
                )
            )
        return self.packer.pack(steps)

    def _step(self, scheduled: list[tuple[_Sequence, int]]) -> None:
        bs = self.block_size
        by_rank = [[(s, n) for s, n in scheduled if s.rank == r] for r in range(self.dp)]
        packed = [self._pack_group(g, by_rank) for g in range(len(self.caches))]
        shape = packed[0][1]
        t = shape.num_tokens
        # Token rows rank-major, each rank's requests in order; a request's logits row is
        # its last token's.
        ids = np.zeros(self.dp * t, np.int32)
        logits_indices = np.zeros(self.dp * shape.num_reqs, np.int32)
        rows, logit_row = [], {}
        for rank, ranked in enumerate(by_rank):
            offset = rank * t
            for s, n in ranked:
                ids[offset : offset + n] = s.tokens[s.num_computed : s.num_computed + n]
                rows.append((s, offset, s.num_computed, s.num_computed + n))
                offset += n
                logit_row[id(s)] = len(logit_row)
                logits_indices[logit_row[id(s)]] = offset - 1
        uses_embeds = any(s.embeds is not None for s, _ in scheduled)
        inputs_embeds = self._embeds(rows, ids) if uses_embeds else None
        ctx = PagedContext(
            caches=self.caches,
            shapes=tuple(group_shape for _, group_shape in packed),
            layer_to_group=self.layer_to_group,
            metadata=tuple(c.put(m) for c, (m, _) in zip(self.caches, packed, strict=True)),
            logits_indices=jnp.asarray(logits_indices),
        )
        logits, self.kv_cache = self.step_fn(jnp.asarray(ids), self.kv_cache, ctx, inputs_embeds)
        logits = np.asarray(logits)
        for s, n in scheduled:
            s.num_computed += n
            for b in range(s.num_computed // bs):  # remember full prompt blocks
                if s.embeds is None and (b + 1) * bs <= s.num_prompt:
                    key = (s.rank, tuple(s.tokens[: (b + 1) * bs]))
                    self.prefix_blocks.setdefault(key, tuple(blocks[b] for blocks in s.blocks))
            if s.num_computed == len(s.tokens):
                row = logits[logit_row[id(s)]]
                s.tokens.append(int(row.argmax()))
                s.logits.append(row)

    def _embeds(self, rows, ids: np.ndarray) -> jax.Array:
        """Input embeddings of this step's token rows: prompt rows from `embeds` when given."""
        out = np.array(self.model.embed_tokens(jnp.asarray(ids)))
        for s, row, start, end in rows:
            prompt_end = min(end, s.num_prompt)
            if s.embeds is not None and start < prompt_end:
                out[row : row + prompt_end - start] = s.embeds[start:prompt_end]
        return jnp.asarray(out)


def dense_greedy(
    dense_fn, prompt: list[int], num_new: int, prompt_embeds=None, pad_to: int = 64
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation by the dense reference, the whole sequence recomputed per token.

    `dense_fn` is `CausalLM.dense_fn()`. Returns the tokens and the logits that chose
    each. `prompt_embeds [len(prompt), hidden]` (optional) replaces the prompt rows'
    input embeddings; generated rows use token embeddings (`embed_fn` of the model is
    reached through `dense_fn.model`). The sequence is padded at the end to a multiple
    of `pad_to` tokens (causal: padding changes no earlier row), so few programs compile.
    """
    model = dense_fn.model
    tokens, logits = list(prompt), []
    for _ in range(num_new):
        n = len(tokens)
        ids = jnp.asarray(tokens + [0] * (-n % pad_to), jnp.int32)
        embeds = None
        if prompt_embeds is not None:
            rows = np.array(model.embed_tokens(ids))
            rows[: len(prompt)] = prompt_embeds
            embeds = jnp.asarray(rows)
        row = np.asarray(dense_fn(ids, embeds)[n - 1])
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens[len(prompt) :], logits
