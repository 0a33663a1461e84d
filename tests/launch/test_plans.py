"""Local, hostfile and MPI plans, and the launcher's clear errors on bad input."""

import json
import os
import stat

import pytest
import yaml

from launch.launch import main
from launch.schedulers import build_plan
from launch.schedulers.hostfile import ENV_FILE, read_hostfile
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError, LaunchError


def run_config(tmp_path, scheduler: str, world_size: int = 2, **launch) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "name": "tiny",
            "output_dir": str(tmp_path / "runs"),
            "parallel": {"world_size": world_size, "expert_parallel_size": 2},
            "launch": {"scheduler": scheduler, **launch},
        },
    )


def test_local_plan_starts_world_size_ranks_of_the_entry_point(tmp_path):
    plan = build_plan(run_config(tmp_path, "local", world_size=4, env={"OMP_NUM_THREADS": "1"}))
    cmd = plan.command
    assert cmd[cmd.index("--num_gpus") + 1] == "4"
    assert cmd[-3:] == ["launch.rank", "--config", str(tmp_path / "runs" / "tiny" / "config.yaml")]
    assert plan.env["OMP_NUM_THREADS"] == "1" and not plan.submits


def write_hostfile(tmp_path, text: str):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_plan_checks_filters_and_writes_deepspeed_env(tmp_path):
    hosts = write_hostfile(tmp_path, "# cluster\nworker-0 slots=2\nworker-1 slots=2  # spare\n\n")
    plan = build_plan(
        run_config(
            tmp_path,
            "hostfile",
            env={"NCCL_IB_HCA": "mlx5_0"},
            hostfile={"path": hosts, "exclude": "worker-0:1@worker-1:1"},
        )
    )
    cmd = plan.command
    assert cmd[cmd.index("--hostfile") + 1] == hosts
    assert cmd[cmd.index("--exclude") + 1] == "worker-0:1@worker-1:1"
    assert cmd[cmd.index("--master_addr") + 1] == "worker-0"
    assert (plan.world_size, plan.nodes, plan.requires) == (2, 2, ["pdsh", "ssh"])
    # DeepSpeed's runner reads DS_ENV_FILE and exports each line on every remote node.
    run_dir = tmp_path / "runs" / "tiny"
    assert plan.env["DS_ENV_FILE"] == str(run_dir / ENV_FILE)
    assert "NCCL_IB_HCA=mlx5_0\n" in plan.files[ENV_FILE]
    plan.write(run_dir)
    assert (run_dir / ENV_FILE).read_text() == plan.files[ENV_FILE]
    assert json.loads((run_dir / "plan.json").read_text())["command"] == cmd


