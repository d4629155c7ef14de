"""Encoder store: the device store's functional API (store array in, store array out,
donated) driven by the host page allocator, as the engine's runner drives it: exact round
trips, page reuse, donation, merge, sharding, sizing, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from default_codegen import compile_by_default
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from jax.sharding import Mesh, PartitionSpec

from jaxkv.device.encoder_store import EncoderCacheStore
from jaxkv.encoder_cache_manager import EncoderCacheManager
from jaxkv.encoder_pages import EmbedPlacement, EncoderPageAllocator
from jaxkv.request import MultiModalFeatureSpec, Request

HIDDEN = 8


class Held:
    """A device store, its array and its host pages, held as the engine's runner holds
    them (`ModelRunner.encoder_store`, `encoder_cache`, `encoder_pages`)."""

    def __init__(self, num_pages: int, page_size: int, dtype=jnp.float32, **kwargs) -> None:
        self.device = EncoderCacheStore(num_pages, page_size, HIDDEN, dtype=dtype, **kwargs)
        self.pages = EncoderPageAllocator(num_pages, page_size)
        self.array = self.device.allocate()

    def put(self, mm_hash: str, x) -> np.ndarray:
        """Allocate pages for `mm_hash` on the host, write `x` there; return the pages."""
        pages = self.pages.allocate(mm_hash, x.shape[0])
        self.array = self.device.write(self.array, x, pages)
        return pages

    def get(self, mm_hash: str) -> jax.Array:
        pages = self.pages
        return self.device.gather(self.array, pages.pages_of(mm_hash), pages.num_embeds_of(mm_hash))


def store(num_pages: int = 16, page_size: int = 4, **kwargs) -> Held:
    return Held(num_pages, page_size, **kwargs)


def embeds(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, HIDDEN)).astype(np.float32)


def test_write_then_gather_returns_exact_embeddings():
    rng = np.random.default_rng(0)
    s = store()
    a, b, c = embeds(rng, 10), embeds(rng, 4), embeds(rng, 1)
    pages_a = s.put("a", a)
    pages_b = s.put("b", jnp.asarray(b))  # device input too
    s.put("c", c)
    assert len(pages_a) == 3 and len(pages_b) == 1
    assert len(set(pages_a) | set(pages_b) | set(s.pages.pages_of("c"))) == 5
    np.testing.assert_array_equal(np.asarray(s.get("a")), a)
    np.testing.assert_array_equal(np.asarray(s.get("b")), b)
    np.testing.assert_array_equal(np.asarray(s.get("c")), c)
    np.testing.assert_array_equal(np.asarray(s.device.gather(s.array, pages_a, 6)), a[:6])
    assert s.pages.num_free_pages == 11 and s.pages.num_embeds_of("a") == 10 and "a" in s.pages


def test_freed_pages_are_reused_and_other_entries_untouched():
    rng = np.random.default_rng(1)
    s = store(num_pages=6)
    a, b = embeds(rng, 8), embeds(rng, 4)
    pages_a = s.put("a", a)
    s.put("b", b)
    assert s.pages.num_free_pages == 3
    s.pages.free(["a"])
    assert s.pages.num_free_pages == 5 and "a" not in s.pages
    c = embeds(rng, 8)
    pages_c = s.put("c", c)
    assert sorted(pages_c.tolist()) == sorted(pages_a.tolist())
    np.testing.assert_array_equal(np.asarray(s.get("c")), c)
    np.testing.assert_array_equal(np.asarray(s.get("b")), b)
    with pytest.raises(KeyError, match="'a' is not in the encoder store"):
        s.get("a")


def test_padding_pages_never_touch_the_last_page():
    # 3 pages pad to a bucket of 4; the padding index must be dropped, not wrap to page -1.
    rng = np.random.default_rng(2)
    s = store(num_pages=8, page_size=2)
    for i in range(7):
        s.put(f"fill{i}", embeds(rng, 2))
    last = embeds(rng, 2)
    assert s.put("last", last).tolist() == [7]
    s.pages.free([f"fill{i}" for i in range(3)])
    s.put("three-pages", embeds(rng, 5))
    np.testing.assert_array_equal(np.asarray(s.get("last")), last)
    np.testing.assert_array_equal(np.asarray(s.array[7]), last)


def test_write_donates_the_store_and_needs_no_store_sized_temporaries():
    s = store(num_pages=256, page_size=16)
    old = s.array
    s.put("a", np.ones((20, HIDDEN), np.float32))
    assert old.is_deleted()
    assert not s.array.is_deleted()
    lowered, donated = s.device.lower_write(2)
    assert donated.shape == s.array.shape and donated.dtype == s.array.dtype
    stats = compile_by_default(lowered).memory_analysis()
    assert stats.alias_size_in_bytes == s.device.nbytes  # output aliases the donated input
    assert stats.temp_size_in_bytes < s.device.nbytes // 16


def test_merge_writes_embed_positions_of_the_step_only():
    rng = np.random.default_rng(3)
    s = store(num_pages=16, page_size=4)
    is_embed = np.array([False, True, True, False, True, True, True, False, True, True])
    image = MultiModalFeatureSpec("img", offset=5, length=10, is_embed=is_embed)
    audio = MultiModalFeatureSpec("aud", offset=0, length=6)
    image_embeds, audio_embeds = embeds(rng, int(is_embed.sum())), embeds(rng, 6)
    s.put("img", image_embeds)
    s.put("aud", audio_embeds)
    placements = [
        # Request 1 computes prompt positions [8, 14) at batch rows [3, 9).
        EmbedPlacement("img", image, 8, num_scheduled_tokens=6, batch_offset=3),
        # Request 2 computes [2, 12) at rows [9, 19); its item ends at 6.
        EmbedPlacement(
            "aud", audio, num_computed_tokens=2, num_scheduled_tokens=10, batch_offset=9
        ),
        # A step that does not reach the item changes nothing.
        EmbedPlacement("img", image, 0, num_scheduled_tokens=5, batch_offset=0),
    ]
    tokens = np.arange(20 * HIDDEN, dtype=np.float32).reshape(20, HIDDEN) + 1000
    expected = tokens.copy()
    for p, data in ((placements[0], image_embeds), (placements[1], audio_embeds)):
        mask = p.feature.is_embed
        if mask is None:
            mask = np.ones(p.feature.length, bool)
        for pos in range(p.num_computed_tokens, p.num_computed_tokens + p.num_scheduled_tokens):
            rel = pos - p.feature.offset
            if 0 <= rel < p.feature.length and mask[rel]:
                expected[p.batch_offset + pos - p.num_computed_tokens] = data[mask[:rel].sum()]
    src, dst = s.pages.merge_indices(placements, len(tokens))
    merged = s.device.merge(s.array, jnp.asarray(tokens), src, dst)
    np.testing.assert_array_equal(np.asarray(merged), expected)
    changed = np.flatnonzero((expected != tokens).any(axis=1)).tolist()
    # Image embed positions 9, 10, 11, 13 of the step [8, 14) -> rows 4, 5, 6, 8 (position 12
    # is a break token); audio positions 2..5 -> rows 9..12.
    assert changed == [4, 5, 6, 8, 9, 10, 11, 12]


def test_merge_rejects_rows_outside_the_step():
    s = store()
    s.put("img", np.ones((4, HIDDEN), np.float32))
    feature = MultiModalFeatureSpec("img", offset=0, length=4)
    placement = EmbedPlacement("img", feature, 0, 4, batch_offset=3)
    with pytest.raises(ValueError, match=r"rows \[3, 6\], outside the step's 5 rows"):
        s.pages.merge_indices([placement], 5)
    src, dst = s.pages.merge_indices([placement], 7)
    with pytest.raises(ValueError, match=r"\[tokens, 8\]"):
        s.device.merge(s.array, jnp.zeros((7, 3)), src, dst)
    with pytest.raises(ValueError, match=r"dst value 8 is out of range \[0, 8\)"):
        s.device.merge(s.array, jnp.zeros((7, HIDDEN)), src, dst + 2)
    with pytest.raises(ValueError, match="src has 4 rows but dst has 2"):
        s.device.merge(s.array, jnp.zeros((7, HIDDEN)), src, dst[:2])
    with pytest.raises(KeyError, match="'gone' is not in the encoder store"):
        s.pages.merge_indices([EmbedPlacement("gone", feature, 0, 4, batch_offset=0)], 7)


def test_allocation_errors_change_nothing():
    s = store(num_pages=4, page_size=4)
    s.put("a", np.ones((9, HIDDEN), np.float32))
    with pytest.raises(ValueError, match="needs 2 pages of 4 embeddings but only 1 of 4 are free"):
        s.pages.allocate("b", 5)
    with pytest.raises(ValueError, match="'a' is already in the encoder store"):
        s.pages.allocate("a", 1)
    with pytest.raises(ValueError, match="num_embeds must be >= 0, got -1"):
        s.pages.allocate("c", -1)
    with pytest.raises(TypeError, match="mm_hash must be a str, got int"):
        s.pages.allocate(3, 1)
    with pytest.raises(KeyError, match="unknown \\['zz'\\]"):
        s.pages.free(["a", "zz"])
    with pytest.raises(KeyError, match="listed twice"):
        s.pages.free(["a", "a"])
    assert s.pages.num_free_pages == 1 and "a" in s.pages


def test_write_and_gather_validate_shapes():
    s = store(num_pages=4, page_size=4)
    pages = s.pages.allocate("a", 6)
    device, array = s.device, s.array
    with pytest.raises(ValueError, match=r"embeds \[n, 8\] and ceil\(n / 4\) pages"):
        device.write(array, np.ones((9, HIDDEN), np.float32), pages)
    with pytest.raises(ValueError, match="embeds"):
        device.write(array, np.ones((6, 3), np.float32), pages)
    with pytest.raises(ValueError, match=r"pages value 4 is out of range \[0, 4\)"):
        device.write(array, np.ones((6, HIDDEN), np.float32), [0, 4])
    with pytest.raises(ValueError, match=r"num_embeds must lie in \[0, 8\]"):
        device.gather(array, pages, 9)
    with pytest.raises(ValueError, match=r"store array has shape \(3, 4, 8\)"):
        device.gather(array[:3], pages, 6)
    assert not array.is_deleted(), "a rejected write must not donate"
    for bad in ({"num_pages": 0}, {"page_size": -1}):
        with pytest.raises(ValueError, match="must be a positive int"):
            EncoderCacheStore(**{"num_pages": 4, "page_size": 4, **bad}, hidden_size=HIDDEN)
        with pytest.raises(ValueError, match="must be >= 1"):
            EncoderPageAllocator(**{"num_pages": 4, "page_size": 4, **bad})


def test_sizes_in_bytes():
    s = EncoderCacheStore(10, 16, 64, dtype=jnp.bfloat16)
    assert s.nbytes == 10 * 16 * 64 * 2 == s.allocate().nbytes
    assert EncoderCacheStore.bytes_per_page(16, 64, jnp.float32) == 4096
    assert EncoderCacheStore.pages_for_bytes(10_000, 16, 64, jnp.float32) == 2
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        EncoderCacheStore.pages_for_bytes(-1, 16, 64, jnp.float32)


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.integers(1, 32),
    min_item=st.integers(1, 600),
    extra=st.lists(st.integers(0, 600), min_size=1, max_size=12),
)
def test_pages_needed_covers_any_set_of_items_that_fits_the_cache(page_size, min_item, extra):
    sizes = [min_item + e for e in extra]
    cache_size = sum(sizes)
    needed = sum(-(-n // page_size) for n in sizes)
    bound = EncoderPageAllocator.pages_needed(cache_size, page_size, min_item)
    assert needed <= bound <= cache_size


def test_single_device_mesh_shards_hidden_axis():
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    s = store(mesh=mesh, hidden_axis="model")
    assert s.array.sharding.spec == PartitionSpec(None, None, "model")
    data = np.random.default_rng(4).standard_normal((7, HIDDEN)).astype(np.float32)
    s.put("a", data)
    assert s.array.sharding == s.device.sharding
    np.testing.assert_array_equal(np.asarray(s.get("a")), data)
    with pytest.raises(ValueError, match="'data' is not a mesh axis"):
        store(mesh=mesh, hidden_axis="data")
    with pytest.raises(ValueError, match="needs a mesh"):
        store(hidden_axis="model")


def test_two_device_mesh_splits_hidden_and_round_trips():
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec
        from jaxkv.device.encoder_store import EncoderCacheStore
        mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
        s = EncoderCacheStore(8, 4, 8, dtype=jnp.float32, mesh=mesh, hidden_axis="model")
        array = s.allocate()
        assert array.sharding.spec == PartitionSpec(None, None, "model")
        assert {sh.data.shape for sh in array.addressable_shards} == {(8, 4, 4)}
        data = np.random.default_rng(5).standard_normal((9, 8)).astype(np.float32)
        array = s.write(array, data, [3, 5, 0])
        assert array.sharding == s.sharding
        np.testing.assert_array_equal(np.asarray(s.gather(array, [3, 5, 0], 9)), data)
        try:
            EncoderCacheStore(8, 4, 7, dtype=jnp.float32, mesh=mesh, hidden_axis="model")
        except ValueError as error:
            assert "not divisible by the 2 devices" in str(error)
        else:
            raise AssertionError("indivisible hidden size accepted")
        print("ok")
        """
    )
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_store_driven_by_manager_holds_exactly_the_cached_entries():
    """Scheduler allocates, runner frees the drained hashes then writes; pages never run out."""
    rng = np.random.default_rng(6)
    page_size, sizes = 4, {f"img{i}": int(rng.integers(3, 12)) for i in range(12)}
    manager = EncoderCacheManager(cache_size=30)
    s = store(num_pages=EncoderPageAllocator.pages_needed(30, page_size, 3), page_size=page_size)
    truth = {h: embeds(rng, n) for h, n in sizes.items()}
    evictions = 0
    for step in range(60):
        names = rng.choice(sorted(sizes), size=2, replace=False)
        features, offset = [], 0
        for name in names:
            features.append(MultiModalFeatureSpec(str(name), offset, sizes[name]))
            offset += sizes[name]
        request = Request(f"r{step}", list(range(offset)), mm_features=features)
        scheduled, to_encode = 0, []
        for i, feature in enumerate(request.mm_features):
            if manager.check_and_update_cache(request, i):
                continue
            if manager.can_allocate(request, i, 100, scheduled):
                manager.allocate(request, i)
                scheduled += sizes[feature.identifier]
                to_encode.append(feature.identifier)
        freed = manager.get_freed_mm_hashes()
        evictions += len(freed)
        s.pages.free(freed)
        for mm_hash in to_encode:
            if mm_hash not in s.pages:  # evicted and re-allocated in one pass: data kept
                s.put(mm_hash, truth[mm_hash])
        assert len(s.pages) == len(manager.cached) and all(h in s.pages for h in manager.cached)
        for mm_hash in manager.cached:
            np.testing.assert_array_equal(np.asarray(s.get(mm_hash)), truth[mm_hash])
        manager.free(request)
    assert evictions > 10


