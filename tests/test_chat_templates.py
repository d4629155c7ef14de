"""Chat templates from a checkpoint's files, found and rendered as vLLM 0.33 and
transformers find and render them: which file wins and what a malformed one says
(quick), transformers' Jinja dialect in the sandbox (quick), and checkpoints of each
kind against transformers' `apply_chat_template` and vLLM's resolution of the template
in the peer environment (slow; skipped without `.venv-vllm`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from test_chat_content import LLAVA_HF

from jaxkv import models
from jaxkv.models.chat_content import OPENAI, chat_content_format
from jaxkv.models.chat_sandbox import render_chat_template
from jaxkv.models.chat_template_files import find_chat_template
from jaxkv.models.prompting import PromptEncoder
from jaxkv.models.testing import TINY_PREPROCESSOR, save_word_tokenizer, tiny_configs

REPO = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LLAVA = tiny_configs()["llava-tiny"]
# Llama 4's special words too: its template (transformers' own) writes them.
SPECIALS = {0: "<unk>", 1: "<bos>", 2: "<eos>", 3: "<turn>", 4: "<end>",
            250: "<|header_start|>", 251: "<|header_end|>", 252: "<|eot|>",
            LLAVA["image_token_index"]: "<image>"}  # fmt: skip
# transformers' dialect at work: `generation`, `continue`, `break`, `raise_exception`,
# `strftime_now`, `tojson` with its arguments, the special tokens by name.
DIALECT = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}\
{% set messages = messages[1:] %}{% endif %}
{% for m in messages %}
{% if m['role'] not in ['user', 'assistant'] %}\
{{ raise_exception('roles are user and assistant, not ' + m['role']) }}{% endif %}
{% if m['content'] == 'skip' %}{% continue %}{% endif %}
<turn> {{ m['role'] }} {% if m['role'] == 'assistant' %}\
{% generation %}{% set hidden = 1 %}{{ m['content'] }} <end>{% endgeneration %}\
{% else %}{{ m['content'] }} <end>{% endif %}
{% if m['content'] == 'stop' %}{% break %}{% endif %}
{% endfor %}
{{ hidden is defined }} {{ unk_token }} {{ image_token }} {{ pad_token is defined }}
{{ {'date': strftime_now('%Y-%m-%d'), 'system': system | default(none), 'x': '<&>é'}
   | tojson(separators=(',', ':')) }} {{ tools | tojson }} {{ documents is none }}
{{ {'b': [1, {'c': []}], 'a': 2} | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}
{% if add_generation_prompt %}<turn>{% endif %}"""
TEXT_CHAT = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6"},
             {"role": "assistant", "content": "w7"}, {"role": "user", "content": "skip"},
             {"role": "user", "content": "stop"}, {"role": "user", "content": "w8"}]  # fmt: skip
LLAVA_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "w5 w6"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "w7"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w8"}]},
]


def write_checkpoint(
    path: Path, files: dict[str, str | bytes | dict], kind: str | None = None, **config
) -> Path:
    """A checkpoint's tokenizer files (`tokenizer_config.json`: `config` over bos, eos,
    unk and the image token), `files` (name -> text, bytes or a JSON object) and, for
    `kind` "llava" or "llama", its `config.json` (LLaVA with `preprocessor_config.json`
    unless `files` maps it to None). No weights: nothing here loads the model."""
    path.mkdir(parents=True, exist_ok=True)
    save_word_tokenizer(path, 256, SPECIALS)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
              "eos_token": "<eos>", "unk_token": "<unk>", "image_token": "<image>",
              **config}  # fmt: skip
    files = {"tokenizer_config.json": config, **files}
    if kind is not None:
        files = {"config.json": LLAVA if kind == "llava" else tiny_configs()["llama-tiny"],
                 **({"preprocessor_config.json": TINY_PREPROCESSOR} if kind == "llava" else {}),
                 **files}  # fmt: skip
    for name, data in files.items():
        file = path / name
        file.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            file.write_bytes(data)
        elif isinstance(data, str):
            file.write_text(data)
        elif data is not None:
            file.write_text(json.dumps(data))
    return path


def found(path: Path) -> tuple[str | None, str]:
    config = json.loads((path / "tokenizer_config.json").read_text())
    return tuple(find_chat_template(path, config))


# ---- which file wins ----------------------------------------------------------------


