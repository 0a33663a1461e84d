"""moe-eval: evaluate checkpoints on one process: perplexity, expert statistics, generation, and
a report (JSON, Markdown, PNG plots); or, with --tasks, downstream tasks of
lm-evaluation-harness. Several checkpoints give a table comparing them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from launch.cli import exits_cleanly, stops_cleanly
from moe.checkpoint.files import MAIN_STATES, MARKER, resolve_checkpoint
from moe.core.errors import CheckpointError, ConfigError, EvaluationError
from moe.core.run_dir import RunDir
from moe.evaluation.evaluate import EvalOptions, evaluate_checkpoint_dir
from moe.evaluation.harness import evaluate_checkpoint_tasks
from moe.evaluation.report import summary_table, write_report
from moe.model.generation import GenerationConfig
from moe.training.harness_setup import lm_eval_missing

EVAL_DIR = "eval"
TASKS_DIR = "eval-tasks"  # beside eval/: a tasks report does not replace the loss report


def run_checkpoints(path: str | Path) -> list[Path]:
    """Every checkpoint of a run directory (or of its checkpoints directory), oldest first."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such run directory")
    ckpt_dir = RunDir(path).checkpoints if RunDir(path).checkpoints.is_dir() else path
    found = [d for d in ckpt_dir.iterdir() if (d / MAIN_STATES).is_file()]
    complete = [d for d in found if (d / MARKER).is_file()]
    for d in sorted(set(found) - set(complete)):
        print(
            f"moe-eval: skipping {d}: incomplete checkpoint (no {MARKER}; its save was "
            "interrupted)",
            file=sys.stderr,
        )
    if not complete:
        raise CheckpointError(
            f"{path}: no complete checkpoints (directories holding {MARKER}) in {ckpt_dir}"
        )
    return sorted(complete, key=lambda d: (d.name.startswith("step_"), d.name))


def default_output(checkpoints: list[Path], name: str = EVAL_DIR) -> Path:
    if len(checkpoints) == 1:
        return checkpoints[0] / name
    runs = {c.parent.parent for c in checkpoints}
    if len(runs) == 1:
        return runs.pop() / name
    raise ConfigError(
        ["--output: the checkpoints belong to different runs; say where the report goes"],
        "moe-eval",
    )


def evaluate(
    checkpoints: list[str | Path],
    opts: EvalOptions,
    output: str | Path | None = None,
    all_of_run: bool = False,
) -> dict:
    """Evaluate each checkpoint and write the report; returns the results (as in eval.json)."""
    if all_of_run:
        tag_dirs = [c for path in checkpoints for c in run_checkpoints(path)]
    else:
        tag_dirs = [resolve_checkpoint(path) for path in checkpoints]  # every path checked first
    tag_dirs = list({d.resolve(): d for d in tag_dirs}.values())  # a checkpoint named twice: once
    report_name = TASKS_DIR if opts.tasks else EVAL_DIR
    out_dir = Path(output) if output else default_output(tag_dirs, report_name)
    if opts.tasks:  # every task, its data and its settings checked before any model loads
        from moe.training.lm_harness import load_tasks

        load_tasks(opts.tasks, opts.include_paths, opts.num_fewshot)
    results = {"data": None, "checkpoints": []}
    for tag_dir in tag_dirs:
        r = (
            evaluate_checkpoint_tasks(tag_dir, opts)
            if opts.tasks
            else evaluate_checkpoint_dir(tag_dir, opts)
        )
        results["checkpoints"].append(r)
        results["data"] = r.get("data")
    if output is None and not out_dir.parent.is_dir():
        # Writing the report would make the directory again: a checkpoint of nothing but eval/.
        raise CheckpointError(
            f"{out_dir.parent}: deleted during the evaluation (a run's checkpoint.keep_last "
            "removes older checkpoints); no report written (--output DIR puts it elsewhere)"
        )
    write_report(results, out_dir)
    return results


def evaluate_checkpoint(
    path: str, data_dir: str | None = None, max_tokens: int | None = None, output: str | None = None
) -> dict:
    """The evaluation moe-launch runs after training: one checkpoint, default settings. Returns
    its results with ``output`` (the JSON file) and ``report`` (the Markdown file)."""
    opts = EvalOptions(
        data_dir=data_dir,
        max_tokens=max_tokens,
        generation=default_generation(),
        fit_generation=True,  # settings nobody chose for this model: shortened to fit
    )
    results = evaluate([path], opts, output)
    return {
        **results["checkpoints"][0],
        "output": results["files"]["json"],
        "report": results["files"]["report"],
    }