def test_out_of_range_pages_bare_strings_and_bad_sizes_are_rejected_changing_nothing():
    s = store(num_pages=6, page_size=4)
    a = s.put("a", np.ones((6, HIDDEN), np.float32))
    b = s.put("b", np.full((3, HIDDEN), 2.0, np.float32))
    s.array = s.device.write(s.array, np.full((6, HIDDEN), 5.0, np.float32), a)  # a rewrite
    with pytest.raises(ValueError, match=r"pages value 6 is out of range \[0, 6\)"):
        s.device.gather(s.array, [0, 6], 4)
    with pytest.raises(ValueError, match=r"pages value -1"):
        s.device.gather(s.array, [-1], 1)
    with pytest.raises(TypeError, match="pages must hold integers, got dtype float64"):
        s.device.write(s.array, np.zeros((4, HIDDEN), np.float32), [1.0])
    with pytest.raises(TypeError, match="bare string 'a'"):
        s.pages.free("a")
    with pytest.raises(TypeError, match="num_embeds must be an integer, got 2.5"):
        s.pages.allocate("c", 2.5)
    with pytest.raises(TypeError, match="num_pages must be an integer, got True"):
        store(num_pages=True)
    with pytest.raises(TypeError, match="page_size must be an integer, got True"):
        EncoderPageAllocator(4, True)
    assert "a" in s.pages and "b" in s.pages and s.pages.num_free_pages == 3
    np.testing.assert_array_equal(np.asarray(s.get("b")), np.full((3, HIDDEN), 2.0))
    np.testing.assert_array_equal(np.asarray(s.get("a")), np.full((6, HIDDEN), 5.0))
    assert b.tolist() == [2]


