"""Request token bookkeeping: the prompt+output view and the counters kept beside it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import Request
from jaxkv.request import AllTokenIds


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    outputs=st.lists(st.one_of(st.integers(0, 1000), st.lists(st.integers(0, 9), max_size=3))),
    start=st.integers(-20, 20),
    stop=st.integers(-20, 20),
    step=st.sampled_from([None, 1, 2, -1, 3]),
)
def test_all_token_ids_behaves_like_the_concatenated_list(prompt, outputs, start, stop, step):
    request = Request("r", prompt)
    expected = list(prompt)
    for out in outputs:
        request.append_output_token_ids(np.int64(out) if isinstance(out, int) else out)
        expected += [out] if isinstance(out, int) else out
        # The view stays current and the counters match it.
        assert request.all_token_ids == expected
        assert request.num_tokens == len(request.all_token_ids) == len(expected)
        assert request.num_output_tokens == len(request.output_token_ids)
    view = request.all_token_ids
    assert list(view) == expected
    assert view[start:stop:step] == expected[start:stop:step]
    assert type(view[start:stop]) is list
    # `span`: the in-range slice without a slice object (`BlockStored` token ids).
    lo, hi = sorted((start % (len(expected) + 1), stop % (len(expected) + 1)))
    assert view.span(lo, hi) == expected[lo:hi] and type(view.span(lo, hi)) is list
    for i in (start, stop):
        if -len(expected) <= i < len(expected):
            assert view[i] == expected[i]
        else:
            with pytest.raises(IndexError, match="out of range"):
                view[i]
    assert request.prompt_token_ids == prompt, "the prompt is never mutated"


def test_all_token_ids_is_read_only_and_not_a_copy_of_the_prompt():
    prompt = [5, 6, 7]
    request = Request("r", prompt)
    assert request.prompt_token_ids is prompt
    view = request.all_token_ids
    assert isinstance(view, AllTokenIds)
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    assert not hasattr(view, "append")
    assert view != [5, 6] and view == (5, 6, 7) and repr(view) == "AllTokenIds([5, 6, 7])"
    # A numpy prompt becomes a list of plain ints.
    assert Request("n", np.array([1, 2])).prompt_token_ids == [1, 2]


@pytest.mark.parametrize("bad", [1.5, [1, 2.5], "ab", None])
def test_non_integer_output_tokens_rejected_without_change(bad):
    request = Request("r", [1, 2, 3])
    with pytest.raises(TypeError, match="token_ids must .*integer"):
        request.append_output_token_ids(bad)
    assert request.num_tokens == 3 and request.output_token_ids == []
