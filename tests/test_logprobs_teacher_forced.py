"""The logprobs of decoding are the trainer's teacher-forced view (issue 39, item 3).

For every model family (Gemma 1/2/3 with sliding windows and soft caps, Llama, LLaVA with
an image in the prompt) in float32 and bfloat16: the logprobs a request returns while
decoding equal the `prompt_logprobs` of a second request whose prompt is the first's
prompt plus its output (carrying the same image), at those positions: the sampled
token's logprob and rank, and every top-k entry both hold, within 1e-5 in float32 and
2e-3 in bfloat16 (measured: at most a few 1e-6 in either). One engine per family and
dtype runs every condition at once: the decoding requests share a prefix a warm-up
request cached (prefix hits), their prompts are longer than `max_num_batched_tokens`
(chunked prefill), and the pool holds one request of `max_model_len`, so they preempt
each other and recompute mid-decode. They sample greedily, at temperature 1, and through
top-k/top-p and min-p: the logprobs are of the raw model output whatever the sampling
(the default `logprobs_mode`). The 8-device case runs
Gemma 3 and LLaVA on a `(data 2, model 4)` mesh in a fresh JAX process.

Each engine compiles its step shapes (about half a minute): the whole module is in the
slow part.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from eight_devices import call_on_8_devices
from models_util import family_configs

from jaxkv import models
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.sizing import kv_cache_groups

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAMILIES = ("gemma", "gemma2", "gemma3", "llama", "llava")
BOUNDS = {"float32": 1e-5, "bfloat16": 2e-3}
BLOCK, CHUNK, MAX_LEN = 4, 16, 64
CONFIG = EngineConfig(
    block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=MAX_LEN
)
NUM_TOP, MAX_TOKENS = 5, 12
# Greedy, plain sampling, top-k with top-p, min-p: one request each. No penalties: a
# penalized request reads no prefix cache (its penalty state counts the prompt it feeds).
SAMPLINGS = (
    dict(),
    dict(temperature=1.0, seed=1),
    dict(temperature=0.7, top_k=20, top_p=0.9, seed=2),
    dict(temperature=1.0, min_p=0.05, seed=4),
)
FORCED = SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP, ignore_eos=True)


def family_config(family: str) -> dict:
    """The tiny HF config of `family` (`FAMILIES`)."""
    return {**family_configs(), "llava": models.tiny_configs()["llava-tiny"]}[family]


def _pool_blocks(model, dtype: str) -> int:
    """The smallest pool the engine takes: one request of `MAX_LEN` tokens and the null
    block. Four requests of about 40 tokens do not fit it together: they preempt each
    other."""
    groups, _ = kv_cache_groups(model.kv_cache_specs(BLOCK, dtype))
    one = sum(g.kv_cache_spec.max_num_blocks_per_req(MAX_LEN, CHUNK) for g in groups)
    return 1 + one


def _workload(model) -> tuple[list[list[int]], list | None, tuple[int, ...]]:
    """A warm-up prompt and four decoding prompts sharing its first 12 tokens (with
    LLaVA's image among them), each longer than `CHUNK`; their images (None: a text
    model); the token the requests must not sample (LLaVA's image token: a teacher-forced
    prompt holding it would ask for a second image)."""
    rng = np.random.default_rng(7)
    llava = getattr(model, "llava_config", None)
    shared = rng.integers(3, 250, 12).tolist()
    if llava is not None:
        shared[2] = llava.image_token_id
    prompts = [shared + rng.integers(3, 250, int(rng.integers(14, 21))).tolist() for _ in range(5)]
    if llava is None:
        return prompts, None, ()
    size = llava.vision.image_size
    picture = np.random.default_rng(8).standard_normal((3, size, size)).astype(np.float32)
    return prompts, [[picture]] * len(prompts), (llava.image_token_id,)


def _samplings(banned: tuple[int, ...]) -> list[SamplingParams]:
    """`SAMPLINGS` as requests of `MAX_TOKENS` tokens with `NUM_TOP` logprobs; `banned`
    tokens are stop tokens held back by `min_tokens` (so never sampled)."""
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_TOP, stop_token_ids=banned,
            min_tokens=MAX_TOKENS if banned else 0, **fields,
        )  # fmt: skip
        for fields in SAMPLINGS
    ]


def _rank_unexplained(decode: dict, prompt: dict, sampled: int, bound: float) -> bool:
    """Whether the two ranks of `sampled` differ by more than its near-ties explain: the
    top entries whose logprob is within `bound` of its own (two programs may order
    tokens that close either way, as they may differ by `bound` in value), plus one for
    a token ranked below the top entries, whose near-tie these entries cannot show."""
    own = prompt[sampled].logprob
    near = sum(abs(e.logprob - own) <= bound for t, e in prompt.items() if t != sampled)
    unseen = min(decode[sampled].rank, prompt[sampled].rank) > len(prompt) - 1
    return abs(decode[sampled].rank - prompt[sampled].rank) > near + unseen


def _differences(outs, forced, bound: float) -> dict:
    """The largest |decode - teacher-forced| logprob of the sampled tokens and of the top
    entries both hold, how many ranks differ beyond the near-ties within `bound`, how
    many tokens were compared."""
    token = top = 0.0
    ranks_differ = checked = 0
    for out, teacher in zip(outs, forced, strict=True):
        start = len(out.prompt_token_ids)
        assert teacher.prompt_token_ids == out.prompt_token_ids + out.output_token_ids
        assert len(out.logprobs) == len(out.output_token_ids) == MAX_TOKENS
        for i, sampled in enumerate(out.output_token_ids):
            decode, prompt = out.logprobs[i], teacher.prompt_logprobs[start + i]
            token = max(token, abs(decode[sampled].logprob - prompt[sampled].logprob))
            ranks_differ += _rank_unexplained(decode, prompt, sampled, bound)
            both = decode.keys() & prompt.keys()
            assert len(both) >= NUM_TOP, "the top entries are mostly the same tokens"
            top = max(top, *(abs(decode[t].logprob - prompt[t].logprob) for t in both))
            checked += 1
    return {"token": token, "top": top, "ranks_differ": ranks_differ, "checked": checked}


def teacher_forced_report(path: str, dtype: str, mesh_shape: str = "") -> dict:
    """Serve `_workload` on the checkpoint at `path` in `dtype` (on a `"data,model"` mesh
    when `mesh_shape` is given) and compare each decoding request's logprobs with the
    teacher-forced ones (`_differences`); with the conditions it ran under. JSON data,
    so the 8-device run can send it back."""
    mesh = None
    if mesh_shape:
        from jaxkv.device import make_mesh

        mesh = make_mesh(*(int(n) for n in mesh_shape.split(",")))
    model = models.load_model(path, dtype=dtype, mesh=mesh)
    config = dataclasses.replace(CONFIG, dtype=dtype, num_blocks=_pool_blocks(model, dtype))
    engine = LLMEngine(model, config, mesh=mesh)
    prompts, images, banned = _workload(model)
    warm_up = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate(prompts[:1], warm_up, images=images and images[:1])
    preempted = engine.num_preemptions
    outs = engine.generate(prompts[1:], _samplings(banned), images=images and images[1:])
    preempted = engine.num_preemptions - preempted
    full = [p + o.output_token_ids for p, o in zip(prompts[1:], outs, strict=True)]
    forced = engine.generate(full, FORCED, images=images and images[1:])
    return {
        **_differences(outs, forced, BOUNDS[dtype]),
        "preemptions": preempted,
        "cached": [o.num_cached_tokens for o in outs],
        "prompt_lens": [len(o.prompt_token_ids) for o in outs],
        "ranks": len(engine.schedulers),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """One random checkpoint per family, in `root / family`."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        models.save_random_checkpoint(root / family, family_config(family), seed=3)
    return root


