"""Evaluation's view of prepared data: random access to a split's tokens (:class:`TokenStream`)
and the fixed pass of windows over it that evaluation and the validation loss read
(:func:`token_windows`, :func:`validation_windows`). Training reads packed batches instead
(``data_pipeline/reader.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from data_pipeline.errors import DataError
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import next_token_targets, prepared


class TokenStream:
    """Random access to a split's tokens (its shards concatenated in manifest order, or one
    source's), memory-mapped shard by shard; remote shards are copied into memory as they are
    fetched, so that none stays pinned in the shard cache."""

    def __init__(self, data_dir: str | Path | PreparedData, split: str, source: str | None = None):
        data = prepared(data_dir)
        self.data_dir = data.dir
        self.manifest = data.manifest
        if split not in self.manifest.splits:
            raise DataError(f"{self.data_dir}: no split {split!r} in the manifest")
        infos = self.manifest.splits[split].shards
        if source is not None:
            infos = [s for s in infos if s.source == source]
        self.files = [data.location(s.file) for s in infos]
        if data.remote:
            opened = []
            for info in infos:
                with data.shard_data(info) as (tokens, mask):
                    opened.append((np.array(tokens), None if mask is None else np.array(mask)))
        else:
            opened = [data.open_local_data(s) for s in infos]
        self.shards = [tokens for tokens, _ in opened]
        self.masks = [mask for _, mask in opened] if data.masked else None
        """Loss masks per shard (uint8), None for data without one."""
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in self.shards], out=self.starts[1:])
        self.vocab_size = int(self.manifest.tokenizer["vocab_size"])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        out = self._read(self.shards, start, length, np.int64)
        if length and out.max() >= self.vocab_size:
            shard = (
                int(
                    np.searchsorted(
                        self.starts, start + int(np.argmax(out >= self.vocab_size)), side="right"
                    )
                )
                - 1
            )
            raise DataError(
                f"{self.files[shard]}: token id {int(out.max())} out of range "
                f"for the tokenizer's vocabulary of {self.vocab_size}"
            )
        return out

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        """The loss mask of tokens ``[start, start + length)``; None: data without one."""
        return None if self.masks is None else self._read(self.masks, start, length, np.uint8)

    def _read(self, arrays: list[np.ndarray], start: int, length: int, dtype) -> np.ndarray:
        out = np.empty(length, dtype=dtype)
        pos, filled = start, 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            local = pos - self.starts[shard]
            take = min(length - filled, len(arrays[shard]) - local)
            out[filled : filled + take] = arrays[shard][local : local + take]
            filled, pos, shard = filled + take, pos + take, shard + 1
        return out


class Window(NamedTuple):
    """A window of evaluation: its tokens and what the loss predicts of them."""

    tokens_S: torch.Tensor
    """(S,) int64 token ids: the inputs are ``tokens_S[:-1]``."""
    targets_S: torch.Tensor
    """(S - 1,) int64: ``tokens_S[1:]``, IGNORE_INDEX where the loss mask is 0."""


def token_windows(tokens, seq_len: int, max_tokens: int | None = None) -> Iterator[Window]:
    """Consecutive windows of seq_len + 1 tokens overlapping by one token, so every token after
    the first is predicted exactly once; at most ``max_tokens`` predictions. ``tokens`` has
    ``len``, ``read(start, length)`` and ``read_mask(start, length)`` (None: no loss mask), as a
    TokenStream."""
    total = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    start = 0
    while start + 1 < total:
        length = min(seq_len + 1, total - start)
        window = np.asarray(tokens.read(start, length), dtype=np.int64)
        targets = next_token_targets(window, tokens.read_mask(start, length))
        yield Window(torch.from_numpy(window), torch.from_numpy(targets))
        start += length - 1


def validation_windows(
    data_dir: str | Path | PreparedData,
    seq_len: int,
    max_tokens: int | None = None,
    source: str | None = None,
) -> Iterator[Window]:
    """A fixed pass over the validation split (or one source's part of it): consecutive windows
    of seq_len + 1 tokens that overlap by one token, so every token after the first is predicted
    exactly once (:func:`token_windows`)."""
    return token_windows(TokenStream(data_dir, "valid", source), seq_len, max_tokens)
