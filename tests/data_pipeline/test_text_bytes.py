"""The bytes of text an evaluation's predictions stand for (data_pipeline/text_bytes.py), the
denominator of bits per byte, and the documents they reach into."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_pipeline import text_bytes
from data_pipeline.config import TokenizerConfig
from data_pipeline.tokenizer import LineSample, Tokenizer, train_tokenizer

DOCS = [
    "Plain ASCII text, with  two spaces.",
    "Unseen: λx → 漢字 🙂 and more",
    "a\nmulti-line\n\tdocument\n",
    "é" * 40,
]


class Stream:
    """Tokens in memory with a TokenStream's read / read_mask."""

    def __init__(self, ids, mask=None):
        self.ids, self.mask = np.asarray(ids), None if mask is None else np.asarray(mask)

    def __len__(self):
        return len(self.ids)

    def read(self, start, length):
        return self.ids[start : start + length]

    def read_mask(self, start, length):
        return None if self.mask is None else self.mask[start : start + length]


@pytest.fixture(scope="module")
def sentencepiece(tiny_data, tmp_path_factory) -> Tokenizer:
    sample = LineSample(20000, seed=0)
    for f in sorted(Path(tiny_data.sources[0].paths[0]).iterdir()):
        sample.add(f.read_text(encoding="utf-8"))
    return train_tokenizer(
        sample.lines, TokenizerConfig(vocab_size=600), tmp_path_factory.mktemp("tok") / "t.model"
    )


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    from tests.data_pipeline.test_tokenizer_json import write_json

    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    write_json(path)
    return Tokenizer(path)


def _stream(tok: Tokenizer, docs=DOCS) -> list[int]:
    """The prepared layout: each document's tokens then EOS; one EOS first, so that the first
    document's first token is predicted too."""
    ids = [tok.eos_id]
    for d in docs:
        ids += tok.encode(d) + [tok.eos_id]
    return ids


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_the_predicted_text_is_the_documents_own_bytes(kind, request, monkeypatch):
    """Every document whole: the bytes are the UTF-8 bytes of the texts (multi-byte characters,
    byte-fallback pieces, SentencePiece's dummy-prefix space and a byte-level tokenizer's
    partial characters included), whatever the reads' chunk size; the targets are every token
    after the first."""
    tok = request.getfixturevalue(kind)
    ids = _stream(tok)
    expected = sum(len(d.encode("utf-8")) for d in DOCS)
    whole = (len(ids) - 1, expected, len(DOCS))
    assert text_bytes.predicted_text_bytes(Stream(ids), tok) == whole
    monkeypatch.setattr(text_bytes, "CHUNK_TOKENS", 3)  # documents across chunk boundaries
    assert text_bytes.predicted_text_bytes(Stream(ids), tok) == whole


def test_max_tokens_and_the_loss_mask_bound_the_text(sentencepiece):
    """max_tokens: the first documents' text only; a loss mask: the bytes of the trained
    targets only (here the second document masked out)."""
    tok = sentencepiece
    ids = _stream(tok)
    first = len(tok.encode(DOCS[0])) + 1  # the first document and its EOS
    assert text_bytes.predicted_text_bytes(Stream(ids), tok, max_tokens=first) == (
        first,
        len(DOCS[0].encode()),
        1,
    )
    assert text_bytes.predicted_text_bytes(Stream(ids), tok, max_tokens=first + 2).documents == 2
    mask = np.ones(len(ids), np.uint8)
    second = slice(first + 1, first + 1 + len(tok.encode(DOCS[1])))
    mask[second] = 0
    targets, text, _ = text_bytes.predicted_text_bytes(Stream(ids, mask), tok)
    assert targets == len(ids) - 1 - (second.stop - second.start)
    assert text == sum(len(d.encode()) for i, d in enumerate(DOCS) if i != 1)
