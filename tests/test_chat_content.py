"""`chat_content_format`: the content format vLLM 0.33 detects for a chat template, by
the rules (the quick part) and against vLLM's own detection on the same templates and
on the templates vLLM ships (in the peer environment `.venv-vllm`; skipped without it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from jaxkv.models.chat_content import OPENAI, STRING, chat_content_format
from jaxkv.models.testing import CHAT_TEMPLATE, LLAVA_CHAT_TEMPLATE

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

# llava-hf/llava-1.5-7b-hf's chat_template.json: images first, then the text; the
# assistant's text in transformers' `{% generation %}` tag.
LLAVA_HF = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TEMPLATES = {
    "jaxkv chat": (CHAT_TEMPLATE, STRING),
    "jaxkv llava": (LLAVA_CHAT_TEMPLATE, OPENAI),
    "llava-hf": (LLAVA_HF, OPENAI),
    "aliased messages": (
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
        "{{ message['content'] | trim }}{% endfor %}",
        STRING,
    ),
    "gemma3-like": (
        "{%- set first = messages[0] -%}{%- set loop_messages = messages[1:] -%}"
        "{%- for message in loop_messages -%}{%- if message['content'] is string -%}"
        "{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}"
        "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}"
        "<start_of_image>{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}",
        OPENAI,
    ),
    "namespace alias": (
        "{% set ns = namespace(rest=messages[1:]) %}{% for m in ns.rest %}"
        "{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
        OPENAI,
    ),
    "macro over content": (
        "{% macro render(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m['content']) }}{% endfor %}",
        OPENAI,
    ),
    "macro over another field": (
        "{% macro render(parts) %}{% for p in parts %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m['role']) }}{{ m.content }}{% endfor %}",
        STRING,
    ),
    "a variable named content": (
        "{% for m in messages %}{% set content = m.content %}{% for c in content %}"
        "{{ c.text }}{% break %}{% endfor %}{% endfor %}",
        OPENAI,
    ),
    "content of something else": (
        "{% for t in tools %}{% for c in t.content %}{{ c }}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        STRING,
    ),
    "not jinja": ("{% for m in messages %}{{ m.content }", STRING),
    # parses, but a `break` outside a loop does not compile: vLLM reads it as "string"
    "break outside a loop": (
        "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}"
        "{% break %}",
        STRING,
    ),
    "content loop in a generation tag": (
        "{% for m in messages %}{% generation %}{% for c in m['content'] %}{{ c.text }}"
        "{% continue %}{% endfor %}{% endgeneration %}{% endfor %}",
        OPENAI,
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_by_the_rules(name) -> None:
    template, expected = TEMPLATES[name]
    assert chat_content_format(template) == expected


def test_no_template_is_string() -> None:
    assert chat_content_format(None) == STRING


_VLLM_SNIPPET = """
import json, sys
from vllm.renderers.hf import _detect_content_format
print(json.dumps([_detect_content_format(t, default="string") for t in json.load(sys.stdin)]))
"""


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=f"no peer environment at {PEER_PYTHON}")
def test_content_format_matches_vllm() -> None:
    shipped = (REPO_ROOT / ".venv-vllm").glob(
        "lib/python*/site-packages/vllm/transformers_utils/chat_templates/*.jinja"
    )
    templates = [t for t, _ in TEMPLATES.values()] + [p.read_text() for p in sorted(shipped)]
    result = subprocess.run(
        [str(PEER_PYTHON), "-c", _VLLM_SNIPPET], input=json.dumps(templates),
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(templates) > len(TEMPLATES)
    assert [chat_content_format(t) for t in templates] == expected
