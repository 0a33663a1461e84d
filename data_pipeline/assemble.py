"""Shards from encoded work items: the one place where documents meet shards, for a
preparation on one machine and for a merge of parts alike.

Items are taken in item order; per item, each split's token arrays go to the shard writers,
after ``dedup: exact`` dropped copies. On the way each source's statistics (documents, tokens,
empty and filtered rows) are counted for the manifest, and a source left with nothing to train
on is refused with what became of its documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_pipeline import storage
from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.progress import Progress
from data_pipeline.shards import (
    SCHEMA_VERSION,
    SPLITS,
    Manifest,
    ShardWriter,
    SplitInfo,
    token_type,
)
from data_pipeline.sources import EMPTY_ROWS_KEPT, JSONL_TYPES, WorkItem
from data_pipeline.split import KEY_BYTES, SPLIT_RULE
from data_pipeline.tokenizer import Tokenizer
from data_pipeline.workers import ItemCounts, Loader


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


Encoded = tuple[str, ItemCounts]
"""An encoded work item: its spill path and its counts."""


def item_bytes(source: SourceConfig, items: list[WorkItem], s3: S3Config) -> list[int]:
    """Input bytes of each item, for progress: a JSONL byte range's length, else the item's
    share of its file (compressed files count their compressed bytes)."""
    per_file: dict[str, int] = {}
    for it in items:
        per_file[it.path] = per_file.get(it.path, 0) + 1
    file_bytes = {path: storage.size(path, s3) for path in per_file}  # one request per object
    return [
        it.part[1] - it.part[0]
        if source.type in JSONL_TYPES and it.part is not None
        else file_bytes[it.path] // per_file[it.path]
        for it in items
    ]


def write_shards(
    cfg: DataConfig,
    staging: Path,
    tokenizer: Tokenizer,
    encoded: Callable[[SourceConfig, list[int]], Iterator[Encoded]],
    load: Loader,
    progress: bool,
    items: dict[str, list[WorkItem]],
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
    valid_keys: dict[str, list[np.ndarray]] = {}  # see _validation_copies below
    masked = loss_masked(cfg)
    for source in cfg.sources:
        writers = {
            split: ShardWriter(
                staging, split, source.name, cfg.shard_tokens, tokenizer.vocab_size, masked
            )
            for split in SPLITS
        }
        entry, source_moved = _write_source(
            cfg, source, writers, encoded, load, progress, items[source.name], seen, valid_keys
        )
        for split in SPLITS:
            writers[split].flush()
            splits[split].shards += writers[split].shards
        source_stats.append(entry)
        moved += source_moved
    if not splits["valid"].shards:
        total = sum(sum(st["documents"].values()) for st in source_stats)
        raise DataError(
            f"the validation split is empty: {total:,} document(s) in all, too few "
            f"for data.valid_fraction {cfg.valid_fraction} (each file of a text "
            "source is one document): add documents or raise valid_fraction"
        )
    return splits, source_stats, moved


def _write_source(
    cfg: DataConfig,
    source: SourceConfig,
    writers: dict[str, ShardWriter],
    encoded: Callable[[SourceConfig, list[int]], Iterator[Encoded]],
    load: Loader,
    progress: bool,
    items: list[WorkItem],
    seen: set[bytes] | None,
    valid_keys: dict[str, list[np.ndarray]],
) -> tuple[dict, int]:
    """One source's work items into its shard writers (left unflushed). Returns the source's
    statistics entry and the documents the location rule would split otherwise."""
    valid_keys[source.name] = []
    stats = {
        "documents": {s: 0 for s in SPLITS},
        "tokens": {s: 0 for s in SPLITS},
        "empty_documents": 0,
        "filtered_documents": 0,
        "invalid_utf8": 0,
        "duplicates_dropped": 0,
    }
    if source.type == "instruction":
        stats["trained_tokens"] = {s: 0 for s in SPLITS}
    empties = EmptyRows(source)
    sizes = item_bytes(source, items, cfg.s3)
    bar = Progress(f"tokenize {source.name}", sum(sizes), progress)
    moved = 0
    for size, item, (path, counts) in zip(sizes, items, encoded(source, sizes), strict=True):
        loaded = load(path, counts.documents, source.type == "instruction")
        docs, tokens_seen = _append_item(loaded, writers, stats, seen, valid_keys[source.name])
        empties.add(item, counts)
        if counts.empty and cfg.on_empty == "error":
            raise DataError(
                f"source {source.name!r}: {empties.describe(item.path)}; "
                "data.on_empty is 'error' (set it to 'skip' to leave them out)"
            )
        stats["empty_documents"] += counts.empty
        stats["filtered_documents"] += counts.filtered
        stats["invalid_utf8"] += counts.invalid_utf8
        moved += counts.moved
        bar.update(size, docs, tokens_seen)
    bar.close()
    _check_trainable(source, stats, valid_keys)
    entry = {
        "name": source.name,
        "type": source.type,
        "paths": list(source.paths),
        "field": source.field,
        "filter": dataclasses.asdict(source.row_filter) if source.row_filter else None,
        **template_entry(source),
        **stats,
        "empty_rows": empties.files,
    }
    return entry, moved


def _append_item(
    loaded: dict,
    writers: dict[str, ShardWriter],
    stats: dict,
    seen: set[bytes] | None,
    valid_keys: list[np.ndarray],
) -> tuple[int, int]:
    """One work item's token arrays, per split, into the writers (``dedup: exact``: unseen
    documents only); counts them into ``stats``. Returns its documents and tokens written."""
    docs = tokens_seen = 0
    for split, (tokens, lengths, keys, mask) in loaded.items():
        if seen is not None:
            tokens, lengths, mask, dropped = _drop_seen(tokens, lengths, keys, seen, mask)
            stats["duplicates_dropped"] += dropped
        elif split == "valid":
            valid_keys.append(_key_prefixes(keys))
        writers[split].add(tokens, lengths, mask)
        if mask is not None:
            stats["trained_tokens"][split] += int(np.count_nonzero(mask))
        stats["documents"][split] += len(lengths)
        stats["tokens"][split] += len(tokens)
        docs, tokens_seen = docs + len(lengths), tokens_seen + len(tokens)
    return docs, tokens_seen


def _drop_seen(
    tokens: np.ndarray,
    lengths: np.ndarray,
    keys: np.ndarray,
    seen: set[bytes],
    mask: np.ndarray | None = None,
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
    return (
        tokens[per_token],
        lengths[keep],
        None if mask is None else mask[per_token],
        int(len(keep) - keep.sum()),
    )


EMPTY_FILES_KEPT = 100
"""Files listed with their empty rows in a source's manifest entry (the count is of all)."""


