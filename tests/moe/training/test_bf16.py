"""bf16 mixed precision through the real trainer on 2 ranks (gloo, DeepSpeed's CPU accelerator,
ZeRO 2, expert parallelism 2): the loss curve follows fp32's from the same initial weights, a
killed and resumed run repeats the uninterrupted one exactly, the expert all-to-all moves bf16
activations, and the checkpoints evaluate and export like fp32 ones with the fp32 master weights.

Three runs of 30 steps share one module fixture (one to two minutes on 2 shared cores): fp32,
bf16, and bf16 killed after its step-10 checkpoint then resumed; and 11 steps of bf16 at ZeRO
stage 1 (DeepSpeed's BF16_Optimizer) whose checkpoint is resumed on another layout."""

import copy
import json
import math
import os
import signal

import pytest
import torch
import torch.multiprocessing

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

STEPS = 30
KILL_AFTER = 12  # the newest complete checkpoint is then step 10


def run_dict(tiny_data, runs, name, precision):
    d = tiny_run_dict(tiny_data, runs, max_steps=STEPS, precision=precision)
    d["name"] = name
    d["logging"] = {"log_every": 1, "tensorboard": False}
    d["checkpoint"] = {"every_n_steps": 10}
    return d


def _record_all_to_all(rank, out_file):
    """Record the dtype and width of every tensor the expert all-to-all sends."""
    from moe.model import dispatcher

    original = dispatcher._AllToAll.apply
    seen = set()

    def apply(x, *args):
        seen.add((str(x.dtype), x.shape[-1]))
        with open(out_file, "w") as f:
            json.dump(sorted(seen), f)
        return original(x, *args)

    dispatcher._AllToAll.apply = apply


def _engine_dtypes(cfg_dict, env):
    from moe.training.trainer import build_engine, resolve_vocab

    engine, _ = build_engine(resolve_vocab(from_dict(RunConfig, copy.deepcopy(cfg_dict))), env)
    opt = engine.optimizer
    return {
        "optimizer": type(opt).__name__,
        "bit16": str(opt.dtype),
        "grad_accum": str(opt.gradient_accumulation_dtype),
        "communication": str(engine.communication_data_type),
        "master": str(opt.single_partition_of_fp32_groups[0].dtype),
        "score_bias": str(engine.module.blocks[0].ffn.deepspeed_moe.router.score_bias.dtype),
        "lm_head": str(engine.module.lm_head.weight.dtype),
    }


def _train_worker(rank, world, cfg_dicts, out_dir):
    from moe.training.trainer import DistEnv, train

    env = DistEnv(rank, world, rank, world)
    _record_all_to_all(rank, f"{out_dir}/all_to_all_rank{rank}.json")
    bf16_reduced = copy.deepcopy(cfg_dicts[1])
    bf16_reduced["train"]["grad_reduce_dtype"] = "bf16"
    with open(f"{out_dir}/engine_rank{rank}.json", "w") as f:
        json.dump(
            {"fp32": _engine_dtypes(cfg_dicts[1], env), "bf16": _engine_dtypes(bf16_reduced, env)},
            f,
        )
    for d in cfg_dicts:
        train(from_dict(RunConfig, copy.deepcopy(d)), env)


def _killed_worker(rank, world, cfg_dict):
    from moe.training.resilience.faults import FaultInjector
    from moe.training.trainer import DistEnv, train

    class KillAfter(FaultInjector):
        def before_update(self, step, engine):  # step KILL_AFTER ended, saves included
            if step == KILL_AFTER + 1:
                os.kill(os.getpid(), signal.SIGKILL)

    train(
        from_dict(RunConfig, copy.deepcopy(cfg_dict)),
        DistEnv(rank, world, rank, world),
        faults=KillAfter(),
    )


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    fp32 = run_dict(tiny_data, out / "runs", "fp32", "fp32")
    bf16 = run_dict(tiny_data, out / "runs", "bf16", "bf16")
    resumed = run_dict(tiny_data, out / "runs", "resumed", "bf16")
    # ZeRO stage 1 (the large presets' setting): DeepSpeed then uses its BF16_Optimizer.
    zero1 = run_dict(tiny_data, out / "runs", "bf16_zero1", "bf16")
    zero1["train"]["max_steps"] = 11
    zero1["parallel"]["zero_stage"] = 1
    with pytest.raises(torch.multiprocessing.ProcessExitedException):
        run_distributed(_killed_worker, 2, resumed)
    run_distributed(_train_worker, 2, [fp32, bf16, resumed, zero1], str(out))
    return out