def test_tokenizer_config_template_one_or_named(tmp_path) -> None:
    assert found(write_checkpoint(tmp_path / "one", {}, chat_template="T")) == (
        "T", "tokenizer_config.json's chat_template")  # fmt: skip
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D"}]
    assert found(write_checkpoint(tmp_path / "list", {}, chat_template=named)) == (
        "D", "tokenizer_config.json's chat_template named 'default'")  # fmt: skip
    by_name = {"rag": "R", "default": "D2"}
    assert found(write_checkpoint(tmp_path / "object", {}, chat_template=by_name))[0] == "D2"


def test_named_templates_without_default_are_no_template(tmp_path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "rag", "template": "R"}]
    path = write_checkpoint(tmp_path, {}, chat_template=named)
    template, reason = found(path)
    assert template is None and "named ['rag', 'tool_use'], none 'default'" in reason
    encoder = PromptEncoder.from_dir(path, models.load_tokenizer(path))
    with pytest.raises(ValueError, match=r"needs a chat template.*none 'default'"):
        encoder.encode("w5", chat=True)


def test_template_files_replace_tokenizer_config(tmp_path) -> None:
    # chat_template.jinja wins, even over a chat_template transformers could not use
    path = write_checkpoint(tmp_path / "a", {"chat_template.jinja": "J"}, chat_template=5)
    assert found(path) == ("J", "chat_template.jinja")
    # for the tokenizer additional_chat_templates/default.jinja wins over chat_template.jinja
    files = {"chat_template.jinja": "J", "additional_chat_templates/default.jinja": "AD",
             "additional_chat_templates/tool_use.jinja": "AT"}  # fmt: skip
    path = write_checkpoint(tmp_path / "b", files, chat_template="C")
    assert found(path) == ("AD", "additional_chat_templates/default.jinja")
    # named files without a default replace the config's template too: none
    files = {"additional_chat_templates/tool_use.jinja": "AT"}
    path = write_checkpoint(tmp_path / "c", files, chat_template="C")
    assert found(path)[0] is None and "['tool_use']" in found(path)[1]


def test_a_processor_reads_its_own_files_first(tmp_path) -> None:
    files = {"chat_template.json": {"chat_template": "JSON"}, "chat_template.jinja": "J"}
    path = write_checkpoint(tmp_path / "json", files, "llava", chat_template="C")
    assert found(path) == ("JSON", "chat_template.json")
    files["processor_config.json"] = {"chat_template": "PROC", "patch_size": 4}
    path = write_checkpoint(tmp_path / "proc", files, "llava", chat_template="C")
    assert found(path) == ("PROC", "processor_config.json's chat_template")
    # the processor's files in its order: chat_template.jinja over default.jinja
    files = {"chat_template.jinja": "J", "additional_chat_templates/default.jinja": "AD"}
    assert found(write_checkpoint(tmp_path / "files", files, "llava"))[0] == "J"
    # a processor without a template: the tokenizer's
    assert found(write_checkpoint(tmp_path / "none", {}, "llava", chat_template="C"))[0] == "C"


@pytest.mark.parametrize(
    ("kind", "preprocessor"),
    [(None, False), ("llama", True), ("llava", False)],
    ids=["tokenizer only", "text model", "llava without preprocessor_config.json"],
)
def test_chat_template_json_without_a_processor_is_not_read(tmp_path, kind, preprocessor) -> None:
    files = {"chat_template.json": b"\xff not even JSON"}
    if kind == "llava" and not preprocessor:
        files["preprocessor_config.json"] = None
    elif kind == "llama":
        files["preprocessor_config.json"] = TINY_PREPROCESSOR
    path = write_checkpoint(tmp_path, files, kind)
    template, reason = found(path)
    assert template is None and "chat_template.json is a processor's file" in reason
    path = write_checkpoint(tmp_path, files, kind, chat_template="C")
    assert found(path)[0] == "C"


