"""Argument checks shared by the paged attention entry points (reference and kernels)."""

from __future__ import annotations


def check_attention_args(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    sliding_window: int | None,
    soft_cap: float | None,
    grouped: bool = True,
) -> int:
    """Validate queries `[T, Hq, D]` against a `[blocks, bs, 2 * H, D]` cache; returns `H`.

    With `grouped`, query heads are grouped over the KV heads, so `Hq % H == 0`.
    Raises `ValueError` naming the offending value.
    """
    num_q_heads, head_size = q_shape[-2:]
    combined, cache_head_size = cache_shape[-2:]
    if cache_head_size != head_size or combined % 2:
        raise ValueError(
            f"cache shape {tuple(cache_shape)} does not fit queries {tuple(q_shape)}: need "
            f"[blocks, block_size, 2 * kv_heads, {head_size}]"
        )
    num_kv_heads = combined // 2
    if grouped and num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    if isinstance(sliding_window, int) and sliding_window <= 0:  # a traced window is data
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    return num_kv_heads
