"""Resuming on fewer ranks when a restart cannot have them all (``launch.elastic``).

Before each automatic restart (launch/restarts.py) moe-launch asks which slots are usable now:

- hostfile launches over several hosts: each host of the hostfile (after include/exclude) is
  reached the way DeepSpeed's runner reaches it, ``ssh HOST true`` with a short timeout; a host
  that does not answer has no usable slot. A one-host hostfile runs on this machine (DeepSpeed's
  runner starts it without ssh), like a local launch. The hostfile is read again, so a host
  removed from it counts as gone too;
- local launches: on a machine with NVIDIA GPUs, the GPUs ``nvidia-smi -L`` still lists (within
  ``CUDA_VISIBLE_DEVICES``); on CPU every slot stays usable.

With fewer usable slots than ``parallel.world_size``, the restart runs on the largest world size
that fits, keeps the global batch exactly (micro-batch x accumulation steps x ranks; the
accumulation steps grow by the ratio, which must be an integer), is at least
``launch.min_world_size`` and is divided by an expert-parallel size (the configured one, or the
largest smaller divisor of the number of experts and the new world size). The ranks get the new
layout as overrides and resume from the newest complete checkpoint, which loads on any layout
(moe/parallel/layout.py); the data stream continues at the same global sample.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from launch.restarts import Relaunch
from launch.schedulers import build_plan
from launch.schedulers.hostfile import active_slots, read_hostfile
from moe.config.run import RunConfig
from moe.core.errors import ConfigError, LaunchError

USABLE_SLOTS_ENV = "MOE_TEST_USABLE_SLOTS"
"""Test only: the path of a JSON object ``{HOST: N}`` that replaces the probe's answer for those
hosts (N usable slots, 0: unreachable; a local launch's host is ``localhost``), read at each
restart. Nothing in the project sets it; tests use it to declare a host gone without a network."""
PROBE_TIMEOUT_S = 10
LOCAL_HOST = "localhost"


@dataclass(frozen=True)
class Layout:
    world_size: int
    expert_parallel_size: int
    grad_accum_steps: int

    def overrides(self) -> list[str]:
        return [
            f"parallel.world_size={self.world_size}",
            f"parallel.expert_parallel_size={self.expert_parallel_size}",
            f"train.grad_accum_steps={self.grad_accum_steps}",
        ]


def layout_of(cfg: RunConfig) -> Layout:
    return Layout(
        cfg.parallel.world_size, cfg.parallel.expert_parallel_size, cfg.train.grad_accum_steps
    )


def fitting_layout(
    original: Layout, usable: int, num_experts: int, min_world_size: int, micro_batch_size: int
) -> Layout:
    """The layout to restart ``original`` on with ``usable`` slots: the largest world size no
    larger than both that keeps the global batch and is at least ``min_world_size``; the
    original expert-parallel size if it divides that world size, else the largest divisor of
    both the number of experts and the world size below it. LaunchError when none fits."""
    micro_steps = original.grad_accum_steps * original.world_size  # per optimizer step
    glob = micro_batch_size * micro_steps
    for world in range(min(usable, original.world_size), min_world_size - 1, -1):
        if micro_steps % world:
            continue
        ep = max(
            d
            for d in range(1, original.expert_parallel_size + 1)
            if num_experts % d == 0 and world % d == 0
        )
        return Layout(world, ep, micro_steps // world)
    have = f"{usable} usable slot(s) of {original.world_size}"
    if usable < min_world_size:
        raise LaunchError(f"elastic: {have}, fewer than launch.min_world_size ({min_world_size})")
    raise LaunchError(
        f"elastic: {have}, and no world size from {min(usable, original.world_size)} "
        f"down to launch.min_world_size ({min_world_size}) keeps the global batch "
        f"of {glob} sequences ({micro_batch_size} per micro-batch x "
        f"{original.grad_accum_steps} accumulation step(s) x {original.world_size} "
        f"ranks): the world size must divide {micro_steps}"
    )


def _test_answers() -> dict[str, int]:
    path = os.environ.get(USABLE_SLOTS_ENV)
    if not path:
        return {}
    with open(path) as f:
        return {str(k): int(v) for k, v in json.load(f).items()}


def reachable(host: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """``ssh HOST true`` as DeepSpeed's runner checks its first host: no password prompt, and
    a connect timeout so that a dead host costs seconds, not minutes. An argument list, no
    shell on this side; the host name passed the hostfile's plain-name check."""
    cmd = [
        "ssh",
        "-o",
        "PasswordAuthentication=no",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={int(timeout)}",
        host,
        "true",
    ]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout + 5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def visible_gpus(env: dict[str, str]) -> int | None:
    """GPUs ``nvidia-smi -L`` lists, within the run's ``CUDA_VISIBLE_DEVICES``; None on a
    machine without NVIDIA's driver tools or a run that hides every GPU (a CPU run)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if shutil.which("nvidia-smi") is None or visible in ("", "-1"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
        listed = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        listed = 0  # the driver no longer answers: no GPU can be used
    return listed if visible is None else min(listed, len(visible.split(",")))


def usable_slots(cfg: RunConfig, env: dict[str, str]) -> tuple[dict[str, list[int]], list[str]]:
    """Per host (in order), the slots a restart may use now; and why some are missing."""
    answers = _test_answers()
    if cfg.launch.scheduler == "local":
        slots = {LOCAL_HOST: list(range(cfg.parallel.world_size))}
        probe = {LOCAL_HOST: lambda: visible_gpus(env)}
    else:
        h = cfg.launch.hostfile
        try:
            slots = active_slots(read_hostfile(h.path), h.include, h.exclude)
        except ConfigError as e:
            raise LaunchError(
                f"elastic: the hostfile {h.path} no longer matches "
                f"launch.hostfile: {'; '.join(e.problems)}"
            ) from None
        # One host: DeepSpeed's runner starts it here, without ssh.
        probe = (
            {host: (lambda host=host: None if reachable(host) else 0) for host in slots}
            if len(slots) > 1
            else {}
        )
    pending = {host: fn for host, fn in probe.items() if host not in answers}
    with ThreadPoolExecutor(max_workers=max(1, len(pending))) as pool:
        found = dict(zip(pending, pool.map(lambda fn: fn(), pending.values())))
    out, why = {}, []
    for host, host_slots in slots.items():
        n = answers.get(host, found.get(host))
        if n is not None and n < len(host_slots):
            why.append(
                f"host {host} unreachable"
                if n == 0
                else f"{host} has {n} usable slot(s) of {len(host_slots)}"
            )
            host_slots = host_slots[:n]
        if host_slots:
            out[host] = host_slots
    return out, why


class Elastic:
    """The ``replan`` of :func:`launch.restarts.run_with_restarts` for a ``launch.elastic``
    run: the command for the next attempt, on the layout the usable slots allow."""

    def __init__(self, cfg: RunConfig, env: dict[str, str]):
        self.cfg, self.env = cfg, env
        self.original = self.current = layout_of(cfg)

    def __call__(self) -> Relaunch:
        cfg = self.cfg
        slots, why = usable_slots(cfg, self.env)
        usable = sum(len(s) for s in slots.values())
        layout = fitting_layout(
            self.original,
            usable,
            cfg.model.moe.num_experts,
            cfg.launch.min_world_size,
            cfg.train.micro_batch_size,
        )
        new = copy.deepcopy(cfg)
        new.parallel.world_size = layout.world_size
        new.parallel.expert_parallel_size = layout.expert_parallel_size
        new.train.grad_accum_steps = layout.grad_accum_steps
        if cfg.launch.scheduler == "hostfile":
            new.launch.hostfile.include = "@".join(
                f"{host}:{','.join(map(str, s))}"
                for host, s in first_slots(slots, layout.world_size)
            )
            new.launch.hostfile.exclude = ""
        command = build_plan(new).command
        if layout != self.original:
            command += layout.overrides()  # the ranks read them after the resolved config
        was, self.current = self.current, layout
        if layout == was:
            return Relaunch(command, layout.world_size)
        glob = cfg.train.micro_batch_size * layout.grad_accum_steps * layout.world_size
        ep = (
            f", expert_parallel_size {layout.expert_parallel_size} (was {was.expert_parallel_size})"
            if layout.expert_parallel_size != was.expert_parallel_size
            else ""
        )
        note = (
            f"elastic: {', '.join(why) or 'every slot usable again'}; resuming on "
            f"{layout.world_size} rank(s) (was {was.world_size}), grad_accum "
            f"{layout.grad_accum_steps} (was {was.grad_accum_steps}){ep}, same global batch "
            f"of {glob} sequences"
        )
        record = {
            "world_size": layout.world_size,
            "was_world_size": was.world_size,
            "grad_accum_steps": layout.grad_accum_steps,
            "expert_parallel_size": layout.expert_parallel_size,
            "global_batch": glob,
            "unusable": why,
        }
        return Relaunch(command, layout.world_size, note, {"elastic": record})


def first_slots(slots: dict[str, list[int]], n: int) -> list[tuple[str, list[int]]]:
    """The first ``n`` slots, host by host in hostfile order."""
    out = []
    for host, host_slots in slots.items():
        take = host_slots[: n - sum(len(s) for _, s in out)]
        if take:
            out.append((host, take))
    return out
