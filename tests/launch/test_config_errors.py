"""moe-launch reports every config problem of every section in one error: the sections' own
value checks, the checks across sections and the scheduler's plan checks, without a fix-one,
find-the-next round trip."""

import json

import pytest

from launch.launch import main
from moe.config.run import dump_config
from moe.core.errors import ConfigError


def launch_errors(tmp_path, capsys, *overrides) -> list[str]:
    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'runs'}\n")
    with pytest.raises(SystemExit) as e:
        main([str(config), "--scheduler", "slurm", "--dry-run", *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid config in {config}:")
    return [line.strip()[2:] for line in err.splitlines()[1:]]


def test_errors_of_three_sections_and_the_scheduler_in_one_pass(tmp_path, capsys):
    problems = launch_errors(
        tmp_path,
        capsys,
        "parallel.world_size=3",
        "launch.slurm.nodes=2",
        "train.lr=-1",
        "model.moe.num_experts=5",
        "launch.slurm.time=99:99:99",
    )
    keys = [p.split(":")[0] for p in problems]
    assert sorted(keys) == sorted(
        [
            "train.lr",
            "train.min_lr",  # train's own checks
            "parallel.expert_parallel_size",  # parallel's own: EP 2 does not divide 3
            "launch.slurm.time",  # launch's own
            "parallel.expert_parallel_size",  # across sections: EP vs model.moe.num_experts
            "parallel.world_size",  # the SLURM plan: 3 ranks over 2 nodes
        ]
    ), problems
    assert (
        "parallel.world_size: 3 ranks cannot be spread evenly over launch.slurm.nodes (2)"
        in problems
    )
    assert "parallel.expert_parallel_size: 2 must divide model.moe.num_experts (5)" in problems


def test_a_type_error_does_not_hide_the_other_sections_problems(tmp_path, capsys):
    problems = launch_errors(
        tmp_path,
        capsys,
        "train.lr=fast",
        "parallel.world_size=3",
        "launch.slurm.cpus_per_task=0",
        "logging.bogus=1",
    )
    assert "train.lr: expected a number, got 'fast'" in problems
    assert "parallel.expert_parallel_size: 2 must divide world_size (3)" in problems
    assert any(p.startswith("launch.slurm.cpus_per_task: must be >= 1") for p in problems)
    assert any(p.startswith("logging.bogus: unknown key") for p in problems)


def test_a_source_that_gives_no_weights_is_refused_before_anything_starts(tmp_path, capsys):
    """model.init_from is checked by the launcher before the run directory or the data are
    touched, by its key, and not restarted; a transformers directory given without hf: is
    named as one."""
    not_a_checkpoint = tmp_path / "notckpt"
    not_a_checkpoint.mkdir()
    hf_dir = tmp_path / "export"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'runs'}\n")
    cases = [
        (not_a_checkpoint, "neither a checkpoint"),
        (f"hf:{not_a_checkpoint}", "config.json: missing"),
        (hf_dir, f"(a transformers model directory is given as hf:{hf_dir})"),
        (tmp_path / "absent", "no such checkpoint directory"),
    ]
    for source, needle in cases:
        with pytest.raises(SystemExit) as e:
            main([str(config), f"model.init_from={source}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"  - model.init_from: {str(source).removeprefix('hf:')}" in err, err
        assert needle in err, err
        assert not (tmp_path / "runs").exists()


def test_a_run_resuming_its_own_checkpoint_does_not_read_its_source_again(tmp_path):
    from launch.launch import refuse_bad_source
    from moe.config.run import load_config
    from moe.core.errors import ConfigError

    cfg = load_config("configs/default.yaml", [f"model.init_from={tmp_path / 'gone'}"])
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="model.init_from: .*gone: no such checkpoint"):
        refuse_bad_source(cfg, run_dir, "c.yaml")
    tag = run_dir / "checkpoints" / "step_00000010"
    tag.mkdir(parents=True)
    marker = {"format": 1, "files": {}, "num_moe_layers": 0, "num_experts": 0}
    (tag / "checkpoint.json").write_text(json.dumps(marker))
    (tag / "run_config.yaml").write_text(dump_config(cfg))
    refuse_bad_source(cfg, run_dir, "c.yaml")  # resumes from its own: nothing to check


def test_a_run_that_would_not_resume_its_checkpoint_is_refused_before_anything_changes(
    tmp_path,
):
    """A fine-tuning given the name of the run it starts from: its ranks refused the run's
    checkpoint, but only after its config and plan had replaced the run's own."""
    from launch.launch import refuse_bad_source
    from moe.config.run import load_config
    from moe.core.errors import CheckpointError

    base = load_config("configs/default.yaml")  # model.vocab_size: null (the tokenizer's)
    run_dir = tmp_path / "run"
    tag = run_dir / "checkpoints" / "step_00000010"
    tag.mkdir(parents=True)
    marker = {"format": 1, "files": {}, "num_moe_layers": 0, "num_experts": 0}
    (tag / "checkpoint.json").write_text(json.dumps(marker))
    # A checkpoint's config holds the vocabulary size the tokenizer gave it.
    saved = load_config("configs/default.yaml", ["model.vocab_size=4096"])
    (tag / "run_config.yaml").write_text(dump_config(saved))
    ft = load_config("configs/default.yaml", ["finetune.method=full", f"model.init_from={run_dir}"])
    with pytest.raises(CheckpointError, match=r"finetune\.method"):
        refuse_bad_source(ft, run_dir, "c.yaml")
    other = load_config("configs/default.yaml", ["model.d_model=64"])
    with pytest.raises(CheckpointError, match=r"model\.d_model"):
        refuse_bad_source(other, run_dir, "c.yaml")
    refuse_bad_source(base, run_dir, "c.yaml")
    # A damaged checkpoint is left to the ranks, which say how to resume from the one before.
    marker["files"] = {"mp_rank_00_model_states.pt": 10}
    (tag / "checkpoint.json").write_text(json.dumps(marker))
    refuse_bad_source(ft, run_dir, "c.yaml")


def test_an_adapter_file_that_is_none_is_refused_before_anything_starts(tmp_path):
    from launch.launch import refuse_bad_source
    from moe.config.run import load_config

    base = tmp_path / "base" / "checkpoints" / "step_0000006"
    base.mkdir(parents=True)
    marker = {"format": 1, "files": {}, "num_moe_layers": 0, "num_experts": 0}
    (base / "checkpoint.json").write_text(json.dumps(marker))
    (tmp_path / "notes.safetensors").write_bytes(b"not safetensors")
    cfg = load_config(
        "configs/finetune-lora.yaml",
        [f"model.init_from={base}", f"finetune.lora.init_from={tmp_path / 'notes.safetensors'}"],
    )
    with pytest.raises(ConfigError, match=r"finetune\.lora\.init_from: cannot read"):
        refuse_bad_source(cfg, tmp_path / "runs" / "ft", "c.yaml")


def test_a_rank_stops_on_a_bad_source_without_a_restart(tmp_path):
    """Reached in a rank (a run started otherwise than by moe-launch), the same problem is a
    configuration error, which the supervisor does not restart."""
    from launch.train import final_cause
    from moe.core.errors import ConfigError
    from moe.training.upcycle import check_source_tokenizer

    with pytest.raises(ConfigError) as e:
        check_source_tokenizer(tmp_path / "gone", "0" * 64, "data")
    assert final_cause(e.value, tmp_path)[0] == "configuration"
    assert "model.init_from:" in str(e.value)


def test_a_fine_tuning_refuses_data_of_another_tokenizer_than_its_base(tmp_path):
    """A fine-tuning from a checkpoint of this project with data prepared by another tokenizer
    trained without a word: its token ids mean other text to the model. An upcycling's source
    may have had another tokenizer (its embeddings are trained again) and is not checked."""
    from moe.core.errors import ConfigError
    from moe.training.upcycle import check_source_tokenizer

    tag = tmp_path / "base" / "checkpoints" / "step_0000006"
    tag.mkdir(parents=True)
    record = {"file": "tokenizer.model", "sha256": "a" * 64}
    (tag / "checkpoint.json").write_text(json.dumps({"format": 1, "tokenizer": record}))
    base = tmp_path / "base"
    with pytest.raises(ConfigError, match=rf"model.init_from: {base} expects the tokenizer"):
        check_source_tokenizer(base, "b" * 64, "data", finetune=True)
    check_source_tokenizer(base, "a" * 64, "data", finetune=True)  # the same tokenizer
    check_source_tokenizer(base, "b" * 64, "data")  # an upcycling


def test_a_preparation_that_fails_leaves_no_run_directory(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'runs'}\n")
    sources = f"[{{name: mine, type: text, paths: [{tmp_path / 'absent.txt'}]}}]"
    with pytest.raises(SystemExit) as e:
        main([str(config), f"data.dir={tmp_path / 'data'}", f"data.sources={sources}"])
    assert e.value.code == 2
    assert "absent.txt" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_read_only_output_directory_is_refused_before_the_data_work(
    tmp_path, capsys, monkeypatch
):
    """Checked on the nearest directory that exists (a read-only file system refuses root too;
    os.access stands in for it here), before any preparation: no data directory appears."""
    import launch.launch as launch_mod

    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'ro' / 'runs'}\n")
    (tmp_path / "ro").mkdir()
    real = launch_mod.os.access
    monkeypatch.setattr(
        launch_mod.os, "access", lambda p, m: False if str(p).endswith("ro") else real(p, m)
    )
    with pytest.raises(SystemExit) as e:
        main([str(config), f"data.dir={tmp_path / 'data'}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'ro' / 'runs' / 'x'}: cannot write the run directory: "
        f"{tmp_path / 'ro'} is read-only or not writable"
    )
    assert not (tmp_path / "data").exists() and not (tmp_path / "ro" / "runs").exists()


def test_a_full_disk_while_writing_the_run_directory_leaves_none(tmp_path, monkeypatch):
    import errno

    from launch.launch import write_run_dir
    from moe.core.errors import LaunchError

    run_dir = tmp_path / "runs" / "x"

    class Plan:
        def write_run_dir(self, text):
            run_dir.mkdir(parents=True)
            (run_dir / "config.yaml").write_text(text)
            raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "plan.json"))

    with pytest.raises(LaunchError) as e:
        write_run_dir(Plan(), run_dir, "name: x\n")
    assert (
        str(e.value)
        == f"{run_dir / 'plan.json'}: could not write the run directory: the disk holding it is full"
    )
    assert not run_dir.exists()
    run_dir.mkdir(parents=True)  # an existing run (a resume) keeps what it had
    (run_dir / "kept").write_text("1")
    Plan.write_run_dir = lambda self, text: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    with pytest.raises(LaunchError) as e:  # a buffered write's error names no file
        write_run_dir(Plan(), run_dir, "")
    assert str(e.value).startswith(f"{run_dir}: could not write the run directory: the disk")
    Plan.write_run_dir = lambda self, text: (_ for _ in ()).throw(OSError(errno.EROFS, "ro", "f"))
    with pytest.raises(
        LaunchError, match="f: could not write the run directory: the disk holding it is read-only"
    ):
        write_run_dir(Plan(), run_dir, "")
    assert (run_dir / "kept").read_text() == "1"


