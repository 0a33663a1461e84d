"""Data preparation: sources -> tokenizer -> tokenized train/valid Arrow shards + manifest.

Everything is built in a staging directory next to ``data.dir`` and swapped in at the end, so
an interrupted or failed preparation never leaves data the reader would accept (and never
damages data prepared before). Work items are read and tokenized by a pool of processes and
written in item order: the shards do not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.shards import (
    MANIFEST,
    SCHEMA_VERSION,
    SPLITS,
    Manifest,
    ShardWriter,
    SplitInfo,
    read_manifest,
    token_type,
    write_manifest,
)
from data_pipeline.sources import ItemDocuments, WorkItem, read_item, work_items
from data_pipeline.tokenizer import LineSample, Tokenizer, train_tokenizer

TOKENIZER_FILE = "tokenizer.model"
SAMPLE_SEED = 0
"""Seed of the tokenizer's line sample: fixed, so that data.seed (the reading order) does not
change the prepared data."""
READ_CACHE_CHARS = 256 << 20
"""Documents read for the tokenizer sample are kept in spill files (up to this many characters)
and tokenized without reading the sources again; larger corpora are read twice."""


@dataclass
class PrepareReport:
    data_dir: Path
    manifest: Manifest
    seconds: float
    skipped: bool
    invalid_utf8: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: read (tokenizer sample), tokenizer, encode (read, tokenize, write);
    ``encode_cpu``: CPU seconds of the encode phase over all its processes."""


