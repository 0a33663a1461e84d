"""Build a DeepSpeed engine around the MoE model and run the training loop.

Reading order: :func:`train`, then :func:`run_step` (one step and everything that follows it),
then :func:`start_run` and :func:`add_parts` (what the loop is made of, one ``run.add`` per
part). The loop owns a :class:`~moe.training.run.TrainState` (step, tokens, newest checkpoint).
After each step, every registered part's hooks (moe/training/hooks.py, ``LoopPart``), in this
order: meters add their scalars and the router bias moves (``after_step``), the guards decide
(``decide``; moe/training/decision.py), reporters report (``on_step_end``); then the loop acts:
it raises on a stop, saves, exits on a preemption, rolls back. Nothing else changes the course
of training, and every part is closed when training ends, however it ends."""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import read_manifest
from data_pipeline.token_stream import validation_windows
from moe.checkpoint.files import unreadable, verify_checkpoint
from moe.config.run import SIGNALS, RunConfig, dump_config
from moe.core.errors import (
    CheckpointError,
    ConfigError,
    DamagedCheckpointError,
    LaunchError,
    TrainingError,
)
from moe.model.adapters.qlora import quantize_base
from moe.model.compile import compile_blocks
from moe.model.recompute import apply_recompute
from moe.model.size import flops_per_token
from moe.model.transformer import MoETransformer
from moe.parallel import deepspeed_adapter
from moe.parallel.deepspeed_adapter import (
    check_loaded_experts,
    deepspeed_config,
    expert_parallel_rank,
    optimizer_param_groups,
    report_global_expert_shapes,
    wrap_moe_layers,
)
from moe.parallel.flat_grads import use_flat_grad_ops
from moe.parallel.layout import load_other_layout
from moe.training.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    SaveContext,
    load_rng,
    resolve_resume,
    restore,
)
from moe.training.decision import Rollback, Stop, decide
from moe.training.device import device_type, peak_bf16_flops
from moe.training.downstream import DownstreamEvaluator
from moe.training.esft import ExpertSelection
from moe.training.finetune import log_parameter_counts, parameter_counts, prepare_finetune
from moe.training.hooks import (
    ConsoleReporter,
    MemoryMeter,
    StepRecorder,
    TensorBoardReporter,
    ThroughputMeter,
    ValidationMeter,
    hparams,
)
from moe.training.prefetch import PrefetchingReader
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.nan_guard import NonFiniteGuard
from moe.training.resilience.preemption import PreemptionGuard, exit_for_requeue
from moe.training.resilience.spike_guard import (
    LossSpikeGuard,
    cut_back_events,
    recorded_events,
    skipped_windows,
)
from moe.training.resilience.watchdog import HangWatchdog
from moe.training.routing import RouterBalance
from moe.training.run import History, PartFactory, Run, TrainState, close
from moe.training.step import train_step
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
                raise LaunchError(
                    f"rank {self.rank} of {self.world_size}: MASTER_ADDR and "
                    f"MASTER_PORT must be set by the launcher"
                )
            from moe.training.ports import free_port

            addr, port = "127.0.0.1", free_port()
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }


def resolve_vocab(cfg: RunConfig) -> RunConfig:
    """Fill model.vocab_size from the tokenizer and refuse a tokenizer the model cannot hold."""
    manifest = read_manifest(cfg.data.dir, cfg.data.s3)
    tok_vocab = int(manifest.tokenizer["vocab_size"])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tok_vocab
    elif cfg.model.vocab_size < tok_vocab:
        raise ConfigError(
            [
                f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                f"tokenizer's vocabulary ({tok_vocab}, {cfg.data.dir})"
            ]
        )
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

    deepspeed_adapter.install()  # our changes to DeepSpeed's internals, for its pinned release
    cfg = cfg.for_device(device_type())  # start_run's config already is; direct callers' too
    if cfg.train.cuda_graphs and not torch.cuda.is_available():
        raise ConfigError(
            [
                "train.cuda_graphs: needs a CUDA device (this rank has none): CUDA graphs replay "
                "recorded GPU kernels; set it false on the CPU"
            ]
        )
    ep = cfg.parallel.expert_parallel_size
    if env.world_size % ep:
        raise ConfigError(
            [f"parallel.expert_parallel_size: {ep} must divide the world size ({env.world_size})"]
        )
    # Same seed on every rank: identical non-expert weights, and each rank keeps its slice of
    # identically initialized experts, whatever the layout.
    seed_everything(cfg.train.seed)
    model = MoETransformer(cfg.model)
    if cfg.model.init_from:  # a resumed run's checkpoint overwrites these weights later
        initialize_from_checkpoint(
            model, cfg.model.init_from, cfg.model.upcycle_noise_std, cfg.train.seed
        )
    prepare_finetune(model, cfg.finetune)  # adapters and frozen parameters, before wrapping
    wrap_moe_layers(model, ep, expert_parallel_rank(env.rank, ep))
    if cfg.finetune.method == "qlora":  # once wrapped: each rank quantises its own experts
        quantize_base(model)
    if env.rank == 0 and cfg.finetune.method != "esft":  # ESFT's, once it selected (start_run)
        log_parameter_counts(parameter_counts(model, ep), cfg.finetune.method)
    t = cfg.train
    apply_recompute(model, t.recompute, t.recompute_every_n_blocks)
    groups = optimizer_param_groups(
        model, t.weight_decay, t.lr, t.router_lr_scale, t.expert_lr_scale
    )
    if make_optimizer is not None:
        optimizer = make_optimizer(groups)
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, **t.adamw_options()
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, env.world_size),
    )
    if t.compile:
        # Last: on the model as wrapped and recomputed, and as DeepSpeed placed and cast it.
        # Compiled before, the expert layers would probe the grouped GEMM for the fp32 CPU
        # weights they had then, not for the device and dtype they train in, and under compile
        # an unprobed kernel runs the per-expert loop (about half the eager tokens/s of
        # moe-125m on one H100).
        compile_blocks(model, cuda_graphs=t.cuda_graphs)
        if t.cuda_graphs:
            # A new generation of the graph trees at every forward: the outputs of the previous
            # one (already consumed: the loss, the aux losses, the gradients) may be overwritten.
            model.register_forward_pre_hook(lambda *_: torch.compiler.cudagraph_mark_step_begin())
    report_global_expert_shapes(engine)  # so that DeepSpeed's zero_to_fp32 can merge experts
    if t.flat_grad_ops:
        use_flat_grad_ops(engine)
    # Different ranks must draw different router noise / dropout from here on.
    torch.manual_seed(cfg.train.seed + 1000 * env.rank + 1)
    return engine, model


def resume_from(
    engine, model, tag_dir: Path, cfg: RunConfig, env: DistEnv, tokenizer_sha256: str
) -> dict:
    """Load a verified checkpoint into the engine, on the saving layout or another one, and
    restore the RNG. Returns the client state: step, tokens, and every registered part's state
    under its name (:func:`~moe.training.checkpoint.restore` gives them back)."""
    marker = verify_checkpoint(tag_dir, cfg, tokenizer_sha256)
    same_layout = (
        marker["world_size"] == env.world_size
        and marker["expert_parallel_size"] == cfg.parallel.expert_parallel_size
    )
    if same_layout:
        try:
            path, client = engine.load_checkpoint(str(tag_dir.parent), tag_dir.name)
        except Exception as e:
            if not unreadable(e):
                raise
            raise DamagedCheckpointError(
                f"{tag_dir}: a file of this checkpoint cannot be read ({type(e).__name__}: {e}); "
                "it has its recorded size, so it was altered after the save"
            ) from e
        if path is None or client is None:
            raise CheckpointError(f"could not load checkpoint {tag_dir}")
    else:
        client = load_other_layout(engine, model, tag_dir)
        if env.rank == 0:
            log.info(
                f"{tag_dir} was saved on {marker['world_size']} rank(s) with expert "
                f"parallelism {marker['expert_parallel_size']}; converted to "
                f"{env.world_size} rank(s), expert parallelism "
                f"{cfg.parallel.expert_parallel_size}"
            )
    problems = check_loaded_experts(model, marker.get("expert_fingerprints"))
    if problems:
        raise DamagedCheckpointError(
            f"{tag_dir}: expert weights are wrong after loading: " + "; ".join(problems)
        )
    load_rng(tag_dir, marker, env.rank, env.world_size, cfg.train.seed)
    return client