def _check(report: dict, dtype: str, min_hits: int, preempts: bool = True) -> None:
    """The bound of `dtype` holds and the run met every condition it stands for: at
    least `min_hits` decoding requests hit the warm-up's prefix (a sliding-window group's
    prefix blocks leave the window of the requests running and may be evicted before
    the last one is admitted; on several data ranks the prefix is on one rank only).
    `preempts`: the pool runs dry (one device; on 8 data ranks each has its own pool and
    the four requests spread over them)."""
    assert report["checked"] == len(SAMPLINGS) * MAX_TOKENS
    assert report["token"] <= BOUNDS[dtype] and report["top"] <= BOUNDS[dtype], report
    assert report["ranks_differ"] == 0, report
    if preempts:
        assert report["preemptions"] > 0, "the pool is sized to preempt mid-decode"
    assert min(report["prompt_lens"]) > CHUNK, "every prompt is chunked"
    assert sum(cached > 0 for cached in report["cached"]) >= min_hits, report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_logprobs_equal_teacher_forced(checkpoints, family, dtype) -> None:
    report = teacher_forced_report(str(checkpoints / family), dtype)
    print(f"{family} {dtype}: {report}")
    _check(report, dtype, min_hits=2)


@pytest.mark.timeout(1800)
def test_decode_logprobs_equal_teacher_forced_on_8_devices(checkpoints) -> None:
    for family, dtype in (("gemma3", "float32"), ("llava", "bfloat16")):
        report = call_on_8_devices(
            "test_logprobs_teacher_forced", "teacher_forced_report",
            checkpoints / family, dtype, "2,4", timeout=1500,
        )  # fmt: skip
        print(f"{family} {dtype} on 8 devices: {report}")
        # Several data ranks (the engine may turn model devices its KV heads cannot use
        # into data ranks: 2 KV heads over a model axis of 4).
        assert report["ranks"] >= 2
        _check(report, dtype, min_hits=1, preempts=False)
