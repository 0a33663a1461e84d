"""Typed configuration of data preparation and reading (the ``data`` section of a run config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class FilterConfig:
    """Keep only the rows (JSON records) whose ``column`` equals ``value``; no column: keep
    every row. (Not Optional in SourceConfig so that a mistake inside it is reported by key.)"""

    column: str | None = None
    """The column (Parquet, Arrow, hf_disk) or JSON field compared; every row must have it."""
    value: str | bool | int | float | None = None
    """The value a row keeps; compared with the column's own type (``en``, ``true``, ``3``)."""

    def problems(self) -> list[str]:
        out = []
        if self.column is None and self.value is not None:
            out.append("column: name the column to filter on, e.g. {column: lang, value: en}")
        if self.column == "":
            out.append("column: must be a column name, e.g. lang")
        if self.column is not None and self.value is None:
            out.append(f"value: give the value of {self.column!r} that rows must have")
        return out


COLUMN_TYPES = ("jsonl", "instruction", "parquet", "arrow", "hf_disk")
"""Source types whose rows have named fields or columns (to filter on)."""

ROLES = ("system", "user", "assistant")
"""The roles of an instruction conversation's messages."""


@dataclass
class RoleTemplate:
    """How one role's messages are written around their text: ``prefix + content + suffix``."""

    prefix: str = ""
    """Text before the message (never trained: it is what the model is given)."""
    suffix: str = ""
    """Text after the message, trained with it when the role is trained (e.g. an end-of-turn
    marker the model must learn to write)."""


@dataclass
class TemplateConfig:
    """How an ``instruction`` source's conversations become one document of tokens and which of
    them the loss counts. Each message is written as its role's ``prefix + content + suffix``,
    messages in order, then EOS (every document ends with EOS: packing and document masking
    find documents by it); the text is tokenized whole and a token is trained when it covers a
    character of a trained role's content or suffix. Part of the prepared data: a change is a
    new preparation."""

    system: RoleTemplate = field(default_factory=lambda: RoleTemplate("System: ", "\n\n"))
    """Default ``{prefix: "System: ", suffix: "\\n\\n"}``; given here, both strings come from
    the config (one left out is empty)."""
    user: RoleTemplate = field(default_factory=lambda: RoleTemplate("User: ", "\n\n"))
    """Default ``{prefix: "User: ", suffix: "\\n\\n"}``."""
    assistant: RoleTemplate = field(default_factory=lambda: RoleTemplate("Assistant: ", "\n\n"))
    """Default ``{prefix: "Assistant: ", suffix: "\\n\\n"}``."""
    add_bos: bool = False
    """Put BOS before each conversation (never trained)."""
    train_eos: bool = True
    """Train the closing EOS when the last message's role is trained: the model learns to stop
    after its answer. False: EOS only separates documents."""
    train_roles: list[Literal["system", "user", "assistant"]] = field(
        default_factory=lambda: ["assistant"]
    )
    """Roles whose message text and suffix the loss counts (``{prompt, response}`` records are
    a user message and an assistant message). Every other token is a prompt token: its target
    is ignored."""

    def role(self, name: str) -> RoleTemplate:
        return getattr(self, name)

    def check(self) -> list[str]:
        """Problems (not ``problems()``: the source reports them, for instruction sources only)."""
        out = []
        if not self.train_roles:
            out.append(
                "train_roles: name at least one role whose text is trained, e.g. [assistant]"
            )
        if len(set(self.train_roles)) != len(self.train_roles):
            out.append(f"train_roles: roles must be distinct, got {self.train_roles}")
        return out