def test_bf16_stored_as_uint16_round_trips_in_place_with_bounded_programs():
    from jaxkv.device import compilation_count

    s = store(num_pages=64, page_size=4, dtype=jnp.bfloat16, storage_dtype="auto")
    assert s.device.storage_dtype == np.uint16 and s.array.dtype == np.uint16
    rng = np.random.default_rng()
    want = {}
    s.put("warm", rng.standard_normal((3, HIDDEN)).astype(np.float32))
    s.pages.free(["warm"])
    before = compilation_count()
    for i in range(40):  # random sizes, NumPy input: programs per page bucket only
        n = int(rng.integers(1, 17))
        x = rng.standard_normal((n, HIDDEN)).astype(jnp.bfloat16)
        s.put(f"h{i}", x)
        want[f"h{i}"] = x
        s.device.gather_padded(s.array, s.pages.pages_of(f"h{i}"))
        if len(s.pages) > 6:
            gone = sorted(want)[0]
            s.pages.free([gone])
            del want[gone]
    assert compilation_count() - before <= 6, "one write and one gather program per bucket"
    for h, x in want.items():
        got = np.asarray(s.get(h))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(np.uint16), x.view(np.uint16))
    stats = compile_by_default(s.device.lower_write(4)[0]).memory_analysis()
    assert stats.temp_size_in_bytes < 0.1 * s.device.nbytes, "the uint16 store is written in place"


