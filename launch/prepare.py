"""moe-prepare: build the tokenizer and tokenized Arrow shards described by a run config."""

from __future__ import annotations

import argparse

from data_pipeline.prepare import prepare
from launch.cli import exits_cleanly
from moe.training.config import load_config


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-prepare", description=__doc__)
    p.add_argument("config", help="run config (YAML); its data section says what to prepare")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.dir=data/mine")
    p.add_argument("--force", action="store_true", help="replace data prepared from another config")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    report = prepare(cfg.data, force=args.force)
    m = report.manifest
    verb = "already prepared" if report.skipped else f"prepared in {report.seconds:.1f}s"
    print(f"{report.data_dir}: {verb}; train {m.splits['train'].tokens:,} tokens in "
          f"{len(m.splits['train'].shards)} shards, valid {m.splits['valid'].tokens:,} tokens; "
          f"tokenizer {m.tokenizer['file']} ({m.tokenizer['vocab_size']} pieces)")
    if report.invalid_utf8_bytes:
        print(f"warning: {report.invalid_utf8_bytes} invalid UTF-8 sequences were replaced")


if __name__ == "__main__":
    main()
