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

from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader, validation_windows
from data_pipeline.shards import read_manifest
from moe.checkpoint.files import verify_checkpoint
from moe.config.run import SIGNALS, RunConfig, dump_config
from moe.errors import CheckpointError, ConfigError, LaunchError
from moe.model.compile import compile_blocks
from moe.model.moe_layer import counting_routes
from moe.model.recompute import apply_recompute
from moe.model.size import flops_per_token
from moe.model.transformer import MoETransformer
from moe.parallel.deepspeed_adapter import (
    check_loaded_experts,
    expert_parallel_rank,
    optimizer_param_groups,
    report_global_expert_shapes,
    wrap_moe_layers,
)
from moe.parallel.layout import load_other_layout
from moe.training.checkpoint import (
    CheckpointHook,
    SaveContext,
    load_rng,
    resolve_resume,
)
from moe.training.device import peak_bf16_flops, to_device
from moe.training.hooks import (
    ConsoleHook,
    Hook,
    MoEStatsHook,
    ResourceHook,
    StepRecordHook,
    StepState,
    TensorBoardHook,
    ThroughputHook,
    ValidationHook,
)
from moe.training.prefetch import PrefetchingReader
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.nan_guard import NonFiniteGuard, poison_nonfinite
from moe.training.resilience.preemption import PREEMPTED_MARKER, PreemptionHook
from moe.training.resilience.spike_guard import (
    SPIKE_STATE,
    LossSpikeGuard,
    recorded_events,
    skipped_windows,
)
from moe.training.resilience.watchdog import HangWatchdog
from moe.training.upcycle import check_source_tokenizer, initialize_from_checkpoint

log = logging.getLogger("moe.train")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous reads. Every launcher must
        provide the master address when there is more than one rank; a single rank gets a
        loopback address and a free port."""
        addr, port = self.master_addr, self.master_port
        if addr is None or port is None:
            if self.world_size > 1:
                raise LaunchError(f"rank {self.rank} of {self.world_size}: MASTER_ADDR and "
                                  f"MASTER_PORT must be set by the launcher")
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                addr, port = "127.0.0.1", s.getsockname()[1]
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the tokenizer and refuse a tokenizer the model cannot hold."""
    manifest = read_manifest(cfg.data.dir, cfg.data.s3)
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
    if cfg.model.init_from:  # a resumed run's checkpoint overwrites these weights later
        initialize_from_checkpoint(model, cfg.model.init_from, cfg.model.upcycle_noise_std,
                                   cfg.train.seed)
    wrap_moe_layers(model, ep, expert_parallel_rank(env.rank, ep))
    t = cfg.train
    apply_recompute(model, t.recompute, t.recompute_every_n_blocks)
    if t.compile:  # last: it compiles the model as wrapped and recomputed
        compile_blocks(model)
    groups = optimizer_param_groups(model, t.weight_decay, t.lr, t.router_lr_scale,
                                    t.expert_lr_scale)
    if make_optimizer is not None:
        optimizer = make_optimizer(groups)
    else:
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler,
                                           config=cfg.deepspeed_config(env.world_size))
    report_global_expert_shapes(engine)  # so that DeepSpeed's zero_to_fp32 can merge experts
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
    problems = check_loaded_experts(model, marker.get("expert_fingerprints"))
    if problems:
        raise CheckpointError(f"{tag_dir}: expert weights are wrong after loading: "
                              + "; ".join(problems))
    reader.load_state_dict(client["data"])
    load_rng(tag_dir, marker, env.rank, env.world_size, cfg.train.seed)
    return client


def roll_back(engine, model, loader, tag_dir: Path, cfg: RunConfig, env: DistEnv,
              tokenizer_sha256: str, hooks: list[Hook]) -> int:
    """Restore the checkpoint ``tag_dir`` in this process, on every rank, the way a resumed run
    loads it (model, optimizer, LR schedule, data cursor, RNG), and let each hook drop what it
    kept of the steps after it (:meth:`Hook.on_rollback`). Returns the checkpoint's step."""
    t0 = time.time()
    client = resume_from(engine, model, loader, tag_dir, cfg, env, tokenizer_sha256)
    for hook in hooks:
        hook.on_rollback(client)
    step = int(client["step"])
    if env.rank == 0:
        log.info(f"rolled back to {tag_dir} (step {step}) in {time.time() - t0:.2f}s; "
                 f"the steps after it run again")
    return step