@dataclass
class SourceConfig:
    name: str = "stdlib"
    """A name for this source (used in the manifest, for mixture weights and in the counters)."""
    type: Literal[
        "stdlib", "python", "text", "jsonl", "instruction", "parquet", "arrow", "hf_disk"
    ] = "stdlib"
    """``stdlib``: docstrings and comments of the installed Python standard library.
    ``python``: docstrings and comments of the ``.py`` files in ``paths`` (a directory is
    searched for them), one document per file; a file that does not parse gives nothing.
    ``text``: plain-text files, one document per file. ``jsonl``: one JSON object per line, the
    document is its ``field``. ``instruction``: JSONL of ``{"prompt": ..., "response": ...}``
    or ``{"messages": [{"role": ..., "content": ...}, ...]}`` records, written with
    ``template``; only the trained roles' tokens count in the loss (docs/data.md, "Instruction
    data"). Text and JSONL files may be gzip or zstd compressed (known by
    their first bytes). ``parquet`` / ``arrow`` (Arrow IPC files): one document per row, taken
    from the column ``field``. ``hf_disk``: Hugging Face datasets written by ``save_to_disk``
    (each path a directory with ``state.json`` and ``data-*.arrow``), read with pyarrow alone,
    one document per row."""
    paths: list[str] = field(default_factory=list)
    """Files, directories (searched recursively; ``parquet``, ``arrow`` and ``python`` take
    only the ``.parquet`` / ``.arrow`` / ``.py`` files in them; hidden entries are skipped) or glob patterns
    (``**`` allowed, e.g. ``corpus/**/*.jsonl.gz``)."""
    field: str = "text"
    """The JSON field or table column holding the text (``jsonl``, ``parquet``, ``arrow``,
    ``hf_disk``)."""
    filter: FilterConfig = dataclasses.field(default_factory=FilterConfig)  # `field` is taken
    """Keep only rows whose column equals a value, e.g. ``{column: lang, value: en}``
    (``jsonl``, ``parquet``, ``arrow``, ``hf_disk``). Rows left out are counted in the manifest."""
    template: TemplateConfig = dataclasses.field(default_factory=TemplateConfig)
    """``instruction`` sources: how conversations are written and which roles are trained."""
    weight: float | None = None
    """Mixture weight when reading (relative; normalized over sources). Null on every source:
    each source in proportion to its tokens. Not part of the prepared data: change it freely."""

    def problems(self) -> list[str]:
        out = []
        if self.type != "stdlib" and not self.paths:
            out.append(f"paths: a {self.type!r} source needs at least one path or glob")
        if self.type == "stdlib" and self.paths:
            out.append("paths: a 'stdlib' source takes no paths")
        if not self.name or "/" in self.name:
            out.append(f"name: {self.name!r} must be a non-empty name without '/'")
        out += [f"filter.{p}" for p in self.filter.problems()]
        if self.filter.column is not None:
            if self.type not in COLUMN_TYPES:
                out.append(
                    f"filter: a {self.type!r} source has no columns to filter on; "
                    f"filters apply to {', '.join(COLUMN_TYPES)} sources"
                )
        if self.type == "instruction":
            out += [f"template.{p}" for p in self.template.check()]
        elif self.template != TemplateConfig():
            out.append(
                f"template: only 'instruction' sources have a template (this one is {self.type!r})"
            )
        if self.type == "hf_disk" and any(p.startswith("s3://") for p in self.paths):
            out.append(
                "paths: an 'hf_disk' source is read from local disk only; point a "
                "'parquet' or 'arrow' source at the dataset's files in the bucket"
            )
        if self.weight is not None and not self.weight > 0:
            out.append(f"weight: must be > 0 (or null), got {self.weight}")
        return out

    @property
    def row_filter(self) -> FilterConfig | None:
        """The filter, or None when every row is kept."""
        return self.filter if self.filter.column is not None else None


MIN_VOCAB = 300
"""The least data.tokenizer.vocab_size: byte fallback's 256 pieces, the 4 special ones and room."""


@dataclass
class TokenizerConfig:
    model_file: str | None = None
    """An existing tokenizer to use instead of training one: a SentencePiece model, or a
    Hugging Face ``tokenizer.json`` (an open-weights model's own; BOS/EOS/PAD/UNK found by
    their usual names, e.g. ``<s>``, ``</s>``, ``<|endoftext|>``)."""
    vocab_size: int = 4096
    model_type: Literal["bpe", "unigram"] = "bpe"
    byte_fallback: bool = True
    """Unknown characters become byte pieces instead of <unk>."""
    normalization: Literal["identity", "nmt_nfkc"] = "identity"
    """``identity`` keeps text as it is (with byte fallback, decoding gives the text back
    exactly, spaces and U+FFFD included); ``nmt_nfkc`` applies NFKC and collapses whitespace."""
    sample_sentences: int = 300000
    """Lines sampled (uniformly, seeded) from the sources to train the tokenizer."""
    special_tokens: list[str] = field(default_factory=list)
    """Extra pieces that are never split (e.g. ``<|im_start|>``), after UNK=0 BOS=1 EOS=2 PAD=3."""

    def problems(self) -> list[str]:
        out = []
        if self.vocab_size < MIN_VOCAB:
            out.append(
                f"vocab_size: must be >= {MIN_VOCAB} (byte fallback needs 256 pieces), "
                f"got {self.vocab_size}"
            )
        if self.vocab_size > 2**32:
            out.append(
                f"vocab_size: must be <= 2**32 (tokens are stored as uint32 at most), "
                f"got {self.vocab_size}"
            )
        if len(set(self.special_tokens)) != len(self.special_tokens) or "" in self.special_tokens:
            out.append(
                f"special_tokens: must be distinct non-empty strings, got {self.special_tokens}"
            )
        return out