def default_generation(strategies=("greedy", "sample", "beam"), **kw) -> list[GenerationConfig]:
    base = {"temperature": 0.8, "top_p": 0.95, "num_beams": 4, **kw}
    return [GenerationConfig(strategy=s, **base) for s in strategies]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="moe-eval", description=__doc__)
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="checkpoint directories, or run / checkpoints directories (their latest "
        "checkpoint; with --all every checkpoint)",
    )
    p.add_argument("--all", action="store_true", help="evaluate every checkpoint of the run(s)")
    p.add_argument(
        "--output",
        help="report directory (default: CHECKPOINT/eval, or RUN/eval for "
        "several checkpoints of one run; eval-tasks instead of eval with --tasks)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (or, off a terminal, no progress lines)",
    )
    _data_args(p)
    _expert_stat_args(p)
    _generation_args(p)
    _task_args(p)
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    args.given = {k for k, v in vars(args).items() if v != p.get_default(k)}
    return args


LOSS_ONLY = (
    *("data_dir", "split", "text", "tokenizer", "max_tokens"),
    *("no_expert_stats", "top_tokens", "min_token_count"),
    *("prompt", "num_prompts", "strategy", "no_generation", "max_new_tokens", "temperature"),
    *("top_k", "top_p", "num_beams", "num_return", "length_penalty"),
)
"""Flags of the loss evaluation, the expert statistics and the generations, which --tasks
replaces."""
TASKS_ONLY = ("num_fewshot", "limit", "include_path", "dtype")


def unused_flags(given: set[str], tasks: bool) -> list[str]:
    """Flags given that the evaluation asked for does not read: refused rather than ignored."""
    if tasks:
        return [
            f"--{k.replace('_', '-')}: not used with --tasks (it sets the loss evaluation, "
            "the expert statistics or the generations)"
            for k in LOSS_ONLY
            if k in given
        ]
    return [f"--{k.replace('_', '-')}: used only with --tasks" for k in TASKS_ONLY if k in given]


def _data_args(p: argparse.ArgumentParser) -> None:
    """What to evaluate on: the run's prepared data, another split or text files."""
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", help="prepared data to evaluate on (default: the run's)")
    d.add_argument("--split", default="valid", help="split of the prepared data (default: valid)")
    d.add_argument(
        "--text",
        nargs="+",
        metavar="FILE",
        help="evaluate on these text files instead, tokenized with the run's tokenizer",
    )
    d.add_argument("--tokenizer", help="SentencePiece model to use instead of the run's")
    d.add_argument("--max-tokens", type=int, help="predict at most this many tokens")
    d.add_argument(
        "--batch-size",
        type=int,
        help="sequences per forward (default: the training "
        "micro-batch for models that drop tokens)",
    )


def _expert_stat_args(p: argparse.ArgumentParser) -> None:
    """The per-expert load and preferred-token statistics."""
    s = p.add_argument_group("expert statistics")
    s.add_argument("--no-expert-stats", action="store_true")
    s.add_argument("--top-tokens", type=int, default=8, help="preferred tokens shown per expert")
    s.add_argument(
        "--min-token-count", type=int, default=5, help="rank only tokens seen at least this often"
    )


def _generation_args(p: argparse.ArgumentParser) -> None:
    """The sample generations: prompts, strategies and their settings."""
    g = p.add_argument_group("generation")
    g.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt to continue (repeatable; default: document starts of the data)",
    )
    g.add_argument("--num-prompts", type=int, default=3, help="prompts taken from the data")
    g.add_argument(
        "--strategy",
        nargs="+",
        choices=["greedy", "sample", "beam"],
        default=["greedy", "sample", "beam"],
    )
    g.add_argument("--no-generation", action="store_true")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--num-beams", type=int, default=4)
    g.add_argument("--num-return", type=int, default=1, help="samples / beams shown per prompt")
    g.add_argument("--length-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)


def _task_args(p: argparse.ArgumentParser) -> None:
    """Downstream tasks through lm-evaluation-harness."""
    t = p.add_argument_group(
        "downstream tasks (lm-evaluation-harness; pip install -c constraints.txt -e '.[eval]')"
    )
    t.add_argument(
        "--tasks",
        nargs="+",
        metavar="NAME",
        help="run these harness tasks instead of the loss, statistics and "
        "generations: the bundled stdlib_sentence_mc and stdlib_next_word, tasks "
        "of --include-path, or the harness's own (hellaswag, arc_easy, ...; their "
        "data is downloaded once); commas separate names too",
    )
    t.add_argument(
        "--num-fewshot",
        type=int,
        help="solved examples before each question (default: each task's own)",
    )
    t.add_argument("--limit", type=int, help="the first N examples of each task (default: all)")
    t.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of more task YAML files (repeatable)",
    )
    t.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="weights and activations for the tasks (default: fp32)",
    )


