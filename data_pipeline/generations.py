"""Generations of prepared data, and the switch from one to the next.

Every preparation is written as a new generation (``data.dir/gen-N/``) that no live manifest
references, in ``data.dir`` itself or, for an ``s3://`` ``data.dir``, in a local temporary
directory uploaded object by object; then the manifest is replaced in one write (the switch),
and only then are the files of the earlier generation removed. A kill at any point leaves
either the earlier data whole or the new data complete, and an interrupted or failed
preparation never leaves data the reader would accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from data_pipeline import storage
from data_pipeline.assemble import PrepareReport
from data_pipeline.config import DataConfig
from data_pipeline.errors import DataError
from data_pipeline.shards import (
    MANIFEST,
    SPLITS,
    Manifest,
    SplitInfo,
    read_manifest,
    write_manifest,
)
from data_pipeline.tokenizer import TOKENIZER_FILE
from data_pipeline.write_errors import write_error, writing
from moe.core.fileio import fsync_path

Fill = Callable[[Path], PrepareReport]
"""What writes a generation: given its (empty) directory, fills it with the shards and the
tokenizer and returns the report, whose manifest names the files inside the directory."""


def publish(cfg: DataConfig, fill: Fill) -> PrepareReport:
    """Write a new generation of ``cfg.dir`` with ``fill``, switch the manifest to it, then
    remove what no longer belongs to the data. Returns ``fill``'s report with the manifest as
    written (its files named inside the generation)."""
    live = _live_manifest(cfg)
    gen = _next_generation(live, _stored_names(cfg))
    report = (_publish_remote if storage.is_s3(cfg.dir) else _publish_local)(cfg, gen, fill)
    _remove(cfg, _stale(_stored_names(cfg), live, gen), lambda d: d != gen)
    return report


def _publish_local(cfg: DataConfig, gen: str, fill: Fill) -> PrepareReport:
    data_dir = Path(cfg.dir)
    for legacy in (".staging", ".old"):  # left by versions that swapped whole directories
        shutil.rmtree(data_dir.with_name(f".{data_dir.name}{legacy}"), ignore_errors=True)
    made = [d for d in (data_dir, *data_dir.absolute().parents) if not d.exists()]
    staging = data_dir / gen
    shutil.rmtree(staging, ignore_errors=True)  # empty directories a killed run left
    try:
        with writing(staging):  # a full or read-only disk: one line naming the file
            staging.mkdir(parents=True)
            report = fill(staging)
        report.manifest = _in_generation(report.manifest, gen)
        with writing(data_dir / MANIFEST):
            fsync_path(staging)  # the shards' names are on disk before the manifest names them
            write_manifest(data_dir, report.manifest)
            fsync_path(data_dir)
    except BaseException:
        shutil.rmtree(data_dir if made else staging, ignore_errors=True)
        for d in made[1:]:  # the folders above data.dir this preparation created
            with contextlib.suppress(OSError):
                d.rmdir()
        for tmp in data_dir.glob(f".{MANIFEST}.tmp*"):  # a manifest write that failed
            tmp.unlink(missing_ok=True)
        raise
    return report


def _publish_remote(cfg: DataConfig, gen: str, fill: Fill) -> PrepareReport:
    try:
        return _upload_generation(cfg, gen, fill)
    except OSError as e:
        failure = write_error(e, Path(tempfile.gettempdir()))
        if failure is None:
            raise
        raise DataError(
            f"{failure}; an s3:// data.dir is prepared in a local temporary directory first "
            "(set TMPDIR to a disk with room)"
        ) from e


def _upload_generation(cfg: DataConfig, gen: str, fill: Fill) -> PrepareReport:
    """Fill the generation in a local temporary directory, upload it, then the manifest."""
    with tempfile.TemporaryDirectory(prefix="moe-prepare-") as tmp:
        staging = Path(tmp) / gen
        staging.mkdir()
        report = fill(staging)
        report.manifest = _in_generation(report.manifest, gen)
        files = sorted(staging.iterdir())
        done = 0
        try:
            for path in files:
                storage.upload(path, str(storage.join(cfg.dir, f"{gen}/{path.name}")), cfg.s3)
                done += 1
        except BaseException:  # before the switch: what was uploaded is no one's
            _remove(
                cfg, [f"{gen}/{p.name}" for p in files[: done + 1]], lambda d: d == gen, quiet=True
            )
            raise
        write_manifest(Path(tmp), report.manifest)
        storage.upload(Path(tmp) / MANIFEST, str(storage.join(cfg.dir, MANIFEST)), cfg.s3)
    return report


def manifest_exists(cfg: DataConfig) -> bool:
    """Whether ``cfg.dir`` holds a manifest (readable or not)."""
    if not storage.is_s3(cfg.dir):
        return (Path(cfg.dir) / MANIFEST).exists()
    try:
        storage.size(str(storage.join(cfg.dir, MANIFEST)), cfg.s3)
    except DataError as e:
        if "no such object" in str(e):
            return False
        raise
    return True


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
    return {manifest.tokenizer["file"]} | {
        s.file for split in manifest.splits.values() for s in split.shards
    }


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
    splits = {
        name: SplitInfo([dataclasses.replace(s, file=f"{gen}/{s.file}") for s in split.shards])
        for name, split in manifest.splits.items()
    }
    tokenizer = {**manifest.tokenizer, "file": f"{gen}/{manifest.tokenizer['file']}"}
    return dataclasses.replace(manifest, tokenizer=tokenizer, splits=splits)


def _stored_names(cfg: DataConfig) -> list[str]:
    """Every file under data.dir, relative to it ('/'-separated)."""
    if storage.is_s3(cfg.dir):
        base = cfg.dir.rstrip("/")
        return [
            info.path[len(base) - len(storage.S3_SCHEME) + 1 :]
            for info in storage.list_s3(base, cfg.s3, missing_ok=True)
        ]
    data_dir = Path(cfg.dir)
    return [p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*") if p.is_file()]


def _stale(stored: list[str], live: Manifest | None, gen: str) -> list[str]:
    """What the switch to generation ``gen`` left unreferenced: the earlier manifest's files,
    every other generation's (a killed preparation's), and files of data prepared before
    generations whose removal a kill cut short."""
    old = _referenced(live)
    keep = int(gen.split("-")[1])
    return [
        name
        for name in stored
        if name in old
        or _generation(name) not in (None, keep)
        or name.startswith(f".{MANIFEST}.tmp")
        or _LEGACY.fullmatch(name)
    ]


def _remove(
    cfg: DataConfig, names: list[str], retired: Callable[[str], bool], quiet: bool = False
) -> None:
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
