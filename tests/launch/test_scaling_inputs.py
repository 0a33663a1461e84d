"""moe-scaling against hand-edited sweep directories, options that other options make
meaningless, a full disk under the report, and a second ``run`` of a sweep beside the launches
of a killed one."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from launch import scaling_run, scaling_sweep
from moe.core.errors import ScalingError
from moe.tools import scaling_fit, scaling_text
from tests.helpers.scaling_runs import dense_runs
from tests.moe.tools.test_scaling import _plan_cli, base


@pytest.mark.parametrize(
    "text",
    ['{"a": 1}', "[1, 2]", '{"runs": [{"name": "x"}]}', '{"runs": [1]}'],
)
def test_a_sweep_file_that_is_not_a_plan_is_refused_naming_it(tmp_path, text):
    """Each of these once ended in a KeyError or TypeError traceback."""
    (tmp_path / scaling_sweep.SWEEP_FILE).write_text(text)
    with pytest.raises(ScalingError, match="sweep.json: not a plan moe-scaling wrote"):
        scaling_sweep.load_sweep(tmp_path)


def test_a_plan_without_runs_is_refused(tmp_path):
    """``run`` once failed with an IndexError on it."""
    plan = {"config": "c.yaml", "overrides": [], "runs": []}
    (tmp_path / scaling_sweep.SWEEP_FILE).write_text(json.dumps(plan))
    with pytest.raises(ScalingError, match="the plan has no runs"):
        scaling_sweep.load_sweep(tmp_path)


PLAN = ["plan", "configs/default.yaml", "--budgets", "1e13,3e13", "--families", "dense"]


def test_plan_into_a_directory_of_the_users_configs_removes_none_of_them(monkeypatch, tmp_path):
    """``--out`` a project directory: its configs/ once lost every YAML file the plan did not
    write. Only the configs of a plan replaced with --force are removed."""
    cli = _plan_cli(monkeypatch, base())
    mine = tmp_path / "configs" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text("name: mine\n")
    cli.main([*PLAN, "--sizes", "3", "--out", str(tmp_path)])
    assert mine.read_text() == "name: mine\n"
    cli.main([*PLAN, "--sizes", "3", "--out", str(tmp_path), "--force"])
    assert mine.read_text() == "name: mine\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--experts", "4,8"], "--experts 4,8: only the moe family has experts"),
        (["--widths", "64,96,128", "--sizes", "3"], "--sizes 3: --widths names the ladder"),
        (
            ["--widths", "64,96,128", "--centre-from", "elsewhere"],
            "--centre-from elsewhere: --widths names the ladder, nothing is centred",
        ),
        (["--sizes", "22"], "--sizes 22: the ladder has 21 widths"),
        (["--widths", "100,128,20"], "--widths: 100, 20 cannot be split into heads"),
    ],
)
def test_plan_refuses_options_it_would_ignore_or_cannot_build(
    monkeypatch, tmp_path, capsys, flags, message
):
    """--experts of a dense-only sweep, --sizes and --centre-from beside --widths were ignored;
    --sizes beyond the ladder took the whole ladder; a width of 100 failed as an invalid config
    naming n_heads, which the user does not set."""
    cli = _plan_cli(monkeypatch, base())
    with pytest.raises(SystemExit) as e:
        cli.main([*PLAN, *flags, "--out", str(tmp_path / "s")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_second_run_is_refused_while_a_launch_of_the_first_lives(tmp_path):
    """A ``moe-scaling run`` killed with SIGKILL leaves its launches training: each launch
    inherits the sweep's lock, so a second ``run`` (which would start the same runs into the
    same directories beside them) is refused, naming them, until they end."""
    lock = scaling_run.SweepLock(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,)
    )
    lock.started("dense-c1e13-w64", child.pid)
    lock.close()  # the killed moe-scaling run's descriptor
    try:
        with pytest.raises(ScalingError, match=rf"dense-c1e13-w64 \(pid {child.pid}\)"):
            scaling_run.SweepLock(tmp_path)
    finally:
        child.kill()
        child.wait()
    scaling_run.SweepLock(tmp_path).close()  # ended: the sweep runs again


def test_a_report_that_cannot_be_written_keeps_the_last_plot_whole(tmp_path):
    """A full disk (here a file size limit) while writing the plot: the plot of the last fit
    stays as it was, not cut short."""
    runs = dense_runs(((64, 1e5, 6.1), (96, 2e5, 5.9), (128, 4e5, 6.0)))
    from moe.tools import scaling_report

    analysis = scaling_report.analyse(runs, bootstrap=0)
    out = tmp_path / "report"
    last = scaling_text.write_report(analysis, out)["plot"].read_bytes()
    assert len(last) > 20_000
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, hard))
    try:
        with pytest.raises(OSError):
            scaling_text.write_report(analysis, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert (out / "scaling.png").read_bytes() == last
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "scaling.png"]


def test_the_optimum_of_a_law_with_exponents_near_zero_does_not_overflow():
    """Runs that all end at one loss fit exponents of about 1e-12: the optimum's power overflowed
    and ``fit`` stopped with a traceback while drawing the plot."""
    law = scaling_fit.Law(E=4.97, A=0.024, B=0.005, alpha=1e-12, beta=1e-12)
    n, d, loss = law.optimum(1e12, 6.0)
    assert n == float("inf") and d == 0.0


def test_a_sweep_moved_elsewhere_reads_its_finished_runs(tmp_path):
    """A run's summary names its checkpoint where it trained: a sweep copied or moved to
    another disk read as if none of its runs had finished."""
    run = SimpleNamespace(name="dense-w16", steps=100)
    trained = tmp_path / "old" / "runs" / run.name
    moved = tmp_path / "new" / "runs" / run.name
    tag = moved / "checkpoints" / "step_0000100"
    (tag / "eval").mkdir(parents=True)
    (tag / "eval" / "eval.json").write_text(
        json.dumps({"checkpoints": [{"step": 100, "loss": 4.2}]})
    )
    summary = {"steps": 100, "checkpoint": str(trained / "checkpoints" / "step_0000100")}
    (moved / "train_summary.json").write_text(json.dumps(summary))
    assert scaling_sweep.finished(tmp_path / "new", run) == {"step": 100, "loss": 4.2}