def test_a_llava_template_from_chat_template_json_takes_content_parts(tmp_path) -> None:
    files = {"chat_template.json": {"chat_template": LLAVA_HF}}
    path = write_checkpoint(tmp_path, files, "llava", chat_template="{{ messages[0].content }}")
    encoder = PromptEncoder.from_dir(path, models.load_tokenizer(path))
    assert encoder.chat_template == LLAVA_HF and chat_content_format(LLAVA_HF) == OPENAI
    assert encoder.render_messages(LLAVA_CHAT) == (
        "USER: w5 w6 ASSISTANT: w7 USER: <image>\nw8 ASSISTANT:"
    )
    assert encoder.encode_chat(LLAVA_CHAT)[-3:] == [255, 8, 0]  # <image> w8 ASSISTANT:(unk)
    # one user message (`generate --chat`) as parts too: the text is kept, the image placed
    assert encoder.render_chat("w5 w6") == "USER: w5 w6 ASSISTANT:"
    assert encoder.encode("w5 w6", chat=True, images=1) == [0, 255, 5, 6, 0]
    # a template over a string takes the text as it is
    string = PromptEncoder(None, {}, "{{ messages[0]['content'] }}!")
    assert string.user_turn("w5", images=1) == {"role": "user", "content": "w5"}
    assert string.render_chat("w5") == "w5!"


# ---- malformed files ----------------------------------------------------------------

NOT_UTF8 = b"{{ messages }}\xff"
MALFORMED = {
    "tokenizer_config.json not JSON": (
        None, {"tokenizer_config.json": "{"}, r"tokenizer_config.json: not valid JSON"),
    "tokenizer_config.json a list": (
        None, {"tokenizer_config.json": "[]"}, r"tokenizer_config.json: not a JSON object"),
    "chat_template a number": (
        None, {"tokenizer_config.json": {"chat_template": 5}},
        r"tokenizer_config.json: chat_template must be a template \(a string\), a list of"),
    "chat_template an object of numbers": (
        None, {"tokenizer_config.json": {"chat_template": {"default": 1}}},
        r"tokenizer_config.json: chat_template must be"),
    "named template without its text": (
        None, {"tokenizer_config.json": {"chat_template": [{"name": "default"}]}},
        r'tokenizer_config.json: chat_template\[0\] must be an object with a string "name" '
        r'and "template"'),
    "named template a string": (
        None, {"tokenizer_config.json": {"chat_template": [{"name": "a", "template": "A"}, "B"]}},
        r"tokenizer_config.json: chat_template\[1\] must be an object"),
    "chat_template.jinja not UTF-8": (
        None, {"chat_template.jinja": NOT_UTF8}, r"chat_template.jinja: not UTF-8 text"),
    "additional template not UTF-8": (
        None, {"additional_chat_templates/x.jinja": NOT_UTF8},
        r"additional_chat_templates/x.jinja: not UTF-8 text"),
    "chat_template.json not JSON": (
        "llava", {"chat_template.json": "{'chat_template': 'x'}"},
        r"chat_template.json: not valid JSON"),
    "chat_template.json without it": (
        "llava", {"chat_template.json": {"template": "x"}},
        r'chat_template.json: needs "chat_template": the template, a string'),
    "chat_template.json a list of templates": (
        "llava", {"chat_template.json": {"chat_template": [{"name": "default", "template": "x"}]}},
        r'chat_template.json: needs "chat_template"'),
    "chat_template.json beside additional templates": (
        "llava", {"chat_template.json": {"chat_template": "x"},
                  "additional_chat_templates/tool_use.jinja": "T"},
        r"chat_template.json: a legacy chat_template.json beside additional_chat_templates/ "
        r"\(transformers refuses the pair\)"),
    "processor_config.json's chat_template a number": (
        "llava", {"processor_config.json": {"chat_template": 3}},
        r"processor_config.json: chat_template must be"),
    "processor_config.json not an object": (
        "llava", {"processor_config.json": [1]}, r"processor_config.json: not a JSON object"),
    "config.json not an object": (
        "llava", {"config.json": "3"}, r"config.json: not a JSON object"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_file_is_refused_naming_it(tmp_path, name) -> None:
    kind, files, message = MALFORMED[name]
    path = write_checkpoint(tmp_path, {}, kind)
    write_checkpoint(path, files)  # over what write_checkpoint wrote
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/{message}"):
        PromptEncoder.from_dir(path, None)


# ---- transformers' dialect in the sandbox -------------------------------------------


def render(template: str, **variables) -> str:
    return render_chat_template(template, messages=TEXT_CHAT, **variables)


def test_generation_renders_its_body_in_a_scope_of_its_own() -> None:
    template = "{% generation %}{% set x = 1 %}[{{ x }}]{% endgeneration %}{{ x is defined }}"
    assert render(template) == "[1]False"


def test_loop_controls() -> None:
    template = (
        "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
        "{{ m.content }};{% if m.content == 'skip' %}{% break %}{% endif %}{% endfor %}"
    )
    assert render(template) == "w9 w10;w7;skip;"


def test_strftime_now_is_local_time() -> None:
    before = datetime.now().strftime("%Y-%m-%d %H")
    text = render("{{ strftime_now('%Y-%m-%d %H') }}")
    assert text in {before, datetime.now().strftime("%Y-%m-%d %H")}


def test_raise_exception_is_a_value_error_with_the_templates_message() -> None:
    with pytest.raises(ValueError, match=r"^chat template: roles are user and assistant, not x$"):
        render_chat_template(DIALECT, messages=[{"role": "x", "content": "w5"}])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<a & b>' | tojson }}", '"<a & b>"'),  # Jinja's would escape HTML
        ("{{ {'b': 1, 'a': 'é'} | tojson }}", '{"b": 1, "a": "é"}'),  # keys kept in order
        ("{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=true, ensure_ascii=true) }}",
         '{"a": "\\u00e9", "b": 1}'),
        ("{{ [1, [2]] | tojson(indent=2) }}", "[\n  1,\n  [\n    2\n  ]\n]"),
        ("{{ [1, [2]] | tojson(indent='\t', separators=(';', '=')) }}",
         "[\n\t1;\n\t[\n\t\t2\n\t]\n]"),
        ("{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}", '{"a":[1,2]}'),
        ("{{ none | tojson }}{{ [] | tojson(indent=4) }}", "null[]"),
    ],
)  # fmt: skip
def test_tojson_takes_transformers_arguments(template, expected) -> None:
    assert render(template) == expected