class EmptyRows:
    """A source's empty rows per file, numbered from the file's start: its work items come in
    file order, each saying how many rows it covers. JSONL rows are lines, numbered from 1 as
    editors do; table rows (Parquet, Arrow, hf_disk) from 0 as pyarrow and pandas do; a text
    file (one document) is named alone."""

    def __init__(self, source: SourceConfig):
        self.unit, self.first = {
            "jsonl": ("lines", 1),
            "instruction": ("lines", 1),
            "text": (None, 0),
            "stdlib": (None, 0),
            "python": (None, 0),
        }.get(source.type, ("rows", 0))
        self.files: dict[str, dict] = {}
        self._rows_before: dict[str, int] = {}

    def add(self, item: WorkItem, counts: ItemCounts) -> None:
        before = self._rows_before.get(item.path, 0)
        self._rows_before[item.path] = before + counts.rows
        if not counts.empty:
            return
        if item.path not in self.files and len(self.files) == EMPTY_FILES_KEPT:
            return
        entry = self.files.setdefault(
            item.path, {"count": 0} | ({self.unit: []} if self.unit else {})
        )
        entry["count"] += counts.empty
        if self.unit:
            rows = entry[self.unit]
            rows += [self.first + before + r for r in counts.empty_rows][
                : EMPTY_ROWS_KEPT - len(rows)
            ]

    def describe(self, path: str) -> str:
        return describe_empty(path, self.files[path])