def test_any_command_reports_a_storage_error_in_one_line(capsys):
    import errno

    from launch.cli import exits_cleanly

    @exits_cleanly
    def command(argv):
        raise OSError(errno.EDQUOT, "Disk quota exceeded", "/data/out.arrow")

    with pytest.raises(SystemExit) as e:
        command([])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err
        == "error: /data/out.arrow: could not write: this user's disk quota on the disk holding it is used up\n"
    )

    @exits_cleanly
    def other(argv):
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError):  # no verdict and no file to name: a traceback, as before
        other([])

    @exits_cleanly
    def missing(argv):  # moe-scaling predict --write-config /proc/x/out.yaml
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/x/out.yaml")

    with pytest.raises(SystemExit) as e:
        missing([])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: /proc/x/out.yaml: No such file or directory\n"


def test_a_full_output_disk_is_refused_before_the_data_work(tmp_path, capsys, monkeypatch):
    import os
    from types import SimpleNamespace

    import launch.launch as launch_mod

    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'runs'}\n")
    monkeypatch.setattr(
        launch_mod.os, "statvfs", lambda p: SimpleNamespace(f_bavail=100, f_frsize=4096)
    )
    with pytest.raises(SystemExit) as e:
        main([str(config), f"data.dir={tmp_path / 'data'}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'runs' / 'x'}: cannot write the run directory: the disk holding "
        f"{tmp_path} is full (409,600 bytes free)"
    )
    assert not (tmp_path / "data").exists() and os.listdir(tmp_path) == ["c.yaml"]
