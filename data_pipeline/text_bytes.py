"""How many bytes of text a stretch of tokens stands for: the denominator of bits per byte,
which compares losses across tokenizers (a loss per token does not: a tokenizer with longer
pieces has fewer, harder tokens)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from data_pipeline.tokenizer import Tokenizer

CHUNK_TOKENS = 1 << 20
"""Tokens read at a time."""


class PredictedText(NamedTuple):
    targets: int
    """Trained targets: the predictions a loss averages over."""
    bytes: int
    """UTF-8 bytes of the text they decode to."""
    documents: int
    """Documents the predictions reach into (an EOS ends one)."""


def predicted_text_bytes(
    tokens, tokenizer: Tokenizer, max_tokens: int | None = None
) -> PredictedText:
    """:class:`PredictedText` of the predictions an evaluation of ``tokens`` makes
    (:func:`data_pipeline.token_stream.token_windows`: every token after the first, at most
    ``max_tokens``, those whose loss mask is 0 left out): how many trained targets there are,
    the UTF-8 bytes of the text they decode to, and how many documents they reach into. Each
    document's targets are decoded together (a SentencePiece piece may begin with the space
    between two words, a byte-level piece may hold part of a character), documents apart (EOS
    decodes to no text); with the identity normalisation (``data.tokenizer.normalization``)
    that is the document's own text.
    ``tokens`` has ``len``, ``read`` and ``read_mask``, as a
    :class:`~data_pipeline.token_stream.TokenStream`."""
    total = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    targets = text = eos = 0
    last = tokenizer.eos_id
    pending: list[np.ndarray] = []  # the document being read, across chunks
    for start in range(1, total, CHUNK_TOKENS):
        length = min(CHUNK_TOKENS, total - start)
        ids = np.asarray(tokens.read(start, length), dtype=np.int64)
        mask = tokens.read_mask(start, length)
        trained = np.ones(length, bool) if mask is None else np.asarray(mask) != 0
        targets += int(trained.sum())
        eos += int((ids == tokenizer.eos_id).sum())
        last = int(ids[-1])
        # A target the loss skips ends a stretch of text as an EOS does: its text is not scored.
        ends = np.flatnonzero((ids == tokenizer.eos_id) | ~trained)
        begin = 0
        for end in ends:
            pending.append(ids[begin:end])
            text += _bytes(tokenizer, pending)
            pending, begin = [], end + 1
        pending.append(ids[begin:])
    documents = eos + (last != tokenizer.eos_id)
    return PredictedText(targets, text + _bytes(tokenizer, pending), documents)


def _bytes(tokenizer: Tokenizer, parts: list[np.ndarray]) -> int:
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return len(tokenizer.decode(ids.tolist()).encode("utf-8")) if len(ids) else 0