def test_the_dialect_template_renders() -> None:
    encoder = PromptEncoder(None, {"bos_token": "<bos>", "unk_token": "<unk>",
                                   "image_token": "<image>"}, DIALECT)  # fmt: skip
    dates = {datetime.now().strftime("%Y-%m-%d")}
    text = encoder.render_messages(TEXT_CHAT)
    dates.add(datetime.now().strftime("%Y-%m-%d"))
    # trim_blocks: a block tag ending a line takes its newline
    assert text in {
        "<bos>\n<turn> user w5 w6 <end><turn> assistant w7 <end><turn> user stop <end>"
        f'False <unk> <image> False\n{{"date":"{date}","system":"w9 w10","x":"<&>é"}} null '
        'True\n{\n  "a": 2,\n  "b": [\n    1,\n    {\n      "c": []\n    }\n  ]\n}\n<turn>'
        for date in dates
    }


# ---- against transformers and vLLM --------------------------------------------------

_PEER = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
import transformers
from transformers.models.llama4 import processing_llama4
from vllm.renderers.hf import safe_apply_chat_template

def outcome(render):
    try:
        return {"text": render(False), "ids": list(render(True))}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}

results = []
for case in json.load(sys.stdin):
    path, messages = case["path"], case["messages"]
    if case["llama4"]:  # transformers' own text of Llama 4's template
        Path(path, "chat_template.jinja").write_text(processing_llama4.chat_template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    owner = transformers.AutoProcessor.from_pretrained(path) if case["processor"] else tokenizer
    def hf(tokenize):
        text = owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids if tokenize else text
    model_config = SimpleNamespace(
        model=path, tokenizer=path, tokenizer_revision=None, code_revision=None,
        trust_remote_code=False, hf_config=SimpleNamespace(model_type=case["model_type"]))
    def vllm(tokenize):
        return safe_apply_chat_template(model_config, tokenizer, messages,
                                        add_generation_prompt=True, tokenize=tokenize)
    results.append({"transformers": outcome(hf), "vllm": outcome(vllm)})
print(json.dumps(results))
"""
NAMED = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": DIALECT}]
LLAMA4_CHAT = [
    {"role": "system", "content": "w9 w10 "},
    {"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "image"}]},
    {"role": "tool", "content": 'w11 <&> "w12"'},
    {"role": "assistant", "content": "w7"},
]
# name -> (kind, files, tokenizer_config's chat_template, messages, processor loads)
PEER_CASES = {
    "llava chat_template.json": (
        "llava", {"chat_template.json": {"chat_template": LLAVA_HF}, "chat_template.jinja": "J"},
        "C", LLAVA_CHAT, True),
    "llava processor_config.json": (
        "llava", {"processor_config.json": {"chat_template": LLAVA_HF},
                  "chat_template.json": {"chat_template": "JSON"}}, "C", LLAVA_CHAT, True),
    "llava template files": (
        "llava", {"chat_template.jinja": LLAVA_HF, "additional_chat_templates/default.jinja": "AD"},
        "C", LLAVA_CHAT, True),
    "llava without preprocessor_config.json": (
        "llava", {"preprocessor_config.json": None, "chat_template.json": {"chat_template": "J"}},
        DIALECT, TEXT_CHAT, False),
    "named templates": (None, {}, NAMED, TEXT_CHAT, False),
    "named templates without default": (None, {}, NAMED[:1], TEXT_CHAT, False),
    "template files over tokenizer_config": (
        None, {"chat_template.jinja": "J", "additional_chat_templates/default.jinja": DIALECT,
               "additional_chat_templates/rag.jinja": "R"}, "C", TEXT_CHAT, False),
    "raise_exception": (None, {}, DIALECT, [*TEXT_CHAT[:2], {"role": "tool", "content": "w1"}],
                        False),
    "text model's chat_template.json": (
        "llama", {"preprocessor_config.json": TINY_PREPROCESSOR,
                  "chat_template.json": {"chat_template": DIALECT}}, None, TEXT_CHAT, False),
    "llama 4": (None, {}, None, LLAMA4_CHAT, False),
}  # fmt: skip


def jaxkv_outcome(path: Path, messages: list) -> dict:
    encoder = PromptEncoder.from_dir(path, models.load_tokenizer(path))
    try:
        return {"text": encoder.render_messages(messages), "ids": encoder.encode_chat(messages)}
    except ValueError as error:
        return {"error": str(error)}


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=f"no peer environment at {PEER_PYTHON}")
def test_checkpoints_render_as_transformers_and_vllm_render_them(tmp_path) -> None:
    cases = []
    for i, (name, (kind, files, template, messages, processor)) in enumerate(PEER_CASES.items()):
        config = {} if template is None else {"chat_template": template}
        path = write_checkpoint(tmp_path / f"c{i}", files, kind, **config)
        model_type = {"llava": "llava", "llama": "llama"}.get(kind, "llama")
        cases.append({"name": name, "path": str(path), "messages": messages,
                      "processor": processor, "model_type": model_type,
                      "llama4": name == "llama 4"})  # fmt: skip
    # strftime_now: jaxkv renders before and after the peer does (a date may turn over).
    before = [jaxkv_outcome(Path(c["path"]), c["messages"]) for c in cases]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(PEER_PYTHON), "-c", _PEER], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    peers = json.loads(proc.stdout.strip().splitlines()[-1])
    after = [jaxkv_outcome(Path(c["path"]), c["messages"]) for c in cases]
    for case, *ours, peer in zip(cases, before, after, peers, strict=True):
        if case["llama4"]:
            ours = ours[1:]  # its template file is the peer's writing
        for who, theirs in peer.items():
            if "error" in theirs:
                assert all("error" in o for o in ours), (case["name"], who, theirs, ours)
            else:
                assert theirs in ours, (case["name"], who, theirs, ours)
    errors = {c["name"]: o["error"] for c, o in zip(cases, after, strict=True) if "error" in o}
    assert errors.keys() == {"named templates without default", "raise_exception",
                             "text model's chat_template.json"}  # fmt: skip
    assert "roles are user and assistant, not tool" in errors["raise_exception"]


def test_generate_chat_puts_the_image_where_a_llava_template_does(tmp_path, capsys) -> None:
    """`jaxkv generate --chat --image` on a llava-hf-style checkpoint: the user's text
    and image reach the template as content parts, so the template places the image."""
    from PIL import Image

    from jaxkv import cli
    from jaxkv.models.testing import save_chat_checkpoint

    path = save_chat_checkpoint(tmp_path / "llava", "llava-tiny")
    (path / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_HF}))
    Image.new("RGB", (20, 16), (200, 10, 10)).save(tmp_path / "red.png")
    argv = ["generate", "--model", str(path), "--prompt", "w5 w6", "--chat", "--json",
            "--image", str(tmp_path / "red.png"), "--max-tokens", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    (result,) = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    # "USER: <image>\nw5 w6 ASSISTANT:" (USER: and ASSISTANT: unknown words), the image
    # token repeated for the image's features
    ids = result["prompt_token_ids"]
    assert ids[:2] == [0, LLAVA["image_token_index"]] and ids[-3:] == [5, 6, 0]
    assert set(ids[1:-3]) == {LLAVA["image_token_index"]}
