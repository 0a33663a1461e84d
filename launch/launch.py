"""moe-launch: prepare data, start (or print) the training ranks, and evaluate the result."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from data_pipeline.prepare import prepare
from launch.cli import exits_cleanly
from launch.evaluate import evaluate_checkpoint
from moe.errors import LaunchError
from moe.training.config import RunConfig, dump_config, load_config


@dataclass
class Plan:
    """What a launch will do, as data: printable with --dry-run, executed without a shell."""

    scheduler: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""

    def render(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.command)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_plan(cfg: RunConfig, config_path: str) -> Plan:
    n = cfg.parallel.world_size
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(n),
           "--master_port", str(free_port()), "--log_level", "warning", "--no_local_rank", "--module", "launch.train",
           "--config", config_path]
    return Plan("local", cmd, {"PYTHONUNBUFFERED": "1"}, str(cfg.run_dir))


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-launch", description=__doc__)
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=50")
    p.add_argument("--scheduler", choices=["local"], default="local")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--no-eval", action="store_true", help="skip evaluating the final checkpoint")
    args = p.parse_args(argv)

    cfg = load_config(args.config, args.overrides)
    run_dir = cfg.run_dir
    resolved = run_dir / "config.yaml"
    plan = local_plan(cfg, str(resolved))
    if args.dry_run:
        print(plan.render())
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved.write_text(dump_config(cfg))
    (run_dir / "plan.json").write_text(json.dumps(plan.__dict__, indent=2))

    report = prepare(cfg.data)
    print(f"data: {report.data_dir} ({'reused' if report.skipped else 'prepared'}, "
          f"{report.manifest.splits['train'].tokens:,} train tokens)", flush=True)
    print(f"launch: {plan.render()}", flush=True)
    import os

    rc = subprocess.call(plan.command, env={**os.environ, **plan.env})
    if rc != 0:
        raise LaunchError(f"training failed with exit code {rc}; per-rank logs in {run_dir / 'logs'}")
    summary = json.loads((run_dir / "train_summary.json").read_text())
    lines = [f"run directory   {run_dir}",
             f"tensorboard     tensorboard --logdir {run_dir / 'tensorboard'}",
             f"checkpoint      {summary['checkpoint']}"]
    if summary["history"] and summary["history"][0]["step"] == 1:
        lines.append(f"step-1 loss     {summary['history'][0]['loss']:.4f}")
    if not args.no_eval:
        r = evaluate_checkpoint(summary["checkpoint"])
        lines += [f"valid loss      {r['loss']:.4f} nats/token over {r['tokens']:,} tokens "
                  f"(uniform guess {r['uniform_loss']:.4f})",
                  f"perplexity      {r['perplexity']:.2f}",
                  f"evaluation      {r['output']}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