def peak_flops(cfg: RunConfig, device: torch.device, threads: int | None = None) -> float | None:
    """One rank's peak FLOP/s: logging.peak_flops_per_device, or for bf16 runs the device's known
    bf16 peak. On the CPU the configured figure is one core's and a rank computes on as many
    cores as it has torch threads (``threads``, default: this process's)."""
    peak = cfg.logging.peak_flops_per_device
    if peak is not None and device.type == "cpu":
        return peak * (threads or torch.get_num_threads())
    if peak is not None or cfg.train.precision != "bf16":
        return peak
    return peak_bf16_flops(device)


def train(
    cfg: RunConfig,
    env: DistEnv,
    resume: str = "auto",
    faults: FaultInjector | None = None,
    parts: Sequence[PartFactory] = (),
) -> dict:
    """Train to ``cfg.train.max_steps``. ``resume``: ``auto`` (the newest complete checkpoint of
    the run directory, if any), ``none``, or a checkpoint directory. ``faults``: tests only
    (moe/training/resilience/faults.py). ``parts``: more parts of the loop, each built from the
    run after the built-in ones (code that embeds the trainer, tests)."""
    run = start_run(cfg, env, resume, faults, parts)
    try:
        while run.state.step < run.cfg.train.max_steps:
            run_step(run)
        # The step the weights are at: max_steps, or a resumed checkpoint's step past it (a
        # lowered max_steps trains nothing and saves nothing; its checkpoint is the result).
        save(run, run.state.step)
    finally:
        failed = close(run)  # also when the loop raised or was preempted
    if failed:
        raise failed[0]
    return finish_run(run)


def run_step(run: Run) -> None:
    """One optimizer step and what follows it, in this order: the parts measure, the guards
    decide, the parts report, then the loop acts on the decision (stop, save, preempt, roll
    back)."""
    ts, every = run.state, run.cfg.checkpoint.every_n_steps
    state = train_step(run.engine, run.loader, run.cfg, run.env.world_size, ts.step + 1, run.spike)
    ts.step, ts.tokens = state.step, ts.tokens + state.tokens_per_step
    for part in run.parts:
        part.after_step(state)  # meters; the router bias for the next step
    decision = decide(run.parts, state, ts.latest())
    for part in run.parts:
        part.on_step_end(state)
    if isinstance(decision, Stop) and decision.signal is None:
        raise TrainingError(decision.reason)
    undone = isinstance(decision, Rollback) or state.rollback_to is not None
    if state.is_log_step and not undone:  # before the saves: a checkpoint carries its own step
        ts.history.append(
            {
                "step": ts.step,
                "loss": state.loss,
                "lm_loss": state.lm_loss,
                "tokens_per_s": state.tokens_per_second,
            }
        )
    if every and ts.step % every == 0 and state.rollback_to is None:
        save(run, ts.step)  # a step that rolls back is undone next: never saved
    if isinstance(decision, Stop):  # a preemption: save the step it names, exit for a requeue
        save(run, decision.step)
        exit_for_requeue(run.cfg.run_files.preempted, run.env.rank, decision)
    if isinstance(decision, Rollback):
        roll_back(run, decision)


