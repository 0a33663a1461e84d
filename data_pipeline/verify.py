"""A full check of prepared data, for when start-up's O(1) per-shard checks are not enough
(after copying data between machines, or when a run reports odd tokens): every shard's bytes
against the manifest's SHA-256, its schema and counts, and every token id against the
vocabulary. Reads all the data once."""

from __future__ import annotations

import hashlib
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.progress import Progress
from data_pipeline.shards import open_shard, read_manifest
from data_pipeline.tokenizer import Tokenizer


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    except FileNotFoundError:
        raise DataError(f"{path}: file listed in the manifest is missing") from None
    return h.hexdigest()


def verify(data_dir: str | Path, progress: bool = True) -> str:
    """Raise DataError naming the first bad file; return a one-line summary. ``progress``:
    a bar (terminal) or a log line every 30 s on stderr."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    infos = [info for split in manifest.splits.values() for info in split.shards]
    bar = Progress(f"verify {data_dir}", sum((data_dir / i.file).stat().st_size
                                             for i in infos if (data_dir / i.file).exists()),
                   progress)
    tok = Tokenizer(data_dir / manifest.tokenizer["file"])
    if tok.sha256 != manifest.tokenizer["sha256"]:
        raise DataError(f"{tok.path}: SHA-256 differs from the manifest's")
    vocab = int(manifest.tokenizer["vocab_size"])
    shards = tokens = 0
    for info in infos:
        path = data_dir / info.file
        array = open_shard(path, info, manifest.token_type)
        if _sha256(path) != info.sha256:
            raise DataError(f"{path}: SHA-256 differs from the manifest's (corrupt shard)")
        if len(array) and int(array.max()) >= vocab:
            raise DataError(f"{path}: token id {int(array.max())} out of range for the "
                            f"tokenizer's vocabulary of {vocab}")
        shards, tokens = shards + 1, tokens + len(array)
        bar.update(path.stat().st_size, info.documents, len(array))
    bar.close()
    return f"{shards} shards, {tokens:,} tokens, fingerprint {manifest.fingerprint}"
