"""launch.elastic: the layout a restart falls back to with fewer usable slots, the probe of the
hosts, the replanned command, and the config checks. The real launch is tested in
tests/integration/test_elastic_restart.py."""

import json
import os

import pytest

from launch import elastic
from launch.elastic import USABLE_SLOTS_ENV, Elastic, Layout, fitting_layout, usable_slots
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import LaunchError
from tests.launch.test_config_errors import launch_errors


@pytest.mark.parametrize(
    "original, usable, experts, want",
    [
        # world, ep, accum       usable  experts  -> world, ep, accum
        ((2, 2, 1), 1, 4, (1, 1, 2)),  # one host of two gone: EP must drop to 1
        ((4, 4, 1), 3, 8, (2, 2, 2)),  # 3 does not divide 4 micro-batches: 2 ranks
        ((6, 2, 1), 4, 4, (3, 1, 2)),  # 4 and 5 do not divide 6; EP 2 does not divide 3
        ((8, 8, 2), 6, 8, (4, 4, 4)),  # 16 micro-batches per step: 4 ranks x 4
        ((4, 2, 1), 4, 4, (4, 2, 1)),  # everything usable: the original layout
        ((4, 2, 1), 9, 4, (4, 2, 1)),  # more than configured: never grows past it
        ((6, 6, 1), 4, 12, (3, 3, 2)),  # EP lowered to the largest divisor of 12 and 3
    ],
)
def test_the_largest_world_that_keeps_the_global_batch(original, usable, experts, want):
    got = fitting_layout(Layout(*original), usable, experts, min_world_size=1, micro_batch_size=2)
    assert got == Layout(*want)
    assert 2 * got.grad_accum_steps * got.world_size == 2 * original[2] * original[0]


def test_none_fits_above_min_world_size():
    with pytest.raises(
        LaunchError,
        match=r"3 usable slot\(s\) of 4, and no world size from 3 "
        r"down to launch.min_world_size \(3\) keeps the global "
        r"batch of 8 sequences \(2 per micro-batch x 1 "
        r"accumulation step\(s\) x 4 ranks\): the world size "
        r"must divide 4",
    ):
        fitting_layout(Layout(4, 2, 1), 3, 4, min_world_size=3, micro_batch_size=2)
    with pytest.raises(
        LaunchError,
        match=r"1 usable slot\(s\) of 4, fewer than "
        r"launch.min_world_size \(2\)",
    ):
        fitting_layout(Layout(4, 2, 1), 1, 4, min_world_size=2, micro_batch_size=2)
    with pytest.raises(LaunchError, match=r"0 usable slot\(s\) of 2"):
        fitting_layout(Layout(2, 2, 1), 0, 4, min_world_size=1, micro_batch_size=2)


def hostfile_config(tmp_path, **launch) -> RunConfig:
    hosts = tmp_path / "hostfile"
    hosts.write_text("alpha slots=2\nbeta slots=2\n")
    return from_dict(
        RunConfig,
        {
            "name": "x",
            "output_dir": str(tmp_path / "runs"),
            "train": {"micro_batch_size": 2},
            "parallel": {"world_size": 4, "expert_parallel_size": 4},
            "model": {"moe": {"num_experts": 4}},
            "launch": {
                "scheduler": "hostfile",
                "elastic": True,
                "max_restarts": 2,
                "hostfile": {"path": str(hosts), "ssh_check": False},
                **launch,
            },
        },
    )


