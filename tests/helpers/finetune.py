"""Fine-tuning runs for tests: a tiny pretrained base and a run fine-tuned from it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from data_pipeline.reader import PackedReader
from moe.checkpoint.consolidate import read_consolidated
from moe.checkpoint.files import find_latest
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.evaluation.evaluate import evaluate_perplexity, load_model
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed


def base_and_finetune(
    data, runs: Path, finetune: dict, pretrain: dict | None = None, **train
) -> tuple[dict, dict]:
    """Run configs: "base" (6 steps of pretraining at lr 3e-3, 2 ranks, expert parallelism 2,
    ZeRO 2, one shared expert; ``pretrain``: changes to its train section) and "ft"
    (``finetune`` from base's last checkpoint; ``train``: its train section's changes)."""
    base = tiny_run_dict(data, runs)
    base["name"] = "base"
    base["model"]["moe"]["num_shared_experts"] = 1
    base["train"].update(max_steps=6, micro_batch_size=4, lr=3e-3)
    ft = copy.deepcopy(base)
    base["train"].update(pretrain or {})
    ft["name"] = "ft"
    ft["model"]["init_from"] = str(runs / "base")
    ft["finetune"] = finetune
    ft["train"].update(train)
    return base, ft


def latest_weights(run_dir: Path) -> dict:
    """The single-device state dict of a run's newest checkpoint."""
    ckpt = run_dir / "checkpoints"
    return read_consolidated(ckpt / find_latest(ckpt))[0]


def trained_samples(data, steps: int = 8, per_step: int = 8) -> torch.Tensor:
    """The first samples of the training data, those of a fine-tuning run's first ``steps``
    steps of ``per_step`` samples (default: 2 ranks x micro-batch 4)."""
    return (
        PackedReader(data.dir, data.seq_len, data.seed, 0, 1, per_step * steps)
        .next_step(1)[0]
        .tokens_BS
    )


def losses_before_and_after(data, runs: Path, steps: int) -> tuple[dict, dict]:
    """The lm loss of "base" and "ft" in ``runs``: on the samples of ft's first ``steps`` steps
    (:func:`trained_samples`), and held out (the first 4,000 tokens of the valid split)."""
    samples = trained_samples(data, steps)
    trained, held_out = {}, {}
    for name in ("base", "ft"):
        model = load_model(runs / name)[0]
        with torch.no_grad():
            trained[name] = model(samples[:, :-1], samples[:, 1:]).lm_loss.item()
        held_out[name] = evaluate_perplexity(model, data.dir, data.seq_len, max_tokens=4000)["loss"]
    return trained, held_out


def train_measuring_start(rank, world, base, ft, data, out_file, steps: int = 8):
    """Pretrain, measure the fine-tuning run's loss at step 0 (its model as the trainer builds
    it, with its initial adapters) on the samples of its first ``steps`` steps, fine-tune."""
    from moe.training.trainer import DistEnv, build_engine, resolve_vocab, train

    env = DistEnv(rank, world, rank, world)
    train(from_dict(RunConfig, copy.deepcopy(base)), env)
    _, model = build_engine(resolve_vocab(from_dict(RunConfig, copy.deepcopy(ft))), env)
    samples = trained_samples(data, steps)
    model.eval()
    with torch.no_grad():
        start = model(samples[:, :-1], samples[:, 1:]).lm_loss
    torch.save(start, out_file)
    train(from_dict(RunConfig, copy.deepcopy(ft)), env)


def finetune_over_frozen_base(
    data, tmp_path: Path, finetune: dict, steps: int, **train
) -> tuple[set[str], float, float]:
    """Pretrain "base", fine-tune "ft" from it for ``steps`` steps (2 ranks, expert parallelism
    2, ZeRO 2), and check that every tensor of the base is bitwise unchanged. Returns the names
    of the tensors the fine-tuning added, and its loss on the samples of those steps at step 0
    and at the end."""
    runs = tmp_path / "runs"
    base, ft = base_and_finetune(data, runs, finetune, max_steps=steps, **train)
    run_distributed(train_measuring_start, 2, base, ft, data, str(tmp_path / "start.pt"), steps)
    before, after = latest_weights(runs / "base"), latest_weights(runs / "ft")
    for name, w in before.items():
        assert torch.equal(after[name], w), name
    samples = trained_samples(data, steps)
    with torch.no_grad():
        end = load_model(runs / "ft")[0](samples[:, :-1], samples[:, 1:]).lm_loss.item()
    start = torch.load(tmp_path / "start.pt", weights_only=True).item()
    return set(after) - set(before), start, end
