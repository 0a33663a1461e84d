"""The names of a run directory are spelled once, in moe/core/run_dir.py: no other module of the
project spells them (docstrings aside), so the trainer that writes a file and the launcher, the
SLURM job and the evaluation that read it cannot drift apart."""

from __future__ import annotations

import ast
from pathlib import Path

from moe.core.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "launch", "data_pipeline", "benchmarks")
SPELLED_ONCE = ("train_summary.json", "preempted.json", "steps_rank")
"""Names no other directory of the project has."""
JOINED_ONCE = ("checkpoints", "tensorboard")
"""Subdirectories, found as ``path / "checkpoints"`` (a results key of the same name is not)."""


def _documentation(tree: ast.AST) -> set[int]:
    """Strings that stand alone as statements: docstrings of modules, classes, functions and
    config fields."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def spellings(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = _documentation(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [name for name in SPELLED_ONCE if name in node.value]
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in JOINED_ONCE
        ):
            found.append(f'/ "{node.right.value}"')
    return found


def test_the_check_finds_each_spelling():
    assert sorted(spellings('p = run_dir / "checkpoints"\nq = f"steps_rank{r}.jsonl"')) == [
        '/ "checkpoints"',
        "steps_rank",
    ]
    assert spellings('"""train_summary.json is a docstring"""\nx = d["checkpoints"]') == []


def imports_the_project(source: str) -> bool:
    return any(
        isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] in PACKAGES
        or isinstance(node, ast.Import)
        and any(a.name.split(".")[0] in PACKAGES for a in node.names)
        for node in ast.walk(ast.parse(source))
    )


def test_no_module_but_run_dir_spells_a_run_directory_name():
    """Standalone scripts (benchmarks/gpu_proof.py imports only the standard library, for a
    machine without the project's dependencies) spell what they read themselves."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            if path == ROOT / "moe" / "core" / "run_dir.py" or not imports_the_project(source):
                continue
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in spellings(source)]
    assert offenders == [], "use moe.core.run_dir.RunDir instead"


def test_the_names(tmp_path):
    files = RunDir(str(tmp_path))
    assert files.checkpoints == tmp_path / "checkpoints"
    assert files.summary == tmp_path / "train_summary.json"
    assert files.step_records(3) == tmp_path / "logs" / "steps_rank3.jsonl"
    for rank in (0, 1, 10):
        files.step_records(rank).parent.mkdir(exist_ok=True)
        files.step_records(rank).touch()
    files.rank_log(0).touch()
    assert files.all_step_records() == [files.step_records(r) for r in (0, 1, 10)]