def save(run: Run, step: int) -> None:
    """Save step ``step`` unless the newest checkpoint is of it (saved already, or resumed
    from); a failed save (``checkpoint.on_save_error: continue``) is remembered."""
    ts = run.state
    if step == ts.checkpoint_step:
        return
    t0 = time.time()
    saved = run.checkpointer.save(step, ts.tokens)
    if saved is None:
        if step not in ts.failed_saves:
            ts.failed_saves.append(step)
        return
    ts.checkpoint, ts.checkpoint_step, ts.failed_saves = saved, step, []
    ts.last_save_seconds = time.time() - t0
    for part in run.parts:
        part.on_checkpoint(step, saved)


def roll_back(run: Run, decision: Rollback) -> None:
    """Restore the checkpoint ``decision.checkpoint`` in this process, on every rank, the way a
    resumed run loads it (model, optimizer, LR schedule, RNG, every registered state: data
    cursor, guards' windows, ...); then the parts drop what they kept of the steps after it."""
    t0, ts = time.time(), run.state
    client = resume_from(
        run.engine, run.model, decision.checkpoint, run.cfg, run.env, run.tokenizer_sha256
    )
    ts.step, ts.tokens = int(client["step"]), int(client.get("tokens", 0))
    ts.history = [h for h in ts.history if h["step"] <= ts.step]
    restore(run.states, client, decision.checkpoint)
    for part in run.parts:
        part.on_rollback(client)
    log.info(
        f"rolled back to {decision.checkpoint} (step {ts.step}) in "
        f"{time.time() - t0:.2f}s; the steps after it run again"
    )


def start_run(
    cfg: RunConfig,
    env: DistEnv,
    resume: str,
    faults: FaultInjector | None = None,
    parts: Sequence[PartFactory] = (),
) -> Run:
    """The engine, the data, the resumed state; then the checkpointer and the loop's parts
    around them (closed again if starting fails)."""
    cfg = resolve_vocab(cfg)
    chosen = cfg.device_choices(device_type())
    cfg = cfg.for_device(device_type())  # before anything reads the settings left to the device
    if chosen and env.rank == 0:
        log.info(
            f"settings left to the device ({device_type()}): "
            + ", ".join(f"{key} {value}" for key, value in chosen.items())
        )
    data = PreparedData.from_config(cfg.data)  # a local directory or s3:// (through a cache)
    tokenizer_sha = data.manifest.tokenizer["sha256"]
    files = cfg.run_files
    ckpt_dir = files.checkpoints
    resume_dir = resolve_resume(resume, ckpt_dir)
    check_start(cfg, resume_dir, tokenizer_sha)  # before building anything
    if env.rank == 0:  # written again when this run ends with its checkpoint; none till then
        files.summary.unlink(missing_ok=True)
    engine, model = build_engine(cfg, env)
    reader = PackedReader(
        data,
        cfg.data.seq_len,
        cfg.data.seed,
        env.rank,
        env.world_size,
        cfg.train.micro_batch_size,
        weights=cfg.data.weights(),
        loader_workers=cfg.data.loader_workers,
        allow_other_data=cfg.data.allow_other_data_on_resume,
        document_ids=cfg.model.document_masking,
    )
    loader = PrefetchingReader(reader, cfg.train.grad_accum_steps)
    state = TrainState()
    client = (
        None
        if resume_dir is None
        else resume_state(state, engine, model, resume_dir, cfg, env, tokenizer_sha)
    )
    train_loader = loader
    if faults is not None:  # tests only: proxies that call the injector (resilience/faults.py)
        engine, train_loader = faults.install(engine, loader, state)
    run = Run(
        cfg,
        env,
        engine,
        model,
        train_loader,
        tokenizer_sha,
        state,
        resumed=None if client is None else (client, resume_dir),
    )
    try:
        run.carry("data", loader)
        run.carry("history", History(state))
        if cfg.finetune.method == "esft":  # before the parts: the parameter counts need it
            add_expert_selection(run, reader, select=client is None)
        add_parts(run, data)
        for build in parts:
            run.add(build(run))
        add_watch(run)
    except BaseException:
        close(run)
        raise
    run.resumed = None
    if state.step >= cfg.train.max_steps and env.rank == 0:
        log.info(
            f"the latest checkpoint is at step {state.step}; nothing left to train "
            f"(max_steps {cfg.train.max_steps})"
        )
    return run


