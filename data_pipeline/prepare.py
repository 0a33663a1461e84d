"""Data preparation: sources -> tokenizer -> tokenized train/valid Arrow shards + manifest.

Everything is built as a new generation (``data.dir/gen-N/``, see :func:`prepare`) that the
manifest names only once it is complete, so an interrupted or failed preparation never leaves
data the reader would accept, and never damages data prepared before. Work items are read and tokenized by a pool of processes and
written in item order: the shards do not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing as mp
import re
import resource
import shutil
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from data_pipeline import instruction, storage
from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.progress import Progress
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
from data_pipeline.sources import (
    EMPTY_ROWS_KEPT,
    JSONL_TYPES,
    ItemDocuments,
    WorkItem,
    read_item,
    work_items,
)
from data_pipeline.tokenizer import LineSample, Tokenizer, train_tokenizer
from moe.fileio import fsync_path, write_atomic

TOKENIZER_FILE = "tokenizer.model"
SAMPLE_SEED = 0
"""Seed of the tokenizer's line sample: fixed, so that data.seed (the reading order) does not
change the prepared data."""
READ_CACHE_CHARS = 256 << 20
"""Documents read for the tokenizer sample are kept in spill files (up to this many characters)
and tokenized without reading the sources again; larger corpora are read twice."""
TASK_BYTES = 1 << 20
TASK_ITEMS = 16
"""Consecutive work items go to the pool in tasks of about TASK_BYTES of input and at most
TASK_ITEMS items: small enough that the workers finish together, large enough that a source of
many small files is not one message per file."""


@dataclass
class PrepareReport:
    data_dir: Path | str
    manifest: Manifest
    seconds: float
    skipped: bool
    invalid_utf8: int = 0
    moved_from_location_rule: int = 0
    """Documents whose split differs from the one the location rule (manifests without
    ``split_rule``) gives them: what a preparation over such data changes."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: read (tokenizer sample), tokenizer, encode (read, tokenize, write);
    ``encode_cpu``: CPU seconds of the encode phase over all its processes, ``encode_cpu_main``
    the main process's share of them (what competes with the workers for the cores)."""


def config_hash(cfg: DataConfig) -> str:
    """What determines the prepared data: not where it is written, how many workers write it,
    nor how it is read (order seed, sequence length, mixture weights, loader workers)."""
    d = dataclasses.asdict(cfg)  # tuples stay tuples: json.dumps writes them as lists
    for k in ("dir", "prepare_workers", "seq_len", "seed", "loader_workers",
              "allow_other_data_on_resume", "s3", "cache_dir", "cache_bytes", "read_ahead",
              "on_empty"):
        # s3: how to reach the inputs; cache_*, read_ahead: how shards are read; on_empty:
        # whether empty rows stop the preparation (data made either way is the same)
        d.pop(k)
    if d["dedup"] == "none":  # data prepared before deduplication keeps its hash
        d.pop("dedup")
    for s in d["sources"]:
        s.pop("weight")
        if s["type"] != "instruction":  # data prepared before templates keeps its hash
            s.pop("template")
        if s["filter"]["column"] is None:  # data prepared before filters keeps its hash
            s.pop("filter")
    model_file = cfg.tokenizer.model_file
    if model_file and Path(model_file).is_file():
        d["tokenizer"]["model_sha256"] = hashlib.sha256(Path(model_file).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def loss_masked(cfg: DataConfig) -> bool:
    """Whether the data has a loss mask: some source is instruction data (then every shard,
    of every source, has the ``loss_mask`` column; other sources' tokens are all trained)."""
    return any(s.type == "instruction" for s in cfg.sources)


def template_entry(source: SourceConfig) -> dict:
    """The manifest's record of an instruction source's template: the template and its hash
    (of the same JSON that enters the config hash, so a new template is a new preparation)."""
    if source.type != "instruction":
        return {}
    template = dataclasses.asdict(source.template)
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    return {"template": template, "template_sha256": digest}


SPLIT_RULE = "content-v1"
"""The rule that puts documents in the validation split, recorded in the manifest: a document
is in it when the first 8 bytes of its :func:`content_key`, as a big-endian integer over 2**64,
are below ``valid_fraction``. Manifests without ``split_rule`` were made by the location rule
(:func:`in_valid_split_by_location`)."""
KEY_BYTES = 16
"""Bytes of a document's content key kept for deduplication (128 bits: no accidental equal
keys among billions of documents)."""


def content_key(text: str) -> bytes:
    """What identifies a document's text for the split and for deduplication: SHA-256 of its
    UTF-8 bytes after ``str.strip()`` (Unicode whitespace at both ends) and Unicode NFC, its
    first KEY_BYTES bytes. The text tokenized is the document's own, unchanged."""
    text = unicodedata.normalize("NFC", text.strip())
    # surrogatepass: JSON may hold lone surrogates ("\ud800"), which strict UTF-8 refuses
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:KEY_BYTES]


def in_valid_split(key: bytes, fraction: float) -> bool:
    """Whether the document of content key ``key`` is in the validation split (SPLIT_RULE)."""
    return int.from_bytes(key[:8], "big") / 2**64 < fraction


