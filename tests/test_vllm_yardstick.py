"""tools/vllm_core_yardstick.py: import rewriting, name resolution, and a run end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxkv
import jaxkv.blocks
from jaxkv import hashing

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


yardstick = _load("vllm_core_yardstick")
shim = _load("vllm_yardstick_shim")

SAMPLE = """\
# header comment
import copy
import torch
import vllm.v1.core.kv_cache_utils as kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    init_none_hash as init,
)


def test_body():
    from vllm.v1.core.block_pool import BlockPool
    x = copy.copy([torch.float32])
    return BlockPool, x
"""


def test_rewrite_touches_only_vllm_and_torch_imports_and_keeps_line_numbers():
    out = yardstick.rewrite_imports(SAMPLE).splitlines()
    src = SAMPLE.splitlines()
    assert out[0].startswith("import vllm_yardstick_shim as _jaxkv_yardstick")
    body = out[1:]
    assert len(body) == len(src)
    assert body[1] == "import copy"
    assert body[2] == "torch = _jaxkv_yardstick.module('torch')"
    assert body[3] == ("kv_cache_utils = _jaxkv_yardstick.module('vllm.v1.core.kv_cache_utils')")
    assert body[4] == (
        "KVCacheBlock, init = _jaxkv_yardstick.names("
        "'vllm.v1.core.kv_cache_utils', 'KVCacheBlock', 'init_none_hash')"
    )
    assert body[5:8] == ["", "", ""]  # the rest of the multi-line import, blanked
    assert (
        body[11] == "    BlockPool = _jaxkv_yardstick.names('vllm.v1.core.block_pool', 'BlockPool')"
    )
    # Test bodies are untouched.
    assert body[12:] == src[12:]


def test_plain_dotted_import_binds_the_top_package():
    out = yardstick.rewrite_imports("import vllm.v1.core.kv_cache_utils\n").splitlines()
    assert out[1] == "vllm = _jaxkv_yardstick.root('vllm.v1.core.kv_cache_utils')"


def test_names_resolve_to_jaxkv_objects():
    block, queue = shim.names(
        "vllm.v1.core.kv_cache_utils", "KVCacheBlock", "FreeKVCacheBlockQueue"
    )
    assert block is jaxkv.KVCacheBlock and queue is jaxkv.blocks.FreeKVCacheBlockQueue
    assert shim.names("vllm.utils.hashing", "sha256_cbor") is hashing.get_hash_fn_by_name(
        "sha256_cbor"
    )
    assert shim.module("torch").float16 is np.float16


def test_missing_name_fails_only_when_used_and_names_itself():
    missing = shim.names("vllm.v1.core.sched.scheduler", "Scheduler")
    assert isinstance(missing | None, shim.Missing)  # usable in annotations
    with pytest.raises(shim.NoJaxkvEquivalentError, match="vllm.v1.core.sched.scheduler.Scheduler"):
        missing()


def test_module_proxy_reads_module_globals_live():
    proxy = shim.module("vllm.v1.core.kv_cache_utils")
    jaxkv.init_none_hash(jaxkv.get_hash_fn_by_name("sha256"), seed="yardstick-a")
    first = proxy.NONE_HASH
    jaxkv.init_none_hash(jaxkv.get_hash_fn_by_name("sha256"), seed="yardstick-b")
    assert proxy.NONE_HASH != first and proxy.NONE_HASH == hashing.NONE_HASH
    jaxkv.init_none_hash(jaxkv.get_hash_fn_by_name("sha256"))
    package = shim.root("vllm.v1.core.kv_cache_utils")
    assert package.v1.core.kv_cache_utils.KVCacheBlock is jaxkv.KVCacheBlock


VLLM_STYLE_TESTS = """\
import pytest
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.cpu_test


def test_queue():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    assert queue.num_free_blocks == 2


def test_scheduler():
    Scheduler()
"""


def test_end_to_end_counts_and_causes(tmp_path):
    (tmp_path / "test_block_pool.py").write_text(VLLM_STYLE_TESTS)
    out = tmp_path / "out.json"
    assert yardstick.main([str(tmp_path), "--json", str(out), "--quiet"]) == 0
    payload = json.loads(out.read_text())
    row = payload["summary"]["test_block_pool.py"]
    assert (row["total"], row["passed"], row["failed"]) == (2, 1, 1)
    assert row["causes"] == {"missing: vllm.v1.core.sched.scheduler.Scheduler": 1}