def test_a_host_that_ssh_cannot_reach_is_left_out_and_the_command_replanned(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(elastic, "reachable", lambda host: asked.append(host) or host == "alpha")
    replan = Elastic(hostfile_config(tmp_path), {})
    relaunch = replan()
    assert sorted(asked) == ["alpha", "beta"]
    assert relaunch.world_size == 2
    cmd = relaunch.command
    assert cmd[cmd.index("--include") + 1] == "alpha:0,1"
    assert cmd[-3:] == [
        "parallel.world_size=2",
        "parallel.expert_parallel_size=2",
        "train.grad_accum_steps=2",
    ]
    assert relaunch.note == (
        "elastic: host beta unreachable; resuming on 2 rank(s) (was 4), "
        "grad_accum 2 (was 1), expert_parallel_size 2 (was 4), same global "
        "batch of 8 sequences"
    )
    assert relaunch.record["elastic"]["global_batch"] == 8
    # Both hosts back at the next restart: the configured layout, no overrides, said so.
    monkeypatch.setattr(elastic, "reachable", lambda host: True)
    back = replan()
    assert back.world_size == 4 and back.command[-1].endswith("config.yaml")
    assert back.note.startswith("elastic: every slot usable again; resuming on 4 rank(s) (was 2)")
    assert replan().note is None  # unchanged since the last attempt


def test_the_test_channel_declares_slots_without_probing(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "reachable", lambda host: pytest.fail("probed " + host))
    answers = tmp_path / "usable.json"
    answers.write_text(json.dumps({"alpha": 1, "beta": 0}))
    monkeypatch.setenv(USABLE_SLOTS_ENV, str(answers))
    slots, why = usable_slots(hostfile_config(tmp_path), {})
    assert slots == {"alpha": [0]}
    assert why == ["alpha has 1 usable slot(s) of 2", "host beta unreachable"]


def test_below_min_world_size_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "reachable", lambda host: host == "alpha")
    with pytest.raises(
        LaunchError,
        match=r"2 usable slot\(s\) of 4, fewer than "
        r"launch.min_world_size \(3\)",
    ):
        Elastic(hostfile_config(tmp_path, min_world_size=3), {})()


def test_local_launches_count_the_gpus_nvidia_smi_lists(tmp_path, monkeypatch):
    cfg = from_dict(
        RunConfig,
        {
            "name": "x",
            "output_dir": str(tmp_path),
            "parallel": {"world_size": 2, "expert_parallel_size": 2},
            "launch": {"elastic": True},
        },
    )
    monkeypatch.setattr(elastic, "visible_gpus", lambda env: 1)
    assert usable_slots(cfg, {}) == ({"localhost": [0]}, ["localhost has 1 usable slot(s) of 2"])
    monkeypatch.setattr(elastic, "visible_gpus", lambda env: None)  # CPU: every slot
    assert usable_slots(cfg, {}) == ({"localhost": [0, 1]}, [])


def test_elastic_and_min_world_size_are_validated_by_name(tmp_path, capsys):
    # launch_errors plans for SLURM, where elastic does not apply.
    problems = launch_errors(
        tmp_path, capsys, "launch.elastic=true", "launch.min_world_size=0", "launch.elastik=true"
    )
    assert (
        "launch.elastic: the slurm scheduler does not resume on fewer ranks by itself "
        "(launch.elastic applies to local and hostfile launches); set elastic: false"
    ) in problems
    assert "launch.min_world_size: must be >= 1, got 0" in problems
    assert any(p.startswith("launch.elastik: unknown key") for p in problems)
    assert "launch.elastic: expected true or false, got 'maybe'" in launch_errors(
        tmp_path, capsys, "launch.elastic=maybe"
    )
    problems = launch_errors(
        tmp_path, capsys, "launch.min_world_size=3", "parallel.zero_stage=0", "launch.elastic=true"
    )
    assert "launch.min_world_size: 3 exceeds parallel.world_size (2)" in problems
    assert any(
        p.startswith("parallel.zero_stage: launch.elastic needs ZeRO stage 1 or 2")
        for p in problems
    ), problems


def fake_program(tmp_path, monkeypatch, name, body):
    """``name`` on PATH as a small shell script (the real one may be absent here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_the_ssh_probe_asks_without_a_prompt_and_a_connect_timeout(tmp_path, monkeypatch):
    log = tmp_path / "ssh.log"
    fake_program(
        tmp_path, monkeypatch, "ssh", f'echo "$@" >> {log}\n[ "$7" = alpha ] || exit 255\n'
    )
    assert elastic.reachable("alpha", timeout=3) and not elastic.reachable("beta", timeout=3)
    assert log.read_text().splitlines()[0] == (
        "-o PasswordAuthentication=no -o BatchMode=yes -o ConnectTimeout=3 alpha true"
    )


def test_visible_gpus_counts_nvidia_smi_within_cuda_visible_devices(tmp_path, monkeypatch):
    fake_program(
        tmp_path,
        monkeypatch,
        "nvidia-smi",
        'echo "GPU 0: NVIDIA H100 (UUID: GPU-a)"\necho "GPU 1: NVIDIA H100 (UUID: GPU-b)"\n',
    )
    assert elastic.visible_gpus({}) == 2
    assert elastic.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert elastic.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None  # a CPU run
