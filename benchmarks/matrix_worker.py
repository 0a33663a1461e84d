"""The settings matrix's worker process (``gpu_train_bench.py --serve``, see bench_worker.py) as
seen from the matrix: started on demand, one JSON task and one JSON answer per line, a time
limit on every answer, and ended (its whole process group) when it runs past it or when the
matrix stops; also the packages it needs, installed from the wheel folder when this Python
lacks them. Standard library only."""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_install import choose_wheels, import_check, install_wheels

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ["torch", "deepspeed", "yaml"]
START_TIMEOUT = 240.0
"""Seconds a starting worker may take to say hello (imports, CUDA, the process group)."""


def worker_env(site: Path | None) -> dict:
    env = dict(os.environ)
    paths = (
        ([str(site)] if site else [])
        + [str(ROOT)]
        + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    )
    env.update(PYTHONPATH=":".join(paths), PYTHONUNBUFFERED="1")
    return env


def ensure_packages(
    scratch: str | None, wheels: str | None, log_path: Path, deadline: float
) -> dict:
    """The worker's environment: SCRATCH/site first on PYTHONPATH, and in it the wheels of the
    folder (benchmarks/gpu_wheels.sh) whose packages this Python lacks, when it cannot import
    what the bench needs (a GPU machine without DeepSpeed). Without ``scratch``, a new
    temporary folder, made only when something is installed."""
    site = Path(scratch).resolve() / "site" if scratch else None
    env = worker_env(site)
    left = lambda: max(deadline - time.monotonic(), 5)
    found, _ = import_check(sys.executable, env, ROOT, left(), NEEDED)
    if found and all(v is not None for v, _ in found.values()):
        return env
    if site is None:
        site = Path(tempfile.mkdtemp(prefix="gpu_matrix_")) / "site"
        env = worker_env(site)
    folder = Path(wheels or os.environ.get("GPU_WHEELS") or ROOT / "gpu-wheels")
    with open(log_path, "a") as log:
        log.write(f"[matrix] installing into {site}\n")
        chosen = choose_wheels(folder, log)
        log.flush()
        install_wheels(
            sys.executable,
            site,
            chosen,
            log,
            lambda cmd, e: (
                subprocess.run(
                    cmd, env=e, stdout=log, stderr=subprocess.STDOUT, timeout=left()
                ).returncode
            ),
        )
    found, output = import_check(sys.executable, env, ROOT, left(), NEEDED)
    missing = [m for m, (v, _) in (found or {}).items() if v is None] if found else NEEDED
    if missing:
        raise RuntimeError(
            f"cannot import {', '.join(missing)} after installing the wheels of "
            f"{folder} ({output.strip()[-300:]})"
        )
    return env


class Worker:
    """``run(task, timeout)`` -> the worker's answer; an error when the worker died; None when
    no answer came in time (the worker is then ended). The next task starts a new worker."""

    def __init__(self, args, env: dict, log_path: Path, cmd: str | None = None):
        if cmd:
            self.cmd = shlex.split(cmd)
        else:
            self.cmd = [
                sys.executable,
                str(ROOT / "benchmarks" / "gpu_train_bench.py"),
                "--serve",
                "--device",
                args.device,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
            self.cmd += ["--tiny"] if args.tiny else []
            self.cmd += ["--peak-flops", str(args.peak_flops)] if args.peak_flops else []
        self.env = dict(env)
        if args.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.buffer, self.closed = b"", False
        self.hello: dict | None = None
        self.starts = self.failed_starts = 0

    def start(self, timeout: float) -> bool:
        if self.failed_starts >= 2:
            raise RuntimeError(f"the worker did not start, twice (see {self.log_path})")
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"[matrix] starting the worker: {shlex.join(self.cmd)}\n".encode())
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self.buffer, self.closed = b"", False
        until = time.monotonic() + timeout
        while (line := self.read_line(until)) is not None:
            try:
                hello = json.loads(line).get("hello")
            except (ValueError, AttributeError):
                continue
            if hello is not None:
                self.hello, self.failed_starts = hello, 0
                return True
        self.kill()
        self.failed_starts += 1
        return False

    def run(self, task: dict, timeout: float) -> dict | None:
        until = time.monotonic() + max(timeout, 1)
        if (self.proc is None or self.proc.poll() is not None) and not self.start(
            min(timeout, START_TIMEOUT)
        ):
            return None
        try:
            self.proc.stdin.write((json.dumps(task) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        while True:
            line = self.read_line(until)
            if line is None:
                rc = self.exit_status()
                self.kill()
                if rc is not None:
                    return {
                        "status": "error",
                        "reason": f"the worker died (exit status {rc}; see {self.log_path.name})",
                    }
                return None
            try:
                answer = json.loads(line)
            except ValueError:
                continue  # not an answer: nothing else should reach this pipe, but be safe
            if answer.get("id") == task.get("id"):
                return answer

    def read_line(self, until: float) -> str | None:
        """The worker's next line, or None at ``until`` or when it ended."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = until - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.closed = True
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def exit_status(self) -> int | None:
        """The worker's exit status when it has ended (its output closed), else None."""
        if self.proc.poll() is None and self.closed:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                return None
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def close(self) -> None:
        """Let the worker finish (its stdin closed), or end it after a few seconds."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
            self.proc = None
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
