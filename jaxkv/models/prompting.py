"""Prompts as transformers encodes them: `add_bos_token` / `add_eos_token` and the chat
template of a checkpoint's `tokenizer_config.json` (or `chat_template.jinja`).

transformers' Llama and Gemma tokenizers (`tokenizer_class` LlamaTokenizer,
GemmaTokenizer, CodeLlamaTokenizer, with or without "Fast") rebuild the post-processor
from `add_bos_token` / `add_eos_token`, so for them those flags win over what
`tokenizer.json` says; every other class (the generic backend included) ignores the
flags and `tokenizer.json`'s own post-processor decides, as here. A chat prompt is the
template rendered (Jinja, as transformers renders it: `messages`,
`add_generation_prompt=True`, the special tokens by name) and tokenized without adding
special tokens (the template writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxkv.models.chat_sandbox import render_chat_template

__all__ = ["PromptEncoder"]

# The tokenizer classes whose post-processor transformers builds from the two flags.
_FLAG_CLASSES = {"LlamaTokenizer", "GemmaTokenizer", "CodeLlamaTokenizer"}


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: text or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptEncoder:
    """Encodes text and chat prompts for one checkpoint directory (module docstring).

    Invariant: `encode(text)` equals transformers' `tokenizer(text).input_ids` for the
    same files, and `encode(text, chat=True)` its `apply_chat_template(...,
    add_generation_prompt=True)`.
    """

    def __init__(self, tokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template = chat_template
        rebuilds = str(config.get("tokenizer_class", "")).removesuffix("Fast") in _FLAG_CLASSES
        self.add_bos = config.get("add_bos_token") if rebuilds else None
        self.add_eos = config.get("add_eos_token") if rebuilds else None
        for name in ("add_bos_token", "add_eos_token"):
            if config.get(name) is not None and not isinstance(config[name], bool):
                raise ValueError(f"tokenizer_config.json: {name} must be true or false")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer) -> PromptEncoder:
        path = Path(path)
        config: dict[str, Any] = {}
        file = path / "tokenizer_config.json"
        if file.is_file():
            try:
                config = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{file}: not valid JSON ({error})") from None
            if not isinstance(config, dict):
                raise ValueError(f"{file}: not a JSON object")
        template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{file}: chat_template must be a string (one template)")
        return cls(tokenizer, config, template)

    def _special_id(self, text: str | None, name: str) -> int:
        token_id = None if text is None else self.tokenizer.token_to_id(text)
        if token_id is None:
            raise ValueError(
                f"tokenizer_config.json sets {name}=true but its token {text!r} is not in "
                "tokenizer.json's vocabulary"
            )
        return token_id

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        if self.add_bos is None and self.add_eos is None:
            return list(self.tokenizer.encode(text).ids)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.add_bos:
            ids = [self._special_id(self.bos_token, "add_bos_token"), *ids]
        if self.add_eos:
            ids.append(self._special_id(self.eos_token, "add_eos_token"))
        return ids

    def render_chat(self, text: str) -> str:
        """The chat template applied to one user message, with the generation prompt."""
        return self.render_messages([{"role": "user", "content": text}])

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to `messages` (`role`, `content`), with the
        generation prompt, as transformers' `apply_chat_template` renders it."""
        if self.chat_template is None:
            raise ValueError(
                "--chat needs a chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja); this checkpoint has none"
            )
        return render_chat_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """`messages` through the chat template, tokenized without added special tokens
        (the template writes them)."""
        text = self.render_messages(messages)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
