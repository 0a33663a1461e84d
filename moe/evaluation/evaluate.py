"""Evaluating checkpoints on one process: load any expert-parallel layout, choose the tokens to
evaluate on, compute token-weighted loss and perplexity (and expert statistics on the way)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline import storage
from data_pipeline.errors import DataError
from data_pipeline.prepared import PreparedData
from data_pipeline.progress import Progress
from data_pipeline.reader import IGNORE_INDEX
from data_pipeline.shards import MANIFEST
from data_pipeline.token_stream import TokenStream, Window, token_windows
from data_pipeline.tokenizer import Tokenizer
from moe.config.run import RunConfig
from moe.core.errors import ConfigError
from moe.evaluation.expert_stats import ExpertStatsCollector
from moe.model.generation import GenerationConfig, KVCacheDecoder, generate
from moe.model.transformer import MoETransformer
from moe.weights.load import load_model


class TokenArray:
    """Tokens held in memory with the ``len`` / ``read`` interface of a prepared split's
    :class:`~data_pipeline.token_stream.TokenStream`."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length]

    def read_mask(self, start: int, length: int) -> None:
        return None  # text files: every token is a target


def tokenize_text_files(paths: list[str | Path], tokenizer: Tokenizer) -> TokenArray:
    """Each file is one document, encoded and ended with EOS, as data preparation does."""
    docs = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"{path}: no such text file") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        docs.append(np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64))
    return TokenArray(np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64))


