"""Document sources: each yields (document id, text) pairs in a deterministic order."""

from __future__ import annotations

import ast
import glob
import io
import os
import sysconfig
import tokenize
from pathlib import Path
from typing import Iterator

from data_pipeline.config import SourceConfig
from moe.errors import DataError


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def stdlib_document(path: Path) -> str:
    """Docstrings and comments of one standard-library module, in source order."""
    try:
        src = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(src)
    except (SyntaxError, ValueError, OSError):
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
        pass
    pieces.sort(key=lambda p: p[0])
    return "\n".join(text for _, text in pieces)


def text_files(patterns: list[str]) -> list[Path]:
    files: set[Path] = set()
    for pattern in patterns:
        matches = glob.glob(os.path.expanduser(pattern), recursive=True)
        if not matches:
            raise DataError(f"text source: nothing matches {pattern!r}")
        for m in matches:
            p = Path(m)
            files.update(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else files.add(p)
    return sorted(files)


def document_refs(source: SourceConfig) -> list[str]:
    """The ids (paths) of a source's documents, sorted: the unit of parallel work."""
    if source.type == "stdlib":
        return [str(p) for p in stdlib_files()]
    return [str(p) for p in text_files(source.paths)]


def read_document(source_type: str, ref: str) -> tuple[str, int]:
    """Text of one document and the number of bytes that were not valid UTF-8 (replaced)."""
    path = Path(ref)
    if source_type == "stdlib":
        return stdlib_document(path), 0
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {ref}: {e.strerror}") from e
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    return text, bad


def iter_documents(source: SourceConfig) -> Iterator[tuple[str, str]]:
    for ref in document_refs(source):
        text, _ = read_document(source.type, ref)
        if text.strip():
            yield ref, text
