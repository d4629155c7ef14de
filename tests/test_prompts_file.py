"""`--prompts FILE` read as people write it, and chat templates rendered with bounded work."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jinja2
import pytest

from jaxkv.models.chat_sandbox import (
    MAX_RANGE_NUMBERS,
    MAX_WRITTEN_CHARS,
    _compiled,
    render_chat_template,
)
from jaxkv.prompts_file import read_prompts


def write(tmp_path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return str(path)


@pytest.mark.parametrize("separator", ["\f", "\x1e", "\x85", "\u2028", "\u2029", "\v", "\r"])
def test_text_lines_end_at_newline_only(tmp_path, separator: str) -> None:
    path = write(tmp_path, "p.txt", f"one{separator}still one\r\ntwo\n\n  \nthree")
    assert read_prompts(path) == [(f"one{separator}still one", None), ("two", None),
                                  ("three", None)]  # fmt: skip


def test_a_text_file_keeps_lines_that_look_like_json(tmp_path) -> None:
    path = write(tmp_path, "p.txt", 'plain first\n{"prompt": "x"}\n{not json\n')
    assert [text for text, _ in read_prompts(path)] == ["plain first", '{"prompt": "x"}',
                                                        "{not json"]  # fmt: skip


@pytest.mark.parametrize("name", ["p.jsonl", "p.txt"])
def test_jsonl_is_chosen_for_the_whole_file(tmp_path, name: str) -> None:
    lines = [json.dumps({"prompt": "a\u2028b", "max_tokens": 3}, ensure_ascii=False),
             json.dumps({"prompt": "c"}), ""]  # fmt: skip
    assert read_prompts(write(tmp_path, name, "\n".join(lines))) == [("a\u2028b", 3), ("c", None)]
    # A text line inside a JSONL file is an error, not a prompt.
    path = write(tmp_path, name, lines[0] + "\nplain text\n")
    with pytest.raises(ValueError, match=r":2: not a JSON object .*the file is JSONL"):
        read_prompts(path)


def test_a_jsonl_file_whose_first_line_is_not_an_object_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"p.jsonl:1: needs an object with \"prompt\""):
        read_prompts(write(tmp_path, "p.jsonl", '["a list"]\n'))


@pytest.mark.parametrize(
    "item", [{"prompt": 3}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 1.5},
             {"prompt": "x", "max_tokens": True}, {"text": "x"}],
)  # fmt: skip
def test_bad_jsonl_objects_name_the_line(tmp_path, item) -> None:
    path = write(tmp_path, "p.jsonl", '{"prompt": "fine"}\n' + json.dumps(item))
    with pytest.raises(ValueError, match=r"p.jsonl:2: needs an object with \"prompt\" \(text\)"):
        read_prompts(path)


def test_deep_nesting_is_refused_not_a_crash(tmp_path) -> None:
    deep = '{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match=r"p.jsonl:1: JSON nested too deeply"):
        read_prompts(write(tmp_path, "p.jsonl", deep))
    # As the first line of a text-named file it is not an object: the file is plain text.
    assert read_prompts(write(tmp_path, "p.txt", "[" * 100_000)) == [("[" * 100_000, None)]


def test_size_limit_and_unreadable_files(tmp_path) -> None:
    path = write(tmp_path, "p.txt", "x" * 101)
    assert read_prompts(path, limit=101) == [("x" * 101, None)]
    with pytest.raises(ValueError, match=r"p.txt: larger than 100 bytes"):
        read_prompts(path, limit=100)
    with pytest.raises(ValueError, match=r"/dev/zero: larger than 4096 bytes"):
        read_prompts("/dev/zero", limit=4096)
    with pytest.raises(ValueError, match=r"p.bin: not UTF-8 text"):
        read_prompts(write(tmp_path, "p.bin", b"\xff\xfe"))
    with pytest.raises(ValueError, match=r"cannot read it"):
        read_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"no prompts in it"):
        read_prompts(write(tmp_path, "blank.txt", "\n \r\n"))


MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_template_renders_as_jinja_renders_it() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% endfor %}{% for i in range(3) %}{{ i }}{% endfor %}{{ 'ab' * 2 }}{{ 2 ** 5 }}"
    )
    expected = jinja2.Environment().from_string(template).render(messages=MESSAGES, bos_token="B")
    assert render_chat_template(template, messages=MESSAGES, bos_token="B") == expected


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "ranges span more than"),
        # each inner range is small; together they pass the budget
        ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
         "ranges span more than"),
        ("{{ 'x' * 10**9 }}", "a repetition of 1000000000 items"),
        ("{{ [0] * 10**8 }}", "a repetition of 100000000 items"),
        ("{{ 2 ** 10000000 }}", "a power of"),
        ("{% for i in range(2000) %}{{ 'y' * 1000 }}{% endfor %}", "writes more than"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[5].content }}", "UndefinedError"),
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{% break %}", "SyntaxError: 'break' outside loop"),
        # transformers' tojson: measured before its text is built
        ("{{ [1] | tojson(indent=10**9) }}", "a tojson indent of 1000000000 items"),
        ("{{ [[[[1]]]] | tojson(indent=400000) }}", "tojson writes more than 1048576"),
        ("{{ ([[0] * 1000000] * 1000000) | tojson }}", "tojson writes more than 1048576"),
        # text built inside macros and blocks counts before anything writes it
        ("{% set x %}{% for i in range(100000) %}{{ 'y' * 1000000 }}{% endfor %}{% endset %}",
         "writes more than 8388608 characters in all"),
        ("{% macro m() %}{{ 'y' * 1000000 }}{% endmacro %}"
         "{% for i in range(100000) %}{% set x = m() %}{% endfor %}", "in all"),
        ("{% for i in range(100000) %}{% set x %}{% generation %}{{ 'y' * 1000000 }}"
         "{% endgeneration %}{% endset %}{% endfor %}", "in all"),
        ("{{ ['x' * 1000000] * 1000000 }}", "in all"),
    ],
)  # fmt: skip
def test_template_work_is_bounded_and_its_errors_are_value_errors(template, message) -> None:
    with pytest.raises(ValueError, match=rf"^chat template: .*{message}"):
        render_chat_template(template, messages=MESSAGES)


def test_the_range_budget_is_per_render() -> None:
    template = f"{{% for i in range({MAX_RANGE_NUMBERS}) %}}{{% endfor %}}ok"
    assert [render_chat_template(template) for _ in range(2)] == ["ok", "ok"]


def test_a_template_compiles_once_and_every_render_has_the_whole_budgets() -> None:
    """One compiled template, rendered in turn and on four threads at once: each render
    spans 60% of the range budget and writes 60% of the written-text budget, so each
    passes only if its budgets are its own."""
    writes = "{% set x %}{{ 'y' * 1000000 }}{% endset %}" * (MAX_WRITTEN_CHARS * 3 // 5 // 10**6)
    template = f"{{% for i in range({MAX_RANGE_NUMBERS * 3 // 5}) %}}{{% endfor %}}{writes}ok"
    before = _compiled.cache_info()
    assert [render_chat_template(template) for _ in range(2)] == ["ok", "ok"]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: render_chat_template(template), range(4))) == ["ok"] * 4
    after = _compiled.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 5)
