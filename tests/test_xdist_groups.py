"""Under pytest-xdist (--dist loadgroup) a file's tests share one worker and SLURM clusters never
overlap (tests/conftest.py); a run whose pytest / pytest-xdist pair loses the groups stops."""

from __future__ import annotations

import types

import pytest

from tests.conftest import pytest_collection_modifyitems, pytest_xdist_node_collection_finished


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


def test_a_files_tests_share_a_group_and_slurm_clusters_share_one():
    items = [
        _Item("tests/moe/tools/test_export_sweep.py::test_a[x]", "slow"),
        _Item("tests/moe/tools/test_export_sweep.py::test_b"),
        _Item("tests/moe/model/test_router.py::test_c"),
        _Item("tests/integration/test_local_launch.py::test_d", "integration"),
        _Item("tests/integration/test_slurm_two_nodes.py::test_e", "integration", "slurm"),
        _Item("tests/launch/test_slurm_plan.py::test_f", "slurm"),
    ]
    pytest_collection_modifyitems(_config(True), items)
    assert [i.group() for i in items] == [
        "tests/moe/tools/test_export_sweep.py",
        "tests/moe/tools/test_export_sweep.py",
        "tests/moe/model/test_router.py",
        "tests/integration/test_local_launch.py",
        "slurm",
        "slurm",
    ]


def test_without_xdist_nothing_is_marked():
    item = _Item("tests/moe/model/test_router.py::test_c")
    pytest_collection_modifyitems(_config(False), [item])
    assert item.get_closest_marker("xdist_group") is None


def _node(dist: str):
    return types.SimpleNamespace(
        config=types.SimpleNamespace(getvalue=lambda name: {"dist": dist}[name]),
        gateway=types.SimpleNamespace(id="gw0"),
    )


def test_ids_without_their_group_stop_the_run_naming_the_first():
    ids = ["tests/a.py::test_x@tests/a.py", "tests/b.py::test_y[1]"]
    with pytest.raises(pytest.exit.Exception) as e:
        pytest_xdist_node_collection_finished(_node("loadgroup"), ids)
    assert e.value.returncode == 4
    assert "1 of 2 tests lost their xdist group on gw0 (first: tests/b.py::test_y[1])" in str(
        e.value.msg
    )


def test_grouped_ids_and_other_distributions_pass():
    grouped = ["tests/a.py::test_x@tests/a.py", "tests/b.py::test_y[p@q]@slurm"]
    pytest_xdist_node_collection_finished(_node("loadgroup"), grouped)
    # an "@" inside a parameter is not a group
    with pytest.raises(pytest.exit.Exception):
        pytest_xdist_node_collection_finished(_node("loadgroup"), ["t.py::f[p@q]"])
    pytest_xdist_node_collection_finished(_node("load"), ["tests/b.py::test_y"])


def test_this_run_groups_by_file_and_slurm(request):
    """Under `-n 2 --dist loadgroup` (CI), this test's own id carries its file's group."""
    if getattr(request.config, "workerinput", None) is None:
        pytest.skip("not on a pytest-xdist worker")
    if not request.config.getvalue("loadgroup"):  # a worker's own form of --dist loadgroup
        pytest.skip("not --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_xdist_groups.py"), request.node.nodeid
