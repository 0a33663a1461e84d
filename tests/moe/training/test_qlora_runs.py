"""QLoRA through the real trainer (moe/model/adapters/qlora.py): from a checkpoint, only the LoRA
factors train while the base is held in NF4 (quantised from model.init_from and saved with the
checkpoint); a stopped run resumes bit for bit; a step on 2 expert-parallel ranks equals one
process; moe-eval reads the checkpoint and moe-export --merge-adapters writes the dequantised
base plus the LoRA update as a plain model."""

import copy
import json

import pytest
import torch

from moe.model.adapters.qlora import dequantize_nf4, quantize_nf4, torchao_missing
from moe.model.transformer import MoETransformer
from moe.weights.load import build_model, load_consolidated
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed
from tests.moe.training.test_finetune import (
    _losses,
    _merged,
    _train_worker,
    _worker,
    assert_same_training,
    run_config,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(torchao_missing() is not None, reason="needs torchao"),
]

TARGETS = ["attention.q", "attention.v", "experts"]


@pytest.fixture(scope="module")
def qlora_runs(tiny_data, tmp_path_factory):
    """A 2-step base run, then QLoRA from its checkpoint for 6 steps (checkpoints at 3 and 6),
    the same 6 steps at a vanishing learning rate, and steps 4-6 again resumed from step 3.
    One rank: the layouts are the business of the test below."""
    runs = tmp_path_factory.mktemp("qlora_runs") / "runs"

    def run(name, max_steps, **train):
        d = tiny_run_dict(tiny_data, runs, max_steps=max_steps, **train)
        d["name"] = name
        d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
        d["logging"]["tensorboard"] = False
        return d

    run_distributed(_train_worker, 1, run("base", 2), "auto")
    base_ckpt = runs / "base" / "checkpoints" / "step_0000002"

    def qlora_run(name, lr=2e-2):
        d = run(name, 6, lr=lr, min_lr=0.0, warmup_steps=1, grad_accum_steps=2)
        d["model"]["init_from"] = str(base_ckpt)
        d["checkpoint"] = {"every_n_steps": 3}
        d["finetune"] = {"method": "qlora", "lora": {"targets": TARGETS, "rank": 4}}
        return d

    run_distributed(_train_worker, 1, qlora_run("qlora"), "auto")
    run_distributed(_train_worker, 1, qlora_run("still", lr=1e-12), "auto")
    step3 = str(runs / "qlora" / "checkpoints" / "step_0000003")
    run_distributed(_train_worker, 1, qlora_run("resumed"), step3)
    # The same global batch on 2 ranks with expert parallelism 2, resumed from the 1-rank run.
    wide = qlora_run("wide")
    wide["train"]["grad_accum_steps"] = 1
    wide["parallel"] = {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 2}
    run_distributed(_train_worker, 2, wide, step3)
    return runs, base_ckpt


