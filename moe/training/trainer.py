"""Build a DeepSpeed engine around the MoE model and run the training loop."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.reader import PackedReader
from data_pipeline.shards import read_manifest
from moe.errors import CheckpointError, ConfigError
from moe.model import MoETransformer
from moe.parallel.deepspeed_adapter import (check_loaded_experts, expert_parallel_rank,
                                            optimizer_param_groups, wrap_moe_layers)
from moe.training.checkpoint import (CheckpointHook, SaveContext, load_rng, resolve_resume,
                                     verify_checkpoint)
from moe.training.config import RunConfig, dump_config
from moe.training.hooks import (ConsoleHook, Hook, RouterBalanceHook, StepRecordHook, StepState,
                                TensorBoardHook)
from moe.training.layout import load_other_layout
from moe.training.nan_guard import NonFiniteGuard, poison_nonfinite

log = logging.getLogger("moe.train")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the tokenizer and refuse a tokenizer the model cannot hold."""
    manifest = read_manifest(cfg.data.dir)
    tok_vocab = int(manifest.tokenizer["vocab_size"])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tok_vocab
    elif cfg.model.vocab_size < tok_vocab:
        raise ConfigError([f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                           f"tokenizer's vocabulary ({tok_vocab}, {cfg.data.dir})"])
    return cfg


def lr_lambda(cfg: RunConfig):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return (t.min_lr + (t.lr - t.min_lr) * cosine) / t.lr

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_engine(cfg: RunConfig, env: DistEnv, make_optimizer=None):
    """The DeepSpeed engine and the (wrapped) model. ``make_optimizer(param_groups)`` replaces
    the configured AdamW (tests use plain SGD so that parameter updates expose gradients)."""
    import deepspeed

    ep = cfg.parallel.expert_parallel_size
    if env.world_size % ep:
        raise ConfigError([f"parallel.expert_parallel_size: {ep} must divide the world size "
                           f"({env.world_size})"])
    # Same seed on every rank: identical non-expert weights, and each rank keeps its slice of
    # identically initialized experts, whatever the layout.
    seed_everything(cfg.train.seed)
    model = MoETransformer(cfg.model)
    wrap_moe_layers(model, ep, expert_parallel_rank(env.rank, ep))
    t = cfg.train
    groups = optimizer_param_groups(model, t.weight_decay)
    if make_optimizer is not None:
        optimizer = make_optimizer(groups)
    else:
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler,
                                           config=cfg.deepspeed_config(env.world_size))
    # Different ranks must draw different router noise / dropout from here on.
    torch.manual_seed(cfg.train.seed + 1000 * env.rank + 1)
    return engine, model


def resume_from(engine, model, reader, tag_dir: Path, cfg: RunConfig, env: DistEnv,
                tokenizer_sha256: str) -> dict:
    """Load a verified checkpoint into the engine, on the saving layout or another one. Returns
    the client state (step, tokens, data cursor)."""
    marker = verify_checkpoint(tag_dir, cfg, tokenizer_sha256)
    same_layout = (marker["world_size"] == env.world_size and marker["expert_parallel_size"]
                   == cfg.parallel.expert_parallel_size)
    if same_layout:
        path, client = engine.load_checkpoint(str(tag_dir.parent), tag_dir.name)
        if path is None or client is None:
            raise CheckpointError(f"could not load checkpoint {tag_dir}")
    else:
        client = load_other_layout(engine, model, tag_dir)
        if env.rank == 0:
            log.info(f"{tag_dir} was saved on {marker['world_size']} rank(s) with expert "
                     f"parallelism {marker['expert_parallel_size']}; converted to "
                     f"{env.world_size} rank(s), expert parallelism "
                     f"{cfg.parallel.expert_parallel_size}")
    problems = check_loaded_experts(model)
    if problems:
        raise CheckpointError(f"{tag_dir}: expert weights are wrong after loading: "
                              + "; ".join(problems))
    reader.load_state_dict(client["data"])
    load_rng(tag_dir, marker, env.rank, env.world_size, cfg.train.seed)
    return client


