"""moe-eval: evaluate checkpoints on the validation split (token-weighted loss and perplexity)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from launch.cli import exits_cleanly
from moe.evaluation import evaluate_perplexity, load_model


def evaluate_checkpoint(path: str, data_dir: str | None = None, max_tokens: int | None = None,
                        output: str | None = None) -> dict:
    t0 = time.time()
    model, cfg, tag_dir = load_model(path)
    data_dir = data_dir or cfg.data.dir
    result = evaluate_perplexity(model, data_dir, cfg.data.seq_len, cfg.eval.batch_size,
                                 max_tokens if max_tokens is not None else cfg.eval.max_tokens)
    result.update({"checkpoint": str(tag_dir), "data_dir": str(data_dir),
                   "vocab_size": cfg.model.vocab_size,
                   "uniform_loss": math.log(cfg.model.vocab_size),
                   "seconds": round(time.time() - t0, 2)})
    out = Path(output) if output else tag_dir / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    result["output"] = str(out)
    return result


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-eval", description=__doc__)
    p.add_argument("checkpoint", help="a checkpoint tag directory, a checkpoints directory or a "
                                      "run directory (its latest checkpoint)")
    p.add_argument("--data-dir", help="prepared data to evaluate on (default: the run's)")
    p.add_argument("--max-tokens", type=int, help="evaluate at most this many tokens")
    p.add_argument("--output", help="where to write the JSON results (default: CHECKPOINT/eval.json)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = evaluate_checkpoint(args.checkpoint, args.data_dir, args.max_tokens, args.output)
    print(f"checkpoint  {r['checkpoint']}\n"
          f"tokens      {r['tokens']:,}\n"
          f"loss        {r['loss']:.4f} nats/token (uniform guess: {r['uniform_loss']:.4f})\n"
          f"perplexity  {r['perplexity']:.2f}\n"
          f"results     {r['output']}")


if __name__ == "__main__":
    main()
