"""Argument checks shared by the host-side public entry points.

Every check raises before its caller changes any state, and its message names
the argument, the value given and what is allowed. Hot paths call these only
where a value enters (constructors, admission), never per inner step.
"""

from __future__ import annotations

import array
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

# Token ids are stored as int64 by the device side and encoded as uint64 by CBOR.
TOKEN_ID_LIMIT = 1 << 63


class AssertedValueError(ValueError, AssertionError):
    """Bad input that vLLM rejects with an `assert`: a `ValueError` like every
    bad argument in jaxkv, and an `AssertionError` so code written for vLLM that
    expects one still catches it."""


def as_int(value: Any) -> int | None:
    """`value` as a Python int when it is an integer, else None.

    The one definition of an integer argument: a Python int or a numpy integer
    (np.int8 .. np.uint64), never a bool (Python's or numpy's) or a float. Entry
    points convert with this (or `check_int`), so inner layers see Python ints only.
    """
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def check_int(
    name: str, value: Any, *, min_value: int | None = None, max_value: int | None = None
) -> int:
    """`value` as a Python int (see `as_int`); TypeError unless it is an integer, ValueError
    unless `min_value <= value <= max_value`."""
    if type(value) is not int:
        converted = as_int(value)
        if converted is None:
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        value = converted
    if (min_value is not None and value < min_value) or (
        max_value is not None and value > max_value
    ):
        if max_value is None:
            allowed = f">= {min_value}"
        elif min_value is None:
            allowed = f"<= {max_value}"
        else:
            allowed = f"in [{min_value}, {max_value}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_num_blocks(name: str, value: Any) -> int:
    """A pool's block count as a Python int: an integer >= 2 (block 0 is the null block,
    never handed out), else TypeError/ValueError naming `name` and the minimum."""
    value = check_int(name, value)
    if value < 2:
        raise ValueError(f"{name} must be >= 2 (block 0 is the null block), got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if type(value) is not bool and not isinstance(value, np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_str(name: str, value: Any, *, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        allowed = "a str or None" if allow_none else "a str"
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    return value


def check_token_ids(name: str, token_ids: Any) -> list[int]:
    """Token ids as a list of ints in [0, 2**63); a list passed in is returned as is.

    Floats, strings and nested sequences are TypeErrors (a float id would be
    truncated and share cache entries with its integer part); negative or
    too-large ids are ValueErrors.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise TypeError(
                f"{name} must be a 1-D array of integers, got shape {token_ids.shape} "
                f"dtype {token_ids.dtype}"
            )
        if token_ids.size:
            low, high = int(token_ids.min()), int(token_ids.max())
            if low < 0 or high >= TOKEN_ID_LIMIT:
                raise ValueError(
                    f"{name} must hold token ids in [0, 2**63), got {low if low < 0 else high}"
                )
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"{name} must be a sequence of integer token ids, got {token_ids!r} "
            f"({type(token_ids).__name__})"
        )
    try:
        packed = array.array("q", token_ids)
    except TypeError:
        raise TypeError(
            f"{name} must hold integer token ids only (no floats, strings or nested "
            f"sequences), got {token_ids!r}"
        ) from None
    except OverflowError:
        raise ValueError(
            f"{name} must hold token ids in [0, 2**63), got one out of that range"
        ) from None
    if packed:
        low = np.frombuffer(packed, dtype=np.int64).min()
        if low < 0:
            raise ValueError(f"{name} must hold token ids in [0, 2**63), got {int(low)}")
    return token_ids if type(token_ids) is list else packed.tolist()


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_memory(text: str, flag: str = "--memory") -> int:
    """Bytes in `text` such as `16GiB`, `512MiB`, `2e9` or `8GB`; ValueError naming
    `flag` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    size = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else math.nan
    if not math.isfinite(size):
        raise ValueError(
            f"{flag} {text!r} is not a size; use a finite number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 16GiB"
        )
    return int(size)


# The tenant-quota key for every cache_salt a quota mapping does not list.
DEFAULT_TENANT_QUOTA_KEY = "*"


def check_tenant_quota_key(name: str, key: Any) -> str:
    """A tenant-quota mapping's key: a non-empty cache_salt, or `DEFAULT_TENANT_QUOTA_KEY`
    for every salt not listed. `""` is no salt (vLLM treats it as none): unsalted
    requests share one cache and no tenant quota applies to them."""
    key = check_str(f"{name} key", key)
    if not key:
        raise ValueError(
            f"{name} has the key ''; '' is no salt and unsalted requests are not capped: "
            f"give non-empty cache_salt values, or {DEFAULT_TENANT_QUOTA_KEY!r} for every "
            "salt not listed"
        )
    return key


def host_memory_bytes() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(name: str, size: int) -> None:
    """ValueError naming `name` when `size` bytes exceed this host's physical memory
    (an allocation that large would fail, or push the host into swap, mid-build)."""
    total = host_memory_bytes()
    if size > total:
        raise ValueError(
            f"{name} is {size} bytes, more than this host's memory ({total} bytes); "
            "give at most what the host can hold beside the rest of the process"
        )
