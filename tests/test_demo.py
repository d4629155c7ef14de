"""`jaxkv demo` runs end to end in quick mode and its checks hold."""

from __future__ import annotations

import pytest

from jaxkv import demo
from jaxkv.testing.reference import DenseReference
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs


@pytest.mark.timeout(300)
def test_quick_demo_serves_everything_correctly(tmp_path) -> None:
    plot = tmp_path / "stats.png"
    summaries = demo.main(["--quick", "--no-progress", "--plot", str(plot)])
    assert [s["model"] for s in summaries] == ["gemma-style-tiny", "llava-style-tiny"]
    for s in summaries:
        assert s["dense_check"] == "OK", s["dense_mismatched"]
        assert s["requests"] > 0
        assert s["compilations"] <= s["compile_bound"]
        assert s["steps_compiling"] < s["steps"] // 2, "most steps must compile nothing"
        assert s["num_free_blocks"] == s["num_blocks"] - 1, "every block came back"
    chats, images = summaries
    assert chats["prefix_cache_hit_rate"] > 0.3, "system prompts and earlier turns hit"
    assert chats["preemptions"] > 0, "the quick run is sized so the pool runs dry"
    assert chats["requests"] > 6, "follow-up turns were served"
    assert images["encoder_cache_hit_rate"] > 0 and images["images_encoded"] == 3
    assert images["prefix_cache_hit_rate"] > 0, "a repeated instruction and image hit"
    assert plot.stat().st_size > 10_000


def test_dense_reference_depends_on_the_context() -> None:
    """A degenerate model (say, one echoing its input) would pass the dense check vacuously."""
    import numpy as np

    model = TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)
    reference = DenseReference(model, 256)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 512, 256).tolist()
    changed = list(tokens)
    changed[:64] = rng.integers(3, 512, 64).tolist()
    before = np.array(reference.expected(tokens[:1], tokens[1:]))
    after = np.array(reference.expected(changed[:1], changed[1:]))
    assert (before[64:] != after[64:]).mean() > 0.5, "later tokens must depend on earlier ones"
    assert (before != np.array(tokens[1:])).mean() > 0.9, "the model must not echo its input"


@pytest.mark.timeout(300)
def test_quick_demo_with_a_host_tier_and_tenants_shows_their_figures(capsys) -> None:
    summaries = demo.main(
        ["--quick", "--no-progress", "--kv-offloading-size", "16MiB", "--tenants", "2",
         "--tenant-device-blocks", "6"]
    )  # fmt: skip
    for s in summaries:
        assert s["dense_check"] == "OK", s["dense_mismatched"]
        assert s["host_tier"] and s["num_free_blocks"] == s["num_blocks"] - 1
        # The bound counts the host tier's transfer programs too.
        assert s["compilations"] <= s["compile_bound"]
        assert set(s["tenants"]) == {"t0", "t1"}
        for t in s["tenants"].values():
            assert 0 < t["device_cached_blocks"] <= t["device_block_quota"] == 6
        assert sum(t["host_bytes_used"] for t in s["tenants"].values()) == s["host_bytes_used"]
    chats = summaries[0]
    assert chats["host_hit_rate"] > 0 and chats["host_loaded_bytes"] > 0
    assert sum(t["host_cached_tokens"] for t in chats["tenants"].values()) > 0
    out = capsys.readouterr().out
    assert "host-tier hit rate" in out and "host-tier MiB held" in out
    assert "tenant t1: device blocks / host MiB" in out