def in_valid_split_by_location(source: str, doc_id: str, fraction: float) -> bool:
    """The rule before SPLIT_RULE, by the document's place in its container: kept only to
    count what a new preparation over such data moves."""
    digest = hashlib.sha256(f"{source}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# --- worker side (each pool process holds its own tokenizer) ---

_TOKENIZER: Tokenizer | None = None
_S3 = S3Config()
"""How this worker reaches s3:// inputs (data.s3), set with the tokenizer."""


def _init_worker(tokenizer_path: str | None, s3: S3Config = _S3) -> None:
    global _TOKENIZER, _S3
    _TOKENIZER = Tokenizer(tokenizer_path) if tokenizer_path else None
    _S3 = s3


# Documents and token arrays travel between the processes through spill files in the staging
# directory, never through the pool's pipes: only short messages (a path, a few counts) do, and a
# short pipe write is atomic. A large result written by a worker that is then terminated (Ctrl-C,
# an error in the main process) can leave half a message in a pipe, and multiprocessing.Pool's
# terminate() then waits forever for the rest.


def _dump_docs(docs: ItemDocuments, path: str) -> None:
    with open(path, "w", encoding="ascii") as f:  # ensure_ascii: any str survives
        json.dump({"docs": docs.docs, "invalid_utf8": docs.invalid_utf8, "empty": docs.empty,
                   "filtered": docs.filtered, "empty_rows": docs.empty_rows,
                   "rows": docs.rows}, f)


def _load_docs(path: str) -> ItemDocuments:
    with open(path, encoding="ascii") as f:
        d = json.load(f)
    return ItemDocuments([(doc_id, text) for doc_id, text in d["docs"]], d["invalid_utf8"],
                         d["empty"], d["filtered"], d["empty_rows"], d["rows"])


def _read(args: tuple[SourceConfig, WorkItem, str]) -> str:
    """Read one work item into the spill file ``args[2]``; returns its path."""
    source, item, spill = args
    _dump_docs(read_item(source, item, _S3), spill)
    return spill


class ItemCounts(NamedTuple):
    """What a worker returns for a work item (its tokens are in the spill file the main
    process named): a few numbers, short enough for the pool's pipes."""

    documents: list[int]
    """Documents per split, in SPLITS order."""
    invalid_utf8: int
    empty: int
    filtered: int
    empty_rows: list[int]
    """The first empty rows, from the item's first row (ItemDocuments.empty_rows)."""
    rows: int
    moved: int
    """Documents whose split by the location rule differs (PrepareReport.moved_from_location_rule)."""


def _encode(args: tuple[SourceConfig, float, WorkItem, str | None, str],
            docs: ItemDocuments | None = None) -> ItemCounts:
    """Read (or load from its spill file, or take ``docs`` read already) and tokenize one work
    item; write per split, in ``SPLITS`` order, the document lengths (int64), the concatenated
    token ids (uint32, each document followed by EOS), for an instruction source their loss
    mask (uint8 per token), and the documents' content keys (KEY_BYTES each) to the raw spill
    file ``args[4]``. Returns the item's counts (:data:`ItemCounts`)."""
    source, valid_fraction, item, cached, spill = args
    assert _TOKENIZER is not None
    if docs is None:
        docs = _load_docs(cached) if cached else read_item(source, item, _S3)
    eos = _TOKENIZER.eos_id
    keys = [content_key(text) for _, text in docs.docs]
    valid = [in_valid_split(key, valid_fraction) for key in keys]
    moved = sum(v != in_valid_split_by_location(source.name, doc_id, valid_fraction)
                for v, (doc_id, _) in zip(valid, docs.docs))
    counts = []
    with open(spill, "wb") as f:
        for split in SPLITS:
            mine = [v == (split == "valid") for v in valid]
            texts = [text for (_, text), m in zip(docs.docs, mine) if m]
            masks = None
            if source.type == "instruction":
                ids, masks = instruction.encode(texts, source.template, _TOKENIZER)
            else:
                ids = _TOKENIZER.encode_batch(texts)
                for x in ids:
                    x.append(eos)
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            lengths.tofile(f)
            # chain.from_iterable flattens in C: a generator over every token cost 13% of encode.
            np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32,
                        count=int(lengths.sum())).tofile(f)
            if masks is not None:
                np.concatenate([np.zeros(0, np.uint8), *masks]).tofile(f)
            f.write(b"".join(key for key, m in zip(keys, mine) if m))
            counts.append(len(ids))
    return ItemCounts(counts, docs.invalid_utf8, docs.empty, docs.filtered, docs.empty_rows,
                      docs.rows, moved)


def _encode_task(jobs: list[tuple]) -> list[ItemCounts]:
    """One pool task: consecutive work items (see :func:`_tasks`), each encoded by :func:`_encode`."""
    return [_encode(job) for job in jobs]


def _docs_sha256(docs: ItemDocuments) -> str:
    """What a work item read: a SHA-256 of its documents' text, each prefixed by its length.
    About 2% of the time tokenizing the same text takes (BENCHMARKS.md)."""
    h = hashlib.sha256()
    for _, text in docs.docs:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _encode_part_task(jobs: list[tuple]) -> list[tuple[ItemCounts, str, str]]:
    """A pool task of ``--part``: each work item read, hashed (:func:`_docs_sha256`) and
    encoded; with its counts come the hash of what it read and the SHA-256 of the file it
    wrote, which --merge checks (read back at once, from the page cache)."""
    out = []
    for job in jobs:
        docs = read_item(job[0], job[2], _S3)
        counts = _encode(job, docs)
        out.append((counts, _docs_sha256(docs),
                    hashlib.sha256(Path(job[-1]).read_bytes()).hexdigest()))
    return out


def _tasks(jobs: list[tuple], sizes: list[int]) -> list[list[tuple]]:
    """``jobs`` (in order) cut into consecutive runs of about TASK_BYTES input bytes (``sizes``)
    and at most TASK_ITEMS jobs. What a task sends is a few work items (a file, a byte range,
    a row group) and spill file names, never documents; what comes back is a few counts per
    item, never tokens (those are in the spill files)."""
    tasks: list[list[tuple]] = []
    run: list[tuple] = []
    run_bytes = 0
    for job, size in zip(jobs, sizes, strict=True):
        run.append(job)
        run_bytes += size
        if run_bytes >= TASK_BYTES or len(run) == TASK_ITEMS:
            tasks.append(run)
            run, run_bytes = [], 0
    if run:
        tasks.append(run)
    return tasks


def _run_tasks(pool, jobs: list[tuple], sizes: list[int], task=_encode_task) -> Iterator:
    """Every job's result (its counts), in job order, from tasks spread over the pool."""
    for results in pool.imap(task, _tasks(jobs, sizes)):
        yield from results


class EncodedSplit(NamedTuple):
    tokens: np.ndarray
    lengths: np.ndarray
    keys: np.ndarray
    """Content keys: one ``V{KEY_BYTES}`` element per document."""
    mask: np.ndarray | None
    """Loss mask per token (instruction sources); None: all ones."""


def _load_encoded(path: str, counts: list[int], masked: bool = False,
                  raw: bytes | None = None) -> dict[str, EncodedSplit]:
    """Each split's documents from an :func:`_encode` spill file (``masked``: of an
    instruction source, with its loss mask; ``raw``: the file's bytes, read already)."""
    raw = Path(path).read_bytes() if raw is None else raw
    out, pos = {}, 0
    for split, n in zip(SPLITS, counts):
        lengths = np.frombuffer(raw, np.int64, count=n, offset=pos)
        pos += lengths.nbytes
        tokens = np.frombuffer(raw, np.uint32, count=int(lengths.sum()), offset=pos)
        pos += tokens.nbytes
        mask = None
        if masked:
            mask = np.frombuffer(raw, np.uint8, count=len(tokens), offset=pos)
            pos += mask.nbytes
        keys = np.frombuffer(raw, f"V{KEY_BYTES}", count=n, offset=pos)
        pos += keys.nbytes
        out[split] = EncodedSplit(tokens, lengths, keys, mask)
    if pos != len(raw):
        raise DataError(f"{path}: {len(raw)} bytes, expected {pos} (spill file damaged)")
    return out