def config_hash(cfg: DataConfig) -> str:
    """What determines the prepared data: not where it is written, how many workers write it,
    nor how it is read (order seed, sequence length, mixture weights, loader workers)."""
    d = dataclasses.asdict(cfg)  # tuples stay tuples: json.dumps writes them as lists
    for k in ("dir", "prepare_workers", "seq_len", "seed", "loader_workers",
              "allow_other_data_on_resume"):
        d.pop(k)
    for s in d["sources"]:
        s.pop("weight")
        if s["filter"]["column"] is None:  # data prepared before filters keeps its hash
            s.pop("filter")
    model_file = cfg.tokenizer.model_file
    if model_file and Path(model_file).is_file():
        d["tokenizer"]["model_sha256"] = hashlib.sha256(Path(model_file).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def in_valid_split(source: str, doc_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"{source}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# --- worker side (each pool process holds its own tokenizer) ---

_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_path: str | None) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer(tokenizer_path) if tokenizer_path else None


# Documents and token arrays travel between the processes through spill files in the staging
# directory, never through the pool's pipes: only short messages (a path, a few counts) do, and a
# short pipe write is atomic. A large result written by a worker that is then terminated (Ctrl-C,
# an error in the main process) can leave half a message in a pipe, and multiprocessing.Pool's
# terminate() then waits forever for the rest.


def _dump_docs(docs: ItemDocuments, path: str) -> None:
    with open(path, "w", encoding="ascii") as f:  # ensure_ascii: any str survives
        json.dump({"docs": docs.docs, "invalid_utf8": docs.invalid_utf8, "empty": docs.empty,
                   "filtered": docs.filtered}, f)


def _load_docs(path: str) -> ItemDocuments:
    with open(path, encoding="ascii") as f:
        d = json.load(f)
    return ItemDocuments([(doc_id, text) for doc_id, text in d["docs"]], d["invalid_utf8"],
                         d["empty"], d["filtered"])


def _read(args: tuple[SourceConfig, WorkItem, str]) -> str:
    """Read one work item into the spill file ``args[2]``; returns its path."""
    source, item, spill = args
    _dump_docs(read_item(source, item), spill)
    return spill


def _encode(args: tuple[SourceConfig, float, WorkItem, str | None, str]
            ) -> tuple[str, list[int], int, int, int]:
    """Read (or load from its spill file) and tokenize one work item; write per split, in
    ``SPLITS`` order, the document lengths (int64) and then the concatenated token ids (uint32,
    each document followed by EOS) to the raw spill file ``args[4]``. Returns (that path, the
    documents per split, invalid UTF-8 count, empty documents, rows filtered out)."""
    source, valid_fraction, item, cached, spill = args
    assert _TOKENIZER is not None
    docs = _load_docs(cached) if cached else read_item(source, item)
    eos = _TOKENIZER.eos_id
    counts = []
    with open(spill, "wb") as f:
        for split in SPLITS:
            texts = [text for doc_id, text in docs.docs
                     if in_valid_split(source.name, doc_id, valid_fraction) == (split == "valid")]
            ids = _TOKENIZER.encode_batch(texts)
            lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
            lengths.tofile(f)
            np.fromiter((t for x in ids for t in (*x, eos)), dtype=np.uint32,
                        count=int(lengths.sum())).tofile(f)
            counts.append(len(ids))
    return spill, counts, docs.invalid_utf8, docs.empty, docs.filtered


def _load_encoded(path: str, counts: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{split: (token ids, document lengths)} from an :func:`_encode` spill file."""
    raw = Path(path).read_bytes()
    out, pos = {}, 0
    for split, n in zip(SPLITS, counts):
        lengths = np.frombuffer(raw, np.int64, count=n, offset=pos)
        pos += lengths.nbytes
        tokens = np.frombuffer(raw, np.uint32, count=int(lengths.sum()), offset=pos)
        pos += tokens.nbytes
        out[split] = (tokens, lengths)
    if pos != len(raw):
        raise DataError(f"{path}: {len(raw)} bytes, expected {pos} (spill file damaged)")
    return out


# --- main side ---

def prepare(cfg: DataConfig, force: bool = False, progress: bool = True) -> PrepareReport:
    """Prepare ``cfg.dir``; a no-op when it already holds data prepared from the same config."""
    t0 = time.time()
    data_dir = Path(cfg.dir)
    want = config_hash(cfg)
    if (data_dir / MANIFEST).exists() and not force:
        replace = "run moe-prepare with --force to replace it, or choose another data.dir"
        try:
            existing = read_manifest(data_dir)
        except DataError as e:
            raise DataError(f"{e}; {replace}") from e
        if existing.config_hash == want:
            return PrepareReport(data_dir, existing, time.time() - t0, skipped=True)
        raise DataError(f"{data_dir} holds data prepared from a different config; {replace}")
    staging = data_dir.with_name(f".{data_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed preparation
    staging.mkdir(parents=True)
    try:
        report = _prepare_into(cfg, staging, want, progress)
        _swap_in(staging, data_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.data_dir, report.seconds = data_dir, time.time() - t0
    return report


def _swap_in(staging: Path, data_dir: Path) -> None:
    old = data_dir.with_name(f".{data_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if data_dir.exists():
        data_dir.rename(old)
    staging.rename(data_dir)
    shutil.rmtree(old, ignore_errors=True)


def _bar(progress: bool, **kw) -> tqdm:
    return tqdm(disable=None if progress else True, dynamic_ncols=True, **kw)


def _prepare_into(cfg: DataConfig, staging: Path, want: str, progress: bool) -> PrepareReport:
    timings: dict[str, float] = {}
    items = {s.name: work_items(s) for s in cfg.sources}  # bad paths fail before any work
    workers = cfg.prepare_workers
    ctx = mp.get_context("spawn")
    tok_path = staging / TOKENIZER_FILE
    spill = staging / ".spill"  # see _dump_docs; removed before the data is swapped in
    spill.mkdir()
    cache: dict[str, list[str | None]] | None = None

    t = time.time()
    if cfg.tokenizer.model_file:
        try:
            shutil.copyfile(cfg.tokenizer.model_file, tok_path)
        except OSError as e:
            raise DataError(f"tokenizer.model_file {cfg.tokenizer.model_file}: {e.strerror}") from e
        tokenizer = Tokenizer(tok_path)
    else:
        sample = LineSample(cfg.tokenizer.sample_sentences, SAMPLE_SEED)
        cache, cached_chars = {}, 0
        with ctx.Pool(workers) as pool:
            for source in cfg.sources:
                docs_seen, kept = 0, []
                jobs = [(source, it, str(spill / f"read-{source.name}-{i}.json"))
                        for i, it in enumerate(items[source.name])]
                for path in _bar(progress, iterable=pool.imap(_read, jobs, chunksize=4),
                                 total=len(jobs), desc=f"read {source.name}", unit="item"):
                    docs = _load_docs(path)
                    docs_seen += len(docs.docs)
                    for _, text in docs.docs:
                        sample.add(text)
                        cached_chars += len(text)
                    if cache is not None and cached_chars <= READ_CACHE_CHARS:
                        kept.append(path)
                        continue
                    if cache is not None:  # too large to keep: the encode phase reads again
                        for p in [*kept, *(q for c in cache.values() for q in c)]:
                            Path(p).unlink()
                        cache, kept = None, []
                    Path(path).unlink()
                _check_not_empty(source, docs_seen)
                if cache is not None:
                    cache[source.name] = kept
        timings["read"] = time.time() - t
        t = time.time()
        if progress:
            print(f"training a {cfg.tokenizer.model_type} tokenizer ({cfg.tokenizer.vocab_size} "
                  f"pieces) on {len(sample.lines):,} of {sample.seen:,} lines", flush=True)
        tokenizer = train_tokenizer(sample.lines, cfg.tokenizer, tok_path, num_threads=workers)
    timings["tokenizer"] = time.time() - t

    t, cpu = time.time(), _cpu_seconds()
    splits = {split: SplitInfo() for split in SPLITS}
    source_stats = []
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tok_path),)) as pool:
        for source in cfg.sources:
            writers = {split: ShardWriter(staging, split, source.name, cfg.shard_tokens,
                                          tokenizer.vocab_size) for split in SPLITS}
            kept = cache[source.name] if cache is not None else [None] * len(items[source.name])
            jobs = [(source, cfg.valid_fraction, it, cached,
                     str(spill / f"encode-{source.name}-{i}.bin"))
                    for i, (it, cached) in enumerate(zip(items[source.name], kept))]
            stats = {"documents": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS},
                     "empty_documents": 0, "filtered_documents": 0, "invalid_utf8": 0}
            bar = _bar(progress, total=len(jobs), desc=f"tokenize {source.name}", unit="item")
            for path, counts, invalid_utf8, empty, filtered in pool.imap(_encode, jobs, chunksize=4):
                for split, (tokens, lengths) in _load_encoded(path, counts).items():
                    writers[split].add(tokens, lengths)
                    stats["documents"][split] += len(lengths)
                    stats["tokens"][split] += len(tokens)
                Path(path).unlink()
                stats["empty_documents"] += empty
                stats["filtered_documents"] += filtered
                stats["invalid_utf8"] += invalid_utf8
                bar.update()
                bar.set_postfix(tokens=f"{sum(stats['tokens'].values()):,}")
            bar.close()
            _check_not_empty(source, sum(stats["documents"].values()))
            if not stats["documents"]["train"]:
                raise DataError(f"source {source.name!r}: all its {stats['documents']['valid']} "
                                "documents fell in the validation split; lower valid_fraction")
            for split in SPLITS:
                writers[split].flush()
                splits[split].shards += writers[split].shards
            source_stats.append({"name": source.name, "type": source.type,
                                 "paths": list(source.paths), "field": source.field,
                                 "filter": dataclasses.asdict(source.row_filter) if source.row_filter else None,
                                 **stats})
    timings["encode"], timings["encode_cpu"] = time.time() - t, _cpu_seconds() - cpu
    shutil.rmtree(spill)
    if not splits["valid"].shards:
        raise DataError(f"the validation split is empty: too few documents for valid_fraction "
                        f"{cfg.valid_fraction}")

    manifest = Manifest(schema_version=SCHEMA_VERSION, config_hash=want,
                        tokenizer=tokenizer.describe(),
                        token_type=str(token_type(tokenizer.vocab_size)), splits=splits,
                        sources=source_stats)
    write_manifest(staging, manifest)
    return PrepareReport(staging, manifest, 0.0, skipped=False,
                         invalid_utf8=sum(s["invalid_utf8"] for s in source_stats),
                         timings=timings)


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pools, once closed)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _check_not_empty(source: SourceConfig, documents: int) -> None:
    if not documents:
        where = f" ({', '.join(source.paths)})" if source.paths else ""
        kept = (f" or left out by its filter ({source.filter.column} == {source.filter.value!r})"
                if source.row_filter else "")
        raise DataError(f"source {source.name!r}{where} holds no text: every document is "
                        f"empty{kept}")
