"""moe-export: export a checkpoint saved with any parallel layout, on one CPU process, as a
consolidated fp32 safetensors file, a Hugging Face transformers model directory, a one-rank
DeepSpeed checkpoint (what DeepSpeed's own zero_to_fp32 reads), or a LoRA fine-tune's adapters
(ours, or for the peft library)."""

from __future__ import annotations

import argparse
import sys

from launch.cli import exits_cleanly, stops_cleanly
from moe.checkpoint.files import resolve_checkpoint
from moe.tools.export import (
    export_adapters,
    export_deepspeed,
    export_fp32,
    export_hf,
    no_tokenizer_note,
    tokenizer_source,
)
from moe.tools.hf_support import TARGETS
from moe.tools.peft_export import export_peft


@exits_cleanly
@stops_cleanly("moe-export")
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-export", description=__doc__)
    p.add_argument(
        "checkpoint",
        help="a checkpoint directory, or a run directory (its newest complete checkpoint)",
    )
    p.add_argument("output", help="a new directory to write (never overwritten)")
    p.add_argument(
        "--format",
        choices=["fp32", "hf", "deepspeed", "adapters", "peft"],
        default="fp32",
        help="fp32: model.safetensors with our parameter names, the run config and "
        "the tokenizer; hf: config.json, safetensors and tokenizer for "
        "transformers' AutoModelForCausalLM / AutoTokenizer; deepspeed: the "
        "whole training state as a DeepSpeed checkpoint of one rank (expert "
        "parallelism 1), readable by DeepSpeed's zero_to_fp32 and resumable; "
        "needs the run's prepared data; adapters: a LoRA run's factors alone "
        "(adapter.safetensors, for finetune.lora.init_from); peft: a LoRA run's "
        "factors as adapter_config.json and adapter_model.safetensors for "
        "peft's PeftModel.from_pretrained on --base-hf",
    )
    p.add_argument(
        "--arch",
        choices=["auto", *TARGETS],
        default="auto",
        help="Hugging Face architecture (auto: the first of "
        f"{', '.join(TARGETS)} that holds the model exactly; a model none can "
        "hold is refused with every reason, see docs/checkpoints.md, Exporting)",
    )
    p.add_argument(
        "--base-hf",
        metavar="DIR",
        help="--format peft: the Hugging Face model the adapter goes onto, the "
        "--format hf export of the run's base (model.init_from); checked to "
        "hold exactly the base the adapters were trained on",
    )
    p.add_argument(
        "--merge-adapters",
        action="store_true",
        help="a fine-tuned checkpoint with LoRA adapters: fold them into the base "
        "weights and export the plain model (fp32 and hf; such a checkpoint is "
        "refused without it)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (or, off a terminal, no progress lines) while the "
        "checkpoint is read (fp32, hf, adapters and peft)",
    )
    args = p.parse_args(argv)
    progress = not args.quiet
    if args.format in ("deepspeed", "adapters", "peft") and args.merge_adapters:
        p.error("--merge-adapters goes with --format fp32 or hf")
    if args.format != "peft" and args.base_hf:
        p.error("--base-hf goes with --format peft")
    if args.format == "peft" and args.arch != "auto":
        p.error("--arch goes with --format hf (--format peft takes the architecture of --base-hf)")
    if args.format == "fp32":
        out = export_fp32(args.checkpoint, args.output, progress, args.merge_adapters)
    elif args.format == "deepspeed":
        out = export_deepspeed(args.checkpoint, args.output)
    elif args.format == "adapters":
        out = export_adapters(args.checkpoint, args.output, progress)
    elif args.format == "peft":
        out = export_peft(args.checkpoint, args.output, args.base_hf, progress)
    else:
        out = export_hf(args.checkpoint, args.output, args.arch, progress, args.merge_adapters)
    print(f"exported {args.checkpoint} -> {out} ({args.format})")
    tag_dir = resolve_checkpoint(args.checkpoint)
    if args.format in ("fp32", "hf") and tokenizer_source(tag_dir) is None:
        print(f"note: {no_tokenizer_note(tag_dir)}", file=sys.stderr)


if __name__ == "__main__":
    main()