def _losses(run_dir, rank):
    """{step: loss} from the step record; a resumed run's later lines replace earlier ones."""
    out = {}
    for line in (run_dir / "logs" / f"steps_rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def test_deepspeed_runs_bf16_with_fp32_master_weights_and_fp32_gradient_reduction(runs):
    common = {
        "optimizer": "DeepSpeedZeroOptimizer",
        "bit16": "torch.bfloat16",
        "master": "torch.float32",
        "score_bias": "torch.float32",
        "lm_head": "torch.bfloat16",
    }
    for rank in range(2):
        by_reduce_dtype = json.loads((runs / f"engine_rank{rank}.json").read_text())
        for reduce, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
            assert by_reduce_dtype[reduce] == {
                **common,
                "grad_accum": dtype,
                "communication": dtype,
            }


def test_expert_all_to_all_moves_bf16_activations(runs):
    for rank in range(2):
        sent = {tuple(x) for x in json.loads((runs / f"all_to_all_rank{rank}.json").read_text())}
        # token activations (width d_model = 64) in bf16 and their combine weights (width 1) in
        # fp32, from the bf16 runs; the fp32 run sent fp32 activations.
        assert sent == {("torch.bfloat16", 64), ("torch.float32", 1), ("torch.float32", 64)}


def test_killed_bf16_run_resumes_exactly(runs):
    for rank in range(2):
        uninterrupted, resumed = (
            _losses(runs / "runs" / "bf16", rank),
            _losses(runs / "runs" / "resumed", rank),
        )
        assert sorted(resumed) == list(range(1, STEPS + 1))
        assert resumed == uninterrupted  # bitwise: floats compared exactly


def _fixed_batch(tiny_data, rows=64):
    """The first validation windows: (inputs, targets), 64 x 32 tokens."""
    from data_pipeline.token_stream import validation_windows

    windows = list(
        validation_windows(tiny_data.dir, tiny_data.seq_len, rows * (tiny_data.seq_len + 1))
    )
    ids = torch.stack([w for w, _ in windows[:rows]])
    return ids[:, :-1], ids[:, 1:]


def _routing(model, ids):
    """Each MoE layer's selected experts (T, K), sorted per token, from one forward."""
    from moe.model.router import TopKRouter

    picked = []
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out: picked.append(out.indices_TK.sort(-1).values)
        )
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return picked, logits


def _slot_agreement(a, b):
    """Fraction of (token, k) slots of ``a`` whose expert is also among the token's experts in
    ``b``, over all MoE layers."""
    same = sum((x[:, :, None] == y[:, None, :]).any(-1).sum().item() for x, y in zip(a, b))
    return same / sum(x.numel() for x in a)


U = 2.0**-8
"""bf16 unit roundoff: 8 significant bits, round to nearest, relative error at most 2^-8."""
ROUNDINGS = 43
"""bf16 roundings on the path from a token to a logit in the tiny config (2 layers): per layer 7
in attention (norm output, q, k, v, attention output, o_proj, residual add) and 6 in the MoE
layer (norm output, expert input projection, activation, expert output, combine sum, residual
add); the embedding, the final norm and the head: 26 + 3 = 29 rounded activations; and the 14
weight matrices the forward reads rounded from their fp32 masters (q, k, v, o, expert in, out
per layer; embedding and head)."""


def derived_tolerances(fp32_losses, sensitivity, tokens_per_step):
    """How far the bf16 loss curve may sit from the fp32 one at each step, from bf16's precision.

    - Forward. Each rounding perturbs a value by a relative error uniform in [-U, U] (rms
      U/sqrt(3)); independent roundings add in quadrature, so every logit carries a relative
      error of rms eps = sqrt(ROUNDINGS) * U / sqrt(3) (1.5%). A token's loss
      logsumexp(z) - z_y moves by sum_i (p_i - y_i) dz_i, of rms eps * sqrt(sum_i (p_i - y_i)^2
      z_i^2) with z centered on its p-weighted mean (the loss ignores a common shift):
      ``sensitivity`` is that root sum, averaged over the tokens of a fixed batch of the fp32
      model. The step loss averages ``tokens_per_step`` tokens with independent roundings: rms
      eps * sensitivity / sqrt(tokens). We allow 4 of these standard deviations. (The weight
      roundings are shared by all tokens; their effect on the mean loss is the first-order
      <grad L, dW>, smaller still: counting them like activation roundings over-covers them.)
    - Trajectory. From step 2 on the weights differ: each gradient carries the same relative
      error eps (the backward rounds as often), and every optimizer step's loss decrease is off
      by about eps of itself, so after step t the curves can have drifted by eps times the
      decrease so far, eps * (L_1 - L_t), taken in the worst case where all errors line up.
    The loss itself is computed in fp32 (a bf16 loss near 6 would be off by up to 0.016 alone).
    """
    eps = math.sqrt(ROUNDINGS) * U / math.sqrt(3)
    forward = 4 * eps * sensitivity / math.sqrt(tokens_per_step)
    return [forward + eps * max(0.0, fp32_losses[0] - loss) for loss in fp32_losses]


