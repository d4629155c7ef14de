"""Incremental detokenization (`jaxkv.engine.detokenizer`): over random token sequences
of a byte-level BPE (GPT-2/Llama-3 style) and a Metaspace + byte-fallback one
(Llama-2/Gemma style), special tokens included, the text only grows, every text is a
prefix of decoding the whole output, and the finished text is exactly that decode.
Random ids split multi-byte characters and make invalid UTF-8 on purpose."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxkv.engine.detokenizer import IncrementalText

CORPUS = [
    "hello world, héllo wörld", "naïve café résumé", "東京は晴れです", "emoji 🙂🚀 ok",
    "the quick brown fox jumps over the lazy dog", "ünïcödé ∑∫√ ≠ ≈", "日本語のテキスト",
] * 20  # fmt: skip
SPECIALS = ["<s>", "</s>", "<pad>"]


def byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def metaspace_byte_fallback() -> Tokenizer:
    """Llama-2's tokenizer.json layout: `▁` for spaces, `<0xXX>` byte tokens for what the
    vocabulary lacks, a decoder that strips the first leading space."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *SPECIALS, *(f"<0x{b:02X}>" for b in range(256))],
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


TOKENIZERS = {"byte-level": byte_level_bpe(), "metaspace-byte-fallback": metaspace_byte_fallback()}


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_texts_grow_as_prefixes_of_the_whole_decode(name: str, data) -> None:
    tokenizer = TOKENIZERS[name]
    vocab = tokenizer.get_vocab_size()
    encoded = tokenizer.encode(data.draw(st.sampled_from(CORPUS))).ids
    noise = st.lists(st.integers(0, vocab - 1), max_size=12)
    tokens = data.draw(st.one_of(noise, st.just(encoded[:24]), st.just(encoded[:8]).map(
        lambda ids: ids + data.draw(noise))))  # fmt: skip
    state, previous = IncrementalText(), ""
    for end in range(1, len(tokens) + 1):
        text = state.text(tokens[:end], tokenizer)
        assert text.startswith(previous), (tokens[:end], previous, text)
        assert tokenizer.decode(tokens[:end]).startswith(text), (tokens[:end], text)
        previous = text
    assert state.text(tokens, tokenizer, finished=True) == tokenizer.decode(tokens)


def test_encoded_text_decodes_to_itself_one_token_at_a_time() -> None:
    tokenizer = TOKENIZERS["byte-level"]
    for line in CORPUS[:7]:
        ids, state = tokenizer.encode(line).ids, IncrementalText()
        for end in range(1, len(ids) + 1):
            text = state.text(ids[:end], tokenizer)
        assert text == line


def test_a_tokenizer_of_another_library_is_decoded_whole() -> None:
    class Words:
        calls = 0

        def decode(self, token_ids: list[int]) -> str:
            Words.calls += 1
            return " ".join(f"w{t}" for t in token_ids)

    state = IncrementalText()
    assert state.text([1], Words()) == "w1"
    assert state.text([1], Words()) == "w1" and Words.calls == 1  # unchanged: not decoded
    assert state.text([1, 2], Words()) == "w1 w2"
