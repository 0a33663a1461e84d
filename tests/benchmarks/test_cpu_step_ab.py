"""benchmarks/cpu_step_ab.py trains each side on its own tree's config and names what differs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_step_ab  # noqa: E402


def _tree(root: Path, text: str) -> Path:
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "default.yaml").write_text(text)
    return root


def test_the_keys_in_which_the_two_configs_differ_are_named(tmp_path):
    base = _tree(tmp_path / "base", "model:\n  d_model: 64\neval:\n  batch_size: 8\n")
    this = _tree(
        tmp_path / "this",
        "model:\n  d_model: 64\neval:\n  batch_size: 4\n  every_n_steps: 50\n",
    )
    assert cpu_step_ab.config_differences(base, this) == [
        "eval.batch_size: 8 -> 4",
        "eval.every_n_steps: (absent) -> 50",
    ]
    assert cpu_step_ab.config_differences(base, base) == []
