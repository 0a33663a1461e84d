"""docs/config.md is the generated config reference: it must match the dataclasses."""

from __future__ import annotations

from pathlib import Path

from moe.config.reference import COMMAND, field_docs, reference
from moe.core.config_schema import function_classes
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    assert DOC.read_text() == reference(), f"docs/config.md is stale; regenerate it: {COMMAND}"


def test_the_reference_shows_whether_each_model_key_changes_the_function():
    text = reference()
    for path, changes in function_classes(ModelConfig).items():
        section, _, key = path.rpartition(".")
        body = text.split(f"## `{'model.' + section if section else 'model'}`\n", 1)[1]
        row = next(line for line in body.split("\n") if line.startswith(f"| `{key}` |"))
        assert row.split(" | ")[3] == ("yes" if changes else "no"), row


def test_field_docstrings_are_read_from_the_source():
    docs = field_docs(RouterConfig)
    assert docs["top_k"].startswith("Experts per token")
    assert "order" in docs and "aux_loss_scope" in docs
    assert (
        "| `z_loss_coef` | float | `0.0` | no | Coefficient of the ST-MoE router z-loss "
        "mean(logsumexp(logits)^2). |"
    ) in reference()
