"""Downstream evaluation during training (``eval.downstream``): a small fixed set of examples of
lm-evaluation-harness tasks, scored at checkpoints or every N steps, their accuracy (and the
normalised accuracy where a task defines one) logged beside the loss.

It changes nothing about training: the model runs in eval mode without gradients, every random
number generator is restored afterwards, and nothing it computes reaches the weights, the
optimizer or the data stream; so the losses of a run with it are bitwise those of a run without
it, and a resumed run evaluates the same examples again.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from moe.config.run import RunConfig
from moe.core.errors import ConfigError
from moe.training.hooks import LoopPart

log = logging.getLogger("moe.train")

LOGGED_METRICS = ("acc", "acc_norm", "word_perplexity", "bits_per_byte")
"""The harness metrics logged to TensorBoard (those a task computes)."""


def downstream_due(cfg: RunConfig, step: int) -> bool:
    """Whether step ``step`` ends with a downstream evaluation: every eval.downstream
    every_n_steps (0: every checkpoint save) and the last step."""
    d = cfg.eval.downstream
    if not d.tasks:
        return False
    every = d.every_n_steps or cfg.checkpoint.every_n_steps
    return step == cfg.train.max_steps or bool(every and step % every == 0)


class DownstreamEvaluator(LoopPart):
    """Built once before the first step (the tasks, their examples and requests are checked
    then); :meth:`on_step_end` evaluates on the steps :func:`downstream_due` names that stand
    (once the guards decided: not a step that rolls back) and adds the scalars to the step
    state, which the reporters registered after it then write."""

    def __init__(
        self, engine, cfg: RunConfig, rank: int, world_size: int, tokenizer_file: str | Path
    ):
        from data_pipeline.tokenizer import Tokenizer
        from moe.training.lm_harness import HarnessLM, load_tasks

        d = cfg.eval.downstream
        self.cfg, self.engine, self.rank = cfg, engine, rank
        self.task_dict = load_tasks(d.tasks, d.include_path, d.num_fewshot)
        generation = sorted(
            n for n, t in self.task_dict["tasks"].items() if t.OUTPUT_TYPE == "generate_until"
        )
        if generation:
            raise ConfigError(
                [
                    f"eval.downstream.tasks: {', '.join(generation)} generate text; "
                    "during training only log-likelihood tasks run (multiple choice, "
                    "loglikelihood, loglikelihood_rolling); evaluate generation with "
                    "moe-eval --tasks"
                ]
            )
        spread = d.ranks == "all"
        self.active = spread or rank == 0
        self.lm = HarnessLM(
            engine.module,
            Tokenizer(tokenizer_file),
            d.batch_size,
            rank=rank if spread else 0,
            world_size=world_size if spread else 1,
        )
        self.last: dict[str, float] = {}
        self.samples: dict[str, int] = {}  # examples evaluated per task, at the last evaluation

    def on_step_end(self, state) -> None:
        if not downstream_due(self.cfg, state.step) or state.rollback_to is not None:
            return  # a step that rolls back runs again
        t0 = time.time()
        scalars = self.evaluate() if self.active else {}
        self.last = scalars
        state.extra.update(scalars)
        if self.rank == 0:
            shown = ", ".join(
                f"{k.removeprefix('downstream/')} {v:.4f}" for k, v in scalars.items()
            )
            log.info(f"step {state.step:>5} | downstream {shown} ({time.time() - t0:.1f}s)")

    def evaluate(self) -> dict[str, float]:
        """The configured examples' metrics, on rank 0 (other ranks return {})."""
        from lm_eval.evaluator import evaluate

        module = self.engine.module
        was_training = module.training
        states = random.getstate(), np.random.get_state()
        cuda = [self.engine.device] if self.engine.device.type == "cuda" else []
        module.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                results = evaluate(
                    self.lm,
                    self.task_dict,
                    limit=self.cfg.eval.downstream.limit,
                    bootstrap_iters=0,
                    log_samples=False,
                    verbosity="WARNING",
                )
        finally:
            module.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])
        if results is None:
            return {}
        self.samples = {t: n["effective"] for t, n in results.get("n-samples", {}).items()}
        out = {}
        for task, metrics in results["results"].items():
            for key, value in metrics.items():
                name = key.split(",")[0]
                if name in LOGGED_METRICS and isinstance(value, (int, float)):
                    out[f"downstream/{task}/{name}"] = float(value)
        return out