def batches(
    windows: Iterable[Window], batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stack windows into (tokens, targets) batches of up to ``batch_size``; a shorter (final)
    window starts its own batch."""
    pending: list[Window] = []

    def stacked():
        return torch.stack([w.tokens_S for w in pending]), torch.stack(
            [w.targets_S for w in pending]
        )

    for window in windows:
        if pending and (
            len(window.tokens_S) != len(pending[0].tokens_S) or len(pending) == batch_size
        ):
            yield stacked()
            pending = []
        pending.append(window)
    if pending:
        yield stacked()


@torch.no_grad()
def evaluate_loss(
    model: MoETransformer,
    windows: Iterable[Window],
    batch_size: int = 8,
    collector: ExpertStatsCollector | None = None,
    source: str = "data",
    progress: Progress | None = None,
) -> dict:
    """Token-weighted mean next-token loss (nats) over the trained targets of ``windows`` (all
    of them, but for the prompt tokens of instruction data), and its perplexity. ``tokens``: the
    targets the loss averages over; ``positions``: every token predicted, trained or not. With a
    ``collector``, the same forwards also feed its expert statistics; ``progress`` counts the
    positions."""
    if batch_size < 1:
        raise ConfigError([f"batch_size: must be >= 1, got {batch_size}"], "evaluation")
    total_loss, total_tokens, positions = 0.0, 0, 0
    device = next(model.parameters()).device
    for tokens_BS, targets_BS in batches(windows, batch_size):
        inputs_BS, targets_BS = tokens_BS[:, :-1].to(device), targets_BS.to(device)
        if collector is not None:
            collector.observe(inputs_BS)
        logits_BSV = model(inputs_BS).logits
        loss = F.cross_entropy(
            logits_BSV.float().flatten(0, 1),
            targets_BS.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        total_loss += float(loss)
        total_tokens += int((targets_BS != IGNORE_INDEX).sum())
        positions += targets_BS.numel()
        if progress is not None:
            progress.update(targets_BS.numel())
    if progress is not None:
        progress.close()
    if total_tokens == 0:
        what = (
            "no trained tokens (every target is masked)"
            if positions
            else "no tokens to evaluate (at least 2 are needed)"
        )
        raise DataError(f"{source}: {what}")
    mean = total_loss / total_tokens
    return {
        "loss": mean,
        "perplexity": math.exp(mean),
        "tokens": total_tokens,
        "positions": positions,
    }


def evaluate_perplexity(
    model: MoETransformer,
    data_dir: str | Path,
    seq_len: int,
    batch_size: int = 8,
    max_tokens: int | None = None,
    split: str = "valid",
) -> dict:
    """Token-weighted mean next-token loss over a prepared split, and its perplexity."""
    windows = token_windows(TokenStream(data_dir, split), seq_len, max_tokens)
    return evaluate_loss(model, windows, batch_size, source=f"{data_dir} ({split} split)")


class EvalData(NamedTuple):
    tokens: TokenStream | TokenArray
    description: str  # where the tokens came from, for reports
    tokenizer: Tokenizer | None  # the run's tokenizer (decodes expert preferences and text)


def run_tokenizer(cfg: RunConfig) -> Tokenizer | None:
    """The tokenizer the run trained with: prepared next to its data's manifest (fetched when
    the data is on S3)."""
    if storage.is_s3(cfg.data.dir) or (Path(cfg.data.dir) / MANIFEST).exists():
        return Tokenizer(PreparedData.from_config(cfg.data).tokenizer_file())
    return None


def open_eval_data(
    cfg: RunConfig,
    data_dir: str | Path | None = None,
    text_files: list[str] | None = None,
    split: str = "valid",
    tokenizer_file: str | Path | None = None,
) -> EvalData:
    """The tokens to evaluate on: a split of the run's prepared data (default), of another
    prepared data directory tokenized with the same tokenizer, or text files tokenized now with
    the run's tokenizer."""
    if data_dir is not None and text_files:
        raise ConfigError(["give a data directory or text files, not both"], "evaluation")
    tokenizer = Tokenizer(tokenizer_file) if tokenizer_file else run_tokenizer(cfg)
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"{tokenizer.path}: its vocabulary ({tokenizer.vocab_size}) is larger "
            f"than the model's ({cfg.model.vocab_size})"
        )
    if text_files:
        if tokenizer is None:
            raise DataError(
                f"no tokenizer for the text files: {cfg.data.dir} holds no prepared "
                "data (prepare the run's data or pass a tokenizer file)"
            )
        return EvalData(
            tokenize_text_files(text_files, tokenizer),
            f"{len(text_files)} text file(s) tokenized with {tokenizer.path}",
            tokenizer,
        )
    data_dir = data_dir if data_dir is not None else cfg.data.dir
    if not storage.is_s3(str(data_dir)) and not (Path(data_dir) / MANIFEST).exists():
        raise DataError(
            f"{data_dir}: no prepared data ({MANIFEST} missing); run moe-prepare "
            "with the run's config or pass another data directory"
        )
    data = PreparedData(data_dir, cfg.data.s3, cfg.data.cache_dir, cfg.data.cache_bytes)
    stream = TokenStream(data, split)
    if tokenizer is not None and stream.manifest.tokenizer.get("sha256") != tokenizer.sha256:
        raise DataError(
            f"{data_dir} was tokenized with another tokenizer than {tokenizer.path} "
            "(sha256 differs): its token ids mean other text to this model"
        )
    if tokenizer is None:
        tokenizer = Tokenizer(data.tokenizer_file())
    if stream.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"{data_dir}: its tokenizer's vocabulary ({stream.vocab_size}) is larger "
            f"than the model's ({cfg.model.vocab_size})"
        )
    return EvalData(stream, f"{data_dir} ({split} split)", tokenizer)


