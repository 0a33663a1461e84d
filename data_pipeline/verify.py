"""A full check of prepared data, for when start-up's O(1) per-shard checks are not enough
(after copying data between machines, or when a run reports odd tokens): every shard's bytes
against the manifest's SHA-256, its schema and counts, every token id against the vocabulary, and
(instruction data) every loss mask value is 0 or 1. Reads all the data once: local files in place, the objects of an ``s3://`` prefix
downloaded one at a time into a temporary directory (removed as each is checked)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from data_pipeline import storage
from data_pipeline.config import S3Config
from data_pipeline.errors import DataError, corrupt
from data_pipeline.progress import Progress
from data_pipeline.shards import ShardInfo, open_shard_data, read_manifest
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


class _Files:
    """The data's files as local paths: in place for a directory, downloaded for a prefix."""

    def __init__(self, data_dir: str | Path, s3: S3Config, tmp: Path | None):
        self.data_dir, self.s3, self.tmp = data_dir, s3, tmp

    def where(self, name: str) -> str:
        return str(storage.join(self.data_dir, name))

    def size(self, info: ShardInfo) -> int:
        """The shard's bytes, for progress (0: missing, reported when it is checked)."""
        if info.bytes is not None:
            return info.bytes
        if self.tmp is not None:
            return storage.size(self.where(info.file), self.s3)
        path = Path(self.data_dir) / info.file
        return path.stat().st_size if path.exists() else 0

    @contextlib.contextmanager
    def local(self, name: str) -> Iterator[Path]:
        if self.tmp is None:
            yield Path(self.data_dir) / name
            return
        path = self.tmp / name.replace("/", "_")  # gen-N/shard: one flat temporary name
        url = self.where(name)
        try:
            with storage.open_object(url, self.s3) as src, open(path, "wb") as out:
                shutil.copyfileobj(src, out, storage.READ_BUFFER)
        except OSError as e:
            raise storage.s3_error(url, e) from None
        try:
            yield path
        except DataError as e:  # name the object, not the temporary copy
            raise DataError(str(e).replace(str(path), url)) from None
        finally:
            path.unlink(missing_ok=True)


def verify(data_dir: str | Path, progress: bool = True, s3: S3Config | None = None) -> str:
    """Raise DataError naming the first bad file; return a one-line summary. ``data_dir``: a
    directory or an ``s3://`` prefix (reached with ``s3``). ``progress``: a bar (terminal) or
    a log line every 30 s on stderr."""
    s3 = s3 or S3Config()
    remote = storage.is_s3(str(data_dir))
    data_dir = str(data_dir).rstrip("/") if remote else Path(data_dir)
    manifest = read_manifest(data_dir, s3)
    infos = [info for split in manifest.splits.values() for info in split.shards]
    with tempfile.TemporaryDirectory(prefix="moe-verify-") as tmp:
        files = _Files(data_dir, s3, Path(tmp) if remote else None)
        sizes = [files.size(info) for info in infos]
        bar = Progress(f"verify {data_dir}", sum(sizes), progress)
        tokenizer_file = manifest.tokenizer["file"]
        with files.local(tokenizer_file) as path:
            found = _sha256(path)
            if found != manifest.tokenizer["sha256"]:
                raise corrupt(
                    files.where(tokenizer_file), "tokenizer", found, manifest.tokenizer["sha256"]
                )
            Tokenizer(path)  # a readable model
        vocab = int(manifest.tokenizer["vocab_size"])
        shards = tokens = 0
        for info, size in zip(infos, sizes):
            with files.local(info.file) as path:
                # Validated before a column is read (every document's offsets): damage is a
                # named error, truncation and a wrong schema by what they are, the rest by hash.
                array, mask = open_shard_data(
                    path, info, manifest.token_type, manifest.loss_mask, full=True
                )
                found = _sha256(path)
                if found != info.sha256:
                    raise corrupt(files.where(info.file), "shard", found, info.sha256)
                if len(array) and int(array.max()) >= vocab:
                    raise DataError(
                        f"{files.where(info.file)}: token id {int(array.max())} out "
                        f"of range for the tokenizer's vocabulary of {vocab}"
                    )
                if mask is not None and len(mask) and int(mask.max()) > 1:
                    raise DataError(
                        f"{files.where(info.file)}: loss mask value "
                        f"{int(mask.max())}; a loss mask holds only 0 and 1"
                    )
                shards, tokens = shards + 1, tokens + len(array)
            bar.update(size, info.documents, len(array))
        bar.close()
    return f"{shards} shards, {tokens:,} tokens, fingerprint {manifest.fingerprint}"