def test_write_returns_a_new_store_array_and_composes_in_a_users_jit():
    s = store(num_pages=8, page_size=4)
    pages = s.pages.allocate("a", 6)
    x = np.arange(6 * HIDDEN, dtype=np.float32).reshape(6, HIDDEN)

    @jax.jit
    def user_step(array, embeds):
        return s.device.write(array, embeds, pages)

    array = user_step(s.array, x)
    np.testing.assert_array_equal(np.asarray(array).reshape(-1, HIDDEN)[4 * pages[0] :][:4], x[:4])
    with pytest.raises(ValueError, match=r"store array has shape \(3, 4, 8\)"):
        s.device.write(array[:3], x, pages)


def test_random_item_sizes_from_numpy_and_jax_compile_a_few_programs_in_place():
    """400 random-size items, half handed over as JAX arrays: programs stay per page
    bucket, bf16 (stored as uint16 on CPU by default) round-trips bit for bit, and every
    write updates the one store buffer in place."""
    from jaxkv.device import compilation_count

    page_size, max_pages = 4, 16
    s = store(num_pages=64, page_size=page_size, dtype=jnp.bfloat16)
    assert s.device.storage_dtype == np.uint16 and s.array.dtype == np.uint16  # CPU default
    pointer = s.array.unsafe_buffer_pointer()
    rng = np.random.default_rng()
    want: dict[str, np.ndarray] = {}
    before = compilation_count()
    for i in range(400):
        n = int(rng.integers(1, page_size * max_pages + 1))
        x = rng.standard_normal((n, HIDDEN)).astype(jnp.bfloat16)
        mm_hash = f"item{i}"
        pages = s.put(mm_hash, jax.device_put(x) if i % 2 else x)  # jnp.asarray compiles
        want[mm_hash] = x
        got = s.get(mm_hash) if i % 3 else s.device.gather(s.array, pages, n)
        assert got.shape == (n, HIDDEN) and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), x.view(np.uint16))
        while s.pages.num_free_pages < max_pages:
            gone = next(iter(want))
            s.pages.free([gone])
            del want[gone]
    buckets = max_pages.bit_length()  # 1, 2, 4, 8, 16 pages
    compiled = compilation_count() - before
    assert compiled <= 2 * buckets, f"{compiled} programs for {buckets} page buckets"
    assert s.array.unsafe_buffer_pointer() == pointer, "writes must update the buffer in place"
    for mm_hash, x in want.items():  # earlier items untouched by later writes
        np.testing.assert_array_equal(np.asarray(s.get(mm_hash)).view(np.uint16), x.view(np.uint16))


