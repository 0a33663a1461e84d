"""Prepared data where it lives: a local directory (shards memory-mapped in place) or an
``s3://`` prefix (shards fetched on demand into a bounded local cache, checked against the
manifest's SHA-256 when fetched, memory-mapped from there).

Nothing the reader's state or order depends on comes from here: both places yield the same
tokens, so a run may move between them and resume exactly."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data_pipeline import storage
from data_pipeline.cache import ObjectCache, default_cache_dir
from data_pipeline.config import DataConfig, S3Config
from data_pipeline.errors import DataError
from data_pipeline.shards import Manifest, ShardData, ShardInfo, open_shard_data, read_manifest
from moe.core.fileio import write_atomic

DEFAULT_CACHE_BYTES = DataConfig.cache_bytes


def checked_tokenizer(data_dir: str | Path, manifest: Manifest, s3: S3Config) -> bytes:
    """The bytes of the data's tokenizer (a local file or an ``s3://`` object), checked against
    the manifest's SHA-256: a run tokenizes nothing, so a tokenizer replaced after the
    preparation would otherwise go unnoticed into every checkpoint, beside tokens it did not
    make. The way out either way: the original file, or the data prepared again."""
    info = manifest.tokenizer
    where = storage.join(data_dir, info["file"])
    fix = "restore the file the data was prepared with, or run moe-prepare --force"
    try:
        data = storage.read_bytes(where, s3)
    except OSError as e:
        raise DataError(f"{where}: cannot read the data's tokenizer ({e.strerror}); {fix}") from e
    found = hashlib.sha256(data).hexdigest()
    if found != info["sha256"]:
        raise DataError(
            f"{where}: not the tokenizer the data was prepared with: its SHA-256 is {found}, "
            f"the manifest's is {info['sha256']}; {fix}"
        )
    return data


class PreparedData:
    """The manifest, tokenizer and shards of prepared data at ``dir`` (a path or ``s3://``)."""

    def __init__(
        self,
        dir: str | Path,
        s3: S3Config | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        read_ahead: int = 2,
    ):
        self.dir = str(dir).rstrip("/") if storage.is_s3(str(dir)) else Path(dir)
        self.remote = storage.is_s3(str(dir))
        self.s3 = s3 or S3Config()
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.cache_bytes, self.read_ahead = cache_bytes, read_ahead
        self.manifest: Manifest = read_manifest(self.dir, self.s3)
        if not self.remote:  # on S3: checked when fetched (tokenizer_file)
            checked_tokenizer(self.dir, self.manifest, self.s3)
        self._cache: ObjectCache | None = None

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PreparedData:
        return cls(cfg.dir, cfg.s3, cfg.cache_dir, cfg.cache_bytes, cfg.read_ahead)

    def __getstate__(self) -> dict:  # DataLoader workers make their own cache object
        return {**self.__dict__, "_cache": None}

    def __str__(self) -> str:
        return str(self.dir)

    def location(self, name: str) -> str | Path:
        """Where the file ``name`` of the data lives (a path or a URL, for messages)."""
        return storage.join(self.dir, name)

    @property
    def cache(self) -> ObjectCache:
        """The shard cache, cleaned of what a crashed run left when first used."""
        if self._cache is None:
            self._cache = ObjectCache(self.cache_dir, self.cache_bytes, self.s3)
            self._cache.clean(
                {s.sha256: s.bytes for split in self.manifest.splits.values() for s in split.shards}
            )
        return self._cache

    def tokenizer_file(self) -> Path:
        """A local copy of the tokenizer, checked against the manifest's SHA-256 (a local
        directory's when the data was opened; an ``s3://`` one's when fetched)."""
        info = self.manifest.tokenizer
        if not self.remote:
            return Path(self.dir) / info["file"]
        local = self.cache_dir / f"tokenizer-{info['sha256'][:16]}" / info["file"]
        if not local.exists():
            data = checked_tokenizer(self.dir, self.manifest, self.s3)
            local.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(local, data)
        return local

    @property
    def masked(self) -> bool:
        """Whether the shards carry a loss mask (instruction data)."""
        return self.manifest.loss_mask

    def open_local(self, info: ShardInfo) -> np.ndarray:
        """A local shard's tokens, memory-mapped (checked: schema and counts)."""
        return self.open_local_data(info).tokens

    def open_local_data(self, info: ShardInfo) -> ShardData:
        """A local shard's tokens and loss mask (None: data without one), memory-mapped."""
        return open_shard_data(
            Path(self.dir) / info.file, info, self.manifest.token_type, self.masked
        )

    @contextmanager
    def shard(self, info: ShardInfo) -> Iterator[np.ndarray]:
        """A shard's tokens, memory-mapped, for the duration of the block (on S3: fetched if not
        cached, and kept from eviction while the block runs)."""
        with self.shard_data(info) as data:
            yield data.tokens

    @contextmanager
    def shard_data(self, info: ShardInfo) -> Iterator[ShardData]:
        """:meth:`shard` with the loss mask (None: data without one)."""
        if not self.remote:
            yield self.open_local_data(info)
            return
        url = str(self.location(info.file))
        with self.cache.open(url, info.sha256, info.bytes) as path:
            try:
                data = open_shard_data(path, info, self.manifest.token_type, self.masked)
            except DataError as e:  # name the object, not the cache file
                raise DataError(str(e).replace(str(path), url)) from None
            yield data

    def fetch_items(self, infos: list[ShardInfo]) -> list[tuple[str, str, int | None]]:
        """(url, sha256, bytes) of shards, as the cache's read-ahead takes them."""
        return [(str(self.location(s.file)), s.sha256, s.bytes) for s in infos]
