"""The model runner's persistent request rows (issue 21, item 5).

The scheduler sends block-id changes (new ids, leading null blocks, row resets); the
runner keeps one row per request and data rank and applies them. After every step each
running request's row must equal the KV cache manager's `get_block_ids`, and the block
tables packed for the device must be exactly those rows in scheduled order, zero-padded
(what the runner sent before it kept rows). Checked at every step across preemption,
finish and re-admission (rows reused), with one step in flight or none, on sliding-window
groups (blocks turning into the null block), and around a request that fails alone.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from jaxkv import models
from jaxkv.block_table import BlockTable
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.model_runner import RowSampling
from jaxkv.engine.request_rows import RequestRows, RequestStepError, RowChanges
from jaxkv.testing.reference import DenseReference
from jaxkv.testing.tiny_model import TinyCausalLM, tiny_configs

CONFIG = EngineConfig(
    block_size=4, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=80
)


@dataclasses.dataclass
class Watch:
    """What the checks saw: steps checked, most rows held at once, requests reset after
    they had a row (re-admitted), rows with leading null blocks."""

    steps: int = 0
    most_rows: int = 0
    readmitted: int = 0
    null_rows: int = 0


def watch(engine: LLMEngine) -> Watch:
    """Check the runner's rows and the block tables it packs after every `execute`."""
    runner, seen, packed = engine.runner, Watch(), []
    step, execute = runner._step, runner.execute
    had_row: set[str] = set()

    def recording_step(buffer, shapes, *features):
        packed.append((buffer, shapes))
        return step(buffer, shapes, *features)

    def checking_execute(outs, *args):
        packed.clear()
        sampled = execute(outs, *args)
        for rows, scheduler, out in zip(runner.rows, engine.schedulers, outs, strict=True):
            manager = scheduler.kv_cache_manager
            assert set(rows.index) == {r.request_id for r in scheduler.running}
            for request_id in rows.index:
                assert rows.block_ids(request_id) == manager.get_block_ids(request_id)
                seen.null_rows += any(ids[:1] == [0] for ids in rows.block_ids(request_id))
            seen.readmitted += sum(s.resets_row and s.request.request_id in had_row
                                   for s in out.scheduled)  # fmt: skip
            had_row.update(rows.index)
            seen.most_rows = max(seen.most_rows, len(rows.index))
        if packed:
            ((buffer, shapes),) = packed
            fields = runner._layout(shapes).unpack(buffer)
            for g, shape in enumerate(shapes):
                r, w = shape.num_reqs, shape.max_blocks_per_req
                metadata = shape.layout.unpack(fields[f"metadata{g}"])
                tables = metadata["block_tables"].reshape(len(outs), r, w)
                for rank, (scheduler, out) in enumerate(zip(engine.schedulers, outs, strict=True)):
                    want = np.zeros((r, w), np.int32)
                    for i, s in enumerate(out.scheduled):
                        ids = scheduler.kv_cache_manager.get_block_ids(s.request.request_id)[g]
                        want[i, : len(ids)] = ids
                    np.testing.assert_array_equal(tables[rank], want)
        seen.steps += 1
        return sampled

    runner._step, runner.execute = recording_step, checking_execute
    return seen