class EncoderStoreMachine(RuleBasedStateMachine):
    """Random puts (NumPy or JAX input, any size), rewrites and frees on one bf16 store.

    After every step: the free pages and the items' pages partition the store, every
    item reads back bit for bit, and the store's buffer is the one it started with.
    One device store and array serve all examples (each starts with fresh host pages),
    so the compile count over the whole run is bounded by the page buckets.
    """

    PAGE_SIZE, NUM_PAGES = 4, 24
    shared = None

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls.shared is None:
            cls.shared = Held(cls.NUM_PAGES, cls.PAGE_SIZE, dtype=jnp.bfloat16)
        self.store = cls.shared
        self.store.pages = EncoderPageAllocator(cls.NUM_PAGES, cls.PAGE_SIZE)
        self.pointer = self.store.array.unsafe_buffer_pointer()
        self.truth: dict[str, np.ndarray] = {}
        self.count = 0

    def _data(self, seed: int, n: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n, HIDDEN)).astype(jnp.bfloat16)

    @rule(n=st.integers(0, 40), seed=st.integers(0, 2**16), as_jax=st.booleans())
    def put(self, n, seed, as_jax):
        x = self._data(seed, n)
        mm_hash = f"h{self.count}"
        self.count += 1
        if -(-n // self.PAGE_SIZE) > self.store.pages.num_free_pages:
            with pytest.raises(ValueError, match="are free"):
                self.store.put(mm_hash, x)
            return
        self.store.put(mm_hash, jax.device_put(x) if as_jax else x)
        self.truth[mm_hash] = x

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), seed=st.integers(0, 2**16), as_jax=st.booleans())
    def rewrite(self, data, seed, as_jax):
        store = self.store
        mm_hash = data.draw(st.sampled_from(sorted(self.truth)))
        x = self._data(seed, store.pages.num_embeds_of(mm_hash))
        x_in = jax.device_put(x) if as_jax else x
        store.array = store.device.write(store.array, x_in, store.pages.pages_of(mm_hash))
        self.truth[mm_hash] = x

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def free(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.truth)), unique=True, min_size=1))
        self.store.pages.free(gone)
        for mm_hash in gone:
            del self.truth[mm_hash]

    @invariant()
    def pages_partition_and_items_read_back(self):
        pages = self.store.pages
        owned = [p for h in self.truth for p in pages.pages_of(h).tolist()]
        assert sorted(owned + pages._free_pages) == list(range(self.NUM_PAGES))
        assert len(pages) == len(self.truth)
        for mm_hash, x in self.truth.items():
            got = np.asarray(self.store.get(mm_hash))
            np.testing.assert_array_equal(got.view(np.uint16), x.view(np.uint16))
        assert self.store.array.unsafe_buffer_pointer() == self.pointer


def test_encoder_store_state_machine():
    from jaxkv.device import compilation_count

    before = compilation_count()
    run_state_machine_as_test(
        EncoderStoreMachine,
        settings=settings(max_examples=15, stateful_step_count=15, deadline=None),
    )
    buckets = (EncoderStoreMachine.NUM_PAGES).bit_length()  # 1..16 pages, plus 0 rows
    assert compilation_count() - before <= 2 * buckets + 2
