"""Checkpoint benchmark (not a test): save and load times and size on disk of the tiny test
config (2 ranks, expert parallelism 2, ZeRO 2, gloo on CPU), against one plain ``torch.save`` /
``torch.load`` of the same tensors (weights and both Adam moments) measured in the same run.

A checkpoint save is every rank's DeepSpeed files plus RNG states, the expert fingerprints, two
barriers, the fsyncs and the marker; a load is the file checks, DeepSpeed's load and the
expert-fingerprint check. Also timed: DeepSpeed's own ``zero_to_fp32`` script and
``moe-export --format fp32`` on the same checkpoint.

    python benchmarks/checkpoint_bench.py [--steps 6]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from data_pipeline.prepare import prepare
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_data_config, tiny_run_dict, write_corpus
from tests.helpers.distributed import run_distributed


def _worker(rank, world, cfg_dict, resume, log_file):
    if rank == 0:
        logging.basicConfig(filename=log_file, level=logging.INFO, force=True)
    train(
        from_dict(RunConfig, copy.deepcopy(cfg_dict)),
        DistEnv(rank, world, rank, world),
        resume=resume,
    )


def _plain_save_load(tensors: dict, path: Path, rounds: int = 3) -> tuple[float, float]:
    save, load = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.save(tensors, path)
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path, weights_only=True)
        load.append(time.perf_counter() - t0)
    return min(save), min(load)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps; a save every 2")
    args = ap.parse_args()
    from moe.parallel.layout import read_layout_free
    from moe.tools.export import export_fp32

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root / "corpus")
        data = tiny_data_config(root)
        prepare(data, progress=False)
        cfg = tiny_run_dict(data, root / "runs", max_steps=args.steps)
        log_file = root / "rank0.log"
        run_distributed(_worker, 2, cfg, "none", str(log_file))
        ckpt_dir = from_dict(RunConfig, cfg).run_files.checkpoints
        tag_dir = ckpt_dir / f"step_{args.steps:07d}"
        cfg["train"]["max_steps"] = args.steps + 1
        run_distributed(_worker, 2, cfg, str(tag_dir), str(log_file))
        log = log_file.read_text()
        saves = [float(s) for s in re.findall(r"saved checkpoint \S+ in ([\d.]+)s", log)]
        loads = [float(s) for s in re.findall(r"\(loaded in ([\d.]+)s", log)]
        size = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())

        state = read_layout_free(tag_dir)
        tensors = {
            f"{k}/{n}": t for k in ("params", "exp_avg", "exp_avg_sq") for n, t in state[k].items()
        }
        plain_save, plain_load = _plain_save_load(tensors, root / "plain.pt")

        t0 = time.perf_counter()
        z = subprocess.run(
            [sys.executable, str(ckpt_dir / "zero_to_fp32.py"), str(ckpt_dir), str(root / "z2f")],
            capture_output=True,
            text=True,
        )
        zero_to_fp32_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        export_fp32(tag_dir, root / "export")
        export_s = time.perf_counter() - t0

    save_s, load_s = min(saves), min(loads)
    print(
        json.dumps(
            {
                "checkpoint_bytes": size,
                "save_s_min": round(save_s, 4),
                "save_s_all": saves,
                "load_s": round(load_s, 4),
                "plain_torch_save_s": round(plain_save, 4),
                "plain_torch_load_s": round(plain_load, 4),
                "save_ratio_to_plain": round(save_s / plain_save, 2),
                "load_ratio_to_plain": round(load_s / plain_load, 2),
                "zero_to_fp32_s (subprocess, incl. python start)": round(zero_to_fp32_s, 2),
                "zero_to_fp32_ok": z.returncode == 0,
                "moe_export_fp32_s": round(export_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
