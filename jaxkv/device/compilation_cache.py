"""XLA's persistent compilation cache: a second run compiles nothing it compiled before.

JAX keeps compiled programs on disk, keyed by the program and the backend, when
`jax_compilation_cache_dir` is set; the setting is process-wide, so the last engine
that turns it on decides where programs go. jaxkv caches every program (JAX's
defaults skip programs that compiled in under a second, which are most of a small
model's step programs on a fast machine).

Settings, as `EngineConfig(compilation_cache_dir=...)` and `--compilation-cache` take
them: `"auto"` (the default) uses `$JAXKV_COMPILATION_CACHE` if set, else
`$XDG_CACHE_HOME/jaxkv/xla` (`~/.cache/jaxkv/xla`); `None` or `"none"` leaves the
cache off (a cache another engine turned on in the same process stays on); any other
string is a directory, created if missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["ENV_VAR", "enable_compilation_cache", "resolve_compilation_cache_dir"]

ENV_VAR = "JAXKV_COMPILATION_CACHE"


def resolve_compilation_cache_dir(setting: str | os.PathLike | None) -> Path | None:
    """The directory `setting` names (module docstring), or None for no cache."""
    if setting is None:
        return None
    if not isinstance(setting, str | os.PathLike):
        raise TypeError(
            f"compilation_cache_dir must be a directory, 'auto', 'none' or None, got {setting!r}"
        )
    setting = os.fspath(setting)
    if setting == "auto":
        setting = os.environ.get(ENV_VAR) or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxkv" / "xla"
        )
    if setting.lower() == "none":
        return None
    if not setting:
        raise ValueError("compilation_cache_dir is empty: give a directory, 'auto' or 'none'")
    return Path(setting).expanduser()


def enable_compilation_cache(setting: str | os.PathLike | None) -> Path | None:
    """Turn XLA's persistent cache on at the directory `setting` names; returns it (None:
    left off). ValueError naming the directory when it cannot be created or written."""
    path = resolve_compilation_cache_dir(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"compilation cache directory {str(path)!r}: {error.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"compilation cache directory {str(path)!r} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
