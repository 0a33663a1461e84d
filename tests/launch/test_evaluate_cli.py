"""moe-eval's command line around the evaluation, with made-up results in place of a model:
where reports go, what an interrupted or unlucky evaluation leaves behind, and the flags that
are refused before any checkpoint loads."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import launch.evaluate
from launch.evaluate import main
from moe.evaluation import report
from tests.helpers.eval_results import fake_checkpoint, fake_result

ARGS = ["--quiet", "--no-generation"]


@pytest.fixture
def evaluated(monkeypatch):
    """Every checkpoint evaluates to made-up results, instantly."""
    monkeypatch.setattr(launch.evaluate, "evaluate_checkpoint_dir", lambda d, opts: fake_result(d))


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "device, cuda, problem",
    [
        ("gpu", True, "--device: 'gpu' is not cpu, cuda or cuda:N"),
        ("cuda", False, "--device: cuda: no CUDA device is visible here"),
        ("cuda:0", False, "--device: cuda:0: no CUDA device is visible here"),
    ],
)
def test_a_device_this_machine_lacks_is_refused_before_anything_runs(
    device, cuda, problem, monkeypatch, capsys
):
    """Torch refused them only when moving the weights, with a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert problem in refused(["a-checkpoint-that-is-never-opened", "--device", device], capsys)


def test_ctrl_c_exits_130_without_a_traceback_and_keeps_the_earlier_report(
    tmp_path, evaluated, monkeypatch, capsys
):
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    main([str(tag_dir), *ARGS])
    before = {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()}

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot_loss_curves", ctrl_c)
    try:
        main([str(tag_dir), *ARGS])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left moe-eval as a KeyboardInterrupt (a traceback)")
    except SystemExit as e:
        assert e.code == 130
    else:
        pytest.fail("moe-eval went on after Ctrl-C")
    assert capsys.readouterr().err.endswith("moe-eval: interrupted (Ctrl-C)\n")
    assert {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()} == before
    assert sorted(p.name for p in tag_dir.iterdir()) == ["checkpoint.json", "eval"]


def test_sigterm_while_the_report_is_written_leaves_no_staging_behind(tmp_path, evaluated):
    """SIGTERM killed the process at once: a hidden folder of half-written report files stayed
    in the checkpoint directory."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    main([str(tag_dir), *ARGS])
    before = {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()}
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        import launch.evaluate
        from moe.evaluation import report
        from tests.helpers.eval_results import fake_result

        launch.evaluate.evaluate_checkpoint_dir = lambda d, opts: fake_result(d)

        def killed(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)

        report.plot_loss_curves = killed
        launch.evaluate.main([{str(tag_dir)!r}, "--quiet", "--no-generation"])
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.endswith("moe-eval: stopped by SIGTERM\n")
    assert sorted(p.name for p in tag_dir.iterdir()) == ["checkpoint.json", "eval"]
    assert {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()} == before


def test_a_checkpoint_deleted_during_its_evaluation_is_not_made_again(
    tmp_path, monkeypatch, capsys
):
    """A run's checkpoint.keep_last deletes older checkpoints while moe-eval reads one: the
    report then made its directory again, a checkpoint directory with nothing but eval/."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)

    def deleted_meanwhile(d, opts):
        shutil.rmtree(d)
        return fake_result(d)

    monkeypatch.setattr(launch.evaluate, "evaluate_checkpoint_dir", deleted_meanwhile)
    err = refused([str(tag_dir), *ARGS], capsys)
    assert f"{tag_dir}: deleted during the evaluation" in err
    assert not tag_dir.exists()


@pytest.fixture
def tasks_evaluated(monkeypatch):
    """Downstream tasks evaluate to made-up results (the task names and settings are checked
    for real)."""
    pytest.importorskip("lm_eval")

    def downstream(tag_dir, opts):
        row = {"task": opts.tasks[0], "metric": "acc", "filter": "none", "value": 0.5}
        return {
            "checkpoint": str(tag_dir),
            "tag": tag_dir.name,
            "step": 2,
            "run_dir": str(tag_dir.parent.parent),
            "data": None,
            "downstream": [{**row, "stderr": 0.1, "samples": 2, "num_fewshot": 0}],
            "settings": {"num_fewshot": 0, "limit": 2, "batch_size": 8, "dtype": "float32"},
            "seconds": 0.1,
        }

    monkeypatch.setattr(launch.evaluate, "evaluate_checkpoint_tasks", downstream)


def test_a_tasks_report_goes_beside_the_loss_report(tmp_path, evaluated, tasks_evaluated):
    """The report moe-launch writes after training (CKPT/eval/) was replaced by the first
    moe-eval --tasks of the same checkpoint, its plots left behind."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    main([str(tag_dir), *ARGS])
    loss_report = {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()}
    main([str(tag_dir), "--tasks", "stdlib_sentence_mc", "--limit", "2", "--quiet"])
    assert {p.name: p.read_bytes() for p in (tag_dir / "eval").iterdir()} == loss_report
    (c,) = json.loads((tag_dir / "eval-tasks" / "eval.json").read_text())["checkpoints"]
    assert c["downstream"][0]["task"] == "stdlib_sentence_mc"
    assert sorted(p.name for p in (tag_dir / "eval-tasks").iterdir()) == ["eval.json", "report.md"]


def test_more_few_shot_examples_than_a_task_has_are_refused_before_the_model_loads(
    tmp_path, tasks_evaluated, capsys
):
    """The harness stopped with a traceback at the first question, after the model loaded."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    argv = [str(tag_dir), "--tasks", "stdlib_sentence_mc", "--limit", "2", "--quiet"]
    err = refused([*argv, "--num-fewshot", "33"], capsys)
    assert "num_fewshot: task stdlib_sentence_mc has 32 examples to draw 33 solved" in err
    assert not (tag_dir / "eval-tasks").exists()
    main([*argv, "--num-fewshot", "32"])  # the 32 examples of its training split are enough


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--tasks", "stdlib_sentence_mc", "--text", "notes.md"], "--text: not used with --tasks"),
        (["--tasks", "stdlib_sentence_mc", "--max-tokens", "9"], "--max-tokens: not used with"),
        (["--tasks", "stdlib_sentence_mc", "--no-generation"], "--no-generation: not used with"),
        (["--dtype", "bf16"], "--dtype: used only with --tasks"),
        (["--num-fewshot", "2"], "--num-fewshot: used only with --tasks"),
    ],
)
def test_a_flag_the_evaluation_does_not_read_is_refused(
    tmp_path, evaluated, flags, problem, capsys
):
    """Flags of the loss evaluation with --tasks, and the tasks' flags without it, were
    ignored without a word."""
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    err = refused([str(tag_dir), "--quiet", *flags], capsys)
    assert problem in err
    assert not (tag_dir / "eval").exists() and not (tag_dir / "eval-tasks").exists()


def test_a_checkpoint_named_twice_is_evaluated_once(tmp_path, monkeypatch):
    tag_dir = fake_checkpoint(tmp_path / "run", 2)
    seen = []
    monkeypatch.setattr(
        launch.evaluate,
        "evaluate_checkpoint_dir",
        lambda d, opts: seen.append(d) or fake_result(d),
    )
    main([str(tag_dir), str(tmp_path / "run"), *ARGS])  # the run's newest checkpoint: the same
    assert seen == [tag_dir]
