"""Multi-node through DeepSpeed's runner and a hostfile (``HOST slots=N`` per line).

DeepSpeed starts remote ranks with pdsh over ssh, through a remote shell: the environment
variables it propagates come from the file named by ``DS_ENV_FILE`` (we write one into the run
directory), and values, the working directory and the script arguments pass through that shell
without full quoting. So this back end refuses any of those that a shell would interpret."""

from __future__ import annotations

import os
import re
import sys
from collections import OrderedDict
from pathlib import Path

from launch.run_plan import RESOLVED_CONFIG, SHELL_INERT, Plan
from moe.config.launch import PLAIN_NAME
from moe.config.run import RunConfig
from moe.core.errors import ConfigError, LaunchError

ENV_FILE = ".deepspeed_env"
HOST_LINE = re.compile(r"(\S+)\s+slots=(\d+)\Z")
# Inside the double quotes DeepSpeed puts around values with other characters, these still act.
DOUBLE_QUOTE_ACTIVE = re.compile(r'[$`"\\\n\r\0]')


def read_hostfile(path: str) -> OrderedDict[str, int]:
    """Hosts and slot counts, in file order; every bad line is reported with its number."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise LaunchError(f"hostfile {path}: cannot read it ({e.strerror})") from None
    hosts: OrderedDict[str, int] = OrderedDict()
    problems = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = HOST_LINE.match(line)
        if not m or not PLAIN_NAME.match(m.group(1)):
            problems.append(f"line {number}: {raw.strip()!r} is not 'HOSTNAME slots=N'")
        elif m.group(1) in hosts:
            problems.append(f"line {number}: host {m.group(1)!r} is listed twice")
        elif int(m.group(2)) < 1:
            problems.append(f"line {number}: {m.group(1)} needs at least 1 slot")
        else:
            hosts[m.group(1)] = int(m.group(2))
    if not hosts and not problems:
        problems.append("no 'HOSTNAME slots=N' line")
    if problems:
        raise LaunchError(f"hostfile {path}:\n" + "\n".join(f"  - {p}" for p in problems))
    return hosts


def parse_filter(text: str, hosts: dict[str, int], key: str) -> dict[str, list[int]]:
    """DeepSpeed's ``HOST[:SLOT,SLOT]@HOST`` syntax, checked against the hostfile."""
    out: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, _, slots_text = spec.partition(":")
        if host not in hosts:
            raise ConfigError(
                [
                    f"launch.hostfile.{key}: host {host!r} is not in the hostfile "
                    f"(hosts: {', '.join(hosts)})"
                ]
            )
        try:
            slots = (
                [int(s) for s in slots_text.split(",")] if slots_text else list(range(hosts[host]))
            )
        except ValueError:
            raise ConfigError(
                [f"launch.hostfile.{key}: {spec!r} is not HOST or HOST:SLOT[,SLOT...]"]
            ) from None
        bad = [s for s in slots if not 0 <= s < hosts[host]]
        if bad:
            raise ConfigError(
                [f"launch.hostfile.{key}: {host} has slots 0..{hosts[host] - 1}, not {bad}"]
            )
        out[host] = sorted(set(out.get(host, []) + slots))
    return out


def active_slots(hosts: dict[str, int], include: str, exclude: str) -> dict[str, list[int]]:
    if include:
        return parse_filter(include, hosts, "include")
    active = {h: list(range(n)) for h, n in hosts.items()}
    if exclude:
        for host, slots in parse_filter(exclude, hosts, "exclude").items():
            active[host] = [s for s in active[host] if s not in slots]
    return {h: s for h, s in active.items() if s}


def plan(cfg: RunConfig, run_dir: Path) -> Plan:
    h = cfg.launch.hostfile
    if h.path is None:
        raise ConfigError(
            [
                "launch.hostfile.path: the hostfile scheduler needs a hostfile "
                "('HOSTNAME slots=N' per line)"
            ]
        )
    active = active_slots(read_hostfile(h.path), h.include, h.exclude)
    n = sum(len(s) for s in active.values())
    problems = []
    if n != cfg.parallel.world_size:
        problems.append(
            f"parallel.world_size: {cfg.parallel.world_size} ranks requested, but "
            f"the hostfile {h.path} gives {n} slots after include/exclude"
        )
    for k, v in cfg.launch.env.items():
        if DOUBLE_QUOTE_ACTIVE.search(v):
            problems.append(
                f'launch.env.{k}: {v!r} holds $, `, ", \\ or a line break, which '
                f"DeepSpeed's runner would pass to a remote shell unquoted"
            )
    config_path = run_dir / RESOLVED_CONFIG
    for what, path in (("the run directory", config_path), ("the working directory", os.getcwd())):
        if not SHELL_INERT.match(str(path)):
            problems.append(
                f"{what} {str(path)!r}: DeepSpeed's runner passes it to a remote "
                f"shell unquoted; use a path of letters, digits and @%+=:,./-_"
            )
    if problems:
        raise ConfigError(problems)
    master = h.master_addr or next(iter(active))
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        h.path,
        "--master_addr",
        master,
        "--master_port",
        str(h.master_port),
    ]
    if h.include:
        cmd += ["--include", h.include]
    if h.exclude:
        cmd += ["--exclude", h.exclude]
    if not h.ssh_check:
        cmd.append("--no_ssh_check")
    cmd += [
        "--log_level",
        "warning",
        "--no_local_rank",
        "--module",
        "launch.rank",
        "--config",
        str(config_path),
    ]
    env = {"PYTHONUNBUFFERED": "1", **cfg.launch.env}
    env_file = "".join(f"{k}={v}\n" for k, v in env.items())
    return Plan(
        "hostfile",
        cmd,
        str(run_dir),
        n,
        nodes=len(active),
        env={**env, "DS_ENV_FILE": str(run_dir / ENV_FILE)},
        files={ENV_FILE: env_file},
        # Several hosts: DeepSpeed's runner starts them with pdsh over ssh.
        requires=["pdsh", "ssh"] if len(active) > 1 else [],
    )
