"""EleutherAI's lm-evaluation-harness on our models: the model class the harness calls
(log-likelihoods, rolling log-likelihoods, generation) and the loading of its tasks, bundled
(moe/tasks/), from the user's folders, or the harness's own.

It lives here, below moe/evaluation/, because the training loop runs it too
(moe/training/downstream.py); moe-eval's registered model (moe/evaluation/harness.py) adds
checkpoint loading to the same class. The harness is an optional dependency
(``pip install -e '.[eval]'``): this module imports it, so callers check
:func:`moe.training.harness_setup.lm_eval_missing` first.

Tokenization follows the harness's ``hf`` model on our Hugging Face export (moe-export --format
hf), so both score the same token ids: a context is encoded with the tokenizer's own special
tokens (a SentencePiece model adds none, an imported tokenizer.json may add BOS), an empty
context and the rolling windows start with BOS where the tokenizer has one and EOS otherwise,
generated text is decoded without special tokens.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

from data_pipeline.tokenizer import Tokenizer
from moe.core.errors import EvaluationError
from moe.model.generation import GenerationConfig
from moe.model.scoring import Group, can_pad, generate_batch, plan_batches, score_batch
from moe.training.harness_setup import BUNDLED_TASKS

log = logging.getLogger("moe.eval")


class HarnessLM(TemplateLM):
    """One of our models as an lm-evaluation-harness model. ``rank``/``world_size`` > 1: the
    harness gives each rank its share of the documents, and every rank makes the same number of
    forward passes (padding with dummy batches), as an expert-parallel forward is a collective."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        prefix_token_id: int | None = None,
        seed: int = 1234,
        rank: int = 0,
        world_size: int = 1,
        progress: bool = False,
    ):
        super().__init__()
        if batch_size < 1:
            raise EvaluationError(f"batch size: must be >= 1, got {batch_size}")
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self._device = next(model.parameters()).device
        self._max_length = max_length or model.cfg.max_seq_len - model.prepended_positions
        self.max_gen_toks = max_gen_toks
        self.custom_prefix = prefix_token_id
        self.seed = seed
        self._rank, self._world_size = rank, world_size
        self.progress = progress
        self.pad_id = max(tokenizer.pad_id, 0)
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise EvaluationError(
                f"{tokenizer.path}: its vocabulary ({tokenizer.vocab_size}) is "
                f"larger than the model's ({model.cfg.vocab_size})"
            )

    # --- tokens -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix is not None:
            return self.custom_prefix
        return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return f"{self.tok.path.name}-{self.tok.sha256[:12]}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self._piece_text(self.prefix_token_id)):
            special = False  # the text holds its BOS already
        if self.tok.hf is not None:
            return self.tok.hf.encode(string, add_special_tokens=special).ids
        return self.tok.encode(string)  # a SentencePiece model adds no special tokens

    def _piece_text(self, i: int) -> str:
        if self.tok.hf is not None:
            return self.tok.hf.decode([i], skip_special_tokens=False)
        return self.tok.sp.IdToPiece(i)

    def tok_decode(self, ids: list[int]) -> str:
        specials = {self.tok.bos_id, self.tok.eos_id, self.tok.pad_id, self.tok.unk_id}
        if self.tok.hf is not None:
            return self.tok.hf.decode(ids, skip_special_tokens=True)
        return self.tok.decode([i for i in ids if i not in specials])

    # --- distribution -------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _batches_in_lockstep(self, batches: list[list[Group]]) -> list[list[Group] | None]:
        """This rank's batches, then None (a dummy batch) until every rank has run as many."""
        if self.world_size == 1:
            return list(batches)
        n = torch.tensor([len(batches)], device=self._device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return list(batches) + [None] * (int(n) - len(batches))

    # --- scoring ------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kw
    ) -> list[tuple[float, bool]]:
        token_reqs = [(ctx, cont) for _, ctx, cont in requests]
        batches = plan_batches(token_reqs, self.batch_size, self.max_length, can_pad(self.model))
        out: list = [None] * len(token_reqs)
        lockstep = self.world_size > 1
        dummy = [Group((self.eot_token_id,), [(-1, [self.eot_token_id] * 2)])]
        with torch.no_grad():
            for batch in self._batches_in_lockstep(batches):
                for i, score in score_batch(self.model, batch or dummy, self.pad_id, lockstep):
                    if i >= 0:
                        out[i] = (score.logprob, score.greedy)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over windows of the model's length, every token predicted
        once, with the prefix token before the first (the harness's own windowing)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations, batched by prompt length per set of generation
        settings, each cut at the first stop sequence (EOS always stops)."""
        if self.world_size > 1:
            raise EvaluationError(
                "generation tasks run on one process (moe-eval --tasks), not "
                "spread over training ranks"
            )
        out: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        generator = torch.Generator().manual_seed(self.seed)
        for indices in by_kwargs.values():
            cfg, until = self._generation_settings(requests[indices[0]].args[1])
            room = self.max_length - cfg.max_new_tokens
            if room < 1:
                raise EvaluationError(
                    f"max_gen_toks {cfg.max_new_tokens} leaves no room for a "
                    f"prompt in the model's {self.max_length} tokens"
                )
            prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            step = self.batch_size if can_pad(self.model) else 1
            for start in range(0, len(order), step):
                chunk = order[start : start + step]
                done = self._stop_check(until)
                toks = generate_batch(
                    self.model,
                    [prompts[i] for i in chunk],
                    cfg,
                    self.eot_token_id,
                    done,
                    generator,
                    self.pad_id,
                )
                for i, t in zip(chunk, toks):
                    out[i] = postprocess_generated_text(self.tok_decode(t), until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out  # type: ignore[return-value]

    def _stop_check(self, until: list[str]):
        def done(row: int, tokens: list[int]) -> bool:
            text = self.tok_decode(tokens)
            return any(s and s in text for s in until)

        return done

    def _generation_settings(self, kwargs: dict) -> tuple[GenerationConfig, list[str]]:
        kw = dict(kwargs)
        until = handle_stop_sequences(
            kw.pop("until", None), eos=self._piece_text(self.eot_token_id)
        )
        max_new = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks)))
        sample = bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 1.0 if sample else 0.0) or 0.0)
        top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
        if kw:
            raise EvaluationError(
                f"generation settings {sorted(kw)} are not supported (until, "
                "max_gen_toks, do_sample, temperature, top_k, top_p are)"
            )
        strategy = "sample" if sample and temperature > 0 else "greedy"
        cfg = GenerationConfig(
            strategy=strategy,
            max_new_tokens=max_new,
            temperature=temperature if strategy == "sample" else 1.0,
            top_k=None if top_k is None else int(top_k),
            top_p=None if top_p is None else float(top_p),
        )
        if cfg.problems():
            raise EvaluationError("generation settings: " + "; ".join(cfg.problems()))
        return cfg, until


# --- tasks ------------------------------------------------------------------------------------


def _resolved_local_files(config: dict, folder: Path) -> dict:
    """A task config whose local data files are named relative to its YAML file, with those
    paths made absolute (the harness would read them relative to the working directory)."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if config.get("dataset_path") not in ("json", "csv", "parquet", "text") or not files:
        return config
    as_dict = files if isinstance(files, dict) else {"test": files}

    def absolute(p):
        if isinstance(p, list):
            return [absolute(x) for x in p]
        return p if Path(p).is_absolute() or "://" in p else str(folder / p)

    resolved = {split: absolute(p) for split, p in as_dict.items()}
    for paths in resolved.values():
        for p in paths if isinstance(paths, list) else [paths]:
            if "://" not in p and not Path(p).is_file():
                raise EvaluationError(f"task {config.get('task')}: data file {p} not found")
    kwargs = {
        **config["dataset_kwargs"],
        "data_files": resolved if isinstance(files, dict) else resolved["test"],
    }
    return {**config, "dataset_kwargs": kwargs}


def task_specs(names: list[str], include_paths: list[str | Path] = ()):
    """The harness's task manager and a spec per name: our bundled tasks and those in
    ``include_paths`` first (the harness's own index is read only for other names; it takes
    seconds). Unknown names are refused together, each with the nearest known names."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    folders = [BUNDLED_TASKS, *map(Path, include_paths)]
    for f in folders:
        if not f.is_dir():
            raise EvaluationError(f"task folder {f}: no such directory")
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    if any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=[str(f) for f in folders])
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise EvaluationError(
            "unknown task(s): "
            + "; ".join(
                f"{n} (nearest: {', '.join(difflib.get_close_matches(n, manager.all_tasks, 5, 0.5)) or 'none'})"
                for n in unknown
            )
            + " (lm-eval --tasks list shows every task)"
        )
    specs = []
    for name in names:
        entry = manager.task_index[name]
        path = entry.yaml_path
        if (
            path is not None
            and str(entry.kind).endswith("TASK")
            and any(Path(path).resolve().is_relative_to(f.resolve()) for f in folders)
        ):
            specs.append(
                _resolved_local_files(load_yaml(path, resolve_func=True), Path(path).parent)
            )
        else:
            specs.append(name)
    return manager, specs


def load_tasks(
    names: list[str],
    include_paths: list[str | Path] = (),
    num_fewshot: int | None = None,
    fewshot_seed: int = 1234,
) -> dict:
    """The harness's task dictionary for ``names`` (tasks, groups or tags), with
    ``num_fewshot`` examples before each question (None: each task's own default). A data set
    on the Hugging Face Hub with no network here is refused by name."""
    manager, specs = task_specs(names, include_paths)
    try:
        task_dict = manager.load(specs)
    except ConnectionError as e:
        raise EvaluationError(
            f"task(s) {', '.join(names)}: a data set must be downloaded from the Hugging Face "
            f"Hub, which cannot be reached ({e}); run once with a network (the harness caches "
            "the data) or use tasks with local data (moe/tasks/, --include-path)"
        ) from None
    for task in task_dict["tasks"].values():
        if num_fewshot is not None:
            task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=fewshot_seed)
    problems = fewshot_problems(task_dict)
    if problems:  # the harness would stop at the first question, after the model loaded
        raise EvaluationError("; ".join(problems))
    return task_dict


def fewshot_problems(task_dict: dict) -> list[str]:
    """Tasks of a loaded task dictionary that ask for more solved examples than they have to
    draw them from."""
    problems = []
    for name, task in task_dict["tasks"].items():
        wanted = task.config.num_fewshot or 0
        if wanted <= 0:
            continue
        sampler = getattr(task, "sampler", None)  # absent: the task has no examples to show
        pool = len(sampler.fewshot_docs()) if sampler is not None else 0
        if task.fewshot_cfg.split == task.config.test_split:
            pool -= 1  # the harness leaves the question itself out of its own examples
        if wanted > pool:
            problems.append(
                f"num_fewshot: task {name} has {max(pool, 0)} examples to draw "
                f"{wanted} solved examples from"
            )
    return problems
