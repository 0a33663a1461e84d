"""moe-prepare: build the tokenizer and tokenized Arrow shards described by a run config, or
verify prepared data (every shard against the manifest: schema, counts, SHA-256, token range).

On many machines sharing a file system: --tokenizer-only once, then --part i/N on each machine
(i = 0 .. N-1), then --merge once; the result is byte for byte that of one machine. On a SLURM
cluster --slurm-parts N submits the three steps as chained jobs (the parts as an array job),
with the config's launch.slurm settings; with --dry-run it prints them instead."""

from __future__ import annotations

import argparse

from data_pipeline.assemble import describe_empty
from data_pipeline.parts import merge_parts, prepare_part, prepare_tokenizer
from data_pipeline.prepare import prepare
from data_pipeline.verify import verify
from launch.cli import exits_cleanly, stops_cleanly

# The run config and the SLURM steps are imported in main(), not here: the preparation's worker
# processes are spawned, and each runs this module again as it starts. At the top, the run
# config's import of the model (torch) cost every worker seconds of CPU before its first
# document, more than tokenizing a 20 MB corpus.


@exits_cleanly
@stops_cleanly("moe-prepare")  # the pools stopped and the staging removed on the way out
def main(argv=None) -> None:
    prepare_command(argv)


def prepare_command(argv=None) -> None:
    p = _parser()
    args = p.parse_intermixed_args(argv)
    if args.verify == "" and not args.config:
        p.error("--verify needs a DATA_DIR or a config")
    if args.verify is not None and not args.config:
        summary = verify(args.verify, progress=not args.quiet)
        print(f"{args.verify}: ok; {summary}")
        return
    if not args.config:
        p.error("a config is needed (or --verify DATA_DIR)")
    if args.dry_run and args.slurm_parts is None:
        p.error("--dry-run goes with --slurm-parts")
    from moe.config.run import load_config

    cfg = load_config(args.config, args.overrides)
    if args.verify is not None:
        target = args.verify or cfg.data.dir
        summary = verify(target, progress=not args.quiet, s3=cfg.data.s3)
        print(f"{target}: ok; {summary}")
        return
    if args.slurm_parts is not None:
        from launch.slurm import prepare as prepare_slurm

        jobs = prepare_slurm.build(cfg, args.slurm_parts, force=args.force)
        if args.dry_run:
            print(jobs.render())
        else:
            print("\n".join(prepare_slurm.watch_lines(jobs, prepare_slurm.submit(cfg, jobs))))
        return
    if args.tokenizer_only:
        print(f"tokenizer: {prepare_tokenizer(cfg.data, progress=not args.quiet)}")
        return
    if args.part:
        print(
            f"part {args.part[0]}/{args.part[1]}: "
            f"{prepare_part(cfg.data, *args.part, progress=not args.quiet)}"
        )
        return
    build = merge_parts if args.merge else prepare
    _print_report(build(cfg.data, force=args.force, progress=not args.quiet))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-prepare", description=__doc__)
    p.add_argument(
        "config", nargs="?", help="run config (YAML); its data section says what to prepare"
    )
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.dir=data/mine")
    p.add_argument("--force", action="store_true", help="replace data prepared from another config")
    p.add_argument(
        "--verify",
        metavar="DATA_DIR",
        nargs="?",
        const="",
        help="check prepared data (a directory or s3://bucket/prefix) instead of "
        "preparing; with a config: its data.dir (if DATA_DIR is left out) "
        "and its data.s3 settings",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _step_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --slurm-parts: print the job scripts and sbatch commands only",
    )
    return p


def _step_args(p: argparse.ArgumentParser) -> None:
    """The steps of a preparation spread over many machines (at most one per command)."""
    steps = p.add_mutually_exclusive_group()
    steps.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="many machines, step 1: build the tokenizer into DATA_DIR.parts",
    )
    steps.add_argument(
        "--part",
        metavar="I/N",
        type=_part,
        help="many machines, step 2: prepare part I of N (0-based) with that tokenizer",
    )
    steps.add_argument(
        "--merge",
        action="store_true",
        help="many machines, step 3: write the shards and manifest from the parts",
    )
    steps.add_argument(
        "--slurm-parts",
        metavar="N",
        type=int,
        help="submit all three steps to SLURM: the tokenizer job, an array job "
        "of N parts, the merge job, each after the one before succeeded",
    )


def _print_report(report) -> None:
    """The prepared data's summary line, then per source its warnings and notes."""
    m = report.manifest
    verb = "already prepared" if report.skipped else f"prepared in {report.seconds:.1f}s"
    print(
        f"{report.data_dir}: {verb}; train {m.splits['train'].tokens:,} tokens in "
        f"{len(m.splits['train'].shards)} shards, valid {m.splits['valid'].tokens:,} tokens; "
        f"tokenizer {m.tokenizer['file']} ({m.tokenizer['vocab_size']} pieces)"
    )
    for s in m.sources:
        if s["invalid_utf8"]:
            print(
                f"warning: source {s['name']!r}: {s['invalid_utf8']} invalid UTF-8 sequences "
                "replaced with U+FFFD"
            )
        if s["empty_documents"]:
            files = s.get("empty_rows", {})
            where = "; ".join(
                describe_empty(path, entry) for path, entry in list(files.items())[:3]
            )
            more = f"; and {len(files) - 3} more files" if len(files) > 3 else ""
            print(
                f"note: source {s['name']!r}: {s['empty_documents']} empty documents skipped"
                f"{' (' + where + more + ')' if where else ''}"
            )
        if s.get("duplicates_dropped"):
            print(
                f"note: source {s['name']!r}: {s['duplicates_dropped']} duplicate documents "
                "dropped (data.dedup: exact)"
            )


def _part(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text}: I must be between 0 and N - 1")
    return index, count


if __name__ == "__main__":
    main()