@dataclass
class EvalOptions:
    """What one evaluation of a checkpoint computes (the moe-eval command line fills it)."""

    data_dir: str | None = None
    """Prepared data to evaluate on (default: the run's)."""
    text_files: list[str] = field(default_factory=list)
    """Raw text files to evaluate on instead, tokenized with the run's tokenizer."""
    split: str = "valid"
    tokenizer_file: str | None = None
    """Tokenizer for text files and decoding (default: the one prepared with the run's data)."""
    max_tokens: int | None = None
    """Most tokens to predict (default: the run's eval.max_tokens; null there: all)."""
    batch_size: int | None = None
    """Sequences per forward (default: the training micro-batch when the model drops tokens, so
    that capacity and dropping are those of training; else the run's eval.batch_size)."""
    expert_stats: bool = True
    top_tokens: int = 8
    """Preferred tokens listed per expert."""
    min_token_count: int = 5
    """Tokens seen fewer times are not ranked as preferences."""
    prompts: list[str] = field(default_factory=list)
    """Prompts to continue; none: the first tokens of ``data_prompts`` documents of the data."""
    data_prompts: int = 3
    prompt_tokens: int = 12
    generation: list[GenerationConfig] = field(default_factory=list)
    """One entry per decoding strategy to show (empty: no generation)."""
    device: str | None = None
    """Where the model runs (default: the GPU if there is one, else the CPU)."""
    progress: bool = True
    """A progress bar on a terminal, else a log line every 30 s (stderr)."""
    fit_generation: bool = False
    """Shorten each generation to the room the model leaves after the longest prompt (no room:
    no generation) instead of refusing its ``max_new_tokens``: the evaluation after training,
    whose settings nobody chose for this model, takes it."""
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks to run instead of the loss, statistics and generations."""
    num_fewshot: int | None = None
    """Solved examples before each question (None: each task's default)."""
    limit: int | None = None
    """The first N examples of each task (None: all)."""
    include_paths: list[str] = field(default_factory=list)
    """Folders of more task YAML files."""
    dtype: str = "fp32"
    """The weights' dtype for the tasks: fp32 or bf16."""
    seed: int = 1234
    """Seed of the tasks' sampled generations."""


def checkpoint_step(tag_dir: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", tag_dir.name)
    return int(m.group(1)) if m else None


def evaluate_checkpoint_dir(path: str | Path, opts: EvalOptions) -> dict:
    """Load a checkpoint (any layout) and compute loss, perplexity, expert statistics and
    generations on one process."""
    t0 = time.perf_counter()
    model, cfg, tag_dir = load_model(path)
    model.to(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = open_eval_data(cfg, opts.data_dir, opts.text_files, opts.split, opts.tokenizer_file)
    drops = cfg.model.moe.capacity_factor is not None
    batch_size = opts.batch_size or (cfg.train.micro_batch_size if drops else cfg.eval.batch_size)
    max_tokens = opts.max_tokens if opts.max_tokens is not None else cfg.eval.max_tokens
    windows = token_windows(data.tokens, cfg.data.seq_len, max_tokens)
    predicted = (
        max(len(data.tokens) - 1, 0)
        if max_tokens is None
        else min(max(len(data.tokens) - 1, 0), max_tokens)
    )
    bar = Progress(f"evaluate {tag_dir.name}", predicted, opts.progress, unit="tokens")
    result = {
        "checkpoint": str(tag_dir),
        "tag": tag_dir.name,
        "step": checkpoint_step(tag_dir),
        "run_dir": str(tag_dir.parent.parent),
        "data": data.description,
        "vocab_size": cfg.model.vocab_size,
        "uniform_loss": math.log(cfg.model.vocab_size),
        "batch_size": batch_size,
        "seq_len": cfg.data.seq_len,
        "capacity_factor": cfg.model.moe.capacity_factor,
    }
    # The prompts and their room in the model, checked before the loss pass, not after it.
    pairs, gens = generation_prompts(model, data, opts) if opts.generation else ([], [])
    if opts.expert_stats and model.moe_layers():
        with ExpertStatsCollector(model) as collector:
            result.update(
                evaluate_loss(model, windows, batch_size, collector, data.description, bar)
            )
        piece = data.tokenizer.id_to_piece if data.tokenizer is not None else None
        result["experts"] = collector.summary(piece, opts.top_tokens, opts.min_token_count)
    else:
        result.update(
            evaluate_loss(model, windows, batch_size, source=data.description, progress=bar)
        )
    if gens:
        result["generations"] = generate_samples(model, data, gens, pairs)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def data_prompts(
    tokens, eos_id: int, count: int, prompt_len: int, reference_len: int, scan: int = 1_000_000
) -> list[tuple[list[int], list[int]]]:
    """(prompt, true continuation) pairs from the starts of the first documents of the data
    that are long enough; each prompt starts with EOS, as every document but the first follows
    one in training."""
    window = np.asarray(tokens.read(0, min(len(tokens), scan)))
    starts = [0] + (np.flatnonzero(window == eos_id) + 1).tolist()
    out = []
    for s in starts:
        doc = window[s : s + prompt_len + reference_len].tolist()
        if eos_id in doc[:prompt_len] or len(doc) < prompt_len + 1:
            continue
        ref = doc[prompt_len:]
        ref = ref[: ref.index(eos_id) + 1] if eos_id in ref else ref
        out.append(([eos_id] + doc[:prompt_len], ref))
        if len(out) == count:
            break
    return out


def generation_prompts(
    model: MoETransformer, data: EvalData, opts: EvalOptions
) -> tuple[list[tuple[list[int], list[int] | None]], list[GenerationConfig]]:
    """(prompt, true continuation or None) of each generation (the given prompts, or document
    starts of the data), and the generations to run. A ConfigError names ``--max-new-tokens``
    where a prompt and the tokens to generate do not fit in the model, unless
    ``opts.fit_generation`` shortens them to fit."""
    tok = data.tokenizer
    if tok is None:
        raise DataError("generation needs the run's tokenizer to encode prompts and decode text")
    longest = max(g.max_new_tokens for g in opts.generation)
    if opts.prompts:
        pairs = [([tok.eos_id] + tok.encode(p), None) for p in opts.prompts]
    else:
        pairs = data_prompts(
            data.tokens, tok.eos_id, opts.data_prompts, opts.prompt_tokens, longest
        )
    limit = KVCacheDecoder(model).max_tokens
    prompt_len = max((len(prompt) for prompt, _ in pairs), default=0)
    room = limit - prompt_len
    if not pairs or longest <= room:
        return pairs, list(opts.generation)
    if opts.fit_generation:
        gens = [replace(g, max_new_tokens=min(g.max_new_tokens, room)) for g in opts.generation]
        return (pairs, gens) if room >= 1 else ([], [])
    raise ConfigError(
        [
            f"--max-new-tokens: the longest prompt ({prompt_len} tokens) and {longest} new "
            f"tokens exceed the model's {limit} tokens"
        ],
        "moe-eval arguments",
    )


def generate_samples(
    model: MoETransformer,
    data: EvalData,
    gens: list[GenerationConfig],
    pairs: list[tuple[list[int], list[int] | None]],
) -> list[dict]:
    tok = data.tokenizer
    decoder = KVCacheDecoder(model)
    out = []
    for prompt, reference in pairs:
        for g in gens:
            hyps = generate(decoder, prompt, g, tok.eos_id)
            out.append(
                {
                    "strategy": g.strategy,
                    "settings": generation_settings(g),
                    "prompt": prompt,
                    "prompt_text": tok.decode(prompt[1:]),
                    "reference_text": None
                    if reference is None
                    else tok.decode([t for t in reference[: g.max_new_tokens] if t != tok.eos_id]),
                    "outputs": [
                        {
                            "tokens": h.tokens,
                            "text": tok.decode([t for t in h.tokens if t != tok.eos_id]),
                            "logprob": h.logprob,
                            "score": h.score,
                        }
                        for h in hyps
                    ],
                }
            )
    return out


def generation_settings(g: GenerationConfig) -> str:
    if g.strategy == "beam":
        return f"{g.num_beams} beams, length penalty {g.length_penalty}"
    if g.strategy == "sample":
        return (
            f"temperature {g.temperature}, top-k {g.top_k or 'all'}, "
            f"top-p {g.top_p or 1.0}, seed {g.seed}"
        )
    return "argmax"
