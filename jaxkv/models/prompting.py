"""Prompts as transformers encodes them: `add_bos_token` / `add_eos_token` and the
checkpoint's chat template (found where vLLM finds it: `chat_template_files`).

transformers' Llama and Gemma tokenizers (`tokenizer_class` LlamaTokenizer,
GemmaTokenizer, CodeLlamaTokenizer, with or without "Fast") rebuild the post-processor
from `add_bos_token` / `add_eos_token`, so for them those flags win over what
`tokenizer.json` says; every other class (the generic backend included) ignores the
flags and `tokenizer.json`'s own post-processor decides, as here. A chat prompt is the
template rendered as transformers' `apply_chat_template` renders it (`chat_sandbox`:
`messages`, `add_generation_prompt=True`, `tools` and `documents` None, and the named
special tokens of `tokenizer_config.json` by name) and tokenized without adding special
tokens (the template writes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxkv.models.chat_content import OPENAI, chat_content_format
from jaxkv.models.chat_sandbox import render_chat_template
from jaxkv.models.chat_template_files import find_chat_template, read_json_object

__all__ = ["PromptEncoder"]

# The tokenizer classes whose post-processor transformers builds from the two flags.
_FLAG_CLASSES = {"LlamaTokenizer", "GemmaTokenizer", "CodeLlamaTokenizer"}
# transformers' named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")  # fmt: skip


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: text or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens transformers gives a chat template by name (its
    `special_tokens_map`): the named ones that are set, then the model's own (other
    `*_token` fields with a token, `extra_special_tokens` given as an object)."""
    tokens = {name: _token_text(config.get(name)) for name in _NAMED_TOKENS}
    own = {k: v for k, v in config.items() if k.endswith("_token") and k not in _NAMED_TOKENS}
    extra = config.get("extra_special_tokens")
    own.update(extra if isinstance(extra, dict) else {})
    tokens.update((name, _token_text(value)) for name, value in own.items())
    return {name: text for name, text in tokens.items() if text is not None}


class PromptEncoder:
    """Encodes text and chat prompts for one checkpoint directory (module docstring).

    Invariant: `encode(text)` equals transformers' `tokenizer(text).input_ids` for the
    same files, and `encode(text, chat=True)` its `apply_chat_template(...,
    add_generation_prompt=True)`.
    """

    def __init__(
        self,
        tokenizer,
        config: dict[str, Any],
        chat_template: str | None,
        template_source: str = "given",
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template = chat_template
        # Where the template came from, or why there is none (`FoundTemplate.source`).
        self.template_source = template_source
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
        """The encoder of checkpoint `path`: its `tokenizer_config.json` (none: {}) and
        its chat template (ValueError naming a malformed file)."""
        file = Path(path) / "tokenizer_config.json"
        config = read_json_object(file) if file.is_file() else {}
        found = find_chat_template(path, config)
        return cls(tokenizer, config, found.template, found.source)

    def _special_id(self, text: str | None, name: str) -> int:
        token_id = None if text is None else self.tokenizer.token_to_id(text)
        if token_id is None:
            raise ValueError(
                f"tokenizer_config.json sets {name}=true but its token {text!r} is not in "
                "tokenizer.json's vocabulary"
            )
        return token_id

    def encode(self, text: str, *, chat: bool = False, images: int = 0) -> list[int]:
        """`text` as transformers tokenizes it, or with `chat` as one user message (with
        `images` images before its text) through the chat template (`user_turn`)."""
        if chat:
            return self.encode_chat([self.user_turn(text, images)])
        if self.add_bos is None and self.add_eos is None:
            return list(self.tokenizer.encode(text).ids)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.add_bos:
            ids = [self._special_id(self.bos_token, "add_bos_token"), *ids]
        if self.add_eos:
            ids.append(self._special_id(self.eos_token, "add_eos_token"))
        return ids

    def user_turn(self, text: str, images: int = 0) -> dict[str, Any]:
        """One user message in the content format the template takes, as vLLM 0.33 gives
        it (`chat_content`): for "openai", parts (`images` image parts, then the text),
        so a template over parts sees the text (and writes the image token itself); for
        "string", the text (`images` left to the caller)."""
        if chat_content_format(self.chat_template) == OPENAI:
            parts = [{"type": "image"}] * images + [{"type": "text", "text": text}]
            return {"role": "user", "content": parts}
        return {"role": "user", "content": text}

    def render_chat(self, text: str) -> str:
        """The chat template applied to one user message, with the generation prompt."""
        return self.render_messages([self.user_turn(text)])

    def render_messages(self, messages: list[dict[str, Any]]) -> str:
        """The chat template applied to `messages` (`role`, `content`), with the
        generation prompt, as transformers' `apply_chat_template` renders it."""
        if self.chat_template is None:
            raise ValueError(
                f"--chat needs a chat template; this checkpoint has none: {self.template_source}"
            )
        # transformers: the special tokens, then its own arguments over them.
        variables = {**_special_tokens(self.config), "tools": None, "documents": None}
        return render_chat_template(
            self.chat_template, **variables, messages=messages, add_generation_prompt=True
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """`messages` through the chat template, tokenized without added special tokens
        (the template writes them)."""
        text = self.render_messages(messages)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
