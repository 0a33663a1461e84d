"""Tokenized Arrow IPC shards and the manifest that describes them.

A shard is an Arrow IPC *file* (memory-mappable) with one column ``tokens`` (list of the smallest
unsigned integer type that holds the vocabulary), one row per document, each document ending with
EOS; in data with a loss mask (``Manifest.loss_mask``: instruction data), a second column
``loss_mask`` (list of uint8, one per token: 1 where the token is a trained target, 0 where the
loss ignores it). Data without the column reads as all ones. Every shard holds documents of one source and one split; concatenating a source's shards
gives the token stream its sequences are packed from. Every file is written under a temporary
name, flushed to disk and renamed into place, so a crash never leaves a file the reader would
accept; the manifest, which lists every shard with its counts and SHA-256, is written last.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from data_pipeline import storage
from data_pipeline.config import S3Config
from data_pipeline.errors import DataError
from moe.core.fileio import write_atomic

SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
SPLITS = ("train", "valid")


def token_type(vocab_size: int) -> pa.DataType:
    """The smallest unsigned integer type that holds every id of the vocabulary."""
    for t in (pa.uint8(), pa.uint16(), pa.uint32()):
        if vocab_size <= 2**t.bit_width:
            return t
    raise DataError(f"a vocabulary of {vocab_size} pieces does not fit in uint32 token ids")


@dataclass
class ShardInfo:
    file: (
        str  # relative to the data directory: gen-N/NAME (NAME in data written before generations)
    )
    source: str
    documents: int
    tokens: int
    sha256: str
    bytes: int | None = None
    """File size; absent in manifests written before it was recorded (the store is asked)."""


@dataclass
class SplitInfo:
    shards: list[ShardInfo] = field(default_factory=list)

    def of_source(self, name: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.source == name]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)


@dataclass
class Manifest:
    schema_version: int
    config_hash: str
    """Hash of the data config that produced this data (a re-run with the same one is a no-op)."""
    tokenizer: dict
    token_type: str
    splits: dict[str, SplitInfo]
    sources: list[dict]
    """Per source: name, type, paths, field, documents, empty documents skipped (and per file,
    where), duplicates dropped, invalid UTF-8 sequences replaced, tokens per split."""
    split_rule: str | None = None
    """How documents were put in the validation split (data_pipeline.split.SPLIT_RULE);
    None: by the location rule of data prepared before it was recorded."""
    loss_mask: bool = False
    """Every shard has a ``loss_mask`` column (some source is instruction data); False: every
    token is a trained target. The templates' hashes are in the sources' entries."""

    @property
    def source_names(self) -> list[str]:
        return [s["name"] for s in self.sources]

    @property
    def fingerprint(self) -> str:
        """Identity of the tokenized data: the tokenizer and every shard's name, counts and hash
        (the name without its generation directory: where a preparation put the data is not
        what the data is)."""
        h = hashlib.sha256(self.tokenizer["sha256"].encode())
        for name in sorted(self.splits):
            for s in self.splits[name].shards:
                file = PurePosixPath(s.file).name
                h.update(f"{name}:{file}:{s.source}:{s.documents}:{s.tokens}:{s.sha256}".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        out = asdict(self)
        out["fingerprint"] = self.fingerprint
        for name, split in self.splits.items():
            out["splits"][name]["tokens"] = split.tokens
            out["splits"][name]["documents"] = split.documents
        return out


def shard_schema(ttype: pa.DataType, masked: bool = False) -> pa.Schema:
    fields = [pa.field("tokens", pa.list_(ttype))]
    if masked:
        fields.append(pa.field("loss_mask", pa.list_(pa.uint8())))
    return pa.schema(fields, metadata={"schema_version": str(SCHEMA_VERSION)})


def write_shard(
    path: Path,
    source: str,
    tokens: np.ndarray,
    lengths: np.ndarray,
    vocab_size: int,
    mask: np.ndarray | None = None,
) -> ShardInfo:
    """Write documents, given as their concatenated token ids (each ending with EOS) and their
    lengths, as one Arrow IPC file; ``mask``: the loss mask of each token (uint8), written as
    the ``loss_mask`` column."""
    ttype = token_type(vocab_size)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != len(tokens):
        raise ValueError(f"document lengths sum to {offsets[-1]}, not {len(tokens)} tokens")
    values = pa.array(np.asarray(tokens).astype(ttype.to_pandas_dtype(), copy=False), type=ttype)
    columns = [pa.ListArray.from_arrays(pa.array(offsets), values)]
    if mask is not None:
        if len(mask) != len(tokens):
            raise ValueError(f"{len(mask)} mask values for {len(tokens)} tokens")
        columns.append(
            pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(np.asarray(mask, dtype=np.uint8), type=pa.uint8())
            )
        )
    schema = shard_schema(ttype, mask is not None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.record_batch(columns, schema=schema))
    buf = sink.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buf)
    return ShardInfo(
        file=path.name,
        source=source,
        documents=len(lengths),
        tokens=len(tokens),
        sha256=hashlib.sha256(buf).hexdigest(),
        bytes=buf.size,
    )


class ShardWriter:
    """Collects a split's documents of one source and writes a shard each time
    ``shard_tokens`` are reached (shards end at document boundaries)."""

    def __init__(
        self,
        data_dir: Path,
        split: str,
        source: str,
        shard_tokens: int,
        vocab_size: int,
        masked: bool = False,
    ):
        self.data_dir, self.split, self.source = data_dir, split, source
        self.shard_tokens, self.vocab_size, self.masked = shard_tokens, vocab_size, masked
        self.shards: list[ShardInfo] = []
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._pending = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents (concatenated tokens, per-document lengths; in a masked writer, the
        tokens' loss mask, or None for all ones)."""
        if self.masked and mask is None:
            mask = np.ones(len(tokens), dtype=np.uint8)
        ends = np.cumsum(lengths)
        start_doc, start_tok = 0, 0
        while start_doc < len(lengths):
            # Last document of this shard: the first whose end reaches the target.
            need = self.shard_tokens - self._pending + start_tok
            cut = int(np.searchsorted(ends, need, side="left"))
            end_tok = int(ends[-1]) if cut >= len(lengths) else int(ends[cut])
            self._tokens.append(tokens[start_tok:end_tok])
            if self.masked:
                self._masks.append(mask[start_tok:end_tok])
            if cut >= len(lengths):
                self._lengths.append(lengths[start_doc:])
                self._pending += end_tok - start_tok
                return
            self._lengths.append(lengths[start_doc : cut + 1])
            self.flush()
            start_doc, start_tok = cut + 1, end_tok

    def flush(self) -> None:
        if not self._lengths or not sum(len(x) for x in self._lengths):
            return
        name = f"{self.split}-{self.source}-{len(self.shards):05d}.arrow"
        self.shards.append(
            write_shard(
                self.data_dir / name,
                self.source,
                np.concatenate(self._tokens),
                np.concatenate(self._lengths),
                self.vocab_size,
                np.concatenate(self._masks) if self.masked else None,
            )
        )
        self._tokens, self._masks, self._lengths, self._pending = [], [], [], 0