def _history(run_dir):
    return [h["loss"] for h in json.loads((run_dir / "train_summary.json").read_text())["history"]]


def test_bf16_loss_curve_and_expert_choices_follow_fp32(runs, tiny_data):
    from moe.evaluation.evaluate import load_model
    from moe.model.transformer import MoETransformer

    fp32_model, cfg, _ = load_model(runs / "runs" / "fp32")
    bf16_model, _, _ = load_model(runs / "runs" / "bf16")
    ids, targets = _fixed_batch(tiny_data)
    picked32, logits = _routing(fp32_model, ids)
    p = logits.double().softmax(-1)
    z_centered = logits.double() - (p * logits.double()).sum(-1, keepdim=True)
    dz = (p - torch.nn.functional.one_hot(targets, p.shape[-1])) * z_centered
    sensitivity = dz.pow(2).sum(-1).sqrt().mean().item()

    fp32, bf16 = _history(runs / "runs" / "fp32"), _history(runs / "runs" / "bf16")
    assert len(fp32) == len(bf16) == STEPS
    tokens = 2 * cfg.train.micro_batch_size * cfg.data.seq_len  # 2 ranks
    tol = derived_tolerances(fp32, sensitivity, tokens)
    diffs = [abs(a - b) for a, b in zip(fp32, bf16)]
    print(
        f"sensitivity {sensitivity:.3f}; max |bf16 - fp32| {max(diffs):.5f}; tolerance "
        f"{tol[0]:.4f} (step 1) to {tol[-1]:.4f} (step {STEPS})"
    )
    assert all(d <= t for d, t in zip(diffs, tol)), list(zip(diffs, tol))
    assert bf16[-1] < bf16[0] - 0.3  # it trains

    # The same weights run in fp32 and in bf16 (the routers see bf16 inputs) choose the same
    # experts: the final fp32 weights, and the initial weights both runs started from.
    picked_bf16, _ = _routing(copy.deepcopy(fp32_model).bfloat16(), ids)
    final = _slot_agreement(picked32, picked_bf16)
    torch.manual_seed(cfg.train.seed)  # as build_engine does
    initial = MoETransformer(cfg.model).eval()
    initial32, _ = _routing(initial, ids)
    initial16, _ = _routing(initial.bfloat16(), ids)
    at_start = _slot_agreement(initial32, initial16)
    # The two trained models are compared but not held to 99%: on this config that figure
    # measures how far 30 steps carry a bf16-sized change of the weights, not bf16 arithmetic.
    # fp32 training from the initial weights rounded to bf16 once (no bf16 arithmetic at all)
    # keeps 95.6-98.9% of slots over 5 seeds, as bf16 training does (95.6-99.1%); and computing
    # the router in bf16, a real bug, moves the trained pair by little while the final fp32
    # weights run in bf16 fall to 97.5-98.3% above (BENCHMARKS.md, "bf16 and expert choices").
    trained = _slot_agreement(picked32, _routing(bf16_model.bfloat16(), ids)[0])
    print(
        f"expert slots agreeing: initial weights {at_start:.4f}, final fp32 weights "
        f"{final:.4f}; bf16-trained vs fp32-trained {trained:.4f}"
    )
    # On the data as split by content (the split changed the training and validation documents)
    # this seed's final fp32 weights agree at 0.984 when run in bf16; with the router computed
    # in bf16 (the bug) at 0.969. 0.975 keeps both apart; 0.99 was set on the earlier split.
    assert at_start >= 0.99 and final >= 0.975


def _bf16_checkpoint(runs):
    from moe.checkpoint.files import resolve_checkpoint

    return resolve_checkpoint(runs / "runs" / "bf16")