Loader = Callable[[str, list[int], bool], dict[str, EncodedSplit]]
"""How :func:`_write_shards` takes the splits of an encoded work item: (its file, documents
per split, masked) -> :func:`_load_encoded`'s result."""


def _load_spill(path: str, counts: list[int], masked: bool) -> dict[str, EncodedSplit]:
    """A spill file's splits; the file is removed (its bytes are in memory)."""
    out = _load_encoded(path, counts, masked)
    Path(path).unlink()
    return out


# --- main side ---

def prepare(cfg: DataConfig, force: bool = False, progress: bool = True,
            build: Callable[[DataConfig, Path, str, bool], PrepareReport] | None = None
            ) -> PrepareReport:
    """Prepare ``cfg.dir``; a no-op when it already holds data prepared from the same config.
    ``build`` fills a staging directory (default: read, tokenize and write here).

    The data is written as a new generation (see :data:`GENERATION`) that no live manifest
    references, in ``cfg.dir`` itself or, for an ``s3://`` ``cfg.dir``, in a local temporary
    directory uploaded object by object; then the manifest is replaced in one write (the
    switch), and only then are the files of the earlier generation removed. A kill at any point
    leaves either the earlier data whole or the new data complete."""
    t0 = time.time()
    want = config_hash(cfg)
    remote = storage.is_s3(cfg.dir)
    data_dir = cfg.dir if remote else Path(cfg.dir)
    exists = _exists_remote(cfg) if remote else (data_dir / MANIFEST).exists()
    if not force and exists:
        replace = "run moe-prepare with --force to replace it, or choose another data.dir"
        try:
            existing = read_manifest(data_dir, cfg.s3)
        except DataError as e:
            raise DataError(f"{e}; {replace}") from e
        if existing.config_hash == want:
            if existing.split_rule is None:
                _note(f"{data_dir} was split by document location (before split_rule "
                      f"{SPLIT_RULE}) and is used as it is; moe-prepare --force splits it by "
                      "content, which moves documents between train and valid")
            return PrepareReport(data_dir, existing, time.time() - t0, skipped=True)
        raise DataError(f"{data_dir} holds data prepared from a different config; {replace}")
    old = _replaced_manifest(data_dir, cfg.s3) if exists else None
    live = _live_manifest(cfg)
    gen = _next_generation(live, _stored_names(cfg))
    if remote:
        with tempfile.TemporaryDirectory(prefix="moe-prepare-") as tmp:
            staging = Path(tmp) / gen
            staging.mkdir()
            report = (build or _prepare_into)(cfg, staging, want, progress)
            _announce_split_change(old, report, data_dir)
            manifest = _in_generation(report.manifest, gen)
            files = sorted(staging.iterdir())
            done = 0
            try:
                for path in files:
                    storage.upload(path, str(storage.join(cfg.dir, f"{gen}/{path.name}")), cfg.s3)
                    done += 1
            except BaseException:  # before the switch: what was uploaded is no one's
                _remove(cfg, [f"{gen}/{p.name}" for p in files[:done + 1]], lambda d: d == gen,
                        quiet=True)
                raise
            write_manifest(Path(tmp), manifest)
            storage.upload(Path(tmp) / MANIFEST, str(storage.join(cfg.dir, MANIFEST)), cfg.s3)
    else:
        for legacy in (".staging", ".old"):  # left by versions that swapped whole directories
            shutil.rmtree(data_dir.with_name(f".{data_dir.name}{legacy}"), ignore_errors=True)
        created = not data_dir.exists()
        staging = data_dir / gen
        shutil.rmtree(staging, ignore_errors=True)  # empty directories a killed run left
        try:
            staging.mkdir(parents=True)
            report = (build or _prepare_into)(cfg, staging, want, progress)
            _announce_split_change(old, report, data_dir)
            manifest = _in_generation(report.manifest, gen)
            fsync_path(staging)  # the shards' names are on disk before the manifest names them
            write_manifest(data_dir, manifest)
            fsync_path(data_dir)
        except BaseException:
            shutil.rmtree(data_dir if created else staging, ignore_errors=True)
            raise
    _remove(cfg, _stale(_stored_names(cfg), live, gen), lambda d: d != gen)
    report.manifest, report.data_dir, report.seconds = manifest, data_dir, time.time() - t0
    return report


GENERATION = re.compile(r"gen-(\d+)")
"""A generation of prepared data: the shards and tokenizer of one preparation, in the directory
(or under the prefix) ``gen-N`` of data.dir, N one more than any generation there. Data
prepared before generations has its files at the top of data.dir; it is read as it is, and
replaced like any other generation."""


_LEGACY = re.compile(rf"{re.escape(TOKENIZER_FILE)}|(?:{'|'.join(SPLITS)})-.+-\d{{5}}\.arrow")
"""The files of data prepared before generations, at the top of data.dir."""


def _live_manifest(cfg: DataConfig) -> Manifest | None:
    """The manifest readers take now, if any can be read."""
    try:
        return read_manifest(cfg.dir, cfg.s3)
    except DataError:
        return None


def _referenced(manifest: Manifest | None) -> set[str]:
    if manifest is None:
        return set()
    return {manifest.tokenizer["file"]} | {s.file for split in manifest.splits.values()
                                            for s in split.shards}


def _generation(name: str) -> int | None:
    top = PurePosixPath(name).parts
    match = GENERATION.fullmatch(top[0]) if len(top) > 1 else None
    return int(match.group(1)) if match else None


def _next_generation(live: Manifest | None, stored: list[str]) -> str:
    """A generation no manifest references and no earlier (perhaps killed) preparation wrote."""
    numbers = [_generation(name) for name in [*stored, *_referenced(live)]]
    return f"gen-{max([n for n in numbers if n is not None], default=0) + 1}"


def _in_generation(manifest: Manifest, gen: str) -> Manifest:
    """The manifest with its files named inside the generation directory ``gen``."""
    splits = {name: SplitInfo([dataclasses.replace(s, file=f"{gen}/{s.file}")
                               for s in split.shards])
              for name, split in manifest.splits.items()}
    tokenizer = {**manifest.tokenizer, "file": f"{gen}/{manifest.tokenizer['file']}"}
    return dataclasses.replace(manifest, tokenizer=tokenizer, splits=splits)


