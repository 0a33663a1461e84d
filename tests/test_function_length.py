"""No function of the project's code runs past 80 lines (STYLE.md: a function reads in one
sitting). Counted from the ``def`` line (decorators included) to the last line of its body,
nested functions inside their enclosing one too; tests are outside the rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "data_pipeline", "launch", "benchmarks")
MAX_LINES = 80


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: name (N lines)`` for every function or method of the packages over ``limit``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root)}: {node.name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_80_lines():
    assert long_functions(ROOT) == [], "split these functions (STYLE.md, at most 80 lines)"


def test_the_count_covers_decorators_nested_functions_and_every_package(tmp_path):
    def body(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    for pkg in PACKAGES:
        (tmp_path / pkg / "sub").mkdir(parents=True)
    # 80 lines with its decorator (79 without), and exactly 80 lines.
    (tmp_path / "benchmarks" / "b.py").write_text(
        "@staticmethod\ndef decorated():\n"
        + body(79, "    ")
        + "\n\ndef at_limit():\n"
        + body(79, "    ")
    )
    (tmp_path / "launch" / "sub" / "c.py").write_text(
        "class C:\n    def method(self):\n        def inner():\n" + body(80, "            ")
    )
    assert long_functions(tmp_path) == [
        "launch/sub/c.py: method (82 lines)",
        "launch/sub/c.py: inner (81 lines)",
        "benchmarks/b.py: decorated (81 lines)",
    ]
