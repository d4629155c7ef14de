"""jaxkv: vLLM v1-style KV-cache management for JAX serving."""
