"""moe-launch reports every config problem of every section in one error: the sections' own
value checks, the checks across sections and the scheduler's plan checks, without a fix-one,
find-the-next round trip."""

import pytest

from launch.launch import main


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