def test_bf16_checkpoint_evaluates_its_fp32_master_weights(runs):
    from moe.checkpoint.consolidate import read_consolidated, read_layout_free
    from moe.evaluation.evaluate import EvalOptions, evaluate_checkpoint_dir, load_model

    tag_dir = _bf16_checkpoint(runs)
    saved, _ = read_consolidated(tag_dir)
    master = read_layout_free(tag_dir)["params"]
    assert saved["lm_head.weight"].dtype == torch.bfloat16  # what the forward used
    model, _, _ = load_model(tag_dir)
    state = model.state_dict()
    for name, value in master.items():
        assert torch.equal(state[name], value), name
    # The masters are not bf16 numbers: evaluation does not see the rounded copies.
    assert not torch.equal(master["lm_head.weight"].bfloat16().float(), master["lm_head.weight"])

    opts = EvalOptions(max_tokens=2000, device="cpu")
    ours, theirs = (
        evaluate_checkpoint_dir(runs / "runs" / name, opts) for name in ("bf16", "fp32")
    )
    assert ours["step"] == STEPS and len(ours["experts"]) == 2
    # The trained models differ as the loss curves do: within the step-30 tolerance's drift
    # term, eps * (L_1 - L_30) (validation averages many tokens, the forward term vanishes).
    fp32 = _history(runs / "runs" / "fp32")
    eps = math.sqrt(ROUNDINGS) * U / math.sqrt(3)
    print(
        f"validation loss: bf16 {ours['loss']:.5f}, fp32 {theirs['loss']:.5f}, allowed "
        f"{eps * (fp32[0] - fp32[-1]):.4f}"
    )
    assert abs(ours["loss"] - theirs["loss"]) <= eps * (fp32[0] - fp32[-1]), (
        ours["loss"],
        theirs["loss"],
    )


def test_bf16_checkpoint_exports_fp32_masters_and_to_hugging_face(runs, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from moe.checkpoint.consolidate import read_layout_free
    from moe.evaluation.evaluate import load_model
    from moe.tools.export import FP32_FILE, export_fp32, export_hf

    tag_dir = _bf16_checkpoint(runs)
    master = read_layout_free(tag_dir)["params"]
    exported = load_file(str(export_fp32(tag_dir, tmp_path / "fp32") / FP32_FILE))
    for name, value in master.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], value), name

    model, cfg, _ = load_model(tag_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(export_hf(tag_dir, tmp_path / "hf")), dtype=torch.float32
    ).eval()
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4
        )


def _converted_worker(rank, world, cfg_dict, tag_dir, out_file):
    """Resume a 2-rank bf16 checkpoint on 1 rank and record, right after loading, whether the
    engine's fp32 masters and bf16 weights are the checkpoint's masters."""
    from deepspeed.utils import safe_get_full_fp32_param

    from moe.checkpoint.consolidate import read_layout_free, single_device_name
    from moe.training import trainer

    original = trainer.resume_from

    def resume_from(engine, model, *args):
        client = original(engine, model, *args)
        saved = read_layout_free(tag_dir)["params"]
        wrong = []
        for name, p in model.named_parameters():
            want = saved[single_device_name(name)]
            if not (
                torch.equal(safe_get_full_fp32_param(p), want)
                and torch.equal(p.data, want.bfloat16())
            ):
                wrong.append(name)
        with open(out_file, "w") as f:
            json.dump({"checked": len(list(model.parameters())), "wrong": wrong}, f)
        return client

    trainer.resume_from = resume_from
    trainer.train(
        from_dict(RunConfig, copy.deepcopy(cfg_dict)),
        trainer.DistEnv(0, 1, 0, 1),
        resume=str(tag_dir),
    )


@pytest.mark.parametrize("source,zero_stage", [("bf16", 2), ("bf16_zero1", 1)])
def test_bf16_checkpoint_resumes_on_another_layout_with_its_fp32_masters(
    runs, tiny_data, source, zero_stage
):
    tag_dir = runs / "runs" / source / "checkpoints" / "step_0000010"
    name = f"converted_{source}"
    d = run_dict(tiny_data, runs / "runs", name, "bf16")
    d["train"].update(max_steps=11, grad_accum_steps=2)  # the same global batch of 4 sequences
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": zero_stage}
    run_distributed(_converted_worker, 1, d, tag_dir, str(runs / f"{name}.json"))
    result = json.loads((runs / f"{name}.json").read_text())
    assert result["checked"] > 10 and result["wrong"] == []
    step11 = _losses(runs / "runs" / name, 0)[11]
    two_ranks = sum(_losses(runs / "runs" / source, r)[11] for r in range(2)) / 2
    # The same bf16 weights and sequences: only the order of fp32 sums differs (a few fp32
    # roundings of a loss near 6 are ~1e-6; a bf16 rounding of the weights would be ~1e-3).
    assert abs(step11 - two_ranks) < 1e-5, (step11, two_ranks)