def write_manifest(data_dir: Path, manifest: Manifest) -> None:
    write_atomic(data_dir / MANIFEST, json.dumps(manifest.to_json(), indent=2).encode())


def read_manifest(data_dir: str | Path, s3: S3Config | None = None) -> Manifest:
    """The manifest of a local data directory or of an ``s3://`` prefix (reached with ``s3``)."""
    path = storage.join(data_dir, MANIFEST)
    try:
        raw = json.loads(storage.read_bytes(path, s3 or S3Config()))
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest; prepare the data first (moe-prepare)") from None
    except DataError as e:
        if "no such object" not in str(e):
            raise
        raise DataError(f"{path}: no manifest; prepare the data first (moe-prepare)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e})") from e
    try:
        if raw["schema_version"] != SCHEMA_VERSION:
            raise DataError(
                f"{path}: schema version {raw['schema_version']}, this reader reads "
                f"{SCHEMA_VERSION}; prepare the data again"
            )
        splits = {
            name: SplitInfo([ShardInfo(**s) for s in raw["splits"][name]["shards"]])
            for name in SPLITS
        }
        manifest = Manifest(
            raw["schema_version"],
            raw["config_hash"],
            raw["tokenizer"],
            raw["token_type"],
            splits,
            raw["sources"],
            raw.get("split_rule"),
            bool(raw.get("loss_mask", False)),
        )
        names = {s.source for split in splits.values() for s in split.shards}
        if not names <= set(manifest.source_names):
            raise DataError(
                f"{path}: shards of unknown sources {sorted(names - set(manifest.source_names))}"
            )
        if manifest.token_type != str(token_type(int(manifest.tokenizer["vocab_size"]))):
            raise DataError(
                f"{path}: token type {manifest.token_type} does not match the "
                f"vocabulary of {manifest.tokenizer['vocab_size']}"
            )
        return manifest
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: malformed manifest (missing or bad field {e})") from e


