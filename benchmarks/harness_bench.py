"""Requests per second of our lm-evaluation-harness model (moe-eval --tasks) against the
harness's own ``hf`` model on our Hugging Face export of the same weights, on the CPU.

Both score the same loglikelihood requests of the bundled multiple-choice task (few-shot
contexts shared by four answers each), in interleaved rounds; the ratio of the medians is
printed with the spread, and the largest difference of any request's log-likelihood:

    python benchmarks/harness_bench.py CHECKPOINT HF_EXPORT [--docs 100] [--rounds 3]
    python benchmarks/harness_bench.py --mixtral-like OUT_DIR --tokenizer-from HF_EXPORT

CHECKPOINT: any checkpoint (moe-eval reads it); HF_EXPORT: ``moe-export CHECKPOINT DIR
--format hf``. ``--mixtral-like`` first builds both from a random Mixtral-shaped model (8
experts, top-2, 1024 positions; the tokenizer of an export) through moe-import and moe-export,
a size at which contexts are long enough to share.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from moe.evaluation.harness import harness_model
from moe.training.lm_harness import load_tasks


def mixtral_like(out: Path, tokenizer_from: Path) -> tuple[Path, Path]:
    """A random Mixtral-shaped model as our checkpoint (moe-import) and as its export."""
    import transformers

    from launch.export import main as export_main
    from launch.import_hf import main as import_main

    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    cfg = transformers.MixtralConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(str(out / "source"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / "source" / name)
    import_main([str(out / "source"), str(out / "checkpoint")])
    export_main([str(out / "checkpoint"), str(out / "export"), "--format", "hf", "--quiet"])
    return out / "checkpoint", out / "export"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("hf_export", nargs="?")
    p.add_argument("--mixtral-like", type=Path, metavar="OUT_DIR")
    p.add_argument("--tokenizer-from", type=Path, metavar="HF_EXPORT")
    p.add_argument("--task", default="stdlib_sentence_mc")
    p.add_argument("--num-fewshot", type=int, default=3)
    p.add_argument("--docs", type=int, default=100, help="documents (x4 requests each)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.mixtral_like:
        args.checkpoint, args.hf_export = map(
            str, mixtral_like(args.mixtral_like, args.tokenizer_from)
        )
    from lm_eval.models.huggingface import HFLM

    task = load_tasks([args.task], num_fewshot=args.num_fewshot)["tasks"][args.task]
    task.build_all_requests(limit=args.docs, rank=0, world_size=1)
    reqs = task.instances
    models = {
        "ours": harness_model(args.checkpoint, batch_size=args.batch_size, device="cpu"),
        "hf": HFLM(
            pretrained=args.hf_export, device="cpu", batch_size=args.batch_size, dtype="float32"
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in models}
    answers = {}
    for _ in range(args.rounds):
        for name, lm in models.items():  # interleaved: load drifts hit both alike
            t0 = time.perf_counter()
            answers[name] = lm.loglikelihood(reqs, disable_tqdm=True)
            times[name].append(time.perf_counter() - t0)
    diff = max(abs(a[0] - b[0]) for a, b in zip(answers["ours"], answers["hf"]))
    tokens = sum(len(r.args[0]) + len(r.args[1]) for r in reqs)
    print(
        f"{len(reqs)} loglikelihood requests ({args.task}, {args.num_fewshot}-shot, "
        f"{tokens / len(reqs):.0f} characters each), batch {args.batch_size}, "
        f"{args.threads} thread(s), {args.rounds} interleaved rounds"
    )
    for name, ts in times.items():
        print(
            f"{name:>5}: median {statistics.median(ts):.2f} s ({len(reqs) / statistics.median(ts):.1f} "
            f"requests/s), rounds {', '.join(f'{t:.2f}' for t in ts)}"
        )
    ratios = [h / o for h, o in zip(times["hf"], times["ours"])]
    print(
        f"speed-up ours / hf: {statistics.median(times['hf']) / statistics.median(times['ours']):.2f}x "
        f"(per round {min(ratios):.2f}-{max(ratios):.2f}x); largest log-likelihood difference "
        f"{diff:.2e}"
    )


if __name__ == "__main__":
    main()
