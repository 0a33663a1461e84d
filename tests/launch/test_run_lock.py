"""One moe-launch at a time per run directory (launch/run_lock.py)."""

import os

import pytest
import yaml

from launch.launch import main
from launch.run_lock import LOCK_FILE, RunLock
from moe.core.errors import LaunchError
from tests.conftest import tiny_run_dict


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path):
    first = RunLock(tmp_path)
    with pytest.raises(
        LaunchError, match=rf"another moe-launch is training this run \(pid {os.getpid()} on "
    ):
        RunLock(tmp_path)
    first.release()
    RunLock(tmp_path).release()  # released: the run is anyone's again


def test_a_launch_of_a_run_being_trained_changes_none_of_its_files(tiny_data, tmp_path, capsys):
    """The second of two launches of one run wrote its config and plan over the first's and
    trained beside it, into the same checkpoints and step records."""
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the running launch's config\n")
    held = RunLock(run_dir)  # the first launch, still training
    try:
        with pytest.raises(SystemExit) as e:
            main([str(config), "--no-eval"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {run_dir}: another moe-launch is training this run" in err
        assert (run_dir / "config.yaml").read_text() == "the running launch's config\n"
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "config.yaml"]
    finally:
        held.release()