@dataclass
class S3Config:
    """How ``s3://`` paths are reached. Credentials are never part of the config: the AWS SDK
    reads them from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` or ``~/.aws/credentials`` and ``~/.aws/config``."""

    endpoint_url: str | None = None
    """An S3-compatible store (MinIO, Ceph, R2, ...), e.g. ``http://minio.local:9000``; null:
    AWS itself."""
    region: str | None = None
    """The bucket's region, e.g. ``eu-west-1``; null: the SDK's default (``AWS_DEFAULT_REGION``,
    ``~/.aws/config``)."""

    def problems(self) -> list[str]:
        url = self.endpoint_url
        if url is not None and not (url.startswith(("http://", "https://")) and len(url) > 8):
            return [
                f"endpoint_url: must be an http:// or https:// URL such as "
                f"http://127.0.0.1:9000, got {url!r}"
            ]
        return []


@dataclass
class DataConfig:
    dir: str = "data/stdlib"
    """Where prepared data lives: manifest.json, the tokenizer and the train/valid shards. A
    local directory, or an ``s3://bucket/prefix`` that training streams the shards from
    (through a local cache, ``cache_dir``; reached with the ``s3`` settings)."""
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    s3: S3Config = field(default_factory=S3Config)
    """Endpoint and region for ``s3://bucket/prefix/...`` URLs: sources' paths and ``dir``."""
    cache_dir: str | None = None
    """Local directory where shards of an ``s3://`` ``dir`` are kept while training reads them;
    ranks of one node share it (downloads are atomic and locked per shard). Null:
    ``$XDG_CACHE_HOME/moe-pretrain/shards`` (``~/.cache/...``). Ignored for local data."""
    cache_bytes: int = 20 * 10**9
    """Bound on the cache's size in bytes: the least recently used shards not open by any rank
    are evicted to keep under it. It must hold a few shards per rank of the node
    (one being read and ``read_ahead`` fetched ahead)."""
    read_ahead: int = 2
    """Shards of an ``s3://`` ``dir`` fetched in the background ahead of the one being read
    (0: fetch each when it is needed)."""
    valid_fraction: float = 0.02
    """Share of documents in the validation split, chosen by a hash of each document's text
    (after ``str.strip()`` and Unicode NFC): the same documents get the same split whatever
    their container, compression, order, sharding or worker count, and copies of a text
    always share it (docs/data.md)."""
    dedup: Literal["none", "exact"] = "none"
    """``exact``: keep only the first document of each text (same key as the split: stripped,
    NFC), across all sources, in source and file order; the documents dropped are counted per
    source. ``none``: keep every document."""
    on_empty: Literal["skip", "error"] = "skip"
    """Rows whose text is null, empty or whitespace: ``skip`` them (counted per file in the
    manifest, with their first row numbers) or stop the preparation with an ``error`` naming
    the file and rows."""
    shard_tokens: int = 4_000_000
    """Target tokens per shard (a shard closes at the first document end past it)."""
    seq_len: int = 256
    """Tokens per training sequence (each sample holds seq_len + 1 tokens)."""
    seed: int = 1234
    """Seed of the sample order."""
    prepare_workers: int = 2
    """Processes that read and tokenize in parallel."""
    loader_workers: int = 0
    """DataLoader worker processes per rank that pack batches ahead of the step (0: the
    training process reads them itself)."""
    allow_other_data_on_resume: bool = False
    """Resume from a checkpoint whose data fingerprint differs from this data (the counters
    carry over; the order is that of the new data)."""

    def weights(self) -> dict[str, float] | None:
        """Mixture weights by source name, or None for natural proportions."""
        if any(s.weight is None for s in self.sources):
            return None
        return {s.name: float(s.weight) for s in self.sources}

    def problems(self) -> list[str]:
        out = [f"sources[{i}].{p}" for i, s in enumerate(self.sources) for p in s.problems()]
        out += [f"tokenizer.{p}" for p in self.tokenizer.problems()]
        out += [f"s3.{p}" for p in self.s3.problems()]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            out.append(f"sources: names must be unique, got {names}")
        if not self.sources:
            out.append("sources: at least one source is needed")
        if not 0 < self.valid_fraction < 1:
            out.append(f"valid_fraction: must be between 0 and 1, got {self.valid_fraction}")
        if not 1024 <= self.shard_tokens <= 2**30:
            # Arrow list offsets are int32: a shard must stay well below 2**31 tokens.
            out.append(f"shard_tokens: must be between 1024 and 2**30, got {self.shard_tokens}")
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            out.append("sources: give every source a weight, or none (natural proportions)")
        if self.seq_len < 2:
            out.append(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.prepare_workers < 1:
            out.append(f"prepare_workers: must be >= 1, got {self.prepare_workers}")
        if self.loader_workers < 0:
            out.append(f"loader_workers: must be >= 0, got {self.loader_workers}")
        if self.cache_bytes < 1:
            out.append(f"cache_bytes: must be > 0 bytes, got {self.cache_bytes}")
        if self.read_ahead < 0:
            out.append(f"read_ahead: must be >= 0, got {self.read_ahead}")
        if self.dir.startswith("s3://") and len(self.dir.rstrip("/")) <= len("s3://"):
            out.append(f"dir: {self.dir!r} names no bucket; use s3://bucket/prefix")
        return out
