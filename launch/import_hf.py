"""moe-import: a Hugging Face transformers model directory (config.json and safetensors weights,
one file or shards with their index) written as one of our checkpoints: Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, and the dense Llama, Mistral and Qwen2. What each carries and what is refused:
docs/open-weights.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.cli import exits_cleanly, stops_cleanly
from moe.tools.hf_import import TOKENIZER_FILES, import_hf
from moe.weights.hf import tokenizer_record


@exits_cleanly
@stops_cleanly("moe-import")
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-import", description=__doc__)
    p.add_argument("hf_dir", help="a local transformers model directory")
    p.add_argument("output", help="a new checkpoint directory to write (never overwritten)")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="the parallel section of the checkpoint's run config: expert "
        "parallelism N on N ranks (it must divide the number of experts)",
    )
    args = p.parse_args(argv)
    out = import_hf(args.hf_dir, args.output, args.expert_parallel_size)
    print(f"imported {args.hf_dir} -> {out}")
    if tokenizer_record(Path(args.hf_dir)) is None:
        print(
            f"note: {args.hf_dir} holds no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): "
            "the checkpoint has none, and its exports carry none; prepare a run's data with "
            "the model's own tokenizer (data.tokenizer.model_file)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