def _stored_names(cfg: DataConfig) -> list[str]:
    """Every file under data.dir, relative to it ('/'-separated)."""
    if storage.is_s3(cfg.dir):
        base = cfg.dir.rstrip("/")
        return [info.path[len(base) - len(storage.S3_SCHEME) + 1:]
                for info in storage.list_s3(base, cfg.s3, missing_ok=True)]
    data_dir = Path(cfg.dir)
    return [p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*") if p.is_file()]


def _stale(stored: list[str], live: Manifest | None, gen: str) -> list[str]:
    """What the switch to generation ``gen`` left unreferenced: the earlier manifest's files,
    every other generation's (a killed preparation's), and files of data prepared before
    generations whose removal a kill cut short."""
    old = _referenced(live)
    keep = int(gen.split("-")[1])
    return [name for name in stored
            if name in old or _generation(name) not in (None, keep)
            or name.startswith(f".{MANIFEST}.tmp") or _LEGACY.fullmatch(name)]


def _remove(cfg: DataConfig, names: list[str], retired: Callable[[str], bool],
            quiet: bool = False) -> None:
    """Remove files of data.dir, then the directories of the generations ``retired`` picks:
    on S3 the empty ``gen-N/`` objects pyarrow leaves where it deleted a prefix's last object,
    and any that earlier preparations left (``quiet``: as far as the store lets us, after
    another error)."""
    for name in names:
        try:
            storage.delete(str(storage.join(cfg.dir, name)), cfg.s3)
        except DataError:
            if not quiet:
                raise
    try:
        for d in storage.subdirs(cfg.dir, cfg.s3):
            if GENERATION.fullmatch(d) and retired(d):
                storage.delete(storage.join(cfg.dir, d), cfg.s3, tree=True)
    except DataError:
        if not quiet:
            raise


def _exists_remote(cfg: DataConfig) -> bool:
    try:
        storage.size(str(storage.join(cfg.dir, MANIFEST)), cfg.s3)
    except DataError as e:
        if "no such object" in str(e):
            return False
        raise
    return True


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _replaced_manifest(data_dir: Path | str, s3: S3Config) -> Manifest | None:
    """The manifest of the data a --force preparation replaces (None: unreadable)."""
    try:
        return read_manifest(data_dir, s3)
    except DataError:
        return None


def _announce_split_change(old: Manifest | None, report: PrepareReport,
                           data_dir: Path | str) -> None:
    """Before data of the location rule is replaced: say that the split changes, and for the
    same config (the same documents) by how many documents."""
    if old is None or old.split_rule is not None:
        return
    what = (f"{data_dir} was split by document location (before split_rule {SPLIT_RULE}); "
            "the data replacing it is split by content")
    if old.config_hash != report.manifest.config_hash:
        _note(f"{what} (and made from another config, so its documents are not compared)")
        return
    read = sum(sum(s["documents"].values()) + s["duplicates_dropped"]
               for s in report.manifest.sources)
    _note(f"{what}: {report.moved_from_location_rule:,} of its {read:,} documents change split")


def _bar(progress: bool, **kw) -> tqdm:
    return tqdm(disable=None if progress else True, dynamic_ncols=True, **kw)


def _build_tokenizer(cfg: DataConfig, items: dict[str, list[WorkItem]], tok_path: Path,
                     spill: Path, progress: bool) -> tuple[Tokenizer, dict[str, list[str]] | None]:
    """Copy ``tokenizer.model_file`` or train one on a sample of the sources. Returns the
    tokenizer and, when the documents read for the sample were small enough to keep, their
    spill files by source (the encode phase then does not read the sources again)."""
    if cfg.tokenizer.model_file:
        try:
            shutil.copyfile(cfg.tokenizer.model_file, tok_path)
        except OSError as e:
            raise DataError(f"tokenizer.model_file {cfg.tokenizer.model_file}: {e.strerror}") from e
        return Tokenizer(tok_path), None
    sample = LineSample(cfg.tokenizer.sample_sentences, SAMPLE_SEED)
    cache: dict[str, list[str]] | None = {}
    cached_chars = 0
    with mp.get_context("spawn").Pool(cfg.prepare_workers, initializer=_init_worker,
                                      initargs=(None, cfg.s3)) as pool:
        for source in cfg.sources:
            docs_seen, kept = 0, []
            jobs = [(source, it, str(spill / f"read-{source.name}-{i}.json"))
                    for i, it in enumerate(items[source.name])]
            for path in _bar(progress, iterable=pool.imap(_read, jobs, chunksize=4),
                             total=len(jobs), desc=f"read {source.name}", unit="item"):
                docs = _load_docs(path)
                docs_seen += len(docs.docs)
                for _, text in docs.docs:
                    if source.type == "instruction":  # the text the template writes
                        text = instruction.render(text, source.template)
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
    if progress:
        print(f"training a {cfg.tokenizer.model_type} tokenizer ({cfg.tokenizer.vocab_size} "
              f"pieces) on {len(sample.lines):,} of {sample.seen:,} lines", flush=True)
    return train_tokenizer(sample.lines, cfg.tokenizer, tok_path), cache


Encoded = tuple[str, ItemCounts]
"""An encoded work item: its spill path and its counts."""


def _encode_jobs(cfg: DataConfig, source: SourceConfig, items: list[WorkItem],
                 cached: list[str] | None, spill: Path, name: str = "encode") -> list[tuple]:
    kept = cached if cached is not None else [None] * len(items)
    return [(source, cfg.valid_fraction, it, c, str(spill / f"{name}-{source.name}-{i}.bin"))
            for i, (it, c) in enumerate(zip(items, kept))]


def item_bytes(source: SourceConfig, items: list[WorkItem], s3: S3Config) -> list[int]:
    """Input bytes of each item, for progress: a JSONL byte range's length, else the item's
    share of its file (compressed files count their compressed bytes)."""
    per_file: dict[str, int] = {}
    for it in items:
        per_file[it.path] = per_file.get(it.path, 0) + 1
    file_bytes = {path: storage.size(path, s3) for path in per_file}  # one request per object
    return [it.part[1] - it.part[0] if source.type in JSONL_TYPES and it.part is not None
            else file_bytes[it.path] // per_file[it.path] for it in items]


def _write_shards(cfg: DataConfig, staging: Path, tokenizer: Tokenizer,
                  encoded: Callable[[SourceConfig, list[int]], Iterator[Encoded]],
                  load: Loader, progress: bool, items: dict[str, list[WorkItem]]
                  ) -> tuple[dict[str, SplitInfo], list[dict], int]:
    """Write each source's shards from its encoded work items (``encoded(source, input bytes
    of each item)``), taken in item order: the one place where documents meet shards, for a
    single machine and for a merge of parts alike. This is all the main process does while the
    workers tokenize: per item, read one spill file of token arrays and append it to the shard
    writers (cheap slicing and, per shard, one concatenation, Arrow write and hash); with
    ``dedup: exact``, also look up each document's content key. Returns the splits, the
    sources' statistics and the documents the location rule would split otherwise."""
    splits = {split: SplitInfo() for split in SPLITS}
    source_stats = []
    moved = 0
    seen: set[bytes] | None = set() if cfg.dedup == "exact" else None  # across all sources
    valid_keys: dict[str, list[np.ndarray]] = {}  # see _validation_copies
    masked = loss_masked(cfg)
    for source in cfg.sources:
        valid_keys[source.name] = []
        writers = {split: ShardWriter(staging, split, source.name, cfg.shard_tokens,
                                      tokenizer.vocab_size, masked) for split in SPLITS}
        stats = {"documents": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS},
                 "empty_documents": 0, "filtered_documents": 0, "invalid_utf8": 0,
                 "duplicates_dropped": 0}
        if source.type == "instruction":
            stats["trained_tokens"] = {s: 0 for s in SPLITS}
        empties = EmptyRows(source)
        sizes = item_bytes(source, items[source.name], cfg.s3)
        bar = Progress(f"tokenize {source.name}", sum(sizes), progress)
        for size, item, (path, counts) in zip(sizes, items[source.name],
                                              encoded(source, sizes), strict=True):
            docs = tokens_seen = 0
            loaded = load(path, counts.documents, source.type == "instruction")
            for split, (tokens, lengths, keys, mask) in loaded.items():
                if seen is not None:
                    tokens, lengths, mask, dropped = _drop_seen(tokens, lengths, keys, seen, mask)
                    stats["duplicates_dropped"] += dropped
                elif split == "valid":
                    valid_keys[source.name].append(_key_prefixes(keys))
                writers[split].add(tokens, lengths, mask)
                if mask is not None:
                    stats["trained_tokens"][split] += int(np.count_nonzero(mask))
                stats["documents"][split] += len(lengths)
                stats["tokens"][split] += len(tokens)
                docs, tokens_seen = docs + len(lengths), tokens_seen + len(tokens)
            empties.add(item, counts)
            if counts.empty and cfg.on_empty == "error":
                raise DataError(f"source {source.name!r}: {empties.describe(item.path)}; "
                                "data.on_empty is 'error' (set it to 'skip' to leave them out)")
            stats["empty_documents"] += counts.empty
            stats["filtered_documents"] += counts.filtered
            stats["invalid_utf8"] += counts.invalid_utf8
            moved += counts.moved
            bar.update(size, docs, tokens_seen)
        bar.close()
        _check_trainable(source, stats, valid_keys)
        for split in SPLITS:
            writers[split].flush()
            splits[split].shards += writers[split].shards
        source_stats.append({"name": source.name, "type": source.type,
                             "paths": list(source.paths), "field": source.field,
                             "filter": dataclasses.asdict(source.row_filter) if source.row_filter else None,
                             **template_entry(source), **stats, "empty_rows": empties.files})
    if not splits["valid"].shards:
        total = sum(sum(st["documents"].values()) for st in source_stats)
        raise DataError(f"the validation split is empty: {total:,} document(s) in all, too few "
                        f"for data.valid_fraction {cfg.valid_fraction} (each file of a text "
                        "source is one document): add documents or raise valid_fraction")
    return splits, source_stats, moved


def _drop_seen(tokens: np.ndarray, lengths: np.ndarray, keys: np.ndarray, seen: set[bytes],
               mask: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """The documents whose content key is not in ``seen``, which gets theirs: the first copy
    of each text in the order documents reach the shards (the same for any worker count or
    --part split). Returns their tokens, lengths, loss mask (if any) and how many were
    dropped."""
    keep = np.ones(len(lengths), dtype=bool)
    for i, key in enumerate(keys.tolist()):  # V16 elements come out as bytes
        if key in seen:
            keep[i] = False
        else:
            seen.add(key)
    if keep.all():
        return tokens, lengths, mask, 0
    per_token = np.repeat(keep, lengths)
    return (tokens[per_token], lengths[keep], None if mask is None else mask[per_token],
            int(len(keep) - keep.sum()))


EMPTY_FILES_KEPT = 100
"""Files listed with their empty rows in a source's manifest entry (the count is of all)."""


class EmptyRows:
    """A source's empty rows per file, numbered from the file's start: its work items come in
    file order, each saying how many rows it covers. JSONL rows are lines, numbered from 1 as
    editors do; table rows (Parquet, Arrow, hf_disk) from 0 as pyarrow and pandas do; a text
    file (one document) is named alone."""

    def __init__(self, source: SourceConfig):
        self.unit, self.first = {"jsonl": ("lines", 1), "instruction": ("lines", 1),
                                 "text": (None, 0), "stdlib": (None, 0),
                                 "python": (None, 0)}.get(source.type, ("rows", 0))
        self.files: dict[str, dict] = {}
        self._rows_before: dict[str, int] = {}

    def add(self, item: WorkItem, counts: ItemCounts) -> None:
        before = self._rows_before.get(item.path, 0)
        self._rows_before[item.path] = before + counts.rows
        if not counts.empty:
            return
        if item.path not in self.files and len(self.files) == EMPTY_FILES_KEPT:
            return
        entry = self.files.setdefault(item.path, {"count": 0} | ({self.unit: []} if self.unit else {}))
        entry["count"] += counts.empty
        if self.unit:
            rows = entry[self.unit]
            rows += [self.first + before + r for r in counts.empty_rows][:EMPTY_ROWS_KEPT - len(rows)]

    def describe(self, path: str) -> str:
        return describe_empty(path, self.files[path])


def describe_empty(path: str, entry: dict) -> str:
    """``a.jsonl: 3 with null, empty or whitespace-only text (lines 4, 9, 12)``, from a
    manifest entry (``empty_rows`` of a source)."""
    unit = next((k for k in ("lines", "rows") if k in entry), None)
    where = f" ({unit} {', '.join(map(str, entry[unit]))}" if unit else ""
    more = ", ..." if unit and entry["count"] > len(entry[unit]) else ""
    return (f"{path}: {entry['count']} with null, empty or whitespace-only text"
            f"{where}{more}{')' if unit else ''}")


def _finish(staging: Path, want: str, tokenizer: Tokenizer, splits: dict[str, SplitInfo],
            source_stats: list[dict], moved: int, timings: dict[str, float]) -> PrepareReport:
    manifest = Manifest(schema_version=SCHEMA_VERSION, config_hash=want,
                        tokenizer=tokenizer.describe(),
                        token_type=str(token_type(tokenizer.vocab_size)), splits=splits,
                        sources=source_stats, split_rule=SPLIT_RULE,
                        loss_mask=any("template_sha256" in s for s in source_stats))
    return PrepareReport(staging, manifest, 0.0, skipped=False,
                         invalid_utf8=sum(s["invalid_utf8"] for s in source_stats),
                         moved_from_location_rule=moved, timings=timings)


def _prepare_into(cfg: DataConfig, staging: Path, want: str, progress: bool) -> PrepareReport:
    timings: dict[str, float] = {}
    items = {s.name: work_items(s, cfg.s3) for s in cfg.sources}  # bad paths fail before any work
    spill = staging / ".spill"  # see _dump_docs; removed before the data is swapped in
    spill.mkdir()
    t = time.time()
    tokenizer, cache = _build_tokenizer(cfg, items, staging / TOKENIZER_FILE, spill, progress)
    timings["tokenizer"] = time.time() - t

    t, cpu, main_cpu = time.time(), _cpu_seconds(), time.process_time()
    with mp.get_context("spawn").Pool(cfg.prepare_workers, initializer=_init_worker,
                                      initargs=(str(tokenizer.path), cfg.s3)) as pool:
        def encoded(source: SourceConfig, sizes: list[int]) -> Iterator[Encoded]:
            cached = cache[source.name] if cache is not None else None
            jobs = _encode_jobs(cfg, source, items[source.name], cached, spill)
            for job, counts in zip(jobs, _run_tasks(pool, jobs, sizes)):
                yield job[-1], counts

        splits, source_stats, moved = _write_shards(cfg, staging, tokenizer, encoded,
                                                    _load_spill, progress, items)
    timings["encode"], timings["encode_cpu"] = time.time() - t, _cpu_seconds() - cpu
    timings["encode_cpu_main"] = time.process_time() - main_cpu
    shutil.rmtree(spill)
    return _finish(staging, want, tokenizer, splits, source_stats, moved, timings)


# --- many machines: the tokenizer once, disjoint parts, one merge ---

def parts_dir(cfg: DataConfig) -> Path:
    """Where --tokenizer-only and --part write, beside data.dir (on storage every machine sees)."""
    if storage.is_s3(cfg.dir):
        raise DataError(f"data.dir {cfg.dir}: the --tokenizer-only, --part and --merge steps "
                        "work in a directory every machine sees; prepare into one, then upload "
                        "it (or run moe-prepare with data.dir=s3://... on one machine)")
    data_dir = Path(cfg.dir)
    return data_dir.with_name(f"{data_dir.name}.parts")


def _part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def _numbered_items(cfg: DataConfig) -> list[tuple[SourceConfig, int, WorkItem]]:
    """Every work item of every source as (source, its index in the source, item), in the order
    a single-machine preparation takes them."""
    return [(s, i, it) for s in cfg.sources for i, it in enumerate(work_items(s, cfg.s3))]


def _items_hash(numbered: list[tuple[SourceConfig, int, WorkItem]]) -> str:
    """Identity of the work-item list, so a merge refuses parts that saw other files."""
    text = json.dumps([[s.name, it.name, it.part] for s, _, it in numbered])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_tokenizer(cfg: DataConfig, progress: bool = True) -> Path:
    """Step 1 of a preparation on many machines: build the tokenizer once, into parts_dir."""
    parts = parts_dir(cfg)
    parts.mkdir(parents=True, exist_ok=True)
    items = {s.name: work_items(s, cfg.s3) for s in cfg.sources}
    tmp = parts / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # A tokenizer trained on the inputs is theirs: the merge checks they did not change.
        inputs = (None if cfg.tokenizer.model_file else
                  _input_stats([it.path for its in items.values() for it in its], cfg.s3))
        _build_tokenizer(cfg, items, tmp / TOKENIZER_FILE, tmp, progress)
        if inputs is not None:
            _check_inputs(inputs, cfg.s3, "while the tokenizer was trained on it",
                          "run moe-prepare CONFIG --tokenizer-only again")
        write_atomic(parts / TOKENIZER_FILE, (tmp / TOKENIZER_FILE).read_bytes())
        write_atomic(parts / "tokenizer.json", json.dumps(
            {"config_hash": config_hash(cfg), "inputs": inputs}).encode())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return parts / TOKENIZER_FILE


def _parts_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The parts' tokenizer, checked: made for this config, from inputs that did not change
    since (when it was trained on them)."""
    parts = parts_dir(cfg)
    try:
        record = json.loads((parts / "tokenizer.json").read_text())
        made_for = record["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{parts}: no tokenizer for the parts; run moe-prepare CONFIG "
                        "--tokenizer-only first") from None
    if made_for != config_hash(cfg):
        raise DataError(f"{parts}/{TOKENIZER_FILE} was made for another data config; run "
                        "moe-prepare CONFIG --tokenizer-only again")
    if record.get("inputs"):
        _check_inputs(record["inputs"], cfg.s3, f"after {parts}/{TOKENIZER_FILE} was trained on it",
                      "run moe-prepare CONFIG --tokenizer-only again, then every --part I/N")
    return Tokenizer(parts / TOKENIZER_FILE)


InputStats = dict[str, list[int]]
"""Per input file (path or URL): its size in bytes and modification time in nanoseconds."""


def _input_stats(paths: list[str], s3: S3Config) -> InputStats:
    return {path: list(storage.stat(path, s3)) for path in sorted(set(paths))}


def _check_inputs(recorded: InputStats, s3: S3Config, when: str, redo: str) -> None:
    """Refuse inputs whose size or modification time differ from ``recorded``, naming the
    first such file, what changed, ``when`` (it was read) and the command that redoes it."""
    for path, (size, mtime_ns) in sorted(recorded.items()):
        try:
            now_size, now_mtime = storage.stat(path, s3)
        except DataError:
            raise DataError(f"{path} is gone {when}; {redo}") from None
        if (now_size, now_mtime) != (size, mtime_ns):
            raise DataError(
                f"{path} changed {when}: {size:,} bytes modified {_when(mtime_ns)} then, "
                f"{now_size:,} bytes modified {_when(now_mtime)} now; {redo}")


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(mtime_ns / 1e9)) + \
        f".{mtime_ns % 10**9:09d} UTC"


def prepare_part(cfg: DataConfig, index: int, count: int, progress: bool = True) -> Path:
    """Step 2, on machine ``index`` of ``count``: tokenize work items index, index + count, ...
    (round robin over every source's items in order, so sizes spread evenly) into
    parts_dir/part-i-of-N, written under a temporary name and renamed when complete."""
    if not 0 <= index < count:
        raise DataError(f"--part {index}/{count}: the part must be between 0 and {count - 1}")
    tokenizer = _parts_tokenizer(cfg)
    numbered = _numbered_items(cfg)
    mine = numbered[index::count]
    final = parts_dir(cfg) / _part_name(index, count)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    redo = f"run moe-prepare CONFIG --part {index}/{count} again"
    try:
        jobs = [(s, cfg.valid_fraction, it, None, str(tmp / f"{s.name}-{i}.bin"))
                for s, i, it in mine]
        sizes = []
        for source in cfg.sources:
            sizes += item_bytes(source, [it for s, _, it in mine if s is source], cfg.s3)
        inputs = _input_stats([it.path for _, _, it in mine], cfg.s3)
        results, files, read, hashes = {}, {}, {}, {}
        with mp.get_context("spawn").Pool(cfg.prepare_workers, initializer=_init_worker,
                                          initargs=(str(tokenizer.path), cfg.s3)) as pool:
            for (s, i, _), job, (counts, sha, written) in zip(mine, jobs, _bar(
                    progress, iterable=_run_tasks(pool, jobs, sizes, _encode_part_task),
                    total=len(jobs), desc=f"part {index}/{count}", unit="item")):
                key = f"{s.name}/{i}"
                results[key] = [Path(job[-1]).name, *counts]
                files[key], read[key] = Path(job[-1]).stat().st_size, sha
                hashes[key] = written
        _check_inputs(inputs, cfg.s3, f"while part {index}/{count} read it", redo)
        marker = {"config_hash": config_hash(cfg), "tokenizer_sha256": tokenizer.sha256,
                  "split_rule": SPLIT_RULE, "items_hash": _items_hash(numbered),
                  "items": results, "inputs": inputs, "bytes": files, "sha256": hashes,
                  "read_sha256": read}
        write_atomic(tmp / "part.json", json.dumps(marker).encode())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def merge_parts(cfg: DataConfig, force: bool = False, progress: bool = True) -> PrepareReport:
    """Step 3: write the shards and manifest from the parts, through the same staging and
    swap as :func:`prepare`; the result is byte for byte what one machine would write."""
    report = prepare(cfg, force=force, progress=progress, build=_merge_into)
    if not report.skipped:  # the parts hold nothing the data does not
        shutil.rmtree(parts_dir(cfg))
    return report


def _merge_into(cfg: DataConfig, staging: Path, want: str, progress: bool) -> PrepareReport:
    tokenizer = _parts_tokenizer(cfg)
    parts = parts_dir(cfg)
    numbered = _numbered_items(cfg)
    found = sorted(p.name for p in parts.glob("part-*-of-*") if p.is_dir())
    counts = {int(name.rsplit("-", 1)[1]) for name in found}
    if len(counts) != 1:
        raise DataError(f"{parts}: expected the parts of one --part i/N split, found {found or 'none'}")
    (count,) = counts
    results: dict[str, tuple[Path, ItemCounts]] = {}
    checks: dict[str, tuple[str, str]] = {}  # part file: the SHA-256 its part recorded, redo
    for index in range(count):
        part = parts / _part_name(index, count)
        try:
            marker = json.loads((part / "part.json").read_text())
        except (OSError, ValueError):
            raise DataError(f"{part}: missing or incomplete; run moe-prepare CONFIG --part "
                            f"{index}/{count}") from None
        if (marker.get("config_hash"), marker.get("tokenizer_sha256")) != (want, tokenizer.sha256):
            raise DataError(f"{part} was prepared from another config or tokenizer; prepare it again")
        if marker.get("split_rule") != SPLIT_RULE:
            raise DataError(f"{part} was split by an earlier rule than {SPLIT_RULE}; prepare it "
                            "again")
        if marker.get("items_hash") != _items_hash(numbered):
            raise DataError(f"{part} saw other input files than this machine; prepare it again")
        redo = f"run moe-prepare CONFIG --part {index}/{count} again"
        if "inputs" not in marker:
            raise DataError(f"{part} records no fingerprints of its inputs (made by an earlier "
                            f"moe-prepare); {redo}")
        if "sha256" not in marker:
            raise DataError(f"{part} records no content hashes of its files (made by an "
                            f"earlier moe-prepare); {redo}")
        _check_inputs(marker["inputs"], cfg.s3, f"after {part.name} read it", redo)
        for key, (name, *rest) in marker["items"].items():
            if Path(name).name != name:
                raise DataError(f"{part}/part.json: bad file name {name!r}")
            _check_part_file(part / name, marker["bytes"][key], redo)
            results[key] = (part / name, ItemCounts(*rest))
            checks[str(part / name)] = (marker["sha256"].get(key, "not recorded"), redo)
    missing = [f"{s.name}/{i}" for s, i, _ in numbered if f"{s.name}/{i}" not in results]
    if missing:
        raise DataError(f"{parts}: the parts lack work items {missing[:5]}; prepare them again")
    shutil.copyfile(tokenizer.path, staging / TOKENIZER_FILE)
    tokenizer = Tokenizer(staging / TOKENIZER_FILE)

    def encoded(source: SourceConfig, sizes: list[int]) -> Iterator[Encoded]:
        for s, i, _ in numbered:
            if s is source:
                path, counts = results[f"{s.name}/{i}"]
                yield str(path), counts

    t = time.time()
    items = {s.name: [it for t, _, it in numbered if t is s] for s in cfg.sources}
    paths = [str(results[f"{s.name}/{i}"][0]) for s, i, _ in numbered]  # the order of the merge
    with _part_reader(paths, checks, tokenizer.vocab_size) as load:
        splits, source_stats, moved = _write_shards(cfg, staging, tokenizer, encoded, load,
                                                    progress, items)
    return _finish(staging, want, tokenizer, splits, source_stats, moved,
                   {"merge": time.time() - t})


PART_READ_AHEAD = 2
"""Part files a merge reads and hashes ahead of the one it writes (a few MB to tens of MB each)."""


@contextlib.contextmanager
def _part_reader(paths: list[str], checks: dict[str, tuple[str, str]],
                vocab_size: int) -> Iterator[Loader]:
    """The merge's :data:`Loader`: part files taken in the order ``paths``, each checked by
    :func:`_load_part_file` against ``checks[path]`` (the SHA-256 its part recorded, the command
    that redoes the part). A thread reads and hashes the next PART_READ_AHEAD files while the
    merge writes shards (hashlib lets go of the GIL): on more than one core the hash adds
    little to the merge's time, and reading from a shared file system overlaps writing."""

    def read(path: str) -> tuple[bytes, str]:
        raw = Path(path).read_bytes()
        return raw, hashlib.sha256(raw).hexdigest()

    with ThreadPoolExecutor(1, thread_name_prefix="merge-read") as pool:
        ahead = {path: pool.submit(read, path) for path in paths[:PART_READ_AHEAD]}
        rest = iter(paths[PART_READ_AHEAD:])

        def load(path: str, counts: list[int], masked: bool) -> dict[str, EncodedSplit]:
            raw, found = ahead.pop(path).result()
            following = next(rest, None)
            if following is not None:
                ahead[following] = pool.submit(read, following)
            return _load_part_file(path, raw, found, counts, masked, *checks[path], vocab_size)

        yield load


def _load_part_file(path: str, raw: bytes, found: str, counts: list[int], masked: bool,
                    sha256: str, redo: str, vocab_size: int) -> dict[str, EncodedSplit]:
    """The splits of a part file (its bytes ``raw``, their SHA-256 ``found``), checked before
    any of its tokens reach a shard: the SHA-256 against ``sha256``, the one its part recorded
    when it wrote the file, then every token id against the tokenizer's vocabulary. A refusal
    names the file and ``redo``."""
    if found != sha256:
        raise DataError(f"{path}: damaged part file: its SHA-256 is {found}, the part recorded "
                        f"{sha256}; {redo}")
    try:
        loaded = _load_encoded(path, counts, masked, raw)
    except (DataError, ValueError):  # the file is as written: its counts in part.json are not
        raise DataError(f"{path}: its document counts in part.json do not fit the file; "
                        f"{redo}") from None
    top = max((int(s.tokens.max()) for s in loaded.values() if len(s.tokens)), default=0)
    if top >= vocab_size:
        raise DataError(f"{path}: damaged part file: token id {top} out of range for the "
                        f"tokenizer's vocabulary of {vocab_size}; {redo}")
    return loaded


def _check_part_file(path: Path, expected: int, redo: str) -> None:
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: missing from its part; {redo}") from None
    if found != expected:
        raise DataError(f"{path}: damaged part file, {found:,} bytes where {expected:,} were "
                        f"written; {redo}")


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pools, once closed)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _where(source: SourceConfig) -> str:
    return f" ({', '.join(source.paths)})" if source.paths else ""


def _check_not_empty(source: SourceConfig, documents: int) -> None:
    if not documents:
        kept = (f" or left out by its filter ({source.filter.column} == {source.filter.value!r})"
                if source.row_filter else "")
        raise DataError(f"source {source.name!r}{_where(source)} holds no text: every document "
                        f"is empty{kept}")


def _key_prefixes(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of content keys (``V{KEY_BYTES}``) as integers: a copy, so that the
    spill file's bytes they come from can be freed."""
    return np.frombuffer(keys.tobytes(), dtype=np.uint64)[::KEY_BYTES // 8].copy()


def _validation_copies(name: str, valid_keys: dict[str, list[np.ndarray]]
                       ) -> tuple[int, list[str]]:
    """How many validation documents of source ``name`` are copies of validation documents
    before them, and where those are: earlier sources by name, "itself". ``valid_keys``: each
    source's validation key prefixes (:func:`_key_prefixes`), in the sources' order; 8 bytes
    per validation document, kept only to say this when a source is refused."""
    mine = np.concatenate([np.zeros(0, np.uint64), *valid_keys[name]])
    copy = np.ones(len(mine), dtype=bool)
    copy[np.unique(mine, return_index=True)[1]] = False  # the first of each text in the source
    earlier = np.zeros(len(mine), dtype=bool)
    origins = []
    for other, arrays in valid_keys.items():
        if other == name:
            break
        hit = np.isin(mine, np.concatenate([np.zeros(0, np.uint64), *arrays]))
        if hit.any():
            origins.append(f"source {other!r}")
            earlier |= hit
    if (copy & ~earlier).any():
        origins.append("itself")
    return int((copy | earlier).sum()), origins


def _check_trainable(source: SourceConfig, stats: dict,
                     valid_keys: dict[str, list[np.ndarray]]) -> None:
    """Refuse a source left with no training document (its mixture weight could not be
    honoured), saying what became of its documents: copies dropped by ``dedup: exact``, copies
    of validation documents (a copy goes to its text's split), empty or filtered rows, or the
    split's hash of a few texts."""
    docs, dropped = stats["documents"], stats["duplicates_dropped"]
    if docs["train"]:
        return
    if not docs["valid"] and not dropped:
        _check_not_empty(source, 0)
    copies, origins = _validation_copies(source.name, valid_keys)
    of = " and ".join(origins)
    empty = "empty (null, empty or whitespace-only)"
    left_out = f"left out by the source's filter ({source.filter.column} == {source.filter.value!r})"
    reasons = [(dropped, "is an exact copy of a document before it",
                "are exact copies of documents before them"),
               (copies, f"is a copy of a validation document of {of}",
                f"are copies of validation documents of {of}"),
               (docs["valid"] - copies, "is in the validation split by the hash of its text",
                "are in the validation split by the hash of their text"),
               (stats["empty_documents"], f"is {empty}", f"are {empty}"),
               (stats["filtered_documents"], f"is {left_out}", f"are {left_out}")]
    reasons = [(n, one if n == 1 else many) for n, one, many in reasons if n]
    total = sum(n for n, _ in reasons)
    if len(reasons) == 1:
        what = (f"its only document {reasons[0][1]}" if total == 1 else
                f"all its {total:,} documents {reasons[0][1]}")
    else:
        what = f"of its {total:,} documents, " + ", ".join(f"{n:,} {text}" for n, text in reasons)
    if copies:
        fix = ("a copy goes to the split of its text, wherever it is: remove the copies from the "
               "source, or the source from data.sources")
    elif dropped:
        fix = ("data.dedup: exact keeps only the first copy of a text: remove the copies from "
               "the source, or the source from data.sources")
    else:
        fix = "add documents, or lower data.valid_fraction"
    raise DataError(f"source {source.name!r}{_where(source)} has no documents to train on: "
                    f"{what}; {fix}")