def _token_hash(batches: list[torch.Tensor]) -> str:
    """Of the host copies of the batches (the device has its own): no device read."""
    h = hashlib.sha256()
    for b in batches:
        h.update(b.numpy().astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def peak_flops(cfg: RunConfig, device: torch.device) -> float | None:
    """logging.peak_flops_per_device, or for bf16 runs the device's known bf16 peak."""
    if cfg.logging.peak_flops_per_device is not None or cfg.train.precision != "bf16":
        return cfg.logging.peak_flops_per_device
    return peak_bf16_flops(device)


def count_global_routing(engine, batches: list) -> None:
    """For routers with ``aux_loss_scope: global_batch``: route every micro-batch of the step
    once without gradients, sum the routed copies per expert over the micro-batches and all
    ranks, and leave them in each layer's ``batch_counts_E`` for the step's training forwards.

    ``batches``: the step's micro-batches as (input ids, document ids or None), on the device.
    The random state is restored afterwards, so jitter and logit noise draw the same values in
    the training forwards and the counted routing is the routing they use."""
    layers = [m for m in engine.module.moe_layers() if m.cfg.router.aux_loss_scope == "global_batch"]
    if not layers:
        return
    cuda = [engine.device] if engine.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), counting_routes(layers):
        for input_ids_BS, doc_ids_BS in batches:
            engine.module(input_ids_BS, doc_ids_BS=doc_ids_BS)
    counts_LE = torch.stack([m.batch_counts_E for m in layers])
    if dist.is_initialized():
        dist.all_reduce(counts_LE)  # every expert's routed copies over all data-parallel ranks
    for m, row in zip(layers, counts_LE):
        m.batch_counts_E.copy_(row)


def train_step(engine, loader: PrefetchingReader, cfg: RunConfig, env: DistEnv,
               step: int, spike: LossSpikeGuard | None = None,
               faults: FaultInjector | None = None) -> StepState:
    """One optimizer step over ``grad_accum_steps`` micro-batches.

    Host syncs of our code in a step (DeepSpeed's own optimizer step reads the gradient norm
    and the overflow flag besides): the loss sums and gradient norm are read once, after the
    optimizer step, in one transfer (the non-finite guard and the per-step record need them
    every step). Nothing is read per micro-batch: the losses add up on the device, and a
    micro-batch's copy to the device is asynchronous from pinned memory."""
    t = cfg.train
    t0 = time.time()
    packed = loader.next_step()
    samples = t.micro_batch_size * t.grad_accum_steps * env.world_size
    if faults is not None:
        end = int(loader.state_dict()["consumed_samples"])
        packed = faults.batches(step, packed, (end - samples, end))
        faults.before_update(step, engine)
    sums = torch.zeros(3, device=engine.device)  # (loss, lm loss, aux loss) summed
    batches = []
    for p in packed:
        p_dev = to_device(p, engine.device)
        doc_ids = None if p_dev.doc_ids_BS is None else p_dev.doc_ids_BS[:, :-1]
        batches.append((p_dev.tokens_BS[:, :-1], p_dev.tokens_BS[:, 1:], doc_ids))
    count_global_routing(engine, [(x, d) for x, _, d in batches])
    spike_ref = spike.reference() if spike is not None else None
    z_max = torch.full((1,), -math.inf, device=engine.device)
    for i, (inputs, targets, doc_ids) in enumerate(batches):
        if faults is not None and i == 0:
            faults.at("forward", step)
        out = engine(inputs, targets, doc_ids_BS=doc_ids)
        loss = out.loss
        if spike_ref is not None:
            loss, z = spike.check(loss, spike_ref)
            z_max = torch.maximum(z_max, z.reshape(1))
        if faults is not None and i == 0:
            faults.at("backward", step)
        engine.backward(poison_nonfinite(loss))
        if faults is not None and i == len(batches) - 1:
            faults.at("optimizer", step)  # the last micro-batch's step() updates the weights
        engine.step()
        sums += torch.stack([out.loss.detach(), out.lm_loss.detach(), out.aux_loss.detach()]).float()
    skipped = not engine.was_step_applied()
    is_log = (step == 1 or step % cfg.logging.log_every == 0 or step == t.max_steps
              or bool(cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0))
    # The spike guard's window needs the loss averaged over the ranks every step.
    mean_over_ranks = (is_log or spike is not None) and dist.is_initialized()
    local_sum = sums[:1].clone()
    if mean_over_ranks:
        dist.all_reduce(sums)
    sums /= t.grad_accum_steps * (env.world_size if mean_over_ranks else 1)
    grad_norm = engine.get_global_grad_norm()
    norm = (grad_norm.detach().float().reshape(1).to(sums.device) if torch.is_tensor(grad_norm)
            else torch.full((1,), math.nan if grad_norm is None else float(grad_norm),
                            device=sums.device))
    # The step's one read of ours (a host sync on GPUs).
    loss, lm_loss, aux_loss, local_sum, norm_value, z_value = torch.cat(
        [sums, local_sum, norm, z_max]).tolist()
    return StepState(
        step=step, max_steps=t.max_steps, loss=loss, lm_loss=lm_loss, aux_loss=aux_loss,
        lr=engine.get_lr()[0], grad_norm=None if grad_norm is None else norm_value,
        step_seconds=time.time() - t0, tokens_per_step=samples * cfg.data.seq_len,
        samples_per_step=samples, is_log_step=is_log, local_loss=local_sum / t.grad_accum_steps,
        tokens_sha256=_token_hash([p.tokens_BS for p in packed]), skipped=skipped,
        spike_zscore=z_value if spike_ref is not None and z_value > spike.cfg.zscore else None,
        consumed_samples=int(loader.state_dict()["consumed_samples"]))


