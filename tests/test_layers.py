"""The import layering stays one-way (see "Where things live" in the README).

Two checks: a static import graph of the packages (no circles, no import pointing up a layer),
and a real import of the lower packages in a fresh interpreter in which everything above them
is made unimportable, so that a lazy import inside a function cannot hide an upward dependency
that runs at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "data_pipeline", "launch")

# Higher number = higher layer. A module may import its own layer or a lower one.
LAYERS = (
    ("launch", 8),
    ("moe.evaluation", 7),
    ("moe.tools", 7),
    ("moe.training", 6),
    ("moe.parallel", 6),
    ("moe.weights", 5),  # a checkpoint (load) or transformers weights (hf) as one single-device
    # model: evaluation, export, import, init_from
    ("moe.config", 4),  # run and launch schemas: hold the model's and the data's configs
    ("moe.model", 3),
    ("data_pipeline", 2),  # beside the model: imports the layer-0 foundations at most
    ("moe.checkpoint", 1),
    ("moe.core", 0),  # the foundations: errors, config_schema, fileio, run_dir
    ("moe", 0),
)


def layer_of(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module}: no layer assigned; add it to LAYERS")


def module_names(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: project modules it imports}, from every import statement, lazy ones included."""
    mods = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod] |= {
                t for t in targets if t in mods and t != mod and not mod.startswith(t + ".")
            }
    return graph


def problems(graph: dict[str, set[str]]) -> list[str]:
    out = [
        f"upward import: {m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)})"
        for m, ts in sorted(graph.items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m)
    ]
    if layer_of("data_pipeline") == layer_of("moe.model"):
        raise AssertionError("data_pipeline must not share the model's layer")
    out += [
        f"data_pipeline reaches into moe/launch: {m} -> {t}"
        for m, ts in sorted(graph.items())
        if m.startswith("data_pipeline")
        for t in sorted(ts)
        if not t.startswith("data_pipeline") and layer_of(t) > 0
    ]
    # circles: depth-first search for a back edge
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                out.append("circle: " + " -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return out


def test_the_project_imports_point_down_only():
    graph = import_graph(ROOT)
    assert "moe.model" in graph and "moe.checkpoint" in graph
    assert problems(graph) == []


def test_the_checker_reports_upward_imports_and_circles(tmp_path):
    """The check above would catch a regression: on a made-up tree it names each fault."""
    files = {
        "moe/__init__.py": "",
        "moe/core/errors.py": "",
        "moe/model/__init__.py": "",
        "moe/model/router.py": "from moe.training.trainer import train\n",  # upward
        "moe/training/__init__.py": "",
        "moe/training/trainer.py": "from moe.training.hooks import Hook\n",
        "moe/training/hooks.py": "def f():\n    from moe.training.trainer import train\n",  # circle
        "data_pipeline/__init__.py": "",
        "data_pipeline/reader.py": (
            "from moe.core.errors import MoEError\nfrom moe.model.router import R\n"
        ),
        "launch/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = problems(import_graph(tmp_path))
    assert "upward import: moe.model.router (layer 3) -> moe.training.trainer (layer 6)" in found
    assert (
        "data_pipeline reaches into moe/launch: data_pipeline.reader -> moe.model.router" in found
    )
    assert not any("-> moe.core.errors" in p for p in found)  # a foundation: allowed
    assert any(
        p.startswith("circle: ") and "moe.training.hooks" in p and "moe.training.trainer" in p
        for p in found
    )


BLOCKER = textwrap.dedent("""
    import importlib, pkgutil, sys
    blocked = {blocked!r}

    class Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in blocked):
                raise ImportError(f"{{name}} is above this layer and must not be imported")
            return None

    sys.meta_path.insert(0, Block())
    pkg = importlib.import_module({package!r})
    names = [{package!r}] + [m.name for m in pkgutil.walk_packages(pkg.__path__, {package!r} + ".")]
    for name in names:
        importlib.import_module(name)
    print(len(names))
""")

ABOVE_MODEL = [
    "moe.training",
    "moe.parallel",
    "moe.evaluation",
    "moe.tools",
    "launch",
    "deepspeed",
    "data_pipeline",
    "moe.checkpoint",
]


@pytest.mark.parametrize(
    "package,blocked",
    [
        ("moe.model", ABOVE_MODEL),
        ("moe.checkpoint", ABOVE_MODEL[:-1] + ["moe.model"]),
        ("moe.config", ABOVE_MODEL[:5] + ["deepspeed", "moe.weights.load"]),
        (
            "data_pipeline",
            ["moe.model", "moe.config", "moe.weights.load", "moe.checkpoint"]
            + ABOVE_MODEL[:5]
            + ["deepspeed"],
        ),
    ],
)
def test_lower_packages_import_with_everything_above_them_missing(package, blocked):
    code = BLOCKER.format(package=package, blocked=blocked)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 2  # the package and at least one module


def test_every_source_directory_is_a_package_that_setup_installs():
    """A directory without __init__.py imports from a checkout but is left out of a wheel
    (setup.py's find_packages skips it)."""
    dirs = {f.parent for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").is_file())
    assert missing == []
