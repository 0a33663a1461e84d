"""Under pytest-xdist (--dist loadgroup) a file's tests share one worker and runs of the real
launcher never overlap (tests/conftest.py)."""

from __future__ import annotations

import types

import pytest

from tests.conftest import pytest_collection_modifyitems


class _Item:
    def __init__(self, nodeid: str, *marks: str):
        self.nodeid = nodeid
        self.marks = [getattr(pytest.mark, m) for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark)

    def group(self):
        return self.get_closest_marker("xdist_group").args[0]


def _config(xdist: bool):
    return types.SimpleNamespace(pluginmanager=types.SimpleNamespace(hasplugin=lambda name: xdist))


def test_a_files_tests_share_a_group_and_launcher_runs_share_one():
    items = [
        _Item("tests/moe/tools/test_export_sweep.py::test_a[x]", "slow"),
        _Item("tests/moe/tools/test_export_sweep.py::test_b"),
        _Item("tests/moe/model/test_router.py::test_c"),
        _Item("tests/integration/test_local_launch.py::test_d", "integration"),
        _Item("tests/integration/test_slurm_two_nodes.py::test_e", "integration", "slurm"),
    ]
    pytest_collection_modifyitems(_config(True), items)
    assert [i.group() for i in items] == [
        "tests/moe/tools/test_export_sweep.py",
        "tests/moe/tools/test_export_sweep.py",
        "tests/moe/model/test_router.py",
        "launcher",
        "launcher",
    ]


def test_without_xdist_nothing_is_marked():
    item = _Item("tests/moe/model/test_router.py::test_c")
    pytest_collection_modifyitems(_config(False), [item])
    assert item.get_closest_marker("xdist_group") is None
