"""The encoding worker pool: processes that read and tokenize work items, and the spill files
that carry their results.

Each worker process holds its own tokenizer. The main process hands out work items in tasks of
consecutive items (:func:`group_tasks`) and takes the results back in item order
(:func:`run_tasks`), so what is written does not depend on the number of workers. Documents and
token arrays never travel through the pool's pipes (see the note above :func:`_dump_docs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing as mp
import multiprocessing.pool as mp_pool
import resource
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data_pipeline import instruction
from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.shards import SPLITS
from data_pipeline.sources import ItemDocuments, WorkItem, read_item
from data_pipeline.split import KEY_BYTES, content_key, in_valid_split, in_valid_split_by_location
from data_pipeline.tokenizer import Tokenizer
from data_pipeline.write_errors import writing

TASK_BYTES = 1 << 20
TASK_ITEMS = 16
"""Consecutive work items go to the pool in tasks of about TASK_BYTES of input and at most
TASK_ITEMS items: small enough that the workers finish together, large enough that a source of
many small files is not one message per file."""

_TOKENIZER: Tokenizer | None = None
_S3 = S3Config()
"""How this worker reaches s3:// inputs (data.s3), set with the tokenizer."""


def init_worker(tokenizer_path: str | None, s3: S3Config = _S3) -> None:
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
        json.dump(
            {
                "docs": docs.docs,
                "invalid_utf8": docs.invalid_utf8,
                "empty": docs.empty,
                "filtered": docs.filtered,
                "empty_rows": docs.empty_rows,
                "rows": docs.rows,
            },
            f,
        )


def load_docs(path: str) -> ItemDocuments:
    with open(path, encoding="ascii") as f:
        d = json.load(f)
    return ItemDocuments(
        [(doc_id, text) for doc_id, text in d["docs"]],
        d["invalid_utf8"],
        d["empty"],
        d["filtered"],
        d["empty_rows"],
        d["rows"],
    )


def read_into_spill(args: tuple[SourceConfig, WorkItem, str]) -> str:
    """Read one work item into the spill file ``args[2]``; returns its path."""
    source, item, spill = args
    docs = read_item(source, item, _S3)
    with writing(Path(spill)):
        _dump_docs(docs, spill)
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


def encode_item(
    args: tuple[SourceConfig, float, WorkItem, str | None, str], docs: ItemDocuments | None = None
) -> ItemCounts:
    """Read (or load from its spill file, or take ``docs`` read already) and tokenize one work
    item; write per split, in ``SPLITS`` order, the document lengths (int64), the concatenated
    token ids (uint32, each document followed by EOS), for an instruction source their loss
    mask (uint8 per token), and the documents' content keys (KEY_BYTES each) to the raw spill
    file ``args[4]``. Returns the item's counts (:data:`ItemCounts`)."""
    source, valid_fraction, item, cached, spill = args
    assert _TOKENIZER is not None
    if docs is None:
        docs = load_docs(cached) if cached else read_item(source, item, _S3)
    eos = _TOKENIZER.eos_id
    keys = [content_key(text) for _, text in docs.docs]
    valid = [in_valid_split(key, valid_fraction) for key in keys]
    moved = sum(
        v != in_valid_split_by_location(source.name, doc_id, valid_fraction)
        for v, (doc_id, _) in zip(valid, docs.docs)
    )
    counts = []
    # f.write, not ndarray.tofile: tofile reports a full disk as a short write with no errno
    # ("N requested and M written") and silently loses a small array whose flush fails.
    with writing(Path(spill)), open(spill, "wb") as f:
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
            f.write(lengths)
            # chain.from_iterable flattens in C: a generator over every token cost 13% of encode.
            f.write(
                np.fromiter(
                    itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum())
                )
            )
            if masks is not None:
                f.write(np.concatenate([np.zeros(0, np.uint8), *masks]))
            f.write(b"".join(key for key, m in zip(keys, mine) if m))
            counts.append(len(ids))
    return ItemCounts(
        counts, docs.invalid_utf8, docs.empty, docs.filtered, docs.empty_rows, docs.rows, moved
    )


def encode_task(jobs: list[tuple]) -> list[ItemCounts]:
    """One pool task: consecutive work items (see :func:`group_tasks`), each encoded by
    :func:`encode_item`."""
    return [encode_item(job) for job in jobs]