class ShardData(NamedTuple):
    tokens: np.ndarray
    """The flat token stream (memory-mapped)."""
    mask: np.ndarray | None
    """The flat loss mask (uint8, memory-mapped) of a masked shard; None: all ones."""


def open_shard(path: Path, expected: ShardInfo, ttype: str) -> np.ndarray:
    """Memory-map a shard and return its flat token stream (zero-copy), checked against the
    manifest: schema, token type, document and token counts. O(1): no token is read. A
    ``loss_mask`` column, if any, is accepted and not read."""
    return open_shard_data(path, expected, ttype, None).tokens


def open_shard_data(
    path: Path, expected: ShardInfo, ttype: str, masked: bool | None, full: bool = False
) -> ShardData:
    """:func:`open_shard` with the loss mask: ``masked`` says whether the shard must have the
    ``loss_mask`` column (``Manifest.loss_mask``); None: either schema, the mask not read.

    Each record batch's structure is validated before a column is read (O(1) per batch: its
    buffers hold what its lengths and its first and last offsets say), so that damaged offsets
    are a :class:`DataError` and not a read outside the file; ``full`` also checks every
    document's offsets (O(documents), what ``moe-prepare --verify`` does)."""
    schemas = [
        shard_schema(getattr(pa, ttype)(), m)
        for m in ((False, True) if masked is None else (masked,))
    ]
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if not any(reader.schema.equals(want, check_metadata=True) for want in schemas):
            found = ", ".join(f"{f.name}: {f.type}" for f in reader.schema)
            version = (reader.schema.metadata or {}).get(b"schema_version", b"none").decode()
            wanted = ", ".join(f"{f.name}: {f.type}" for f in schemas[-1])
            raise DataError(
                f"{path}: wrong shard schema ({found}; schema version {version}), "
                f"expected ({wanted}; schema version {SCHEMA_VERSION})"
            )
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        for batch in batches:
            batch.validate(full=full)
    except FileNotFoundError:
        raise DataError(f"{path}: shard listed in the manifest is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: corrupt or truncated shard ({e})") from e
    docs = sum(b.num_rows for b in batches)
    tokens = _flat(batches, 0)
    if docs != expected.documents or len(tokens) != expected.tokens:
        raise DataError(
            f"{path}: holds {docs} documents / {len(tokens)} tokens but the manifest "
            f"says {expected.documents} / {expected.tokens}"
        )
    mask = None
    if masked:
        mask = _flat(batches, 1)
        # Both columns of a batch share offsets when written here; a file made elsewhere might not.
        if len(mask) != len(tokens) or any(
            not b.column(0).offsets.equals(b.column(1).offsets) for b in batches
        ):
            raise DataError(
                f"{path}: its loss_mask column does not match its tokens document by document"
            )
    return ShardData(tokens, mask)


def _flat(batches: list[pa.RecordBatch], column: int) -> np.ndarray:
    parts = [b.column(column).flatten().to_numpy(zero_copy_only=True) for b in batches]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
