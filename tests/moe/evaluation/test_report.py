"""Writing the report into a directory that holds an earlier one: the new report replaces it as
a whole, and a failed write leaves the earlier one as it was and names where it failed."""

import errno
import json

import pytest

from launch.cli import storage_problem
from moe.evaluation import report
from moe.evaluation.report import write_report
from tests.helpers.eval_results import fake_checkpoint, fake_result


def test_a_new_report_removes_the_plots_of_the_one_it_replaces(tmp_path):
    """Two checkpoints with expert statistics, then one without: the directory held the first
    report's plots of both checkpoints beside a report that shows none of them."""
    a, b = fake_checkpoint(tmp_path / "run", 2), fake_checkpoint(tmp_path / "run", 4)
    out = tmp_path / "run" / "eval"
    first = write_report({"data": "x", "checkpoints": [fake_result(a), fake_result(b)]}, out)
    assert sorted(p.name for p in out.glob("*.png")) == [
        "expert_load_step_0000002.png",
        "expert_load_step_0000004.png",
        "loss_curves.png",
    ]
    assert len(first["plots"]) == 3

    second = write_report({"data": "x", "checkpoints": [fake_result(b, experts=False)]}, out)
    assert sorted(p.name for p in out.glob("*.png")) == ["loss_curves.png"]
    assert second["plots"] == [str(out / "loss_curves.png")]
    assert json.loads((out / "eval.json").read_text())["files"] == second


def test_a_full_disk_names_the_report_directory_and_keeps_the_earlier_report(tmp_path, monkeypatch):
    """A plot is written through a buffer: the error of its write names no file, and the
    command line said only that "a file" could not be written."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    out = tag_dir / "eval"
    write_report({"data": "x", "checkpoints": [fake_result(tag_dir)]}, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "plot_loss_curves", full_disk)
    with pytest.raises(OSError) as e:
        write_report({"data": "y", "checkpoints": [fake_result(tag_dir)]}, out)
    assert storage_problem(e.value) == f"{out}: could not write: the disk holding it is full"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tag_dir.iterdir()) == ["checkpoint.json", "eval"]  # no staging
