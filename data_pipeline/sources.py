"""Document sources: text files, JSONL, Parquet, Arrow IPC and the standard-library corpus.

A source is cut into work items (a file, a byte range of a JSONL file, a Parquet row group, an
Arrow record batch), listed in a deterministic order; the preparation reads and tokenizes items in
parallel processes and writes their documents in item order, so the result does not depend on the
number of workers. Each document has an id that is stable for the same input files (its place
in them); the train/validation split is decided by the document's text (see split.py).
Bytes that are not valid UTF-8 are decoded with U+FFFD and counted, never silently dropped; so
are lone surrogates, which JSON escapes (``"\\ud800"``) and Python literals allow and UTF-8 has
no form for.
Text and JSONL files may be gzip or zstd compressed (streams.py). Paths may be
``s3://bucket/key`` URLs (globs included) for every file-based type but ``hf_disk``; see
storage.py.
"""

from __future__ import annotations

import ast
import glob
import io
import itertools
import json
import os
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_pipeline import instruction as instruction_format
from data_pipeline import storage
from data_pipeline.config import S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.streams import LOCAL, STREAM_CHUNK, compression, open_stream, read_bytes
from data_pipeline.tokenizer import without_surrogates


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def stdlib_document(path: Path) -> str:
    """Docstrings and comments of one standard-library module, in source order."""
    try:
        return python_document(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return ""


def python_document(src: str) -> str:
    """Docstrings and comments of one Python module's source, in source order ("" when it does
    not parse)."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return ""
    pieces: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc:
                pieces.append((node.body[0].lineno, doc))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                if text and not text.startswith("!"):
                    pieces.append((tok.start[0], text))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a module the tokenizer gives up on keeps the comments found before that point
    pieces.sort(key=lambda p: p[0])
    return "\n".join(text for _, text in pieces)


JSONL_TYPES = ("jsonl", "instruction")
"""Source types read from JSON lines (byte ranges of plain files, whole compressed files)."""
JSONL_CHUNK_BYTES = 8 << 20
"""JSONL files are split into byte ranges of about this size (cut at line ends)..."""
JSONL_MIN_CHUNK_BYTES = 1 << 20
JSONL_CHUNKS = 64
"""...or smaller for a small source: about this many ranges, of at least JSONL_MIN_CHUNK_BYTES,
so that a pool of workers shares a source of a few files evenly. Parquet row groups larger than
the same size (uncompressed, from the file's metadata) are cut into row ranges the same way."""


def _glob_base(pattern: str) -> Path:
    """The directory part of a pattern before its first wildcard."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda p: not glob.has_magic(p), parts))
    return Path(*fixed) if fixed else Path(".")


DIRECTORY_SUFFIX = {"parquet": ".parquet", "arrow": ".arrow", "python": ".py"}
"""In a directory, these source types read only files with this suffix (a dataset downloaded
from the Hub also holds README.md, .gitattributes and the like)."""


def _visible_files(root: Path, suffix: str | None) -> list[Path]:
    return [
        q
        for q in root.rglob("*")
        if q.is_file()
        and not any(part.startswith(".") for part in q.relative_to(root).parts)
        and (suffix is None or q.name.endswith(suffix))
    ]


def _matching_s3(pattern: str, source: str, suffix: str | None, s3: S3Config) -> dict[str, str]:
    """matching_files for one ``s3://`` pattern: prefixes play the part of directories."""
    parts = pattern[len(storage.S3_SCHEME) :].rstrip("/").split("/")
    base = storage.S3_SCHEME + "/".join(itertools.takewhile(lambda p: not glob.has_magic(p), parts))
    files: dict[str, str] = {}
    for url, is_prefix in storage.glob_s3(pattern, s3):
        if not is_prefix:
            files[url] = (
                url[len(base) + 1 :] if url.startswith(base + "/") else url.rsplit("/", 1)[-1]
            )
            continue
        found = {}
        for info in storage.list_s3(url, s3):
            name = info.path[len(url) - len(storage.S3_SCHEME) + 1 :]
            if not any(part.startswith(".") for part in name.split("/")) and (
                suffix is None or name.endswith(suffix)
            ):
                found[storage.S3_SCHEME + info.path] = name
        if not found:
            raise DataError(
                f"source {source!r}: {url} holds no {'*' + suffix + ' ' if suffix else ''}objects"
            )
        files.update(found)
    return files


def matching_files(
    patterns: list[str],
    source: str,
    suffix: str | None = None,
    directories: bool = False,
    s3: S3Config = LOCAL,
) -> list[tuple[Path | str, str]]:
    """Files matched by the patterns, each with its name relative to its pattern's base (a
    directory pattern: that directory; a file: its parent). Document ids use that name, so the
    train/validation split does not depend on where the files live. A directory is searched for
    the (non-hidden) files ending with ``suffix``, or returned itself if ``directories``.
    ``s3://`` patterns give URLs (str), searched the same way with prefixes as directories."""
    files: dict[Path | str, str] = {}
    for pattern in patterns:
        if storage.is_s3(pattern):
            files.update(_matching_s3(pattern, source, suffix, s3))
            continue
        pattern = os.path.expanduser(pattern)
        matches = glob.glob(pattern, recursive=True)
        if not matches:
            raise DataError(f"source {source!r}: nothing matches {pattern!r}")
        base = _glob_base(pattern)
        for m in matches:
            p = Path(m)
            name = str(p.relative_to(base)) if base in p.parents else p.name
            if p.is_dir() and not directories:
                found = _visible_files(p, suffix)
                if not found:
                    raise DataError(
                        f"source {source!r}: directory {p} holds no "
                        f"{'*' + suffix + ' ' if suffix else ''}files"
                    )
                files.update((q, str(q.relative_to(p))) for q in found)
            elif p.is_dir() == directories:
                files[p] = name
    if not files:
        kind = "directories" if directories else "files"
        raise DataError(f"source {source!r}: {patterns} match no {kind}")
    # Compared by parts like Path does, so local files keep their order and a bucket holding
    # the same tree gives the same order.
    return sorted(
        files.items(),
        key=lambda f: f[0].parts if isinstance(f[0], Path) else tuple(f[0].split("/")),
    )


@dataclass(frozen=True)
class WorkItem:
    """A piece of a source read by one worker: ``part`` is a byte range (JSONL), a row group
    (Parquet) or rows [start, stop) of one, ``(group, start, stop)``, a record batch (Arrow) or a
    range of record batches (hf_disk); None for a whole file (a text file, a compressed JSONL
    file). ``name`` identifies the file in document ids."""

    path: str
    name: str
    part: tuple[int, int] | tuple[int, int, int] | int | None = None


def jsonl_chunk_bytes(total: int) -> int:
    """Byte range size for the plain JSONL files of a source, ``total`` bytes together. It
    depends on the inputs alone (never on the workers), like the ranges and their documents."""
    return max(JSONL_MIN_CHUNK_BYTES, min(JSONL_CHUNK_BYTES, total // JSONL_CHUNKS))


def _jsonl_ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, size)) for a in range(0, size, chunk)] or [(0, 0)]


def row_ranges(rows: int, nbytes: int, chunk: int) -> list[tuple[int, int]] | None:
    """Consecutive row ranges of about ``chunk`` bytes for a row group of ``rows`` rows and
    ``nbytes`` uncompressed bytes; None when it stays one item."""
    pieces = min(rows, -(-nbytes // chunk))
    if pieces <= 1:
        return None
    step = -(-rows // pieces)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _parquet_items(files: list[tuple[Path | str, str]], s3: S3Config) -> list[WorkItem]:
    """A work item per row group, or per row range of a row group above the chunk size: a
    source of one file with one large row group is still shared by every worker."""
    metas = [(p, n, _open_parquet(p, s3).metadata) for p, n in files]
    groups = [(p, n, g, md.row_group(g)) for p, n, md in metas for g in range(md.num_row_groups)]
    chunk = jsonl_chunk_bytes(sum(rg.total_byte_size for *_, rg in groups))
    items = []
    for p, n, g, rg in groups:
        ranges = row_ranges(rg.num_rows, rg.total_byte_size, chunk)
        items += (
            [WorkItem(str(p), n, g)]
            if ranges is None
            else [WorkItem(str(p), n, (g, a, b)) for a, b in ranges]
        )
    return items


def _read_rows(
    parquet: pq.ParquetFile, group: int, start: int, stop: int, columns: list[str]
) -> pa.Table:
    """Rows [start, stop) of a row group, decoding it only as far as ``stop``."""
    pieces, offset = [], 0
    for batch in parquet.iter_batches(
        batch_size=min(stop - start, 65536), row_groups=[group], columns=columns
    ):
        end = offset + batch.num_rows
        if end > start:
            pieces.append(batch.slice(max(start - offset, 0), min(stop, end) - max(start, offset)))
        offset = end
        if offset >= stop:
            break
    if offset < stop:
        raise DataError(f"row group {group} has {offset} rows, expected at least {stop}")
    return pa.Table.from_batches(pieces)


def _open_arrow(path: Path | str, s3: S3Config) -> pa.ipc.RecordBatchFileReader:
    try:
        return pa.ipc.open_file(storage.random_access(str(path), s3))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Arrow IPC file ({e})") from e


def _open_parquet(path: Path | str, s3: S3Config) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(storage.random_access(str(path), s3))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e


def hf_disk_files(directory: Path) -> list[Path]:
    """The Arrow files of a dataset written by ``datasets.Dataset.save_to_disk``, in its own
    order (``state.json``). The file names come from the dataset: only plain names inside the
    directory are accepted."""
    if (directory / "dataset_dict.json").exists():
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise DataError(
            f"{directory} holds a DatasetDict; name one of its splits "
            f"({', '.join(splits)}), e.g. {directory / (splits[0] if splits else 'train')}"
        )
    state = directory / "state.json"
    try:
        files = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        names = [f["filename"] for f in files]
    except FileNotFoundError:
        raise DataError(
            f"{directory}: no state.json; not a dataset written by save_to_disk"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{state}: unreadable ({type(e).__name__}: {e})") from e
    out = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise DataError(f"{state}: data file {name!r} is not a file name in {directory}")
        if not (directory / name).is_file():
            raise DataError(f"{state}: lists {name}, which is missing")
        out.append(directory / name)
    return out


def _open_arrow_stream(path: Path) -> pa.ipc.RecordBatchStreamReader:
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path), "r"))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Arrow IPC stream ({e})") from e


def _stream_batches(path: Path) -> Iterator[pa.RecordBatch]:
    try:
        yield from _open_arrow_stream(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: corrupt or truncated Arrow IPC stream ({e})") from e


def _batch_ranges(path: Path) -> list[tuple[int, int]]:
    """Record batches of a stream file grouped into ranges of about JSONL_CHUNK_BYTES (a memory
    mapped stream is walked without reading its data)."""
    ranges, start, size, n = [], 0, 0, 0
    for batch in _stream_batches(path):
        n, size = n + 1, size + batch.nbytes
        if size >= JSONL_CHUNK_BYTES:
            ranges.append((start, n))
            start, size = n, 0
    if start < n or not ranges:
        ranges.append((start, n))
    return ranges


def work_items(source: SourceConfig, s3: S3Config = LOCAL) -> list[WorkItem]:
    """The source's work items, in a deterministic order (``s3``: how to reach s3:// paths)."""
    if source.type == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return [WorkItem(str(p), str(p.relative_to(root))) for p in stdlib_files()]
    if source.type == "hf_disk":
        return [
            WorkItem(str(f), f"{name}/{f.name}", r)
            for d, name in matching_files(source.paths, source.name, directories=True)
            for f in hf_disk_files(d)
            for r in _batch_ranges(f)
        ]
    files = matching_files(source.paths, source.name, DIRECTORY_SUFFIX.get(source.type), s3=s3)
    if source.type in ("text", "python"):
        return [WorkItem(str(p), n) for p, n in files]
    if source.type in JSONL_TYPES:
        # A compressed file cannot be entered in the middle: it is one item, read as a stream.
        plain = {p: storage.size(str(p), s3) for p, _ in files if not compression(p, s3)}
        chunk = jsonl_chunk_bytes(sum(plain.values()))
        return [
            WorkItem(str(p), n, r)
            for p, n in files
            for r in (_jsonl_ranges(plain[p], chunk) if p in plain else [None])
        ]
    if source.type == "parquet":
        return _parquet_items(files, s3)
    return [
        WorkItem(str(p), n, b)
        for p, n in files
        for b in range(_open_arrow(p, s3).num_record_batches)
    ]


EMPTY_ROWS_KEPT = 5
"""Positions of the first few empty rows kept per work item (and per file in the manifest)."""


@dataclass
class ItemDocuments:
    """The documents of one work item: (id, text) pairs, plus what was replaced or skipped."""

    docs: list[tuple[str, str]] = field(default_factory=list)
    invalid_utf8: int = 0
    """Invalid UTF-8 sequences and lone surrogates replaced by U+FFFD."""
    empty: int = 0
    """Documents with no text (empty, whitespace or null), skipped."""
    filtered: int = 0
    """Rows left out by the source's filter."""
    empty_rows: list[int] = field(default_factory=list)
    """Where the first EMPTY_ROWS_KEPT empty documents are: their rows (JSONL: lines) counted
    from the item's first, which is row ``rows`` of the items before it in the same file."""
    rows: int = 0
    """Rows (JSONL: lines, blank ones included) this item covers."""

    def add(self, doc_id: str, text: str | None, row: int = 0) -> None:
        if text is None or not text.strip():
            self.empty += 1
            if len(self.empty_rows) < EMPTY_ROWS_KEPT:
                self.empty_rows.append(row)
        else:
            text, surrogates = without_surrogates(text)
            self.invalid_utf8 += surrogates
            self.docs.append((doc_id, text))


def decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text with invalid sequences replaced, and how many were replaced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")


def _jsonl_lines(
    path: Path | str, part: tuple[int, int] | None, s3: S3Config
) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines of a byte range of a plain file, or of a whole compressed
    file (offsets in its decompressed bytes)."""
    with open_stream(path, s3) as f:
        if part is None:
            offset = 0
            for line in f:
                yield offset, line
                offset += len(line)
            return
        # A range owns the lines that start inside it: skip the partial line at its start (the
        # previous range reads it), read past its end to finish the last line.
        start, end = part
        f.seek(max(0, start - 1))
        if start > 0 and f.read(1) != b"\n":
            f.readline()
        while f.tell() < end:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            yield offset, line


def line_number(path: Path | str, offset: int, s3: S3Config) -> int:
    """The 1-based line number of the line at byte ``offset`` of a JSONL file (decompressed
    bytes for a compressed one): its newlines before ``offset`` are counted. For error messages
    only: it reads the file up to there."""
    newlines = 0
    with open_stream(path, s3) as f:
        while offset > 0:
            block = f.read(min(STREAM_CHUNK, offset))
            if not block:
                break
            newlines, offset = newlines + block.count(b"\n"), offset - len(block)
    return newlines + 1


def _jsonl_documents(
    path: Path | str,
    name: str,
    part: tuple[int, int] | None,
    source: SourceConfig,
    out: ItemDocuments,
    s3: S3Config,
) -> None:
    fieldname, keep = source.field, source.row_filter
    instruction = source.type == "instruction"

    def where(offset: int) -> str:
        return f"{path}: line {line_number(path, offset, s3)} (byte {offset})"

    for index, (offset, line) in enumerate(_jsonl_lines(path, part, s3)):
        out.rows = index + 1
        if not line.strip():
            continue
        text, bad = decode(line)
        out.invalid_utf8 += bad
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            near = text[max(0, e.pos - 30) : e.pos + 30].strip()
            raise DataError(
                f"{where(offset)} is not valid JSON: {e.msg} at column {e.colno} (near {near!r})"
            ) from None
        if instruction:
            if not isinstance(record, dict):
                raise DataError(f"{where(offset)} is not a JSON object")
        elif not isinstance(record, dict) or fieldname not in record:
            raise DataError(f"{where(offset)} has no field {fieldname!r}")
        if keep is not None:
            if keep.column not in record:
                raise DataError(
                    f"{where(offset)} has no field {keep.column!r} (the source's filter column)"
                )
            if record[keep.column] != keep.value:
                out.filtered += 1
                continue
        if instruction:
            messages = instruction_format.messages_of(
                record, where(offset), source.template.train_roles
            )
            out.add(f"{name}@{offset}", instruction_format.canonical(messages), index)
            continue
        value = record[fieldname]
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"{where(offset)}: field {fieldname!r} is {type(value).__name__}, expected a string"
            )
        out.add(f"{name}@{offset}", value, index)


def _check_columns(path: Path, names: list[str], source: SourceConfig) -> list[str]:
    """The columns to read (text, then the filter's), each checked to exist."""
    wanted = [source.field] + ([source.filter.column] if source.row_filter else [])
    for column in wanted:
        if column not in names:
            role = "text" if column == source.field else "filter"
            raise DataError(
                f"{path}: no column {column!r} (the source's {role} column; columns: {names})"
            )
    return list(dict.fromkeys(wanted))


def _kept_rows(path: Path, table: pa.Table | pa.RecordBatch, source: SourceConfig) -> np.ndarray:
    """Indices of the rows the source's filter keeps (all rows without a filter)."""
    if source.row_filter is None:
        return np.arange(table.num_rows)
    column = table.column(source.filter.column)
    try:
        mask = pc.fill_null(pc.equal(column, pa.scalar(source.filter.value)), False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise DataError(
            f"{path}: column {source.filter.column!r} is {column.type}, which cannot "
            f"be compared with the filter value {source.filter.value!r} ({e})"
        ) from e
    return np.flatnonzero(mask.to_numpy(zero_copy_only=False))


def _column_documents(
    path: Path,
    name: str,
    table: pa.Table | pa.RecordBatch,
    source: SourceConfig,
    part: int,
    out: ItemDocuments,
    first_row: int = 0,
) -> None:
    """``first_row``: the row of ``part`` that ``table`` starts at (for document ids). The
    table's rows follow the item's rows read so far (``out.rows``)."""
    _check_columns(path, table.schema.names, source)
    rows = _kept_rows(path, table, source)
    out.filtered += table.num_rows - len(rows)
    column = table.column(source.field)
    if len(rows) < table.num_rows:
        column = column.take(pa.array(rows))
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        values = _decoded(column, out)
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            values = column.to_pylist()
        except UnicodeDecodeError:  # writers need not check: a string column may hold any bytes
            values = _decoded(column.cast(pa.large_binary()), out)
    else:
        raise DataError(f"{path}: column {source.field!r} is {column.type}, expected strings")
    for row, text in zip(rows.tolist(), values):
        out.add(f"{name}#{part}:{row + first_row}", text, out.rows + row)
    out.rows += table.num_rows


def _decoded(column, out: ItemDocuments) -> list[str | None]:
    """A binary column's values as text, bytes that are not UTF-8 replaced and counted."""
    values = []
    for raw in column.to_pylist():
        text, bad = decode(raw) if raw is not None else (None, 0)
        out.invalid_utf8 += bad
        values.append(text)
    return values


def read_item(source: SourceConfig, item: WorkItem, s3: S3Config = LOCAL) -> ItemDocuments:
    """Read one work item (runs in a worker process)."""
    path, out = (item.path if storage.is_s3(item.path) else Path(item.path)), ItemDocuments()
    if source.type == "stdlib":
        out.add(item.name, stdlib_document(path))
        out.rows = 1
    elif source.type == "text":
        text, out.invalid_utf8 = decode(read_bytes(path, s3))
        out.add(item.name, text)
        out.rows = 1
    elif source.type == "python":
        text, out.invalid_utf8 = decode(read_bytes(path, s3))
        out.add(item.name, python_document(text))
        out.rows = 1
    elif source.type in JSONL_TYPES:
        _jsonl_documents(path, item.name, item.part, source, out, s3)
    elif source.type == "parquet":
        parquet = _open_parquet(path, s3)
        columns = _check_columns(path, parquet.schema_arrow.names, source)
        group, start, stop = item.part if isinstance(item.part, tuple) else (item.part, 0, None)
        try:
            table = (
                parquet.read_row_group(group, columns=columns)
                if stop is None
                else _read_rows(parquet, group, start, stop, columns)
            )
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: unreadable row group {group} ({e})") from e
        except DataError as e:
            raise DataError(f"{path}: {e}") from e
        _column_documents(path, item.name, table, source, group, out, start)
    elif source.type == "hf_disk":
        first, stop = item.part
        for i, batch in enumerate(itertools.islice(_stream_batches(path), first, stop), first):
            _column_documents(path, item.name, batch, source, i, out)
    else:
        _column_documents(
            path, item.name, _open_arrow(path, s3).get_batch(item.part), source, item.part, out
        )
    return out
