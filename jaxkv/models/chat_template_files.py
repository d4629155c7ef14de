"""Where a checkpoint's chat template comes from: the files and fields vLLM 0.33 reads
(`vllm/renderers/hf.py`, `resolve_chat_template`, no template given, no tools), in its
order: the processor's template when transformers' `AutoProcessor` loads a processor
for the checkpoint, else the tokenizer's.

The tokenizer's (transformers 5, `tokenization_utils_base.py`: `_from_pretrained`,
`get_chat_template`): template files, when there are any, replace
`tokenizer_config.json`'s `chat_template`: `chat_template.jinja` is the template named
"default" and `additional_chat_templates/NAME.jinja` the one named NAME (it wins over
`chat_template.jinja` for "default"). Without files, `chat_template` is one template, a
list of named ones (`[{"name": ..., "template": ...}]`) or an object of them by name.

The processor's (`processing_utils.py`: `ProcessorMixin.get_processor_dict`,
`apply_chat_template`): `processor_config.json`'s own `chat_template` when set; else
`chat_template.json`'s `"chat_template"` as "default" (beside
`additional_chat_templates/` transformers refuses the checkpoint); else the template
files as the tokenizer's, `chat_template.jinja` winning for "default". A processor
loads (vLLM's `_try_get_processor_chat_template` gets a `ProcessorMixin`) for a
multimodal checkpoint (`config.json` with a `vision_config`) that has its image
processor's `preprocessor_config.json`: a text model's `AutoProcessor` is its tokenizer,
and without that file a LLaVA processor fails to load; vLLM then uses the tokenizer's
template. When the processor has any template, vLLM uses it.

Of named templates the one named "default" is used (jaxkv passes no tools, for which
transformers would pick "tool_use"); without one there is no template (transformers
asks for a name). Every file read must be UTF-8, the JSON ones objects whose template
fields are as above: anything else is a ValueError naming the file and what is wrong.
vLLM instead falls back to the tokenizer's template when a malformed file stops the
processor from loading; here the checkpoint is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from jaxkv.models.checkpoint import read_json

__all__ = ["FoundTemplate", "find_chat_template", "read_json_object"]

DEFAULT = "default"
TEMPLATE_DIR = "additional_chat_templates"


class FoundTemplate(NamedTuple):
    """A checkpoint's chat template (None: it has none) and `source`: the file (and
    field) it came from, or why there is none."""

    template: str | None
    source: str


# A checkpoint's templates by name: (text, where it came from).
_Named = dict[str, tuple[str, str]]


def read_json_object(file: Path) -> dict[str, Any]:
    """`file`'s JSON object (ValueError naming the file when it is not one)."""
    value = read_json(file)
    if not isinstance(value, dict):
        raise ValueError(f"{file}: not a JSON object")
    return value


def _read_template(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{file}: not UTF-8 text") from None
    except OSError as error:
        raise ValueError(f"{file}: cannot read it ({error})") from None


def _template_files(path: Path, jinja_wins: bool) -> _Named:
    """`chat_template.jinja` as "default" and `additional_chat_templates/*.jinja` by name;
    `jinja_wins`: `chat_template.jinja` over `additional_chat_templates/default.jinja`
    (the processor's order; the tokenizer's is the other way)."""
    named: _Named = {}
    folder = path / TEMPLATE_DIR
    for file in sorted(folder.glob("*.jinja")) if folder.is_dir() else ():
        name = file.name.removesuffix(".jinja")
        named[name] = (_read_template(file), f"{TEMPLATE_DIR}/{file.name}")
    jinja = path / "chat_template.jinja"
    if jinja.is_file() and (jinja_wins or DEFAULT not in named):
        named[DEFAULT] = (_read_template(jinja), jinja.name)
    return named


def _templates_field(value: Any, file: Path, field: str = "chat_template") -> _Named:
    """A `chat_template` field: one template (named "default"), a list of
    `{"name", "template"}` objects or an object of templates by name."""
    where = f"{file.name}'s {field}"
    if isinstance(value, str):
        return {DEFAULT: (value, where)}
    if isinstance(value, dict) and all(isinstance(t, str) for t in value.values()):
        return {name: (text, f"{where} named {name!r}") for name, text in value.items()}
    if not isinstance(value, list):
        raise ValueError(
            f"{file}: {field} must be a template (a string), a list of "
            '{"name": ..., "template": ...} objects or an object of templates by name'
        )
    named: _Named = {}
    for i, item in enumerate(value):
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        ):
            raise ValueError(
                f'{file}: {field}[{i}] must be an object with a string "name" and "template"'
            )
        # A repeated name: the later one, as transformers builds its dict.
        named[item["name"]] = (item["template"], f"{where} named {item['name']!r}")
    return named


def _has_processor(path: Path) -> bool:
    """transformers' `AutoProcessor` loads a processor for the checkpoint (the module
    docstring says when)."""
    config = path / "config.json"
    if not (config.is_file() and (path / "preprocessor_config.json").is_file()):
        return False
    return "vision_config" in read_json_object(config)


def _processor_templates(path: Path) -> _Named:
    config = path / "processor_config.json"
    if config.is_file() and (value := read_json_object(config).get("chat_template")) is not None:
        return _templates_field(value, config)
    legacy = path / "chat_template.json"
    if not legacy.is_file():
        return _template_files(path, jinja_wins=True)
    value = read_json_object(legacy).get("chat_template")
    if not isinstance(value, str):
        raise ValueError(f'{legacy}: needs "chat_template": the template, a string')
    folder = path / TEMPLATE_DIR
    if folder.is_dir() and any(folder.glob("*.jinja")):
        raise ValueError(
            f"{legacy}: a legacy chat_template.json beside {TEMPLATE_DIR}/ (transformers "
            "refuses the pair); replace it with chat_template.jinja"
        )
    return {DEFAULT: (value, legacy.name)}


def _tokenizer_templates(path: Path, tokenizer_config: dict[str, Any]) -> _Named:
    named = _template_files(path, jinja_wins=False)
    if named or tokenizer_config.get("chat_template") is None:
        return named
    return _templates_field(tokenizer_config["chat_template"], path / "tokenizer_config.json")


def _none_reason(path: Path) -> str:
    reason = "no chat_template.jinja, and tokenizer_config.json has no chat_template"
    if (path / "chat_template.json").is_file():
        reason += (
            " (chat_template.json is a processor's file: transformers and vLLM read it only "
            "for a multimodal checkpoint, config.json with a vision_config, that has a "
            "preprocessor_config.json)"
        )
    return reason


def find_chat_template(path: str | Path, tokenizer_config: dict[str, Any]) -> FoundTemplate:
    """The chat template of checkpoint `path` (its `tokenizer_config.json` already read
    as `tokenizer_config`), where vLLM 0.33 finds it (module docstring); ValueError
    naming a malformed file."""
    path = Path(path)
    named = _processor_templates(path) if _has_processor(path) else {}
    named = named or _tokenizer_templates(path, tokenizer_config)
    if DEFAULT in named:
        return FoundTemplate(*named[DEFAULT])
    if named:
        return FoundTemplate(
            None,
            f"its chat templates are named {sorted(named)}, none 'default' (the one "
            "transformers and vLLM use when no name is given)",
        )
    return FoundTemplate(None, _none_reason(path))