def check_start(cfg: RunConfig, resume_dir: Path | None, tokenizer_sha: str) -> None:
    """The checkpoint a run resumes matches it; the source a new run starts from
    (``model.init_from``) expects the tokenizer of its data (a fine-tuning's base included)."""
    if resume_dir is not None:
        verify_checkpoint(resume_dir, cfg, tokenizer_sha)
    elif cfg.model.init_from:
        finetune = cfg.finetune.method != "none"
        check_source_tokenizer(cfg.model.init_from, tokenizer_sha, str(cfg.data.dir), finetune)


def resume_state(
    state: TrainState,
    engine,
    model,
    resume_dir: Path,
    cfg: RunConfig,
    env: DistEnv,
    tokenizer_sha: str,
) -> dict:
    """Load ``resume_dir`` into the engine and ``state`` (step, tokens, and the checkpoint when
    it is this run's own); the checkpoint's client state."""
    ckpt_dir = cfg.run_files.checkpoints
    t_load = time.time()
    client = resume_from(engine, model, resume_dir, cfg, env, tokenizer_sha)
    state.step, state.tokens = int(client["step"]), int(client.get("tokens", 0))
    if resume_dir.parent.resolve() == ckpt_dir.resolve():
        state.checkpoint, state.checkpoint_step = ckpt_dir / resume_dir.name, state.step
    log.info(
        f"resumed from {resume_dir} at step {state.step} (loaded in {time.time() - t_load:.2f}s)"
    )
    return client


def add_expert_selection(run: Run, reader: PackedReader, select: bool) -> None:
    """ESFT's expert selection, carried by the checkpoint; ``select``: a new run scores the
    experts on its first batches (a resumed one has its selection from the checkpoint)."""
    cfg, env = run.cfg, run.env
    ep_rank = expert_parallel_rank(env.rank, cfg.parallel.expert_parallel_size)
    esft = ExpertSelection(
        run.model, run.engine.optimizer, cfg, env.rank, ep_rank, run.engine.device
    )
    run.carry(esft.state_key, esft)
    if select:
        esft.select(reader)


def add_parts(run: Run, data: PreparedData) -> None:
    """The run's checkpointer and parts, one ``run.add`` each: meters, the router balance,
    guards, reporters (the order of their hooks is this order)."""
    cfg, env, t = run.cfg, run.env, run.cfg.train
    run_dir, files, moe_layers = cfg.run_dir, cfg.run_files, run.model.moe_layers()
    config_text = dump_config(cfg)
    if cfg.eval.every_n_steps:
        windows = list(validation_windows(data, cfg.data.seq_len, cfg.eval.training_max_tokens))
        run.add(
            ValidationMeter(
                run.engine,
                cfg.eval.every_n_steps,
                windows,
                cfg.data.seq_len,
                cfg.eval.batch_size,
                env.rank,
                env.world_size,
            )
        )
    run.add(MemoryMeter())
    train_flops = flops_per_token(cfg.model, cfg.data.seq_len)["training"]
    run.add(ThroughputMeter(train_flops, peak_flops(cfg, run.engine.device), env.world_size))
    run.add(RouterBalance(moe_layers))  # after the meters: its statistics join the state
    run.add(NonFiniteGuard(t.max_consecutive_skips, env.rank))  # the first guard: its stop wins
    if env.rank == 0:  # the record of this run's history: an earlier attempt's later events go
        cut_back_events(run_dir, run.state.step + 1)
    # Whatever train.spike says now: data that a rollback took out stays out.
    events = recorded_events(run_dir)
    run.loader.skip(skipped_windows(events))
    if t.spike.action != "off":
        run.spike = run.add(
            LossSpikeGuard(t.spike, run_dir, run.loader, env.rank, env.world_size, events=events)
        )
    if cfg.eval.downstream.tasks:  # before the reporters, which write its scalars
        run.add(
            DownstreamEvaluator(run.engine, cfg, env.rank, env.world_size, data.tokenizer_file())
        )
    run.add(ConsoleReporter(env.rank))
    run.add(StepRecorder(files.step_records(env.rank), env.rank, env.world_size))
    if env.rank == 0 and cfg.logging.tensorboard:
        counts = parameter_counts(run.model, cfg.parallel.expert_parallel_size)
        run.add(
            TensorBoardReporter(
                files.tensorboard,
                config_text,
                hparams(cfg, counts),
                start_step=run.state.step,  # the resumed checkpoint's; 0 for a new run
                events=events,
                step_records=files.step_records(env.rank),
            )
        )
    save_ctx = SaveContext(
        config_text=config_text,
        tokenizer_file=data.tokenizer_file(),
        tokenizer_sha256=run.tokenizer_sha256,
        world_size=env.world_size,
        expert_parallel_size=cfg.parallel.expert_parallel_size,
        num_moe_layers=len(moe_layers),
        num_experts=cfg.model.moe.num_experts,
        keep_last=cfg.checkpoint.keep_last,
    )
    run.checkpointer = Checkpointer(
        run.engine, files.checkpoints, save_ctx, env.rank, cfg.checkpoint.on_save_error, run.states
    )


