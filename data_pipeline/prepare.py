"""Data preparation: sources -> tokenizer -> tokenized train/valid Arrow shards + manifest.

The phases, each in a module of its own: the tokenizer is copied or trained on a sample of the
sources (:func:`build_tokenizer`); a pool of processes reads and tokenizes the work items
(workers.py), each document put in its split by its text (split.py); the main process writes
the shards in item order (assemble.py), so the shards do not depend on the number of workers;
all of it as a new generation that the manifest names only once it is complete
(generations.py). A preparation on many machines (parts.py) shares the tokenizer phase and the
writing of the shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from data_pipeline import generations, instruction, storage, workers
from data_pipeline.assemble import Encoded, PrepareReport, check_not_empty, finish, write_shards
from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepared import checked_tokenizer
from data_pipeline.progress import item_bar
from data_pipeline.shards import Manifest, read_manifest
from data_pipeline.sources import WorkItem, work_items
from data_pipeline.split import SPLIT_RULE
from data_pipeline.tokenizer import TOKENIZER_FILE, LineSample, Tokenizer, train_tokenizer
from data_pipeline.write_errors import write_error, writing

SAMPLE_SEED = 0
"""Seed of the tokenizer's line sample: fixed, so that data.seed (the reading order) does not
change the prepared data."""
READ_CACHE_CHARS = 256 << 20
"""Documents read for the tokenizer sample are kept in spill files (up to this many characters)
and tokenized without reading the sources again; larger corpora are read twice."""


def config_hash(cfg: DataConfig) -> str:
    """What determines the prepared data: not where it is written, how many workers write it,
    nor how it is read (order seed, sequence length, mixture weights, loader workers)."""
    d = dataclasses.asdict(cfg)  # tuples stay tuples: json.dumps writes them as lists
    for k in (
        "dir",
        "prepare_workers",
        "seq_len",
        "seed",
        "loader_workers",
        "allow_other_data_on_resume",
        "s3",
        "cache_dir",
        "cache_bytes",
        "read_ahead",
        "on_empty",
    ):
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


def prepare(
    cfg: DataConfig,
    force: bool = False,
    progress: bool = True,
    build: Callable[[DataConfig, Path, str, bool], PrepareReport] | None = None,
) -> PrepareReport:
    """Prepare ``cfg.dir``; a no-op when it already holds data prepared from the same config.
    ``build`` fills a staging directory (default: read, tokenize and write here), which
    becomes a new generation of the data (generations.py)."""
    t0 = time.time()
    want = config_hash(cfg)
    data_dir = cfg.dir if storage.is_s3(cfg.dir) else Path(cfg.dir)
    exists = generations.manifest_exists(cfg)
    if not force and exists:
        return _prepared_already(cfg, data_dir, want, t0)
    old = _replaced_manifest(data_dir, cfg.s3) if exists else None

    def fill(staging: Path) -> PrepareReport:
        report = (build or _prepare_into)(cfg, staging, want, progress)
        _announce_split_change(old, report, data_dir)
        return report

    report = generations.publish(cfg, fill)
    report.data_dir, report.seconds = data_dir, time.time() - t0
    return report


def _prepared_already(cfg: DataConfig, data_dir: Path | str, want: str, t0: float) -> PrepareReport:
    """The report of data prepared from this config already; other data is refused."""
    replace = "run moe-prepare with --force to replace it, or choose another data.dir"
    try:
        existing = read_manifest(data_dir, cfg.s3)
    except DataError as e:
        raise DataError(f"{e}; {replace}") from e
    if existing.config_hash != want:
        raise DataError(f"{data_dir} holds data prepared from a different config; {replace}")
    checked_tokenizer(data_dir, existing, cfg.s3)  # a replaced one would reach every checkpoint
    if existing.split_rule is None:
        _note(
            f"{data_dir} was split by document location (before split_rule "
            f"{SPLIT_RULE}) and is used as it is; moe-prepare --force splits it by "
            "content, which moves documents between train and valid"
        )
    return PrepareReport(data_dir, existing, time.time() - t0, skipped=True)


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _replaced_manifest(data_dir: Path | str, s3: S3Config) -> Manifest | None:
    """The manifest of the data a --force preparation replaces (None: unreadable)."""
    try:
        return read_manifest(data_dir, s3)
    except DataError:
        return None


def _announce_split_change(
    old: Manifest | None, report: PrepareReport, data_dir: Path | str
) -> None:
    """Before data of the location rule is replaced: say that the split changes, and for the
    same config (the same documents) by how many documents."""
    if old is None or old.split_rule is not None:
        return
    what = (
        f"{data_dir} was split by document location (before split_rule {SPLIT_RULE}); "
        "the data replacing it is split by content"
    )
    if old.config_hash != report.manifest.config_hash:
        _note(f"{what} (and made from another config, so its documents are not compared)")
        return
    read = sum(
        sum(s["documents"].values()) + s["duplicates_dropped"] for s in report.manifest.sources
    )
    _note(f"{what}: {report.moved_from_location_rule:,} of its {read:,} documents change split")


def build_tokenizer(
    cfg: DataConfig, items: dict[str, list[WorkItem]], tok_path: Path, spill: Path, progress: bool
) -> tuple[Tokenizer, dict[str, list[str]] | None]:
    """Copy ``tokenizer.model_file`` or train one on a sample of the sources. Returns the
    tokenizer and, when the documents read for the sample were small enough to keep, their
    spill files by source (the encode phase then does not read the sources again)."""
    if cfg.tokenizer.model_file:
        try:
            shutil.copyfile(cfg.tokenizer.model_file, tok_path)
        except OSError as e:
            failure = write_error(e, tok_path)
            if failure is not None:
                raise failure from e
            raise DataError(f"tokenizer.model_file {cfg.tokenizer.model_file}: {e.strerror}") from e
        return Tokenizer(tok_path), None
    sample = LineSample(cfg.tokenizer.sample_sentences, SAMPLE_SEED)
    cache: dict[str, list[str]] | None = {}
    cached_chars = 0
    with workers.worker_pool(cfg.prepare_workers, None, cfg.s3) as pool:
        for source in cfg.sources:
            docs_seen, kept = 0, []
            jobs = [
                (source, it, str(spill / f"read-{source.name}-{i}.json"))
                for i, it in enumerate(items[source.name])
            ]
            read = pool.imap(workers.read_into_spill, jobs, chunksize=4)
            for path in item_bar(
                progress, iterable=read, total=len(jobs), desc=f"read {source.name}", unit="item"
            ):
                docs = workers.load_docs(path)
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
            check_not_empty(source, docs_seen)
            if cache is not None:
                cache[source.name] = kept
    if progress:
        print(
            f"training a {cfg.tokenizer.model_type} tokenizer ({cfg.tokenizer.vocab_size} "
            f"pieces) on {len(sample.lines):,} of {sample.seen:,} lines",
            flush=True,
        )
    with writing(tok_path):
        return train_tokenizer(sample.lines, cfg.tokenizer, tok_path), cache


def _prepare_into(cfg: DataConfig, staging: Path, want: str, progress: bool) -> PrepareReport:
    timings: dict[str, float] = {}
    items = {s.name: work_items(s, cfg.s3) for s in cfg.sources}  # bad paths fail before any work
    spill = staging / ".spill"  # see workers.py; removed before the data is swapped in
    spill.mkdir()
    t = time.time()
    tokenizer, cache = build_tokenizer(cfg, items, staging / TOKENIZER_FILE, spill, progress)
    timings["tokenizer"] = time.time() - t

    t, cpu, main_cpu = time.time(), workers.cpu_seconds(), time.process_time()
    with workers.worker_pool(cfg.prepare_workers, str(tokenizer.path), cfg.s3) as pool:

        def encoded(source: SourceConfig, sizes: list[int]) -> Iterator[Encoded]:
            cached = cache[source.name] if cache is not None else None
            jobs = workers.encode_jobs(cfg, source, items[source.name], cached, spill)
            for job, counts in zip(jobs, workers.run_tasks(pool, jobs, sizes)):
                yield job[-1], counts

        splits, source_stats, moved = write_shards(
            cfg, staging, tokenizer, encoded, workers.load_spill, progress, items
        )
    timings["encode"], timings["encode_cpu"] = time.time() - t, workers.cpu_seconds() - cpu
    timings["encode_cpu_main"] = time.process_time() - main_cpu
    shutil.rmtree(spill)
    return finish(staging, want, tokenizer, splits, source_stats, moved, timings)