def _docs_sha256(docs: ItemDocuments) -> str:
    """What a work item read: a SHA-256 of its documents' text, each prefixed by its length.
    About 2% of the time tokenizing the same text takes (BENCHMARKS.md)."""
    h = hashlib.sha256()
    for _, text in docs.docs:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def encode_part_task(jobs: list[tuple]) -> list[tuple[ItemCounts, str, str]]:
    """A pool task of ``--part``: each work item read, hashed (:func:`_docs_sha256`) and
    encoded; with its counts come the hash of what it read and the SHA-256 of the file it
    wrote, which --merge checks (read back at once, from the page cache)."""
    out = []
    for job in jobs:
        docs = read_item(job[0], job[2], _S3)
        counts = encode_item(job, docs)
        out.append(
            (counts, _docs_sha256(docs), hashlib.sha256(Path(job[-1]).read_bytes()).hexdigest())
        )
    return out


def group_tasks(jobs: list[tuple], sizes: list[int]) -> list[list[tuple]]:
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


def run_tasks(pool, jobs: list[tuple], sizes: list[int], task=encode_task) -> Iterator:
    """Every job's result (its counts), in job order, from tasks spread over the pool."""
    for results in pool.imap(task, group_tasks(jobs, sizes)):
        yield from results


class EncodedSplit(NamedTuple):
    tokens: np.ndarray
    lengths: np.ndarray
    keys: np.ndarray
    """Content keys: one ``V{KEY_BYTES}`` element per document."""
    mask: np.ndarray | None
    """Loss mask per token (instruction sources); None: all ones."""


def load_encoded(
    path: str, counts: list[int], masked: bool = False, raw: bytes | None = None
) -> dict[str, EncodedSplit]:
    """Each split's documents from an :func:`encode_item` spill file (``masked``: of an
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
"""How :func:`~data_pipeline.assemble.write_shards` takes the splits of an encoded work item:
(its file, documents per split, masked) -> :func:`load_encoded`'s result."""


def load_spill(path: str, counts: list[int], masked: bool) -> dict[str, EncodedSplit]:
    """A spill file's splits; the file is removed (its bytes are in memory)."""
    out = load_encoded(path, counts, masked)
    Path(path).unlink()
    return out


@contextlib.contextmanager
def worker_pool(workers: int, tokenizer_path: str | None, s3: S3Config) -> Iterator:
    """A pool of ``workers`` spawned processes, each with the tokenizer at ``tokenizer_path``
    (None: reading only, for the tokenizer's sample) and the S3 settings ``s3``."""
    # Ctrl-C reaches the whole process group: the main process stops the pool (stop_now); a
    # worker's own KeyboardInterrupt would only print its traceback. Spawned with SIGINT
    # ignored, a worker keeps it so from its first instruction (an ignored signal survives
    # exec, and Python then installs no handler of its own), its imports included.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        pool = mp.get_context("spawn").Pool(
            workers, initializer=init_worker, initargs=(tokenizer_path, s3)
        )
    finally:
        if main and previous is not None:  # None: a handler installed outside Python
            signal.signal(signal.SIGINT, previous)
    try:
        yield pool
    except BaseException:
        stop_now(pool)
        raise
    pool.terminate()


def stop_now(pool) -> None:
    """Stop ``pool`` at once, whatever its workers were doing. Pool.terminate() first takes the
    task queue's lock, which an idle worker holds while it waits for a task: a worker killed
    then (a SIGTERM to the whole process group, as timeout, kill -- -PGID and scancel send)
    never releases it, and terminate() waits forever. Here no worker is started in place of a
    dead one, every worker is killed and reaped, and the pool's own finalizer (terminate() at
    exit) is dropped; its threads are daemons, which the exit does not wait for."""
    handler = getattr(pool, "_worker_handler", None)
    if handler is not None:
        handler._state = mp_pool.TERMINATE
    workers = list(getattr(pool, "_pool", ()))
    for w in workers:
        w.kill()
    for w in workers:
        w.join()
    finalizer = getattr(pool, "_terminate", None)
    if finalizer is not None:
        finalizer.cancel()


def encode_jobs(
    cfg: DataConfig,
    source: SourceConfig,
    items: list[WorkItem],
    cached: list[str] | None,
    spill: Path,
    name: str = "encode",
) -> list[tuple]:
    kept = cached if cached is not None else [None] * len(items)
    return [
        (source, cfg.valid_fraction, it, c, str(spill / f"{name}-{source.name}-{i}.bin"))
        for i, (it, c) in enumerate(zip(items, kept))
    ]


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pools, once closed)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