def add_watch(run: Run) -> None:
    """The preemption guard (the last guard asked) and the hang watchdog, just before the first
    step."""
    cfg, env, t, files = run.cfg, run.env, run.cfg.train, run.cfg.run_files
    run.add(
        PreemptionGuard(
            files.preempted, env.rank, tuple(SIGNALS[n] for n in cfg.checkpoint.save_on_signals)
        )
    )
    if t.hang_timeout_s:
        run.add(HangWatchdog(t.hang_timeout_s, files.logs, env.rank)).start(run.state.step)


def finish_run(run: Run) -> dict:
    """The run's summary, written by rank 0 to ``RUN_DIR/train_summary.json``. A run whose last
    save failed (``checkpoint.on_save_error: continue``) has no checkpoint of its result: the
    summary names none and the steps left unsaved, and every rank raises
    :class:`CheckpointSaveError`."""
    ts, max_steps = run.state, run.cfg.train.max_steps
    summary = {
        "steps": ts.step,  # max_steps, or the resumed checkpoint's step past it
        "history": ts.history,
        "checkpoint": None if ts.failed_saves or ts.checkpoint is None else str(ts.checkpoint),
        "last_save_seconds": ts.last_save_seconds,
        "threads_per_rank": torch.get_num_threads(),
    }  # the evaluation after it uses them
    if ts.failed_saves:
        first = max(ts.checkpoint_step, 0) + 1
        summary.update(
            unsaved_steps=[first, ts.step],
            failed_saves=ts.failed_saves,
            newest_checkpoint=None if ts.checkpoint is None else str(ts.checkpoint),
        )
    if run.env.rank == 0:
        run.cfg.run_files.summary.write_text(json.dumps(summary, indent=2))
    if ts.failed_saves:
        kept = (
            f"the newest complete checkpoint is {ts.checkpoint} (step {ts.checkpoint_step})"
            if ts.checkpoint is not None
            else "there is no complete checkpoint"
        )
        raise CheckpointSaveError(
            f"the run's final checkpoint is missing: the saves at step(s) "
            f"{', '.join(map(str, ts.failed_saves))} failed (checkpoint.on_save_error: "
            f"continue), so steps {first} to {ts.step} are not saved; {kept}. Free space or "
            "fix the storage, then resume: those steps train again"
        )
    log.info(f"finished: step {ts.step} of {max_steps}, checkpoint {ts.checkpoint}")
    return summary
