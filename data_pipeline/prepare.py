"""Data preparation: sources -> tokenizer -> tokenized train/valid Arrow shards + manifest."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.config import DataConfig
from data_pipeline.shards import (MANIFEST, SCHEMA_VERSION, Manifest, SplitInfo, read_manifest,
                                  token_type, write_manifest, write_shard)
from data_pipeline.sources import document_refs, read_document
from data_pipeline.tokenizer import Tokenizer, train_tokenizer
from moe.config_schema import to_dict
from moe.errors import DataError

TOKENIZER_FILE = "tokenizer.model"


@dataclass
class PrepareReport:
    data_dir: Path
    manifest: Manifest
    seconds: float
    skipped: bool
    invalid_utf8_bytes: int = 0


def _read(args: tuple[str, str]) -> tuple[str, int]:
    return read_document(*args)


_TOKENIZER: Tokenizer | None = None


def _init_worker(path: str) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer(path)


def _tokenize(texts: list[str]) -> list[np.ndarray]:
    assert _TOKENIZER is not None
    eos = _TOKENIZER.eos_id
    return [np.asarray(ids + [eos], dtype=np.int64) for ids in _TOKENIZER.encode_batch(texts)]


def config_hash(cfg: DataConfig) -> str:
    """What determines the prepared data (not where it is written, nor how many workers)."""
    d = to_dict(cfg)
    for k in ("dir", "prepare_workers", "seq_len", "seed"):
        d.pop(k)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def in_valid_split(source: str, doc_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"{source}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True) -> PrepareReport:
    """Prepare ``cfg.dir``; a no-op when it already holds data prepared from the same config."""
    t0 = time.time()
    data_dir = Path(cfg.dir)
    want = config_hash(cfg)
    if (data_dir / MANIFEST).exists() and not force:
        existing = read_manifest(data_dir)
        if existing.sources and existing.sources[0].get("config_hash") == want:
            return PrepareReport(data_dir, existing, time.time() - t0, skipped=True)
        raise DataError(f"{data_dir} holds data prepared from a different config; pass --force "
                        "to replace it or choose another data.dir")

    # Build everything in a staging directory, then swap it in: an interrupted preparation
    # never leaves a manifest the reader would accept next to half-written shards.
    staging = data_dir.with_name(data_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    workers = max(1, cfg.prepare_workers)
    ctx = mp.get_context("spawn")

    docs: list[tuple[str, str, str]] = []  # (source, doc id, text)
    bad_bytes = 0
    with ctx.Pool(workers) as pool:
        for source in cfg.sources:
            refs = document_refs(source)
            jobs = [(source.type, r) for r in refs]
            it = pool.imap(_read, jobs, chunksize=16)
            for ref, (text, bad) in tqdm(zip(refs, it), total=len(refs), disable=None if progress else True,
                                         desc=f"read {source.name}", unit="doc"):
                bad_bytes += bad
                if text.strip():
                    docs.append((source.name, _doc_id(source.type, ref), text))
            if not any(d[0] == source.name for d in docs):
                raise DataError(f"source {source.name!r} holds no text")

    if cfg.tokenizer.model_file:
        tok_path = staging / TOKENIZER_FILE
        shutil.copyfile(cfg.tokenizer.model_file, tok_path)
        tokenizer = Tokenizer(tok_path)
    else:
        if progress:
            print(f"training a {cfg.tokenizer.model_type} tokenizer "
                  f"({cfg.tokenizer.vocab_size} pieces) on {len(docs)} documents", flush=True)
        tokenizer = train_tokenizer((d[2] for d in docs), cfg.tokenizer, staging / TOKENIZER_FILE,
                                    cfg.seed, num_threads=workers)

    splits = {"train": SplitInfo(), "valid": SplitInfo()}
    by_split = {"train": [], "valid": []}
    for source, doc_id, text in docs:
        split = "valid" if in_valid_split(source, doc_id, cfg.valid_fraction) else "train"
        by_split[split].append(text)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(staging / TOKENIZER_FILE),)) as pool:
        for split, texts in by_split.items():
            if not texts:
                raise DataError(f"the {split} split is empty: too few documents for "
                                f"valid_fraction {cfg.valid_fraction}")
            chunks = [texts[i:i + 64] for i in range(0, len(texts), 64)]
            pending: list[np.ndarray] = []
            pending_tokens = 0
            bar = tqdm(total=len(texts), disable=None if progress else True, desc=f"tokenize {split}", unit="doc")
            for encoded in pool.imap(_tokenize, chunks):
                bar.update(len(encoded))
                for arr in encoded:
                    pending.append(arr)
                    pending_tokens += len(arr)
                    if pending_tokens >= cfg.shard_tokens:
                        _flush(staging, split, splits[split], pending, tokenizer.vocab_size)
                        pending, pending_tokens = [], 0
            if pending:
                _flush(staging, split, splits[split], pending, tokenizer.vocab_size)
            bar.close()

    manifest = Manifest(
        schema_version=SCHEMA_VERSION, tokenizer=tokenizer.describe(),
        token_type=str(token_type(tokenizer.vocab_size)), splits=splits,
        sources=[{"name": s.name, "type": s.type, "config_hash": want} for s in cfg.sources])
    write_manifest(staging, manifest)
    if data_dir.exists():
        shutil.rmtree(data_dir)
    staging.rename(data_dir)
    return PrepareReport(data_dir, manifest, time.time() - t0, skipped=False,
                         invalid_utf8_bytes=bad_bytes)


def _doc_id(source_type: str, ref: str) -> str:
    if source_type == "stdlib":
        import sysconfig
        return str(Path(ref).relative_to(sysconfig.get_paths()["stdlib"]))
    return ref


def _flush(staging: Path, split: str, info: SplitInfo, docs: list[np.ndarray], vocab: int) -> None:
    name = f"{split}-{len(info.shards):05d}.arrow"
    shard = write_shard(staging / name, docs, vocab)
    info.shards.append(shard)
