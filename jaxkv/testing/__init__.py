"""Test models and the dense reference that engine outputs are checked against.

- `jaxkv.testing.tiny_model`: `TinyCausalLM` and `tiny_configs()`, tiny random-weight
  models served through the `jaxkv.models` contract (the demo's and the tests' model);
- `jaxkv.testing.reference`: `DenseReference`, greedy tokens re-derived by a plain
  forward pass (no paging, no cache, no batching), and `image_offsets`;
- `jaxkv.testing.paged_generate`: `PagedGenerator`, a model-test harness comparing a
  model's paged forward pass with its dense one at the logits level (`dense_greedy`).

They import JAX; nothing in the engine imports them.
"""
