"""Quality experiment: a dense baseline against an MoE model with the same active parameters,
and two positional encodings, trained on the same tokens of the demo corpus.

Single process, plain PyTorch AdamW over the single-device model (the model code the DeepSpeed
trainer runs), the same sample order for every run (the streaming reader with one seed), the
learning-rate schedule of the trainer, and the validation loss measured on the same held-out
tokens at fixed intervals. Not a test: it takes minutes and its results go to BENCHMARKS.md.

    python -m launch.prepare configs/default.yaml      # data/stdlib, once
    python -m benchmarks.quality_experiment --steps 300 --out quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import torch

from data_pipeline.reader import PackedReader
from data_pipeline.shards import read_manifest
from moe.config.run import TrainConfig
from moe.evaluation.evaluate import evaluate_perplexity
from moe.model.moe_layer import MoEConfig
from moe.model.router import RouterConfig
from moe.model.size import count_parameters
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.trainer import lr_lambda


def base_model(vocab: int, seq_len: int) -> ModelConfig:
    """8 SwiGLU experts of width 128, top-2: active FFN width 256 per layer."""
    return ModelConfig(
        vocab_size=vocab,
        d_model=128,
        n_layers=4,
        n_heads=4,
        max_seq_len=seq_len,
        moe=MoEConfig(
            num_experts=8, expert_hidden=128, router=RouterConfig(top_k=2, aux_loss_coef=0.01)
        ),
    )


def runs(vocab: int, seq_len: int) -> dict[str, ModelConfig]:
    moe = base_model(vocab, seq_len)
    return {
        "dense_rope": replace(moe, ffn="dense"),  # FFN width 2 * 128: same active parameters
        "moe_rope": moe,
        "moe_alibi": replace(moe, position="alibi"),
    }


def train_one(cfg: ModelConfig, args, train_cfg) -> dict:
    torch.manual_seed(args.seed)
    model = MoETransformer(cfg)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": train_cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=train_cfg.lr,
        betas=(train_cfg.beta1, train_cfg.beta2),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(_RunView(train_cfg)))
    reader = PackedReader(args.data_dir, args.seq_len, args.data_seed, 0, 1, args.batch_size)
    curve, train_losses, t0 = [], [], time.time()

    def validate(step: int) -> None:
        model.eval()
        r = evaluate_perplexity(model, args.data_dir, args.seq_len, 16, args.valid_tokens)
        model.train()
        curve.append(
            {"step": step, "tokens": step * args.batch_size * args.seq_len, "valid_loss": r["loss"]}
        )
        print(
            f"  step {step:4d}  valid loss {r['loss']:.4f}  ({time.time() - t0:.0f}s)", flush=True
        )

    validate(0)
    for step in range(1, args.steps + 1):
        (batch,) = reader.micro_batches(1)
        out = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()
        sched.step()
        train_losses.append(out.lm_loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            validate(step)
    counts = count_parameters(cfg)
    return {
        "total_params": counts.total_params,
        "active_params": counts.active_params,
        "curve": curve,
        "final_train_loss_last20": sum(train_losses[-20:]) / 20,
        "seconds": round(time.time() - t0, 1),
    }


class _RunView:
    """lr_lambda reads cfg.train only."""

    def __init__(self, train_cfg: TrainConfig):
        self.train = train_cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default="data/stdlib")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--valid-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0, help="model initialization seed")
    p.add_argument("--data-seed", type=int, default=1234, help="sample order seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", help="run only these configurations")
    p.add_argument("--out", default="quality_experiment.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = int(read_manifest(args.data_dir).tokenizer["vocab_size"])
    train_cfg = TrainConfig(
        max_steps=args.steps, lr=3e-3, min_lr=3e-4, warmup_steps=max(1, args.steps // 15)
    )
    results = {"args": vars(args), "uniform_loss": math.log(vocab), "runs": {}}
    for name, cfg in runs(vocab, args.seq_len).items():
        if args.only and name not in args.only:
            continue
        print(
            f"{name}: training {args.steps} steps of {args.batch_size} x {args.seq_len} tokens",
            flush=True,
        )
        results["runs"][name] = train_one(cfg, args, train_cfg)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    steps = [c["step"] for c in next(iter(results["runs"].values()))["curve"]]
    print("\n| step | tokens | " + " | ".join(results["runs"]) + " |")
    print("|---" * (len(results["runs"]) + 2) + "|")
    for i, step in enumerate(steps):
        vals = [f"{r['curve'][i]['valid_loss']:.3f}" for r in results["runs"].values()]
        print(f"| {step} | {step * args.batch_size * args.seq_len:,} | " + " | ".join(vals) + " |")
    for name, r in results["runs"].items():
        print(
            f"{name}: {r['active_params']:,} active / {r['total_params']:,} total parameters, "
            f"{r['seconds']}s"
        )


if __name__ == "__main__":
    main()
