"""Shared fixtures: the module-level NONE_HASH is put back after every test."""

from __future__ import annotations

import os

import pytest

import jaxkv.hashing as hashing

# The suite counts compilations: programs come from XLA, never from a persistent cache
# a previous run left (tests of the cache give their own directory, in a subprocess).
os.environ["JAXKV_COMPILATION_CACHE"] = "none"


@pytest.fixture(autouse=True)
def restore_none_hash(monkeypatch):
    """Tests may re-initialise NONE_HASH (and must not see PYTHONHASHSEED); undo it after."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    saved = (hashing.NONE_HASH, hashing._none_hash_seed)
    yield
    hashing.NONE_HASH, hashing._none_hash_seed = saved


@pytest.fixture
def fixed_none_hash():
    """NONE_HASH from sha256_cbor with the seed "test-seed"."""
    hashing.init_none_hash(hashing.get_hash_fn_by_name("sha256_cbor"), "test-seed")