@pytest.mark.parametrize(
    "hostfile, filters, message",
    [
        ("worker-0 slots=2\nworker-0 slots=2\n", {}, "line 2: host 'worker-0' is listed twice"),
        (
            "worker-0 slots=2\nworker-1 slot=2\n",
            {},
            "line 2: 'worker-1 slot=2' is not 'HOSTNAME slots=N'",
        ),
        ("$(touch x) slots=2\n", {}, "line 1:"),
        ("# nothing\n", {}, "no 'HOSTNAME slots=N' line"),
        ("worker-0 slots=2\n", {"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
        ("worker-0 slots=2\n", {"include": "worker-0:2"}, "worker-0 has slots 0..1, not [2]"),
        ("worker-0 slots=4\n", {}, "parallel.world_size: 2 ranks requested, but the hostfile"),
    ],
)
def test_bad_hostfiles_and_filters_are_named(tmp_path, hostfile, filters, message):
    path = write_hostfile(tmp_path, hostfile)
    with pytest.raises((LaunchError, ConfigError)) as e:
        build_plan(run_config(tmp_path, "hostfile", hostfile={"path": path, **filters}))
    assert message in str(e.value)
    assert path in str(e.value) or "launch.hostfile" in str(e.value) or "world_size" in str(e.value)


def test_hostfile_refuses_env_values_deepspeed_would_hand_to_a_remote_shell(tmp_path):
    path = write_hostfile(tmp_path, "worker-0 slots=2\n")
    with pytest.raises(ConfigError, match="launch.env.X: .*remote shell"):
        build_plan(
            run_config(
                tmp_path, "hostfile", env={"X": "$(touch /tmp/pwned)"}, hostfile={"path": path}
            )
        )
    assert read_hostfile(path) == {"worker-0": 2}


@pytest.mark.parametrize(
    "flavor, env_args",
    [
        ("mpich", ["-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29400"]),
        ("openmpi", ["-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29400"]),
    ],
)
def test_mpi_plan_passes_the_rendezvous_in_each_flavors_syntax(tmp_path, flavor, env_args):
    plan = build_plan(
        run_config(
            tmp_path,
            "mpi",
            mpi={
                "flavor": flavor,
                "master_addr": "10.0.0.1",
                "master_port": 29400,
                "hostfile": "hosts.txt",
                "extra_args": ["--bind-to", "none"],
            },
        )
    )
    cmd = plan.command
    assert cmd[:3] == ["mpiexec", "-n", "2"]
    assert cmd[3:5] == (["-f", "hosts.txt"] if flavor == "mpich" else ["--hostfile", "hosts.txt"])
    assert cmd[5 : 5 + len(env_args)] == env_args
    assert cmd[-3:-1] == ["launch.rank", "--config"]  # records how each rank ended
    assert "--bind-to" in cmd


def test_mpi_flavor_is_detected_from_the_real_mpiexec(tmp_path):
    plan = build_plan(run_config(tmp_path, "mpi"))  # MPICH from PyPI in the test environment
    assert "-genv" in plan.command


def launch_cli(args, tmp_path, capsys, config: dict | str = None):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(config if isinstance(config, str) else yaml.safe_dump(config or {}))
    with pytest.raises(SystemExit) as e:
        main([str(cfg_file), *args])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "args, config, message",
    [
        ([], "model: [unclosed", "c.yaml:\n  - not valid YAML"),
        (
            ["model.moe.num_experts=6"],
            None,
            "parallel.expert_parallel_size: 4 must divide model.moe.num_experts (6)",
        ),
        (["parallel.world_size=6"], None, "expert_parallel_size: 4 must divide world_size (6)"),
        (
            ["--scheduler", "mpi", "launch.mpi.mpiexec=/nonexistent/mpiexec"],
            None,
            "'/nonexistent/mpiexec' not found on PATH",
        ),
        (
            ["--scheduler", "hostfile", "launch.hostfile.path=/nonexistent"],
            None,
            "hostfile /nonexistent: cannot read it",
        ),
        (
            ["--scheduler", "slurm", "launch.slurm.partition=x;touch SENTINEL"],
            None,
            "launch.slurm.partition: 'x;touch SENTINEL' is not a valid partition name",
        ),
    ],
)
def test_bad_input_exits_2_with_the_key_and_writes_nothing(
    tmp_path, capsys, monkeypatch, args, config, message
):
    monkeypatch.chdir(tmp_path)
    base = {
        "name": "bad",
        "output_dir": "runs",
        "parallel": {"world_size": 4, "expert_parallel_size": 4},
    }
    err = launch_cli(args, tmp_path, capsys, config or base)
    assert message in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "SENTINEL").exists()


def test_missing_sbatch_is_a_clear_error_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bin_dir = tmp_path / "bin"  # PATH without sbatch, but with what the plan itself needs
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    err = launch_cli(
        ["--scheduler", "slurm"], tmp_path, capsys, {"name": "x", "output_dir": "runs"}
    )
    assert "'sbatch' not found on PATH" in err and "--dry-run" in err
    assert not (tmp_path / "runs").exists()


def test_status_needs_a_job_id_or_a_submitted_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path)])
    assert e.value.code == 2
    assert "neither a job id nor a run directory" in capsys.readouterr().err


def test_status_and_cancel_ask_slurm_about_the_recorded_job(tmp_path, capsys, monkeypatch):
    """squeue/scancel replaced by recorders on PATH; the job id comes from the run directory."""
    (tmp_path / "slurm_jobs.json").write_text(json.dumps([{"job_id": "77", "log": "x-%j.out"}]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = (
        f"if [ -e {tmp_path}/cancelled ]; then echo 'CANCELLED|None|0:05|10:00'; "
        f"else echo 'RUNNING|None|0:04|10:00'; fi"
    )
    for name, body in {"squeue": squeue, "scancel": f'echo "$@" > {tmp_path}/cancelled'}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    main(["status", str(tmp_path)])
    assert "job 77: RUNNING, elapsed 0:04 of 10:00" in capsys.readouterr().out
    main(["cancel", str(tmp_path)])
    assert (tmp_path / "cancelled").read_text().strip() == "77"
    assert "cancelled SLURM job 77 (was RUNNING)" in capsys.readouterr().out


def test_multi_host_hostfile_without_pdsh_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hosts = write_hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    err = launch_cli(
        ["--scheduler", "hostfile", f"launch.hostfile.path={hosts}"],
        tmp_path,
        capsys,
        {"name": "x", "output_dir": "runs"},
    )
    assert "'pdsh' not found on PATH: the hostfile scheduler needs it" in err
    assert not (tmp_path / "runs").exists()
