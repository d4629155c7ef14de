"""A `RequestOutput` sent to another process (the server's side of an engine process)
pickles its own span of the request's tokens and logprobs, not the request's history,
and arrives equal to what was sent."""

from __future__ import annotations

import pickle

from jaxkv.engine.outputs import Logprob, RequestOutput


def output_at(end: int, new: int = 2) -> RequestOutput:
    """A DELTA-style output: the last `new` of a request's first `end` tokens."""
    tokens = list(range(100, 100 + end))
    logprobs = [{t: Logprob(-0.5, 1, f"t{t}")} for t in tokens]
    output = RequestOutput(
        "r", [1, 2, 3], tokens, end - new, end - new, end, False, text="ab",
        logprobs=logprobs, cumulative_logprob=-1.0, stop_reason=None,
    )  # fmt: skip
    output.weight_versions = (0, 1)
    return output


def test_an_output_arrives_equal_with_only_its_span() -> None:
    sent = output_at(10)
    got = pickle.loads(pickle.dumps(sent))
    assert got == sent
    assert got.new_token_ids == [108, 109] and got.logprobs == sent.logprobs
    assert got.weight_versions == (0, 1) and got.outputs == sent.outputs


def test_the_pickled_size_does_not_grow_with_the_request() -> None:
    short, long = pickle.dumps(output_at(10)), pickle.dumps(output_at(10_000))
    assert abs(len(long) - len(short)) < 64, (len(short), len(long))


def test_every_field_survives_a_finished_parents_output() -> None:
    """A finished `n > 1` parent's output with every field set to something other than
    its default arrives with each of them (a field the pickled form forgot would come
    back as the default)."""
    child = output_at(6)
    samples = [child.completion(0), child.completion(1)]
    sent = RequestOutput(
        "parent", [7, 8], list(range(6)), 2, 4, 6, True, "stop", "xyz", 3, "why", 2, 1,
        logprobs=child._logprobs, cumulative_logprob=-2.5, stop_reason="</s>",
        prompt_logprobs=[None, {8: Logprob(-0.1, 1, "b")}], completions=samples,
    )  # fmt: skip
    sent.weight_versions = ("v1",)
    got = pickle.loads(pickle.dumps(sent))
    assert got == sent and got.outputs == samples and got.weight_versions == ("v1",)
    assert (got.num_preemptions, got.error, got.num_host_cached_tokens) == (3, "why", 1)
