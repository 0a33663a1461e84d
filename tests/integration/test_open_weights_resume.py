"""A 2-rank run with expert parallelism 2 that starts from open weights (``model.init_from:
hf:DIR``, a tiny random Mixtral made here): its first loss is the imported model's (not a random
initialization's), rank 1 is killed with SIGKILL, the same command resumes from the checkpoint,
and every step's loss and token ids equal those of the same run uninterrupted."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from moe.core.config_schema import to_dict
from moe.weights.hf import read_hf_model
from tests.integration.conftest import REFERENCE_STEPS, reference_dict
from tests.integration.launch_checks import finish, kill_rank_after, start_launch, steps
from tests.moe.test_hf_import import make_hf

pytestmark = pytest.mark.integration


def launch(config: Path) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return start_launch(config, env)


def test_a_two_rank_run_from_hf_weights_is_killed_and_resumes_exactly(tiny_data, tmp_path):
    hf_dir, hf = make_hf(
        tmp_path, "mixtral", vocab_size=tiny_data.tokenizer.vocab_size, num_hidden_layers=2
    )
    (hf_dir / "tokenizer.json").unlink()  # the data's own SentencePiece tokenizer is the model's
    with torch.no_grad():  # confident, wrong predictions: a loss no fresh model has
        hf.lm_head.weight.mul_(30)
    hf.save_pretrained(str(hf_dir), max_shard_size="40KB")
    _, model_cfg, _ = read_hf_model(hf_dir)
    configs = {}
    for name in ("reference", "killed"):
        d = reference_dict(tiny_data, tmp_path / "runs", name)
        d["model"] = {**to_dict(model_cfg), "init_from": f"hf:{hf_dir}", "max_seq_len": 64}
        d["launch"] = {"max_restarts": 0}
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(d))
    finish(launch(configs["reference"]))
    run_dir = tmp_path / "runs" / "killed"
    kill_rank_after(launch(configs["killed"]), run_dir, 3)
    assert max(steps(run_dir, 1)) < REFERENCE_STEPS
    assert "resumed from" in finish(launch(configs["killed"]))

    reference = tmp_path / "runs" / "reference"
    for rank in (0, 1):
        lines = (run_dir / "logs" / f"steps_rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, REFERENCE_STEPS + 1))
        want, got = steps(reference, rank), steps(run_dir, rank)
        for step in range(1, REFERENCE_STEPS + 1):
            assert got[step]["loss"] == want[step]["loss"], (rank, step)
            assert got[step]["tokens_sha256"] == want[step]["tokens_sha256"], (rank, step)
    # Step 1 starts from the imported weights: their sharpened head puts the loss far above
    # the log(V) of any fresh initialization (std 0.02).
    first = [steps(reference, r)[1]["loss"] for r in (0, 1)]
    assert all(f > math.log(tiny_data.tokenizer.vocab_size) + 2 for f in first), first
