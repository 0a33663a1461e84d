"""Tokenized Arrow IPC shards and the manifest that describes them.

A shard is an Arrow IPC *file* (memory-mappable) with one column ``tokens`` (list of the smallest
unsigned integer type that holds the vocabulary), one row per document, each document ending with
EOS. Concatenating the rows gives the token stream that sequences are packed from. Every file is
written under a temporary name and renamed into place, so a crash never leaves a file the reader
would accept; the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from moe.errors import DataError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def token_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size <= 2**16 else pa.uint32()


@dataclass
class ShardInfo:
    file: str  # relative to the data directory
    documents: int
    tokens: int


@dataclass
class SplitInfo:
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)


@dataclass
class Manifest:
    schema_version: int
    tokenizer: dict
    token_type: str
    splits: dict[str, SplitInfo]
    sources: list[dict]

    @property
    def fingerprint(self) -> str:
        """Identity of the tokenized data: the tokenizer and every shard's name and size."""
        h = hashlib.sha256(self.tokenizer["sha256"].encode())
        for name in sorted(self.splits):
            for s in self.splits[name].shards:
                h.update(f"{name}:{s.file}:{s.documents}:{s.tokens}".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        out = asdict(self)
        for name, split in self.splits.items():
            out["splits"][name]["tokens"] = split.tokens
            out["splits"][name]["documents"] = split.documents
        out["fingerprint"] = self.fingerprint
        return out


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path: Path, docs: list[np.ndarray], vocab_size: int) -> ShardInfo:
    """Write documents (arrays of token ids, EOS included) as one Arrow IPC file."""
    ttype = token_type(vocab_size)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(docs).astype(ttype.to_pandas_dtype()) if docs else np.zeros(0, ttype.to_pandas_dtype())
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=ttype))
    schema = pa.schema([pa.field("tokens", pa.list_(ttype))],
                       metadata={"schema_version": str(SCHEMA_VERSION)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.record_batch([column], schema=schema))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, sink.getvalue().to_pybytes())
    return ShardInfo(file=str(path.name), documents=len(docs), tokens=int(lengths.sum()))


def write_manifest(data_dir: Path, manifest: Manifest) -> None:
    write_atomic(data_dir / MANIFEST, json.dumps(manifest.to_json(), indent=2).encode())


def read_manifest(data_dir: str | Path) -> Manifest:
    path = Path(data_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest; prepare the data first (moe-prepare)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e})") from e
    try:
        if raw["schema_version"] != SCHEMA_VERSION:
            raise DataError(f"{path}: schema version {raw['schema_version']}, this reader reads "
                            f"{SCHEMA_VERSION}; prepare the data again")
        splits = {name: SplitInfo([ShardInfo(**s) for s in split["shards"]])
                  for name, split in raw["splits"].items()}
        return Manifest(raw["schema_version"], raw["tokenizer"], raw["token_type"], splits,
                        raw["sources"])
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: malformed manifest (missing or bad field {e})") from e


def open_shard(path: Path, expected: ShardInfo) -> np.ndarray:
    """Memory-map a shard and return its flat token stream (zero-copy), checked against the
    manifest's counts."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if reader.schema.metadata is None or \
                reader.schema.metadata.get(b"schema_version") != str(SCHEMA_VERSION).encode():
            raise DataError(f"{path}: wrong shard schema version (expected {SCHEMA_VERSION})")
        if reader.schema.names != ["tokens"]:
            raise DataError(f"{path}: wrong shard schema {reader.schema.names}, expected ['tokens']")
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except FileNotFoundError:
        raise DataError(f"{path}: shard listed in the manifest is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: corrupt or truncated shard ({e})") from e
    docs = sum(b.num_rows for b in batches)
    parts = [b.column(0).flatten().to_numpy(zero_copy_only=True) for b in batches]
    tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if docs != expected.documents or len(tokens) != expected.tokens:
        raise DataError(f"{path}: holds {docs} documents / {len(tokens)} tokens but the manifest "
                        f"says {expected.documents} / {expected.tokens}")
    return tokens