def train(cfg: RunConfig, env: DistEnv, resume: str = "auto",
          faults: FaultInjector | None = None) -> dict:
    """Train to ``cfg.train.max_steps``. ``resume``: ``auto`` (the newest complete checkpoint of
    the run directory, if any), ``none``, or a checkpoint directory. ``faults``: tests only
    (moe/training/resilience/faults.py)."""
    cfg = resolve_vocab(cfg)
    run_dir = cfg.run_dir
    data = PreparedData.from_config(cfg.data)  # a local directory or s3:// (through a cache)
    manifest = data.manifest
    tokenizer_sha = manifest.tokenizer["sha256"]
    ckpt_dir = run_dir / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_dir)
    if resume_dir is not None:
        verify_checkpoint(resume_dir, cfg, tokenizer_sha)  # before building anything
    elif cfg.model.init_from:
        check_source_tokenizer(cfg.model.init_from, tokenizer_sha, str(cfg.data.dir))
    engine, model = build_engine(cfg, env)
    reader = PackedReader(data, cfg.data.seq_len, cfg.data.seed, env.rank, env.world_size,
                          cfg.train.micro_batch_size, weights=cfg.data.weights(),
                          loader_workers=cfg.data.loader_workers,
                          allow_other_data=cfg.data.allow_other_data_on_resume,
                          document_ids=cfg.model.document_masking)
    start_step, tokens, client = 0, 0, {}
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
    hooks: list[Hook] = []
    if cfg.eval.every_n_steps:
        windows = list(validation_windows(data, cfg.data.seq_len, cfg.eval.max_tokens))
        hooks.append(ValidationHook(engine, cfg.eval.every_n_steps, windows, cfg.data.seq_len,
                                    cfg.eval.batch_size, env.rank, env.world_size))
    train_flops = flops_per_token(cfg.model, cfg.data.seq_len)["training"]
    hooks += [MoEStatsHook(moe_layers), ResourceHook(),
              ThroughputHook(train_flops, peak_flops(cfg, engine.device), env.world_size),
              ConsoleHook(env.rank),
              StepRecordHook(run_dir / "logs" / f"steps_rank{env.rank}.jsonl"),
              NonFiniteGuard(t.max_consecutive_skips, env.rank)]
    loader = PrefetchingReader(reader, cfg.train.grad_accum_steps)
    # Whatever train.spike says now: data that a rollback took out stays out.
    events = recorded_events(run_dir)
    loader.skip(skipped_windows(events))
    save_ctx = SaveContext(
        config_text=config_text, tokenizer_file=data.tokenizer_file(),
        tokenizer_sha256=tokenizer_sha, world_size=env.world_size,
        expert_parallel_size=cfg.parallel.expert_parallel_size, num_moe_layers=len(moe_layers),
        num_experts=cfg.model.moe.num_experts, keep_last=cfg.checkpoint.keep_last)
    spike = None
    if t.spike.action != "off":
        spike = LossSpikeGuard(t.spike, run_dir, loader, env.rank, env.world_size, events=events)
        spike.load_state_dict(client.get(SPIKE_STATE))
        hooks.append(spike)
    if env.rank == 0 and cfg.logging.tensorboard:
        hooks.append(TensorBoardHook(run_dir / "tensorboard", config_text, hparams(cfg)))
    ckpt_hook = CheckpointHook(engine, loader, ckpt_dir, cfg.checkpoint.every_n_steps, save_ctx,
                               env.rank, cfg.checkpoint.on_save_error,
                               {SPIKE_STATE: spike.state_dict} if spike is not None else None)
    if spike is not None:
        spike.checkpoints = ckpt_hook
    hooks.append(ckpt_hook)  # after the guard: a step the guard stops on is never saved
    hooks.append(PreemptionHook(ckpt_hook, run_dir / PREEMPTED_MARKER, env.rank,
                                tuple(SIGNALS[n] for n in cfg.checkpoint.save_on_signals)))

    if start_step >= t.max_steps and env.rank == 0:
        log.info(f"the latest checkpoint is at step {start_step}; nothing left to train "
                 f"(max_steps {t.max_steps})")
    if resume_dir is not None and resume_dir.parent.resolve() == ckpt_dir.resolve():
        ckpt_hook.last_tag, ckpt_hook.last_step = resume_dir.name, start_step
    ckpt_hook.tokens = tokens
    watchdog = (HangWatchdog(t.hang_timeout_s, run_dir / "logs", env.rank)
                if t.hang_timeout_s else None)
    if watchdog is not None:
        hooks.append(watchdog)
        watchdog.start(start_step)
    history = []
    step = start_step
    try:
        while step < t.max_steps:
            step += 1
            state = train_step(engine, loader, cfg, env, step, spike, faults)
            ckpt_hook.tokens += state.tokens_per_step
            for hook in hooks:
                hook.on_step_end(state)
            if state.rollback_to is not None:  # a loss spike (spike_guard.py)
                step = roll_back(engine, model, loader, spike.target, cfg, env, tokenizer_sha,
                                 hooks)
                history = [h for h in history if h["step"] <= step]
                continue
            if state.is_log_step:
                history.append({"step": step, "loss": state.loss, "lm_loss": state.lm_loss,
                                "tokens_per_s": state.tokens_per_second})
        ckpt_hook.save(t.max_steps)
    finally:
        if watchdog is not None:  # also when the loop raised: never end a later caller
            watchdog.close()
        loader.close()
    for hook in hooks:
        hook.close()
    summary = {"steps": t.max_steps, "history": history,
               "checkpoint": str(ckpt_dir / ckpt_hook.last_tag) if ckpt_hook.last_tag else None,
               "last_save_seconds": ckpt_hook.last_save_seconds}
    if env.rank == 0:
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def hparams(cfg: RunConfig) -> dict:
    """The run's scalar settings, flattened, for TensorBoard's hparams view."""
    from moe.config_schema import to_dict

    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, (int, float, str, bool)):
            flat[prefix] = node

    walk("", {k: v for k, v in to_dict(cfg).items() if k in ("model", "train", "parallel")})
    return flat


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM's compressed per-node task counts, e.g. ``2(x3),1``: entry ``node_id``."""
    counts = []
    for part in tasks_per_node.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts[min(node_id, len(counts) - 1)]


def dist_env_from_environment(env: dict | None = None) -> DistEnv:
    """Rank and world size from whichever launcher started us, in this order: torch/DeepSpeed
    variables (RANK, WORLD_SIZE), MPI (Open MPI, MPICH/Hydra and Intel MPI), SLURM's srun. MPI
    comes before SLURM because mpiexec inside a SLURM allocation inherits the batch step's
    SLURM_PROCID (0 on every rank). Nothing set: a single rank."""
    env = os.environ if env is None else env
    master = (env.get("MASTER_ADDR"), int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world)))
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    elif "PMI_RANK" in env:
        rank, world = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
        local = int(env.get("MPI_LOCALRANKID", 0))
        local_world = int(env.get("MPI_LOCALNRANKS", world))
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # Only inside an srun step: the batch script itself also has SLURM_PROCID (0).
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_world = (_slurm_tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0)))
                       if per_node else 1)
    else:
        rank, world, local, local_world = 0, 1, 0, 1
    return DistEnv(rank, world, local, local_world, *master)
