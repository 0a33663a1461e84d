"""The train/validation split rule: a document's split is decided by its text alone.

Copies of a text land in the same split wherever they are (another file, another source,
another container or compression), and the split does not depend on the order, the sharding or
the worker count. The same content key serves ``dedup: exact``.
"""

from __future__ import annotations

import hashlib
import unicodedata

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
    first KEY_BYTES bytes. The text tokenized is the document's own, unchanged. A document's
    text as read has no lone surrogates (sources.py replaces them by U+FFFD)."""
    text = unicodedata.normalize("NFC", text.strip())
    return hashlib.sha256(text.encode("utf-8")).digest()[:KEY_BYTES]


def in_valid_split(key: bytes, fraction: float) -> bool:
    """Whether the document of content key ``key`` is in the validation split (SPLIT_RULE)."""
    return int.from_bytes(key[:8], "big") / 2**64 < fraction


def in_valid_split_by_location(source: str, doc_id: str, fraction: float) -> bool:
    """The rule before SPLIT_RULE, by the document's place in its container: kept only to
    count what a new preparation over such data moves."""
    digest = hashlib.sha256(f"{source}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
