"""Compatibility layers for other projects' call shapes and tests; the core never imports
them. `jaxkv.compat.vllm`: what exists only so vLLM's own tests and call shapes work."""
