"""The smallest complete use of jaxkv without the engine: your model, your jitted step,
jaxkv's host block manager and device paged cache.

Two requests share a 32-token prefix; the second one reads it from the prefix cache.
Each step: the host `KVCacheManager` allocates slots, a `BlockTable` turns block ids
into a slot mapping, `StepMetadataPacker` packs the step into one int32 buffer (one
transfer), and inside YOUR jit `PagedKVCache.stacked_layer_step` writes this step's K/V
into layer 0 of the donated cache and runs paged attention. The last line checks the
greedy tokens against a dense forward pass. Run: `python examples/embed_in_your_loop.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.device import PagedKVCache, StepInputs, StepMetadataPacker

VOCAB, DIM, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, MAX_LEN = 256, 64, 2, 32, 8, 32, 96
rng = np.random.default_rng(0)
QKV = HEADS * HEAD_DIM
SHAPES = {"embed": (VOCAB, DIM), "q": (DIM, QKV), "k": (DIM, QKV), "v": (DIM, QKV),
          "o": (QKV, DIM), "out": (DIM, VOCAB)}  # fmt: skip
W = {k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for k, s in SHAPES.items()}
W["embed"] = W["embed"] * np.sqrt(VOCAB)  # unit-scale embeddings


def qkv(x):
    split = lambda w: (x @ w).reshape(len(x), HEADS, HEAD_DIM)  # noqa: E731
    return split(W["q"]), split(W["k"]), split(W["v"])


# 1. Host side: the block manager, a block table, a packer.
spec = jaxkv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                               dtype="float32")  # fmt: skip
manager = jaxkv.KVCacheManager.from_spec(spec, NUM_BLOCKS, MAX_LEN)
hash_fn = jaxkv.get_hash_fn_by_name("sha256")
jaxkv.init_none_hash(hash_fn)
hasher = jaxkv.get_request_block_hasher(BLOCK, hash_fn)
table = jaxkv.BlockTable(BLOCK, 1, MAX_LEN // BLOCK, NUM_BLOCKS)
packer = StepMetadataPacker(max_num_tokens=64, max_num_reqs=1, max_blocks_per_req=MAX_LEN // BLOCK,
                            block_size=BLOCK, num_blocks=NUM_BLOCKS)  # fmt: skip

# 2. Device side: the paged cache and your jitted step (cache donated: updated in place).
cache = PagedKVCache(spec, NUM_BLOCKS)
kv = cache.allocate_stacked(1)  # every layer in one array: [layers, *cache.shape]


@functools.partial(jax.jit, static_argnames="shape", donate_argnames="kv")
def step(kv, buffer, token_ids, shape):
    x = W["embed"][token_ids]  # (a real model adds RoPE at the packed positions)
    q, k, v = qkv(x)
    kv, attn = cache.stacked_layer_step(kv, 0, q, k, v, buffer, shape)  # write, then attend
    h = x + attn.reshape(len(x), -1) @ W["o"]
    return kv, jnp.argmax(h @ W["out"], axis=-1)


def generate(request: jaxkv.Request, num_tokens: int) -> list[int]:
    hits, num_cached, _ = manager.get_computed_blocks(request)
    new = request.num_tokens - num_cached
    assert manager.allocate_slots(request, new, num_cached, hits) is not None
    request.num_computed_tokens = num_cached
    global kv
    for _ in range(num_tokens):
        start, n = request.num_computed_tokens, request.num_tokens - request.num_computed_tokens
        (block_ids,) = manager.get_block_ids(request.request_id)
        table.add_row(block_ids, 0)
        positions = np.arange(start, start + n)
        slots = table.compute_slot_mapping(np.zeros(n, np.int64), positions)
        rows = table.get_numpy_array()[:1]
        inputs = StepInputs(rows, np.array([start + n]), np.array([n]), slots)
        buffer, shape = packer.pack(inputs)
        tokens = np.zeros(shape.num_tokens, np.int32)
        tokens[:n] = request.all_token_ids[start:]
        kv, next_ids = step(kv, cache.put(buffer), jnp.asarray(tokens), shape)
        request.num_computed_tokens += n
        request.append_output_token_ids(int(next_ids[n - 1]))
        if request.num_output_tokens < num_tokens:  # slots for the next token
            assert manager.allocate_slots(request, 1) is not None
    manager.free(request)
    return request.output_token_ids, num_cached


def dense(tokens: list[int]) -> list[int]:
    """Reference: causal attention over the whole sequence, no cache."""
    x = W["embed"][jnp.asarray(tokens)]
    q, k, v = qkv(x)
    logits = jnp.einsum("thd,shd->hts", q, k) * HEAD_DIM**-0.5
    mask = jnp.tril(jnp.ones((len(tokens),) * 2, bool))
    attn = jnp.einsum("hts,shd->thd", jax.nn.softmax(jnp.where(mask, logits, -jnp.inf)), v)
    return np.asarray(jnp.argmax((x + attn.reshape(len(x), -1) @ W["o"]) @ W["out"], -1)).tolist()


prefix = rng.integers(0, VOCAB, 32).tolist()
for i, tail in enumerate([[1, 2, 3], [4, 5, 6, 7]]):
    request = jaxkv.Request(f"req-{i}", prefix + tail, block_hasher=hasher)
    out, cached = generate(request, 8)
    want = dense(prefix + tail + out)[len(prefix + tail) - 1 : -1]
    print(f"{request.request_id}: cached {cached} tokens, output {out}, dense match: {out == want}")
    assert out == want
