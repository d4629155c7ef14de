"""jaxkv end to end: a tiny continuous-batching server with prefix caching, on CPU.

What it shows, in the order the code runs:

1. A tiny deterministic "model" in JAX: token embeddings, two pre-norm
   transformer layers (GQA attention with RoPE + a small MLP), an output
   head, greedy argmax sampling. Fixed random weights, float32.
2. A scheduler loop in the style of vLLM v1. Every step the host
   `jaxkv.KVCacheManager` decides which KV blocks each request holds:
   running requests get slots first (chunked prefill or one decode token),
   and when the pool runs dry the newest running request is preempted
   (its blocks are freed; it is recomputed later, mostly from the prefix
   cache). Waiting requests are then admitted while blocks and the token
   budget last; prompts that share a system prompt hit the prefix cache.
3. The device hand-off: the host fills a `jaxkv.BlockTable` and computes the
   slot mapping in numpy, `StepMetadataPacker` packs the whole step (plus the
   token ids) into one int32 buffer, sent to the device in one transfer. One
   jitted program per bucketed shape writes every layer's K/V into the donated
   paged caches and runs ragged paged attention (`PagedKVCache.step`). Pages
   whose contents became garbage are zeroed with `PagedKVCache.zero_blocks`.
4. Checks: each bucketed step shape is compiled once, on first use, so the
   compilations are bounded by the bucket count and the steady state compiles
   nothing; every generated token is re-derived by a dense forward pass (no
   paging, no cache, no batching) and must be identical, prefix-cache hits and
   preemptions included; all blocks return to the pool at the end.

Run it with `python examples/demo.py` (`--quick` for a smaller run).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv.device import (
    PagedKVCache,
    StepInputs,
    StepMetadataPacker,
    compilation_count,
    unpack_step,
)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 128
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2  # GQA: two query heads per KV head
    head_size: int = 32
    block_size: int = 16
    num_blocks: int = 40  # small on purpose: the pool runs dry and requests get preempted
    max_model_len: int = 256
    max_running: int = 8  # requests in the running batch
    max_step_tokens: int = 64  # token budget of one step (longer prompts are chunked)

    @property
    def blocks_per_req(self) -> int:
        return self.max_model_len // self.block_size


# ----------------------------------------------------------------------------------------
# The model: the same layer code runs paged (serving) and dense (the reference check).


def init_params(cfg: Config, seed: int) -> dict:
    """Fixed random weights. The attention output is scaled up and the output head is not
    tied to the embeddings, so the next token really depends on the cached context."""
    rng = np.random.default_rng(seed)

    def weight(fan_in: int, fan_out: int, scale: float = 1.0) -> jax.Array:
        w = rng.standard_normal((fan_in, fan_out)) * scale / math.sqrt(fan_in)
        return jnp.asarray(w, jnp.float32)

    d, hd = cfg.d_model, cfg.head_size
    layers = [
        {
            "wq": weight(d, cfg.num_q_heads * hd),
            "wk": weight(d, cfg.num_kv_heads * hd),
            "wv": weight(d, cfg.num_kv_heads * hd),
            "wo": weight(cfg.num_q_heads * hd, d, scale=3.0),
            "w_up": weight(d, 2 * d),
            "w_down": weight(2 * d, d),
        }
        for _ in range(cfg.num_layers)
    ]
    embed = jnp.asarray(rng.standard_normal((cfg.vocab, d)), jnp.float32)
    return {"embed": embed, "unembed": weight(d, cfg.vocab), "layers": layers}


def rms_norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding of `x [T, heads, D]` at `positions [T]`."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(jnp.float32) * (10000.0 ** (-jnp.arange(half) / half))
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def qkv(cfg: Config, layer: dict, x: jax.Array, positions: jax.Array):
    h = rms_norm(x)
    q = (h @ layer["wq"]).reshape(len(x), cfg.num_q_heads, cfg.head_size)
    k = (h @ layer["wk"]).reshape(len(x), cfg.num_kv_heads, cfg.head_size)
    v = (h @ layer["wv"]).reshape(len(x), cfg.num_kv_heads, cfg.head_size)
    return rope(q, positions), rope(k, positions), v


def finish_layer(layer: dict, x: jax.Array, attn: jax.Array) -> jax.Array:
    x = x + attn.reshape(len(x), -1) @ layer["wo"]
    return x + jax.nn.gelu(rms_norm(x) @ layer["w_up"]) @ layer["w_down"]


def greedy(params: dict, x: jax.Array) -> jax.Array:
    return jnp.argmax(rms_norm(x) @ params["unembed"], axis=-1).astype(jnp.int32)


def make_paged_step(cfg: Config, cache: PagedKVCache):
    """The serving step: one jitted program per bucketed `shape`, caches donated."""

    @functools.partial(jax.jit, static_argnames="shape", donate_argnames="caches")
    def step(params: dict, caches: list[jax.Array], buffer: jax.Array, shape):
        metadata, token_ids = buffer[:, : shape.length], buffer[0, shape.length :]
        md = unpack_step(metadata[0], shape)
        x = params["embed"][token_ids]
        new_caches = []
        for layer, kv in zip(params["layers"], caches, strict=True):
            q, k, v = qkv(cfg, layer, x, md.positions)
            kv, attn = cache.step(kv, q, k, v, metadata, shape)  # write K/V, then attend
            new_caches.append(kv)
            x = finish_layer(layer, x, attn)
        last_token = jnp.maximum(md.query_start_loc[1:] - 1, 0)  # of each request row
        return new_caches, greedy(params, x[last_token])

    return step


def make_dense_forward(cfg: Config):
    """Reference: plain causal attention over one whole (padded) sequence, no cache."""

    def attention(q, k, v):
        t, g = len(q), cfg.num_q_heads // cfg.num_kv_heads
        q = q.reshape(t, cfg.num_kv_heads, g, cfg.head_size)
        logits = jnp.einsum("tkgd,skd->kgts", q, k) * cfg.head_size**-0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.einsum("kgts,skd->tkgd", probs, v).reshape(t, cfg.num_q_heads, cfg.head_size)

    @jax.jit
    def forward(params: dict, token_ids: jax.Array) -> jax.Array:
        positions = jnp.arange(len(token_ids))
        x = params["embed"][token_ids]
        for layer in params["layers"]:
            x = finish_layer(layer, x, attention(*qkv(cfg, layer, x, positions)))
        return greedy(params, x)  # the greedy next token after every position

    return forward


# ----------------------------------------------------------------------------------------
# The engine: host-side scheduling with the KV cache manager, one device call per step.


class Engine:
    def __init__(self, cfg: Config, params: dict) -> None:
        self.cfg, self.params = cfg, params
        spec = jaxkv.FullAttentionSpec(
            block_size=cfg.block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_size=cfg.head_size,
            dtype="float32",
        )
        self.manager = jaxkv.KVCacheManager.from_spec(
            spec, cfg.num_blocks, cfg.max_model_len, log_stats=True, track_freed_block_ids=True
        )
        if cfg.num_blocks - 1 < cfg.blocks_per_req:
            raise ValueError(f"need at least {cfg.blocks_per_req + 1} blocks for one request")
        self.cache = PagedKVCache(spec, cfg.num_blocks)
        self.caches = self.cache.allocate(cfg.num_layers)
        self.table = jaxkv.BlockTable(
            cfg.block_size, cfg.max_running, cfg.blocks_per_req, cfg.num_blocks
        )
        self.packer = StepMetadataPacker(
            max_num_tokens=cfg.max_step_tokens,
            max_num_reqs=cfg.max_running,
            max_blocks_per_req=cfg.blocks_per_req,
            block_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
        )
        self.step_fn = make_paged_step(cfg, self.cache)
        self.waiting: collections.deque[jaxkv.Request] = collections.deque()
        self.running: list[jaxkv.Request] = []
        self.finished: list[jaxkv.Request] = []
        self.num_steps = self.num_preemptions = self.num_preemptions_this_step = 0
        self.num_tokens_this_step = self.num_steps_compiling = 0
        self.steady_s, self.steady_tokens = 0.0, 0  # time and tokens of steps that compiled nothing

    def compile_bound(self) -> int:
        """Programs serving can ever compile: a step per bucket shape, a zeroing per id bucket."""
        return len(self.packer.all_shapes()) + len(self.cache.id_buckets)

    # -- scheduling ----------------------------------------------------------------------

    def schedule(self) -> list[tuple[jaxkv.Request, int]]:
        """Pick `(request, num_new_tokens)` pairs for this step and allocate their slots."""
        budget, scheduled = self.cfg.max_step_tokens, []
        i = 0
        while i < len(self.running) and budget > 0:  # running requests first, oldest first
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.allocate_or_preempt(request, n):
                break  # `request` itself was preempted: so were all after it
            scheduled.append((request, n))
            budget -= n
            i += 1
        if self.num_preemptions_this_step:
            return scheduled  # no admissions in a step that had to preempt
        while self.waiting and len(self.running) < self.cfg.max_running and budget > 0:
            n = self.admit(self.waiting[0], budget)
            if n == 0:
                break  # out of blocks: wait for requests to finish
            scheduled.append((self.waiting.popleft(), n))
            budget -= n
        return scheduled

    def allocate_or_preempt(self, request: jaxkv.Request, n: int) -> bool:
        """Slots for `n` more tokens of a running request, preempting the newest ones if needed."""
        while self.manager.allocate_slots(request, n) is None:
            victim = self.running.pop()
            self.manager.free(victim)  # its blocks go back to the pool (hashed ones stay cached)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            victim.status = jaxkv.RequestStatus.PREEMPTED
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            self.num_preemptions_this_step += 1
            if victim is request:
                return False
        return True

    def admit(self, request: jaxkv.Request, budget: int) -> int:
        """Start a waiting request from its longest cached prefix; 0 when blocks run out."""
        bs = self.cfg.block_size
        if self.manager.num_free_blocks < -(-min(request.num_tokens, budget) // bs):
            return 0  # cheap pre-check, so failed attempts do not count as cache lookups
        hit_blocks, num_hits, _ = self.manager.get_computed_blocks(request)
        n = min(request.num_tokens - num_hits, budget)
        if self.manager.allocate_slots(request, n, num_hits, hit_blocks) is None:
            return 0
        request.num_computed_tokens = num_hits
        request.status = jaxkv.RequestStatus.RUNNING
        self.running.append(request)
        return n

    # -- the device step -----------------------------------------------------------------

    def pack(self, scheduled: list[tuple[jaxkv.Request, int]]):
        """Block-table rows, slot mapping and token ids of this step, packed into one buffer."""
        rows, positions, token_ids = [], [], []
        for row, (request, n) in enumerate(scheduled):
            (block_ids,) = self.manager.get_block_ids(request.request_id)  # one KV-cache group
            self.table.add_row(block_ids, row)
            start = request.num_computed_tokens
            rows += [row] * n
            positions += range(start, start + n)
            token_ids += request.all_token_ids[start : start + n]
        slots = self.table.compute_slot_mapping(np.array(rows), np.array(positions))
        step = StepInputs(
            block_tables=self.table.get_numpy_array()[: len(scheduled)],
            seq_lens=np.array([r.num_computed_tokens + n for r, n in scheduled]),
            query_lens=np.array([n for _, n in scheduled]),
            slot_mapping=slots,
        )
        metadata, shape = self.packer.pack(step)
        buffer = np.zeros((1, shape.length + shape.num_tokens), np.int32)
        buffer[0, : shape.length] = metadata[0]
        buffer[0, shape.length : shape.length + len(token_ids)] = token_ids
        return buffer, shape

    def step(self) -> None:
        """Schedule, zero garbage pages, run the device step, append the sampled tokens."""
        self.num_preemptions_this_step = 0
        scheduled = self.schedule()
        freed = self.manager.take_freed_block_ids()  # garbage pages: zero before this step writes
        if freed.size:
            self.caches = [self.cache.zero_blocks(kv, freed) for kv in self.caches]
        buffer, shape = self.pack(scheduled)
        # The one host-to-device transfer of the step, placed on the cache's mesh.
        self.caches, next_tokens = self.step_fn(
            self.params, self.caches, self.cache.put(buffer), shape
        )
        self.update(scheduled, np.asarray(next_tokens))
        self.num_tokens_this_step = sum(n for _, n in scheduled)
        self.num_steps += 1

    def update(self, scheduled: list[tuple[jaxkv.Request, int]], next_tokens: np.ndarray) -> None:
        for row, (request, n) in enumerate(scheduled):
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that is not the last: its sample is dropped
            request.append_output_token_ids(int(next_tokens[row]))
            if request.num_output_tokens >= request.max_tokens:
                self.manager.free(request)
                request.status = jaxkv.RequestStatus.FINISHED
                self.running.remove(request)
                self.finished.append(request)

    def run(self, requests: list[jaxkv.Request], progress: bool = True) -> None:
        self.waiting.extend(requests)
        with tqdm(total=len(requests), unit="req", desc="serving", disable=not progress) as bar:
            while self.waiting or self.running:
                done, compiled, t0 = len(self.finished), compilation_count(), time.perf_counter()
                self.step()
                if compilation_count() == compiled:  # steady state: time it
                    self.steady_s += time.perf_counter() - t0
                    self.steady_tokens += self.num_tokens_this_step
                else:
                    self.num_steps_compiling += 1
                bar.update(len(self.finished) - done)
                bar.set_postfix(running=len(self.running), usage=f"{self.manager.usage:.0%}")


# ----------------------------------------------------------------------------------------
# Workload, reference check, summary.


def make_requests(cfg: Config, num_requests: int, seed: int) -> list[jaxkv.Request]:
    """Requests over three shared system prompts (2-4 blocks) plus a private tail."""
    hash_fn = jaxkv.get_hash_fn_by_name("sha256")
    jaxkv.init_none_hash(hash_fn)
    hasher = jaxkv.get_request_block_hasher(cfg.block_size, hash_fn)
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(1, cfg.vocab, int(rng.integers(2, 5)) * cfg.block_size) for _ in range(3)
    ]
    requests = []
    for i in range(num_requests):
        prompt = np.concatenate([systems[i % 3], rng.integers(1, cfg.vocab, rng.integers(4, 80))])
        max_tokens = int(rng.integers(8, 25))
        params = jaxkv.SamplingParams(max_tokens=max_tokens)
        requests.append(jaxkv.Request(f"req-{i:02d}", prompt, params, None, block_hasher=hasher))
    return requests


def dense_check(cfg: Config, params: dict, requests: list[jaxkv.Request]) -> list[str]:
    """Ids of requests whose generated tokens differ from a dense greedy forward pass."""
    forward = make_dense_forward(cfg)
    mismatched = []
    for request in requests:
        tokens = np.zeros(cfg.max_model_len, np.int32)
        tokens[: request.num_tokens] = list(request.all_token_ids)
        predicted = np.asarray(forward(params, jnp.asarray(tokens)))
        start = request.num_prompt_tokens - 1  # the prediction after the prompt's last token
        expected = predicted[start : start + request.num_output_tokens].tolist()
        if expected != request.output_token_ids:
            mismatched.append(request.request_id)
    return mismatched


def print_summary(summary: dict) -> None:
    rows = [
        ("requests finished", f"{summary['finished']} / {summary['requests']}"),
        ("prompt tokens", summary["prompt_tokens"]),
        ("generated tokens", summary["generated_tokens"]),
        ("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
        ("preemptions", summary["preemptions"]),
        ("steps (of which compiling)", f"{summary['steps']} ({summary['steps_compiling']})"),
        ("XLA compilations while serving",
         f"{summary['compilations']} (bound: {summary['compile_bound']} bucket programs)"),
        ("tokens/s (steady state)", f"{summary['tokens_per_s']:.0f}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("free blocks at the end", f"{summary['num_free_blocks']} / {summary['num_blocks'] - 1}"),
        ("dense check", f"{summary['dense_check']} ({summary['finished']} requests)"),
    ]  # fmt: skip
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")
        return
    table = Table(title="jaxkv demo", show_header=False)
    for name, value in rows:
        table.add_row(name, str(value))
    Console().print(table)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, help="KV pool size (default 40, quick 24)")
    parser.add_argument("--quick", action="store_true", help="fewer requests, smaller batches")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config(num_blocks=24, max_running=4, max_step_tokens=32) if args.quick else Config()
    if args.num_blocks is not None:
        cfg = dataclasses.replace(cfg, num_blocks=args.num_blocks)
    start = time.perf_counter()
    params = init_params(cfg, args.seed)
    engine = Engine(cfg, params)
    requests = make_requests(
        cfg, min(args.requests, 12) if args.quick else args.requests, args.seed
    )
    compiled_before = compilation_count()
    engine.run(requests, progress=not args.no_progress)
    compilations = compilation_count() - compiled_before
    mismatched = dense_check(cfg, params, engine.finished)
    hit_stats = engine.manager.make_prefix_cache_stats()  # since the start (log_stats=True)
    summary = {
        "requests": len(requests),
        "finished": len(engine.finished),
        "prompt_tokens": sum(r.num_prompt_tokens for r in requests),
        "generated_tokens": sum(r.num_output_tokens for r in engine.finished),
        "prefix_cache_hit_rate": hit_stats.hit_rate,
        "preemptions": engine.num_preemptions,
        "steps": engine.num_steps,
        "steps_compiling": engine.num_steps_compiling,
        "compilations": compilations,
        "compile_bound": engine.compile_bound(),
        "tokens_per_s": engine.steady_tokens / max(engine.steady_s, 1e-9),
        "wall_s": time.perf_counter() - start,
        "num_free_blocks": engine.manager.num_free_blocks,
        "num_blocks": cfg.num_blocks,
        "dense_mismatched": mismatched,
        "dense_check": "OK" if engine.finished and not mismatched else "FAILED",
    }
    print_summary(summary)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["dense_check"] == "OK" else 1)
