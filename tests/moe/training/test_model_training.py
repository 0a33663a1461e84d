"""Every model option through the real trainer (DeepSpeed engine, ZeRO 2, checkpoint) and back
through the evaluation script; a dense run upcycled into an MoE run with ``model.init_from``."""

import copy
import json
import math

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.evaluation.evaluate import evaluate_perplexity, load_model
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

VARIANTS = {
    "alibi_layernorm_post_tied_gqa": {
        "position": "alibi",
        "norm": "layernorm",
        "norm_placement": "post",
        "tie_embeddings": True,
        "n_kv_heads": 2,
    },
    "t5_mqa_gelu": {
        "position": "t5",
        "n_kv_heads": 1,
        "t5_num_buckets": 8,
        "t5_max_distance": 24,
        "moe": {"num_experts": 4, "expert_hidden": 32, "activation": "gelu"},
    },
    "learned_shared_first_dense": {
        "position": "learned",
        "moe": {
            "num_experts": 4,
            "expert_hidden": 32,
            "num_shared_experts": 1,
            "first_dense_layers": 1,
        },
    },
    "sinusoidal_document_masked": {"position": "sinusoidal", "document_masking": True},
    "dense": {"ffn": "dense", "moe": {"dense_hidden": 64}},
    "upcycled": {
        "init_from": "@dense",
        "moe": {"num_experts": 4, "expert_hidden": 64, "router": {"top_k": 2, "renormalize": True}},
    },
}


def variant_dict(base: dict, name: str, runs_dir: str) -> dict:
    d = copy.deepcopy(base)
    d["name"] = name
    d["model"].update(copy.deepcopy(VARIANTS[name]))
    if d["model"].get("init_from") == "@dense":
        d["model"]["init_from"] = f"{runs_dir}/dense"
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": 0}
    d["train"].update(max_steps=8, micro_batch_size=8, lr=3e-3)
    return d


def _train_all(rank, world, base, runs_dir, ids):
    from moe.training.trainer import DistEnv, build_engine, resolve_vocab, train

    env = DistEnv(0, 1, 0, 1)
    for name in VARIANTS:
        cfg = resolve_vocab(from_dict(RunConfig, variant_dict(base, name, runs_dir)))
        if name == "upcycled":
            # The engine's model at step 0, before any update, as the trainer builds it.
            engine, _ = build_engine(cfg, env)
            engine.eval()
            with torch.no_grad():
                torch.save(engine(ids).logits, f"{runs_dir}/upcycled_step0_logits.pt")
        train(cfg, env)


def test_every_option_trains_checkpoints_and_evaluates(tiny_data, tmp_path):
    runs = tmp_path / "runs"
    base = tiny_run_dict(tiny_data, runs)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 32))
    run_distributed(_train_all, 1, base, str(runs), ids)

    losses = {
        name: [
            h["loss"]
            for h in json.loads((runs / name / "train_summary.json").read_text())["history"]
        ]
        for name in VARIANTS
    }
    for name, options in VARIANTS.items():
        assert all(math.isfinite(x) for x in losses[name]), (name, losses[name])
        if name != "upcycled":  # it starts trained; see below
            first, last = sum(losses[name][:3]) / 3, sum(losses[name][-3:]) / 3
            assert last < first - 0.05, (name, losses[name])
        model, cfg, _ = load_model(runs / name)
        for key, value in options.items():
            if key not in ("moe", "init_from"):
                assert getattr(cfg.model, key) == value
        result = evaluate_perplexity(model, tiny_data.dir, tiny_data.seq_len, max_tokens=2000)
        assert math.isfinite(result["loss"]) and result["loss"] < math.log(512) + 0.5, name

    # The upcycled run started as the dense run's final model: same logits at step 0.
    dense, _, _ = load_model(runs / "dense")
    with torch.no_grad():
        torch.testing.assert_close(
            torch.load(runs / "upcycled_step0_logits.pt", weights_only=True),
            dense(ids).logits,
            atol=1e-5,
            rtol=1e-5,
        )
    # Its first step starts from the dense run's progress, not from scratch.
    assert losses["upcycled"][0] < losses["dense"][0] - 0.3, losses
    upcycled, _, _ = load_model(runs / "upcycled")
    assert type(upcycled.blocks[0].ffn).__name__ == "MoELayer"
