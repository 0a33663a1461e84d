"""The config reference, generated from the run config's dataclasses: every key with its type,
default and the docstring under its field; for model keys, whether the key changes the function
the model computes (the ``arch`` / ``runtime`` classification, moe/core/config_schema.py).

    python -m moe.config.reference > docs/config.md

tests/moe/config/test_config_reference.py fails when docs/config.md differs from this output.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing

from moe.config.run import RunConfig
from moe.core.config_schema import ARCH, ROLE, describe_type

COMMAND = "python -m moe.config.reference > docs/config.md"


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written under the field in ``cls``'s source."""
    body = typing.cast(
        ast.ClassDef, ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    ).body
    out = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[node.target.id] = after.value.value
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"


def _section_class(tp: typing.Any) -> tuple[typing.Any, str] | None:
    """The config dataclass a field holds (itself, or the items of a list), with the suffix its
    section name takes."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    return None


def sections(cls: type = RunConfig, name: str = "") -> list[str]:
    """Markdown for ``cls`` (one table of its leaf keys) followed by its nested sections."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    model = name == "model" or name.startswith("model.")
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        sub = _section_class(hints[f.name])
        if sub is not None:
            nested.append((sub[0], f"{name}.{f.name}{sub[1]}" if name else f.name + sub[1]))
            continue
        cells = [f"`{f.name}`", _one_line(describe_type(hints[f.name])), _default(f)]
        if model:
            cells.append("yes" if f.metadata.get(ROLE) == ARCH else "no")
        rows.append("| " + " | ".join(cells + [_one_line(docs.get(f.name, ""))]) + " |")
    head = [
        "| key | type | default | "
        + ("changes the function | " if model else "")
        + "description |",
        "|---" * (5 if model else 4) + "|",
    ]
    intro = _one_line((inspect.getdoc(cls) or "").split("\n\n")[0])  # the first paragraph
    out = [f"## `{name}`" if name else "## top level", ""]
    out += [intro, ""] if intro and not intro.startswith(f"{cls.__name__}(") else []  # not
    # the signature dataclass() writes where the class has no docstring
    out += head + rows + [""] if rows else []
    for sub_cls, sub_name in nested:
        out += sections(sub_cls, sub_name)
    return out


def reference() -> str:
    lines = [
        "# Config reference",
        "",
        f"Generated from the config dataclasses by `{COMMAND}`; do not edit by hand. One "
        "YAML file sets these keys (unknown keys are errors); trailing `key.path=value` "
        "arguments override them (e.g. `moe-train CONFIG train.max_steps=100`).",
        "",
        "Model keys marked *changes the function* decide what a trained model computes: a "
        "run resumes from a checkpoint only with the checkpoint's values (a new run starts "
        "a different model from old weights with `model.init_from`), and every Hugging "
        "Face export target holds or refuses each of them. The others (initialization, "
        "training-only noise, losses, kernel choice) may change on resume.",
        "",
    ]
    return "\n".join(lines + sections()).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(reference(), end="")