def _token_hash(batches: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(b.numpy().astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def train(cfg: RunConfig, env: DistEnv, resume: str = "auto") -> dict:
    """Train to ``cfg.train.max_steps``. ``resume``: ``auto`` (the newest complete checkpoint of
    the run directory, if any), ``none``, or a checkpoint directory."""
    cfg = resolve_vocab(cfg)
    run_dir = cfg.run_dir
    manifest = read_manifest(cfg.data.dir)
    tokenizer_sha = manifest.tokenizer["sha256"]
    ckpt_dir = run_dir / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_dir)
    if resume_dir is not None:
        verify_checkpoint(resume_dir, cfg, tokenizer_sha)  # before building anything
    engine, model = build_engine(cfg, env)
    reader = PackedReader(cfg.data.dir, cfg.data.seq_len, cfg.data.seed, env.rank, env.world_size,
                          cfg.train.micro_batch_size)
    start_step, tokens = 0, 0
    if resume_dir is not None:
        t_load = time.time()
        client = resume_from(engine, model, reader, resume_dir, cfg, env, tokenizer_sha)
        start_step, tokens = int(client["step"]), int(client.get("tokens", 0))
        if env.rank == 0:
            log.info(f"resumed from {resume_dir} at step {start_step} (loaded in "
                     f"{time.time() - t_load:.2f}s)")

    config_text = dump_config(cfg)
    moe_layers = model.moe_layers()
    t = cfg.train
    hooks: list[Hook] = [RouterBalanceHook(moe_layers), ConsoleHook(env.rank),
                         StepRecordHook(run_dir / "logs" / f"steps_rank{env.rank}.jsonl"),
                         NonFiniteGuard(t.max_consecutive_skips, env.rank)]
    if env.rank == 0 and cfg.logging.tensorboard:
        hooks.append(TensorBoardHook(run_dir / "tensorboard", config_text))
    save_ctx = SaveContext(
        config_text=config_text, tokenizer_file=Path(cfg.data.dir) / manifest.tokenizer["file"],
        tokenizer_sha256=tokenizer_sha, world_size=env.world_size,
        expert_parallel_size=cfg.parallel.expert_parallel_size, num_moe_layers=len(moe_layers),
        num_experts=cfg.model.moe.num_experts, keep_last=cfg.checkpoint.keep_last)
    ckpt_hook = CheckpointHook(engine, reader, ckpt_dir, cfg.checkpoint.every_n_steps, save_ctx,
                               env.rank)
    hooks.append(ckpt_hook)  # last: a step the guard stops on is never saved

    if start_step >= t.max_steps and env.rank == 0:
        log.info(f"the latest checkpoint is at step {start_step}; nothing left to train "
                 f"(max_steps {t.max_steps})")
    if resume_dir is not None and resume_dir.parent.resolve() == ckpt_dir.resolve():
        ckpt_hook.last_tag, ckpt_hook.last_step = resume_dir.name, start_step
    ckpt_hook.tokens = tokens
    samples_per_step = t.micro_batch_size * t.grad_accum_steps * env.world_size
    history = []
    for step in range(start_step + 1, t.max_steps + 1):
        t0 = time.time()
        sums = torch.zeros(3)
        batches = reader.micro_batches(t.grad_accum_steps)
        for batch in batches:
            out = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(poison_nonfinite(out.loss))
            engine.step()
            sums += torch.stack([out.loss.detach(), out.lm_loss.detach(), out.aux_loss.detach()]).float()
        skipped = not engine.was_step_applied()
        local_loss = float(sums[0]) / t.grad_accum_steps
        is_log = step == 1 or step % cfg.logging.log_every == 0 or step == t.max_steps
        if is_log and dist.is_initialized():
            dist.all_reduce(sums)
        sums /= t.grad_accum_steps * (env.world_size if is_log and dist.is_initialized() else 1)
        grad_norm = engine.get_global_grad_norm()
        ckpt_hook.tokens += samples_per_step * cfg.data.seq_len
        state = StepState(
            step=step, max_steps=t.max_steps, loss=float(sums[0]), lm_loss=float(sums[1]),
            aux_loss=float(sums[2]), lr=engine.get_lr()[0],
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            step_seconds=time.time() - t0, tokens_per_step=samples_per_step * cfg.data.seq_len,
            samples_per_step=samples_per_step, is_log_step=is_log, local_loss=local_loss,
            tokens_sha256=_token_hash(batches), skipped=skipped)
        for hook in hooks:
            hook.on_step_end(state)
        if is_log:
            history.append({"step": step, "loss": state.loss, "lm_loss": state.lm_loss,
                            "tokens_per_s": state.tokens_per_second})
    ckpt_hook.save(t.max_steps)
    for hook in hooks:
        hook.close()
    summary = {"steps": t.max_steps, "history": history,
               "checkpoint": str(ckpt_dir / ckpt_hook.last_tag) if ckpt_hook.last_tag else None,
               "last_save_seconds": ckpt_hook.last_save_seconds}
    if env.rank == 0:
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def dist_env_from_environment() -> DistEnv:
    """Rank and world size from whichever launcher started us (torch/DeepSpeed env vars, SLURM,
    or MPI)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world)))
    elif "SLURM_PROCID" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local, local_world = int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        rank = int(env.get("OMPI_COMM_WORLD_RANK", env.get("PMI_RANK")))
        world = int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE")))
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", 0)))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("MPI_LOCALNRANKS", world)))
    else:
        rank, world, local, local_world = 0, 1, 0, 1
    return DistEnv(rank, world, local, local_world)
