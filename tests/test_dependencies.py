"""Every third-party module the project imports is declared in setup.py.

A package that arrives only as another package's dependency, or that a developer installed by
hand, makes the tests pass on one machine and fail on a fresh one. This walks every import
statement (lazy ones inside functions included) of the project's code, benchmarks and tests,
maps each top-level module to the distribution that provides it, and fails on any distribution
that neither `install_requires` nor an extra of `extras_require` names."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("moe", "data_pipeline", "launch", "benchmarks", "tests")
# Import names whose distribution is named otherwise, for modules that may not be installed
# here (optional extras); installed modules are looked up in the installed metadata.
KNOWN_DIST = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "lm_eval": "lm-eval",
    "liger_kernel": "liger-kernel",
    "google": "protobuf",
    "sklearn": "scikit-learn",
}
# Build tooling, not imported by the installed package at run time.
TOOLING = {"setuptools", "pkg_resources", "pip", "_pytest"}


def normalise(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared_distributions(setup_py: Path) -> set[str]:
    """Names in setup()'s install_requires and in every list of extras_require."""
    requirements: list[str] = []
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"):
            continue
        for kw in node.keywords:
            if kw.arg == "install_requires":
                requirements += ast.literal_eval(kw.value)
            elif kw.arg == "extras_require":
                for reqs in ast.literal_eval(kw.value).values():
                    requirements += reqs
    names = set()
    for req in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)", req)
        assert match, f"setup.py: unreadable requirement {req!r}"
        names.add(normalise(match.group(1)))
    return names


def imported_modules(root: Path) -> dict[str, set[str]]:
    """{top-level module: files importing it} for absolute imports of non-project modules."""
    local = {"setup", "conftest"} | {p.name for p in root.iterdir() if p.is_dir()}
    files = [p for folder in FOLDERS for p in (root / folder).rglob("*.py")]
    local |= {p.stem for p in files}  # scripts importing their neighbours by name
    std = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in std and top not in local and top not in TOOLING:
                    found.setdefault(top, set()).add(str(path.relative_to(root)))
    return found


def distributions_of(module: str, installed: dict[str, list[str]]) -> set[str]:
    if module in installed:
        return {normalise(d) for d in installed[module]}
    return {normalise(KNOWN_DIST.get(module, module))}


def undeclared(root: Path) -> dict[str, set[str]]:
    """{module: files} for every imported module whose distribution setup.py does not name."""
    have = declared_distributions(root / "setup.py")
    installed = importlib.metadata.packages_distributions()
    return {
        module: files
        for module, files in imported_modules(root).items()
        if not distributions_of(module, installed) & have
    }


def test_every_imported_third_party_module_is_declared_in_setup_py():
    missing = undeclared(ROOT)
    installed = importlib.metadata.packages_distributions()
    lines = [
        f"{module} (distribution {', '.join(sorted(distributions_of(module, installed)))}):"
        f" imported by {', '.join(sorted(files)[:3])}"
        for module, files in sorted(missing.items())
    ]
    assert not missing, (
        "imported but not declared in setup.py (install_requires or an extra):\n" + "\n".join(lines)
    )


def test_the_check_finds_an_undeclared_import_lazy_or_not(tmp_path):
    (tmp_path / "setup.py").write_text(
        "from setuptools import setup\n"
        'setup(name="x", install_requires=["numpy>=1", "PyYAML"],\n'
        '      extras_require={"test": ["moto[server]"]})\n'
    )
    pkg = tmp_path / "moe"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import numpy\nimport yaml\nimport moto.server\nimport json\n"
        "from moe import b\nfrom . import b\n"
    )
    (pkg / "b.py").write_text("def f():\n    from scipy.optimize import minimize\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import not_a_real_dist_xyz.sub\n")
    assert {m: sorted(f) for m, f in undeclared(tmp_path).items()} == {
        "scipy": ["moe/b.py"],
        "not_a_real_dist_xyz": ["tests/test_x.py"],
    }


def test_requirements_are_read_from_install_requires_and_every_extra(tmp_path):
    (tmp_path / "setup.py").write_text(
        'setup(install_requires=["torch", "tqdm"],\n'
        '      extras_require={"hf": ["transformers==4.1"], "test": ["pytest-xdist", "Moto[server]"]})\n'
    )
    assert declared_distributions(tmp_path / "setup.py") == {
        "torch",
        "tqdm",
        "transformers",
        "pytest-xdist",
        "moto",
    }
