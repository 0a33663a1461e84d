"""Downstream tasks for moe-eval: our checkpoints as the lm-evaluation-harness model ``moe``
(registered with the harness when this module is imported) and the run of a list of tasks,
whose results (every metric with the harness's standard error) go into eval.json and report.md.

    lm_eval.simple_evaluate(model="moe", model_args="pretrained=runs/default", tasks=[...])

works too, in a program that imported this module.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from data_pipeline.tokenizer import Tokenizer
from moe.checkpoint.files import TOKENIZER_COPY
from moe.core.errors import EvaluationError
from moe.tools.export import HF_TOKENIZER_DIR
from moe.training.harness_setup import lm_eval_missing
from moe.weights.load import load_model

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def checkpoint_tokenizer(tag_dir: Path) -> Tokenizer:
    """The tokenizer a checkpoint was trained with (its copy of the run's), or an imported
    model's own (hf_tokenizer/: tokenizer.json, else tokenizer.model)."""
    for path in (
        tag_dir / TOKENIZER_COPY,
        tag_dir / HF_TOKENIZER_DIR / "tokenizer.json",
        tag_dir / HF_TOKENIZER_DIR / "tokenizer.model",
    ):
        if path.is_file():
            return Tokenizer(path)
    raise EvaluationError(
        f"{tag_dir}: no tokenizer ({TOKENIZER_COPY} or {HF_TOKENIZER_DIR}/); "
        "the harness needs one to turn the tasks' text into tokens"
    )


def _model_class():
    """The registered harness model, defined once the harness is known to be installed."""
    from lm_eval.api.registry import get_model, register_model

    from moe.training.lm_harness import HarnessLM

    try:
        return get_model("moe")
    except (KeyError, ValueError):
        pass

    @register_model("moe")
    class CheckpointLM(HarnessLM):
        """``pretrained``: a checkpoint of any expert-parallel layout, or a run directory (its
        newest); adapters are merged (LoRA) or kept (bottleneck, prompt, prefix) as moe-eval
        loads them. ``device``: cuda when present, else cpu; ``dtype``: float32 or bfloat16."""

        def __init__(
            self,
            pretrained: str,
            batch_size: int | str = 8,
            device: str | None = None,
            dtype: str = "float32",
            max_length: int | None = None,
            max_gen_toks: int = 256,
            prefix_token_id: int | None = None,
            seed: int = 1234,
            **unused,
        ):
            if unused:
                raise EvaluationError(
                    f"model arguments {sorted(unused)} are not supported by the moe model"
                )
            if str(dtype) not in DTYPES:
                raise EvaluationError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
            model, _, tag_dir = load_model(pretrained)
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model.to(device=device, dtype=DTYPES[str(dtype)])
            self.checkpoint = tag_dir
            super().__init__(
                model,
                checkpoint_tokenizer(tag_dir),
                int(batch_size),
                None if max_length is None else int(max_length),
                int(max_gen_toks),
                None if prefix_token_id is None else int(prefix_token_id),
                int(seed),
            )

    return CheckpointLM


def harness_model(checkpoint: str | Path, **model_args):
    """The registered ``moe`` harness model of a checkpoint."""
    missing = lm_eval_missing()
    if missing:
        raise EvaluationError(missing)
    return _model_class()(str(checkpoint), **model_args)


def task_results(results: dict) -> list[dict]:
    """One row per task and metric of the harness's results: value and standard error."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "filter": filt,
                    "value": float(value),
                    "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                    "samples": results.get("n-samples", {}).get(task, {}).get("effective"),
                    "num_fewshot": results.get("n-shot", {}).get(task),
                }
            )
    return rows


def run_tasks(
    lm,
    tasks: list[str],
    num_fewshot: int | None = None,
    limit: int | None = None,
    include_paths: list[str] = (),
    bootstrap_iters: int = 100000,
) -> dict:
    """Evaluate a harness model on ``tasks``; returns {"tasks": rows (task_results), "seconds",
    "settings"}."""
    from lm_eval.evaluator import evaluate

    from moe.training.lm_harness import load_tasks

    t0 = time.perf_counter()
    task_dict = load_tasks(tasks, include_paths, num_fewshot)
    results = evaluate(
        lm, task_dict, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False
    )
    return {
        "tasks": task_results(results),
        "seconds": round(time.perf_counter() - t0, 2),
        "settings": {
            "tasks": list(tasks),
            "num_fewshot": num_fewshot,
            "limit": limit,
            "batch_size": lm.batch_size,
            "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        },
    }


def evaluate_checkpoint_tasks(path: str | Path, opts) -> dict:
    """A checkpoint's results on ``opts.tasks`` (moe-eval --tasks), as one entry of eval.json."""
    from moe.evaluation.evaluate import checkpoint_step

    lm = harness_model(
        path, batch_size=opts.batch_size or 8, device=opts.device, dtype=opts.dtype, seed=opts.seed
    )
    tag_dir = lm.checkpoint
    out = run_tasks(lm, opts.tasks, opts.num_fewshot, opts.limit, opts.include_paths)
    return {
        "checkpoint": str(tag_dir),
        "tag": tag_dir.name,
        "step": checkpoint_step(tag_dir),
        "run_dir": str(tag_dir.parent.parent),
        "data": None,
        "downstream": out["tasks"],
        "settings": out["settings"],
        "seconds": out["seconds"],
    }
