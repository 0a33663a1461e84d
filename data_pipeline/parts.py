"""Preparation on many machines: the tokenizer once, disjoint parts, one merge.

1. :func:`prepare_tokenizer` builds the tokenizer once into the parts directory beside
   data.dir (on storage every machine sees).
2. :func:`prepare_part` on machine i of N tokenizes every N-th work item into a part: one file
   per item, and ``part.json``, which records the items' counts, the SHA-256 of each file and
   of what each item read, and the inputs' sizes and modification times.
3. :func:`merge_parts` checks the parts (config, tokenizer, split rule, inputs unchanged, every
   file whole) and writes the shards and manifest from them through :func:`prepare`'s
   generation switch: byte for byte what one machine would write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data_pipeline import storage, workers
from data_pipeline.assemble import Encoded, PrepareReport, finish, item_bytes, write_shards
from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import build_tokenizer, config_hash, prepare
from data_pipeline.progress import item_bar
from data_pipeline.sources import WorkItem, work_items
from data_pipeline.split import SPLIT_RULE
from data_pipeline.tokenizer import TOKENIZER_FILE, Tokenizer
from data_pipeline.workers import EncodedSplit, ItemCounts, Loader, load_encoded
from data_pipeline.write_errors import FileSnapshot, writing
from moe.core.fileio import write_atomic


def parts_dir(cfg: DataConfig) -> Path:
    """Where --tokenizer-only and --part write, beside data.dir (on storage every machine sees)."""
    if storage.is_s3(cfg.dir):
        raise DataError(
            f"data.dir {cfg.dir}: the --tokenizer-only, --part and --merge steps "
            "work in a directory every machine sees; prepare into one, then upload "
            "it (or run moe-prepare with data.dir=s3://... on one machine)"
        )
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
    with writing(parts_dir(cfg)):
        return _write_tokenizer(cfg, progress)


def _write_tokenizer(cfg: DataConfig, progress: bool) -> Path:
    """The tokenizer and its record (tokenizer.json) in parts_dir; on failure, the parts
    directory as it was."""
    parts = parts_dir(cfg)
    items = {s.name: work_items(s, cfg.s3) for s in cfg.sources}
    made = not parts.exists()
    tmp = parts / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    kept = FileSnapshot([parts / TOKENIZER_FILE, parts / "tokenizer.json"])
    try:
        tmp.mkdir(parents=True)
        # A tokenizer trained on the inputs is theirs: the merge checks they did not change.
        inputs = (
            None
            if cfg.tokenizer.model_file
            else _input_stats([it.path for its in items.values() for it in its], cfg.s3)
        )
        build_tokenizer(cfg, items, tmp / TOKENIZER_FILE, tmp, progress)
        if inputs is not None:
            _check_inputs(
                inputs,
                cfg.s3,
                "while the tokenizer was trained on it",
                "run moe-prepare CONFIG --tokenizer-only again",
            )
        write_atomic(parts / TOKENIZER_FILE, (tmp / TOKENIZER_FILE).read_bytes())
        write_atomic(
            parts / "tokenizer.json",
            json.dumps({"config_hash": config_hash(cfg), "inputs": inputs}).encode(),
        )
    except BaseException:
        if made:
            shutil.rmtree(parts, ignore_errors=True)
        else:  # the earlier tokenizer and its record, as they were
            kept.restore()
        raise
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
        raise DataError(
            f"{parts}: no tokenizer for the parts; run moe-prepare CONFIG --tokenizer-only first"
        ) from None
    if made_for != config_hash(cfg):
        raise DataError(
            f"{parts}/{TOKENIZER_FILE} was made for another data config; run "
            "moe-prepare CONFIG --tokenizer-only again"
        )
    if record.get("inputs"):
        _check_inputs(
            record["inputs"],
            cfg.s3,
            f"after {parts}/{TOKENIZER_FILE} was trained on it",
            "run moe-prepare CONFIG --tokenizer-only again, then every --part I/N",
        )
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
                f"{now_size:,} bytes modified {_when(now_mtime)} now; {redo}"
            )


def _when(mtime_ns: int) -> str:
    return (
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(mtime_ns / 1e9))
        + f".{mtime_ns % 10**9:09d} UTC"
    )


def prepare_part(cfg: DataConfig, index: int, count: int, progress: bool = True) -> Path:
    """Step 2, on machine ``index`` of ``count``: tokenize work items index, index + count, ...
    (round robin over every source's items in order, so sizes spread evenly) into
    parts_dir/part-i-of-N, written under a temporary name and renamed when complete."""
    with writing(parts_dir(cfg)):
        return _write_part(cfg, index, count, progress)


def _write_part(cfg: DataConfig, index: int, count: int, progress: bool) -> Path:
    if not 0 <= index < count:
        raise DataError(f"--part {index}/{count}: the part must be between 0 and {count - 1}")
    tokenizer = _parts_tokenizer(cfg)
    numbered = _numbered_items(cfg)
    mine = numbered[index::count]
    final = parts_dir(cfg) / _part_name(index, count)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    redo = f"run moe-prepare CONFIG --part {index}/{count} again"
    try:
        tmp.mkdir()
        jobs = [
            (s, cfg.valid_fraction, it, None, str(tmp / f"{s.name}-{i}.bin")) for s, i, it in mine
        ]
        sizes = []
        for source in cfg.sources:
            sizes += item_bytes(source, [it for s, _, it in mine if s is source], cfg.s3)
        inputs = _input_stats([it.path for _, _, it in mine], cfg.s3)
        results, files, read, hashes = {}, {}, {}, {}
        with workers.worker_pool(cfg.prepare_workers, str(tokenizer.path), cfg.s3) as pool:
            done = workers.run_tasks(pool, jobs, sizes, workers.encode_part_task)
            for (s, i, _), job, (counts, sha, written) in zip(
                mine,
                jobs,
                item_bar(
                    progress,
                    iterable=done,
                    total=len(jobs),
                    desc=f"part {index}/{count}",
                    unit="item",
                ),
            ):
                key = f"{s.name}/{i}"
                results[key] = [Path(job[-1]).name, *counts]
                files[key], read[key] = Path(job[-1]).stat().st_size, sha
                hashes[key] = written
        _check_inputs(inputs, cfg.s3, f"while part {index}/{count} read it", redo)
        marker = {
            "config_hash": config_hash(cfg),
            "tokenizer_sha256": tokenizer.sha256,
            "split_rule": SPLIT_RULE,
            "items_hash": _items_hash(numbered),
            "items": results,
            "inputs": inputs,
            "bytes": files,
            "sha256": hashes,
            "read_sha256": read,
        }
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
        raise DataError(
            f"{parts}: expected the parts of one --part i/N split, found {found or 'none'}"
        )
    (count,) = counts
    results: dict[str, tuple[Path, ItemCounts]] = {}
    checks: dict[str, tuple[str, str]] = {}  # part file: the SHA-256 its part recorded, redo
    for index in range(count):
        part = parts / _part_name(index, count)
        try:
            marker = json.loads((part / "part.json").read_text())
        except (OSError, ValueError):
            raise DataError(
                f"{part}: missing or incomplete; run moe-prepare CONFIG --part {index}/{count}"
            ) from None
        if (marker.get("config_hash"), marker.get("tokenizer_sha256")) != (want, tokenizer.sha256):
            raise DataError(
                f"{part} was prepared from another config or tokenizer; prepare it again"
            )
        if marker.get("split_rule") != SPLIT_RULE:
            raise DataError(
                f"{part} was split by an earlier rule than {SPLIT_RULE}; prepare it again"
            )
        if marker.get("items_hash") != _items_hash(numbered):
            raise DataError(f"{part} saw other input files than this machine; prepare it again")
        redo = f"run moe-prepare CONFIG --part {index}/{count} again"
        if "inputs" not in marker:
            raise DataError(
                f"{part} records no fingerprints of its inputs (made by an earlier "
                f"moe-prepare); {redo}"
            )
        if "sha256" not in marker:
            raise DataError(
                f"{part} records no content hashes of its files (made by an "
                f"earlier moe-prepare); {redo}"
            )
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
    with part_reader(paths, checks, tokenizer.vocab_size) as load:
        splits, source_stats, moved = write_shards(
            cfg, staging, tokenizer, encoded, load, progress, items
        )
    return finish(staging, want, tokenizer, splits, source_stats, moved, {"merge": time.time() - t})


PART_READ_AHEAD = 2
"""Part files a merge reads and hashes ahead of the one it writes (a few MB to tens of MB each)."""


@contextlib.contextmanager
def part_reader(
    paths: list[str], checks: dict[str, tuple[str, str]], vocab_size: int
) -> Iterator[Loader]:
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


def _load_part_file(
    path: str,
    raw: bytes,
    found: str,
    counts: list[int],
    masked: bool,
    sha256: str,
    redo: str,
    vocab_size: int,
) -> dict[str, EncodedSplit]:
    """The splits of a part file (its bytes ``raw``, their SHA-256 ``found``), checked before
    any of its tokens reach a shard: the SHA-256 against ``sha256``, the one its part recorded
    when it wrote the file, then every token id against the tokenizer's vocabulary. A refusal
    names the file and ``redo``."""
    if found != sha256:
        raise DataError(
            f"{path}: damaged part file: its SHA-256 is {found}, the part recorded {sha256}; {redo}"
        )
    try:
        loaded = load_encoded(path, counts, masked, raw)
    except (DataError, ValueError):  # the file is as written: its counts in part.json are not
        raise DataError(
            f"{path}: its document counts in part.json do not fit the file; {redo}"
        ) from None
    top = max((int(s.tokens.max()) for s in loaded.values() if len(s.tokens)), default=0)
    if top >= vocab_size:
        raise DataError(
            f"{path}: damaged part file: token id {top} out of range for the "
            f"tokenizer's vocabulary of {vocab_size}; {redo}"
        )
    return loaded


def _check_part_file(path: Path, expected: int, redo: str) -> None:
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: missing from its part; {redo}") from None
    if found != expected:
        raise DataError(
            f"{path}: damaged part file, {found:,} bytes where {expected:,} were written; {redo}"
        )
