"""The training loss on instruction data: each micro-batch's mean over its trained targets,
weighed so that a step's loss (and gradient) is the mean over every trained target of the step,
and the real trainer reports that loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.reader import IGNORE_INDEX, PackedReader
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.step import trained_token_weights
from tests.conftest import tiny_run_dict
from tests.data_pipeline.test_instruction import (
    corpus,  # noqa: F401 (a fixture)
    instruction_data,  # noqa: F401 (a fixture)
)
from tests.helpers.distributed import run_distributed


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(
        ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
    )


def test_micro_batches_are_weighed_by_their_trained_targets():
    model = _model()
    torch.manual_seed(1)
    inputs = [torch.randint(0, 64, (2, 12)) for _ in range(2)]
    targets = [torch.randint(0, 64, (2, 12)) for _ in range(2)]
    targets[0][:, :10] = IGNORE_INDEX  # 4 trained targets
    targets[1][0, :3] = IGNORE_INDEX  # 21 trained targets
    weights, total = trained_token_weights(targets, world_size=1, masked=True)
    assert total.item() == 25
    # What the engine does with accumulation: the mean of the micro-batches' losses.
    step = sum(w * model(x, y).lm_loss for x, y, w in zip(inputs, targets, weights)) / 2
    step.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # By hand: every trained target of the step counts once.
    logits = torch.cat([model(x).logits.flatten(0, 1) for x in inputs])
    want = (
        F.cross_entropy(
            logits,
            torch.cat([y.flatten() for y in targets]),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        / 25
    )
    want.backward()
    assert math.isclose(step.item(), want.item(), rel_tol=1e-6)
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    # The plain mean of the micro-batches' means is another number.
    plain = sum(model(x, y).lm_loss for x, y in zip(inputs, targets)) / 2
    assert not math.isclose(plain.item(), want.item(), rel_tol=1e-3)
    # Data without a loss mask: no weights, no count.
    assert trained_token_weights(targets, 1, masked=False) == ([None, None], None)


def _train(rank, world, cfg_dict, out_file):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, resolve_vocab, train

    cfg = resolve_vocab(from_dict(RunConfig, cfg_dict))
    summary = train(cfg, DistEnv(0, 1, 0, 1), resume="none")
    with open(out_file, "w") as f:
        json.dump(summary["history"], f)


@pytest.mark.multiprocess
def test_the_trainer_reports_the_loss_of_the_trained_tokens(instruction_data, tmp_path):  # noqa: F811
    d = tiny_run_dict(
        instruction_data, tmp_path / "runs", max_steps=1, grad_accum_steps=2, micro_batch_size=3
    )
    d["data"] = {
        "dir": instruction_data.dir,
        "seq_len": instruction_data.seq_len,
        "seed": instruction_data.seed,
        "sources": [
            {"name": "chat", "type": "instruction", "paths": instruction_data.sources[0].paths}
        ],
        "tokenizer": {"model_file": instruction_data.tokenizer.model_file, "vocab_size": 512},
        "valid_fraction": instruction_data.valid_fraction,
        "shard_tokens": 4096,
    }
    d["model"].update(max_seq_len=16, init_std=0.5)  # predictions far from uniform
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": 0}
    out = tmp_path / "history.json"
    run_distributed(_train, 1, d, str(out))
    (first,) = json.loads(out.read_text())
    # The same first step by hand: the initial weights, the step's micro-batches, the mean
    # over their trained targets.
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import resolve_vocab, seed_everything

    cfg = resolve_vocab(from_dict(RunConfig, d))
    seed_everything(cfg.train.seed)
    model = MoETransformer(cfg.model)
    reader = PackedReader(instruction_data.dir, 16, instruction_data.seed, micro_batch=3)
    total = count = every = 0.0
    with torch.no_grad():
        for b in reader.next_step(2):
            logits = model(b.tokens_BS[:, :-1]).logits.flatten(0, 1)
            total += F.cross_entropy(
                logits, b.targets_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            count += int((b.targets_BS != IGNORE_INDEX).sum())
            every += F.cross_entropy(logits, b.tokens_BS[:, 1:].flatten(), reduction="sum").item()
    assert 0 < count < 2 * 3 * 16
    assert math.isclose(first["lm_loss"], total / count, rel_tol=1e-4), (first, total / count)
    assert not math.isclose(first["lm_loss"], every / (2 * 3 * 16), rel_tol=1e-2)


def test_validation_during_training_reports_the_loss_of_the_trained_tokens(instruction_data):  # noqa: F811
    """The trainer's validation (padded batches over the validation windows) gives the loss and
    trained-token count that moe-eval's evaluation gives (itself checked by hand in
    tests/data_pipeline/test_instruction.py)."""
    from types import SimpleNamespace

    from data_pipeline.token_stream import validation_windows
    from moe.evaluation.evaluate import evaluate_perplexity
    from moe.training.hooks import ValidationMeter

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=4, max_seq_len=16, init_std=0.5)
    )
    engine = SimpleNamespace(
        module=model, device=torch.device("cpu"), eval=model.eval, train=model.train
    )
    windows = list(validation_windows(instruction_data.dir, 16))
    got = ValidationMeter(engine, 1, windows, 16, 3, 0, 1).evaluate()
    want = evaluate_perplexity(model, instruction_data.dir, 16, batch_size=3)
    assert got["tokens"] == want["tokens"] < want["positions"]
    assert math.isclose(got["loss"], want["loss"], rel_tol=1e-5)