def options_from_args(args) -> EvalOptions:
    gens = (
        []
        if args.no_generation
        else [
            GenerationConfig(
                strategy=s,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                num_beams=args.num_beams,
                num_return=1 if s == "greedy" else args.num_return,
                length_penalty=args.length_penalty,
                seed=args.seed,
            )
            for s in args.strategy
        ]
    )
    problems = []
    for g in gens:  # name the command-line flag, not the config field
        problems += [
            "--" + key.replace("_", "-") + ":" + why
            for key, why in (p.split(":", 1) for p in g.problems())
        ]
    for name, least in (
        ("max_tokens", 1),
        ("batch_size", 1),
        ("min_token_count", 1),
        ("threads", 1),
        ("top_tokens", 0),
        ("num_prompts", 0),
        ("limit", 1),
        ("num_fewshot", 0),
    ):
        value = getattr(args, name)
        if value is not None and value < least:
            problems.append(f"--{name.replace('_', '-')}: must be >= {least}, got {value}")
    tasks = [n for item in args.tasks or [] for n in item.split(",") if n]
    if args.tasks is not None and not tasks:
        problems.append("--tasks: name at least one task")
    if args.device is not None:
        problems += device_problems(args.device)
    problems += unused_flags(getattr(args, "given", set()), args.tasks is not None)
    if problems:
        raise ConfigError(sorted(set(problems)), "moe-eval arguments")
    if tasks and (missing := lm_eval_missing()):
        raise EvaluationError(f"--tasks: {missing}")
    return EvalOptions(
        data_dir=args.data_dir,
        text_files=args.text or [],
        split=args.split,
        tokenizer_file=args.tokenizer,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        expert_stats=not args.no_expert_stats,
        top_tokens=args.top_tokens,
        min_token_count=args.min_token_count,
        prompts=args.prompt,
        data_prompts=args.num_prompts,
        generation=gens,
        device=args.device,
        progress=not args.quiet,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        include_paths=args.include_path,
        dtype=args.dtype,
        seed=args.seed,
    )


def device_problems(name: str) -> list[str]:
    """--device names cpu or a CUDA device that this machine has (checked before any model
    loads: torch would fail only when moving the weights)."""
    try:
        device = torch.device(name)
    except RuntimeError:  # a name torch does not know ("gpu")
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return [f"--device: {name!r} is not cpu, cuda or cuda:N"]
    if device.type == "cuda" and not torch.cuda.is_available():
        return [f"--device: {name}: no CUDA device is visible here (--device cpu runs on the CPU)"]
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return [f"--device: {name}: only {torch.cuda.device_count()} CUDA device(s) visible"]
    return []


@exits_cleanly
@stops_cleanly("moe-eval")  # the report's staging removed on the way out; an earlier one kept
def main(argv=None) -> None:
    eval_command(argv)


def eval_command(argv=None) -> None:
    args = parse_args(argv)
    options = options_from_args(args)  # every flag checked before anything else happens
    if args.threads:
        torch.set_num_threads(args.threads)
    results = evaluate(args.checkpoints, options, args.output, args.all)
    print(summary_table(results["checkpoints"]))
    last = results["checkpoints"][-1]
    for layer in last.get("experts") or []:
        top = ", ".join(f"e{e}:{t[0]['piece']}" for e, t in enumerate(layer["top_tokens"]) if t)
        print(
            f"block {layer['block']}: max/mean load {layer['max_over_mean_load']:.2f}, dropped "
            f"{layer['dropped_fraction']:.2%}, entropy {layer['router_entropy']:.3f}"
            f"/{layer['router_entropy_uniform']:.3f}; prefers {top}"
        )
    for g in (last.get("generations") or [])[:3]:
        print(f"{g['strategy']:>6}: {g['prompt_text']!r} -> {g['outputs'][0]['text']!r}")
    print(f"results  {results['files']['json']}\nreport   {results['files']['report']}")


if __name__ == "__main__":
    main()