def describe_empty(path: str, entry: dict) -> str:
    """``a.jsonl: 3 with null, empty or whitespace-only text (lines 4, 9, 12)``, from a
    manifest entry (``empty_rows`` of a source)."""
    unit = next((k for k in ("lines", "rows") if k in entry), None)
    where = f" ({unit} {', '.join(map(str, entry[unit]))}" if unit else ""
    more = ", ..." if unit and entry["count"] > len(entry[unit]) else ""
    return (
        f"{path}: {entry['count']} with null, empty or whitespace-only text"
        f"{where}{more}{')' if unit else ''}"
    )


def finish(
    staging: Path,
    want: str,
    tokenizer: Tokenizer,
    splits: dict[str, SplitInfo],
    source_stats: list[dict],
    moved: int,
    timings: dict[str, float],
) -> PrepareReport:
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        config_hash=want,
        tokenizer=tokenizer.describe(),
        token_type=str(token_type(tokenizer.vocab_size)),
        splits=splits,
        sources=source_stats,
        split_rule=SPLIT_RULE,
        loss_mask=any("template_sha256" in s for s in source_stats),
    )
    return PrepareReport(
        staging,
        manifest,
        0.0,
        skipped=False,
        invalid_utf8=sum(s["invalid_utf8"] for s in source_stats),
        moved_from_location_rule=moved,
        timings=timings,
    )


def _where(source: SourceConfig) -> str:
    return f" ({', '.join(source.paths)})" if source.paths else ""


def check_not_empty(source: SourceConfig, documents: int) -> None:
    if not documents:
        kept = (
            f" or left out by its filter ({source.filter.column} == {source.filter.value!r})"
            if source.row_filter
            else ""
        )
        raise DataError(
            f"source {source.name!r}{_where(source)} holds no text: every document is empty{kept}"
        )


def _key_prefixes(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of content keys (``V{KEY_BYTES}``) as integers: a copy, so that the
    spill file's bytes they come from can be freed."""
    return np.frombuffer(keys.tobytes(), dtype=np.uint64)[:: KEY_BYTES // 8].copy()


def _validation_copies(name: str, valid_keys: dict[str, list[np.ndarray]]) -> tuple[int, list[str]]:
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


def _check_trainable(
    source: SourceConfig, stats: dict, valid_keys: dict[str, list[np.ndarray]]
) -> None:
    """Refuse a source left with no training document (its mixture weight could not be
    honoured), saying what became of its documents: copies dropped by ``dedup: exact``, copies
    of validation documents (a copy goes to its text's split), empty or filtered rows, or the
    split's hash of a few texts."""
    docs, dropped = stats["documents"], stats["duplicates_dropped"]
    if docs["train"]:
        return
    if not docs["valid"] and not dropped:
        check_not_empty(source, 0)
    copies, origins = _validation_copies(source.name, valid_keys)
    of = " and ".join(origins)
    empty = "empty (null, empty or whitespace-only)"
    left_out = (
        f"left out by the source's filter ({source.filter.column} == {source.filter.value!r})"
    )
    reasons = [
        (
            dropped,
            "is an exact copy of a document before it",
            "are exact copies of documents before them",
        ),
        (
            copies,
            f"is a copy of a validation document of {of}",
            f"are copies of validation documents of {of}",
        ),
        (
            docs["valid"] - copies,
            "is in the validation split by the hash of its text",
            "are in the validation split by the hash of their text",
        ),
        (stats["empty_documents"], f"is {empty}", f"are {empty}"),
        (stats["filtered_documents"], f"is {left_out}", f"are {left_out}"),
    ]
    reasons = [(n, one if n == 1 else many) for n, one, many in reasons if n]
    total = sum(n for n, _ in reasons)
    if len(reasons) == 1:
        what = (
            f"its only document {reasons[0][1]}"
            if total == 1
            else f"all its {total:,} documents {reasons[0][1]}"
        )
    else:
        what = f"of its {total:,} documents, " + ", ".join(f"{n:,} {text}" for n, text in reasons)
    if copies:
        fix = (
            "a copy goes to the split of its text, wherever it is: remove the copies from the "
            "source, or the source from data.sources"
        )
    elif dropped:
        fix = (
            "data.dedup: exact keeps only the first copy of a text: remove the copies from "
            "the source, or the source from data.sources"
        )
    else:
        fix = "add documents, or lower data.valid_fraction"
    raise DataError(
        f"source {source.name!r}{_where(source)} has no documents to train on: {what}; {fix}"
    )