def prompts(num: int, seed: int, length: tuple[int, int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 200, 9).tolist()
    return [shared + rng.integers(3, 200, int(rng.integers(*length))).tolist() for _ in range(num)]


@pytest.fixture(scope="module")
def tiny():
    return TinyCausalLM(tiny_configs()["gemma-style-tiny"], seed=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_follow_the_manager_across_preemption_finish_and_readmission(tiny, overlap):
    engine = LLMEngine(tiny, dataclasses.replace(CONFIG, async_scheduling=overlap))
    seen = watch(engine)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = engine.generate(prompts(8, seed=1, length=(4, 30)), sampling)
    assert all(len(o.output_token_ids) == 12 for o in outputs)
    assert engine.num_preemptions > 0 and seen.readmitted > 0, "preempted, then re-admitted"
    assert seen.most_rows == CONFIG.max_num_seqs, "8 requests through 3 rows: rows reused"
    assert seen.steps > 20
    reference = DenseReference(tiny, CONFIG.max_model_len)
    for out in outputs:
        want = reference.expected(out.prompt_token_ids, out.output_token_ids)
        assert out.output_token_ids == want, out.request_id


def test_a_failed_request_leaves_every_row_as_it_was(tiny):
    engine = LLMEngine(tiny, CONFIG)
    seen = watch(engine)
    good = [engine.add_request(p, sampling=SamplingParams(max_tokens=5, ignore_eos=True))
            for p in prompts(2, seed=2, length=(4, 20))]  # fmt: skip
    bad = engine.add_request([5, 6, 7])
    engine._requests.sampling[bad] = RowSampling(0.5, 0, 1.0, 2**40)  # no int32 holds this seed
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[bad].finish_reason == "error" and "OverflowError" in finals[bad].error
    assert all(finals[r].finish_reason == "length" for r in good)
    assert seen.steps > 5


def test_a_refused_block_change_fails_its_request_alone(tiny):
    """A step's block changes are checked in one batch per group; the one a table refuses
    (here a block id past the pool) fails its own request, named; the others' rows take
    their changes and their tokens are the dense reference's."""
    engine = LLMEngine(tiny, CONFIG)
    ids = [engine.add_request(p, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
           for p in prompts(3, seed=3, length=(4, 12))]  # fmt: skip
    execute, victim = engine.runner.execute, []

    def corrupting_execute(outs, *args):
        for s in outs[0].scheduled:
            if not victim and not s.resets_row and s.new_block_ids:
                victim.append(s.request.request_id)
                s.new_block_ids = ([CONFIG.num_blocks + 5], *s.new_block_ids[1:])
        return execute(outs, *args)

    engine.runner.execute = corrupting_execute
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    (bad,) = victim
    assert finals[bad].finish_reason == "error"
    assert f"block id {CONFIG.num_blocks + 5} is out of range" in finals[bad].error
    reference = DenseReference(tiny, CONFIG.max_model_len)
    for out in (finals[r] for r in ids if r != bad):
        assert out.finish_reason == "length"
        want = reference.expected(out.prompt_token_ids, out.output_token_ids)
        assert out.output_token_ids == want, out.request_id
    engine.step()  # the finished requests' rows are released with the next step
    assert not engine.runner.rows[0].index
    assert engine.kv_cache_manager.num_free_blocks == CONFIG.num_blocks - 1


def test_sliding_window_rows_take_the_null_block_as_the_manager_does(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    models.save_random_checkpoint(path, models.tiny_configs()["gemma3-tiny"], seed=0)
    model = models.load_model(path)
    window = model.config.sliding_window
    config = dataclasses.replace(CONFIG, num_blocks=64, max_num_seqs=4, max_model_len=92)
    engine = LLMEngine(model, config)
    assert len(engine.runner.kv_cache_config.kv_cache_groups) > 1, "hybrid groups"
    seen = watch(engine)
    engine.generate(
        prompts(5, seed=3, length=(3 * window, 3 * window + 20)),
        SamplingParams(max_tokens=16, ignore_eos=True),
    )
    assert seen.null_rows > 0, "blocks left the window"
    assert engine.num_preemptions > 0


def test_request_rows_import_no_jax() -> None:
    """The rows are host-only numpy: importing their module (and so everything it
    imports) leaves JAX unloaded, in a fresh interpreter."""
    code = (
        "import sys; import jaxkv.engine.request_rows; "
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_rows_refuse_bad_block_ids_before_any_row_changes() -> None:
    """Block ids are checked once, where they enter the rows (the step packer trusts
    them): a reset or an append naming a block past the pool is refused, with the
    request and the id named, and no row has changed."""
    table = BlockTable(4, 2, 3, 10)
    rows = RequestRows([table])
    sampling = {"a": RowSampling(0.0, 0, 1.0, 0), "b": RowSampling(0.0, 0, 1.0, 0)}

    def scheduled(request_id, ids, reset):
        request = SimpleNamespace(request_id=request_id, num_prompt_tokens=4)
        return SimpleNamespace(
            request=request, resets_row=reset, new_block_ids=(ids,), num_null_blocks=(0,)
        )

    changes = RowChanges.empty(rows)
    rows.record(changes, scheduled("a", [1, 2], True), sampling)
    rows.check(changes)
    rows.apply(changes)
    before = table.block_table.copy(), dict(rows.index)
    with pytest.raises(ValueError, match="block id 12 is out of range"):
        rows.record(RowChanges.empty(rows), scheduled("b", [3, 12], True), sampling)
    changes = RowChanges.empty(rows)
    rows.record(changes, scheduled("a", [10], False), sampling)
    with pytest.raises(RequestStepError, match="request 'a'.*block id 10 is out of range"):
        rows.check(changes)
    np.testing.assert_array_equal(table.block_table, before[0])
    assert rows.index == before[1] and rows.block_ids("a") == ([1, 2],)