def test_qlora_run_trains_only_its_factors_on_an_nf4_base(qlora_runs):
    runs, base_ckpt = qlora_runs
    losses, still = _losses(runs / "qlora"), _losses(runs / "still")
    gain = {s: still[s] - losses[s] for s in losses}
    assert gain[1] == 0 and min(gain[s] for s in range(3, 7)) > 0, gain  # measured 0.02-0.09
    assert sum(gain[s] for s in range(4, 7)) / 3 > 0.03, gain

    base, _, _ = load_consolidated(base_ckpt)
    tuned, cfg, _ = load_consolidated(runs / "qlora")
    factors = {k for k in tuned if "lora_" in k}
    assert factors and all(tuned[k].abs().sum() > 0 for k in factors if "lora_B" in k)
    nf4 = {k for k in tuned if "_nf4_" in k}
    # Every attention projection and expert stack is held in NF4: no float copy is saved.
    quantised = {k.rsplit("_nf4_", 1)[0] for k in nf4}
    assert quantised == {
        f"blocks.{i}.{w}"
        for i in range(2)
        for w in (
            *(f"attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
            "ffn.experts.w_in",
            "ffn.experts.w_out",
        )
    }
    assert not quantised & tuned.keys()
    # The rest of the base is as the base checkpoint saved it, the NF4 base is the base's
    # weights quantised (one matrix at a time, as the test of the format checks).
    for key, value in tuned.items():
        if key in base:
            assert torch.equal(value, base[key]), key
    for name in quantised:
        w = base[name]
        stack = w if w.ndim == 3 else w[None]
        want = quantize_nf4(stack)
        for part, value in want.items():
            assert torch.equal(tuned[f"{name}_nf4_{part}"], value), (name, part)
        err = dequantize_nf4(*want.values(), stack.shape) - stack
        assert 0 < err.abs().max() < 0.2 * stack.abs().max(), name


def test_stopped_qlora_run_resumes_exactly(qlora_runs):
    runs, _ = qlora_runs
    losses, resumed = _losses(runs / "qlora"), _losses(runs / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == losses[step], step
    again, _, _ = load_consolidated(runs / "resumed")
    tuned, _, _ = load_consolidated(runs / "qlora")
    assert again.keys() == tuned.keys()
    for key, value in tuned.items():
        assert torch.equal(again[key], value), key


def test_qlora_run_resumes_on_another_layout(qlora_runs):
    """Saved on 1 rank, resumed on 2 with expert parallelism 2: each rank quantises its own
    experts from model.init_from again and gets the base the checkpoint holds."""
    from tests.moe.training.test_layout_resume import assert_losses_match, global_losses

    runs, _ = qlora_runs
    assert_losses_match(global_losses(runs / "wide", 2), _losses(runs / "qlora"), [4, 5, 6])
    wide, _, _ = load_consolidated(runs / "wide")
    tuned, _, _ = load_consolidated(runs / "qlora")
    assert wide.keys() == tuned.keys()
    for key, value in tuned.items():
        if "lora_" in key:
            torch.testing.assert_close(wide[key], value, rtol=1e-4, atol=1e-6, msg=key)
        else:  # the frozen base, NF4 parts included, bit for bit
            assert torch.equal(wide[key], value), key


def test_eval_and_merged_export_of_a_qlora_checkpoint(qlora_runs, tmp_path, capsys):
    from safetensors.torch import load_file

    from launch.evaluate import main as evaluate
    from launch.export import main as export
    from moe.config.run import load_config

    runs, base_ckpt = qlora_runs
    for run, ckpt in (("qlora", runs / "qlora"), ("base", base_ckpt)):
        evaluate(
            [
                str(ckpt),
                "--max-tokens",
                "2000",
                "--no-generation",
                "--no-expert-stats",
                "--output",
                str(tmp_path / f"eval-{run}"),
                "--quiet",
            ]
        )
    tuned_loss, base_loss = (
        json.loads((tmp_path / f"eval-{r}" / "eval.json").read_text())["checkpoints"][0]["loss"]
        for r in ("qlora", "base")
    )
    assert 0 < tuned_loss and tuned_loss != base_loss

    for extra in ([], ["--format", "adapters"]):  # the NF4 base has no fp32 fingerprint
        with pytest.raises(SystemExit) as e:
            export([str(runs / "qlora"), str(tmp_path / "plain"), "--quiet", *extra])
        assert e.value.code == 2 and "--merge-adapters" in capsys.readouterr().err
    export([str(runs / "qlora"), str(tmp_path / "plain"), "--quiet", "--merge-adapters"])
    cfg = load_config(tmp_path / "plain" / "run_config.yaml")
    assert cfg.finetune.method == "none"
    merged = load_file(tmp_path / "plain" / "model.safetensors")
    state, tuned_cfg, _ = load_consolidated(runs / "qlora")
    # The merged weight: the NF4 base's value plus the LoRA update, in the weight's layout.
    scale = tuned_cfg.finetune.lora.alpha / tuned_cfg.finetune.lora.rank
    q = "blocks.0.attn.q_proj"
    parts = [state[f"{q}.weight_nf4_{k}"] for k in ("codes", "scales", "factor", "mean")]
    base_q = dequantize_nf4(*parts, torch.Size((1, *merged[f"{q}.weight"].shape)))[0]
    want = base_q + scale * state[f"{q}.lora_B"] @ state[f"{q}.lora_A"]
    torch.testing.assert_close(merged[f"{q}.weight"], want, rtol=0, atol=1e-6)
    ex = "blocks.1.ffn.experts"
    parts = [state[f"{ex}.w_in_nf4_{k}"] for k in ("codes", "scales", "factor", "mean")]
    base_in = dequantize_nf4(*parts, merged[f"{ex}.w_in"].shape)
    want = base_in + scale * torch.bmm(state[f"{ex}.w_in_lora_A"], state[f"{ex}.w_in_lora_B"])
    torch.testing.assert_close(merged[f"{ex}.w_in"], want, rtol=0, atol=1e-6)
    # And the plain model computes what the QLoRA model computes.
    plain = MoETransformer(cfg.model)
    plain.load_state_dict(merged)
    adapted = build_model(tuned_cfg)
    adapted.load_state_dict(state)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            plain.eval()(ids).logits, adapted.eval()(ids).logits, rtol=0, atol=1e-5
        )


def test_qlora_on_two_expert_parallel_ranks_equals_one_process(tmp_path):
    """Each rank quantises only its own experts, one matrix at a time: the same NF4 base, so
    the same losses and LoRA updates as one process with the same global batch."""
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (2, 17)) for _ in range(2)]
    for world, accum in ((1, 2), (2, 1)):
        cfg = run_config(world, accum, ["attention.q", "experts"])
        cfg = copy.deepcopy(cfg)
        cfg["finetune"]["method"] = "qlora"
        cfg["finetune"]["lora"]["train_router"] = False
        run_distributed(_worker, world, [(f"q-w{world}", cfg)], batches, str(tmp_path))
    one, losses1, res1 = _merged(tmp_path, "q", 1)
    two, losses2, res2 = _merged(tmp_path, "q", 2)
    moved = assert_same_training(one, losses1, two, losses2)
    assert moved and all("lora_" in n for n in moved), moved
    assert {f"blocks.1.ffn.experts.w_in_lora_{f}[{e}]" for f in "AB" for e in range(4)} <= moved
    for res in (*res1, *res2):  # only the factors are optimized
        assert res["optimized"] == res["trainable"]
        assert res["trainable"] and all("lora_" in n for n in res["trainable"])
    # One rank holds the whole fp32 master copy: the factors' size, nothing of the base.
    assert res1[0]["partition_numel"] == res1[0]["trainable_numel"]
