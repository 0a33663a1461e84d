"""Typed configuration of data preparation and reading (the ``data`` section of a run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SourceConfig:
    name: str = "stdlib"
    """A name for this source (used in the manifest and for mixtures)."""
    type: Literal["stdlib", "text"] = "stdlib"
    """``stdlib``: docstrings and comments of the installed Python standard library.
    ``text``: plain-text files; each file is one document."""
    paths: list[str] = field(default_factory=list)
    """Files, directories or glob patterns (``text`` sources)."""

    def problems(self) -> list[str]:
        out = []
        if self.type == "text" and not self.paths:
            out.append("paths: a 'text' source needs at least one path or glob")
        if self.type == "stdlib" and self.paths:
            out.append("paths: a 'stdlib' source takes no paths")
        return out


@dataclass
class TokenizerConfig:
    model_file: str | None = None
    """An existing SentencePiece model to use instead of training one."""
    vocab_size: int = 4096
    model_type: Literal["bpe", "unigram"] = "bpe"
    byte_fallback: bool = True
    """Unknown characters become byte pieces instead of <unk>."""
    sample_sentences: int = 300000
    """Lines sampled from the sources to train the tokenizer."""

    def problems(self) -> list[str]:
        return [] if self.vocab_size >= 300 else [
            f"vocab_size: must be >= 300 (byte fallback needs 256 pieces), got {self.vocab_size}"]


@dataclass
class DataConfig:
    dir: str = "data/stdlib"
    """Where prepared data lives: manifest.json, the tokenizer and the train/valid shards."""
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    valid_fraction: float = 0.02
    """Share of documents in the validation split, chosen by a hash of the document id."""
    shard_tokens: int = 4_000_000
    """Target tokens per shard."""
    seq_len: int = 256
    """Tokens per training sequence (each sample holds seq_len + 1 tokens)."""
    seed: int = 1234
    """Seed of the sample order."""
    prepare_workers: int = 2
    """Processes that tokenize in parallel."""

    def problems(self) -> list[str]:
        out = [f"sources[{i}].{p}" for i, s in enumerate(self.sources) for p in s.problems()]
        out += [f"tokenizer.{p}" for p in self.tokenizer.problems()]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            out.append(f"sources: names must be unique, got {names}")
        if not self.sources:
            out.append("sources: at least one source is needed")
        if not 0 < self.valid_fraction < 1:
            out.append(f"valid_fraction: must be between 0 and 1, got {self.valid_fraction}")
        if self.shard_tokens < 1024:
            out.append(f"shard_tokens: must be >= 1024, got {self.shard_tokens}")
        if self.seq_len < 2:
            out.append(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.prepare_workers < 1:
            out.append(f"prepare_workers: must be >= 1, got {self.prepare_workers}")
        return out
