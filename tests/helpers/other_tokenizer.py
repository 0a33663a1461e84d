"""A copy of prepared data whose tokenizer is another one (its file and the manifest's SHA-256
agree, as data prepared with that tokenizer would have them): what checks that compare a
checkpoint's or a run's tokenizer with the data's must refuse."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from data_pipeline.config import TokenizerConfig
from data_pipeline.tokenizer import train_tokenizer


def copy_with_other_tokenizer(data_dir: str | Path, dst: Path) -> Path:
    """``data_dir`` copied to ``dst`` with a freshly trained tokenizer in place of its own."""
    shutil.copytree(data_dir, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    path = dst / manifest["tokenizer"]["file"]
    lines = [f"another corpus, line {i}: {i * 7} quick brown foxes" for i in range(500)]
    train_tokenizer(lines, TokenizerConfig(vocab_size=320), path)
    manifest["tokenizer"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst
