"""The run config: one YAML file describes a run. Sections are typed dataclasses, each beside the
code it configures; this module composes them and checks what spans sections. The DeepSpeed
config is derived from it (never written by hand) by moe/parallel/deepspeed_adapter.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import yaml

from data_pipeline.config import DataConfig
from moe.config.launch import LaunchConfig
from moe.core.config_schema import arch, from_dict, load_yaml, minimums, to_dict
from moe.core.errors import ConfigError
from moe.core.run_dir import RunDir
from moe.model.adapters.bottleneck import BottleneckConfig, bottleneck_problems
from moe.model.adapters.esft import ESFTConfig
from moe.model.adapters.lora import LoRAConfig, lora_problems
from moe.model.adapters.prefix import PrefixConfig, prefix_problems
from moe.model.adapters.prompt import PromptConfig
from moe.model.adapters.qlora import torchao_missing
from moe.model.recompute import RecomputeMode
from moe.model.transformer import ModelConfig, MoETransformer


@dataclass
class SpikeConfig:
    action: Literal["off", "skip", "rollback"] = "off"
    """What to do when the loss spikes: off (nothing), skip (drop that step's update on every
    rank and record its samples), rollback (drop the update, restore the newest checkpoint on
    every rank and never train on the samples of the spiking step, or of the last
    ``rollback_skip_steps`` steps; needs checkpoint.every_n_steps). Off by default: a z-score
    over a short window of an early, fast-falling loss is noisy, and skipping changes the
    training result, so a run opts in once its loss curve is known."""
    window: int = 100
    """Applied steps whose losses form the reference mean and standard deviation."""
    zscore: float = 6.0
    """A micro-batch loss more than this many standard deviations above the window mean is a
    spike (only upward spikes)."""
    min_steps: int = 50
    """Warm-up: no detection before this many applied steps are in the window."""
    rollback_skip_steps: int = 1
    """rollback: the samples of this many steps, ending with the spiking one, are skipped (only
    steps after the checkpoint: earlier ones are in it already)."""
    max_rollbacks: int = 3
    """rollback: how often spikes at one step number may roll back; the next spike there stops
    the run with an error naming the step."""

    def problems(self) -> list[str]:
        out = minimums(self, window=2, min_steps=2, rollback_skip_steps=1, max_rollbacks=1)
        if self.zscore <= 0:
            out.append(f"zscore: must be > 0, got {self.zscore}")
        if self.min_steps > self.window:
            out.append(
                f"min_steps: {self.min_steps} exceeds window ({self.window}); the window "
                "never holds that many steps"
            )
        return out


@dataclass
class TrainConfig:
    max_steps: int = 200
    micro_batch_size: int = 8
    """Sequences per rank per forward pass."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch_size * grad_accum_steps
    * world size sequences."""
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    """Linear warmup, then cosine decay to min_lr at max_steps."""
    weight_decay: float = 0.1
    router_lr_scale: float = 1.0
    """The routers' learning rate as a multiple of lr (warm-up and decay apply alike)."""
    expert_lr_scale: float = 1.0
    """The routed experts' learning rate as a multiple of lr (shared experts count as dense)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 42
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or bf16 mixed precision (DeepSpeed's bf16 mode): bf16 weights and activations in
    the forward and backward, fp32 master weights and Adam moments in the ZeRO optimizer; the
    router, the losses and the norm statistics compute in fp32 whatever the model dtype.
    fp16 is refused: it needs dynamic loss scaling, which this trainer does not do."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """bf16 only: the dtype gradients are reduced across ranks and accumulated over micro-batches
    in (DeepSpeed's communication_data_type and data_types.grad_accum_dtype). bf16 halves the
    gradient traffic and buffers at 8 bits of mantissa per sum."""
    immediate_grad_update: bool | None = None
    """null (the default): by device (RunConfig.for_device): true on CUDA where it applies,
    false on the CPU. bf16 at ZeRO stage 1 with grad_reduce_dtype fp32 (DeepSpeed's BF16
    optimizer, its bf16.immediate_grad_update): each parameter's bf16 gradient is added into the fp32
    accumulation buffer as soon as the backward has produced it, and freed. false: the bf16
    gradients are kept (zeroed, not freed, between the micro-batches of a step) and added once
    the backward has ended. The same additions either way (the same losses, bitwise); true keeps
    no bf16 gradient buffer (2 bytes per parameter, which moe-plan leaves out then), and lets
    train.cuda_graphs run at ZeRO 1. ZeRO 2's own hooks already move each gradient into its
    buckets as it is produced."""
    flat_grad_ops: bool | None = None
    """null (the default): by device (RunConfig.for_device): true on CUDA at ZeRO stage 1 or 2,
    false on the CPU. ZeRO stage 1 or 2: DeepSpeed's per-parameter gradient work done by group
    (moe/parallel/flat_grads.py). With DeepSpeed's BF16 optimizer (bf16 at stage 1 with
    grad_reduce_dtype fp32): the gradient norm is one norm per parameter group's flat fp32
    gradient buffer instead of one per parameter, clipping one multiply per group, the bf16
    gradients are added into the fp32 buffer by one multi-tensor call (with
    train.immediate_grad_update, each by one add without a cast), and a data-parallel group
    of one rank (one GPU; the expert groups when expert parallelism equals the world size) skips
    the all-reduce's two copies of every gradient, and the step reads one value on the host (is
    the norm finite?) instead of several per group. Otherwise (fp32, or bf16 at stage 2 or with
    bf16 reduction): the gradient norm by one multi-tensor call, without an fp64 copy of each
    gradient, and the groups' norms all-reduced together instead of two collectives per group.
    The same additions and reduced gradients; the norm may differ in its last bits (the BF16
    optimizer's norm sums its squares in another order). Fewer kernels, collectives and host work
    per step."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; null: this machine's cores divided by the local ranks."""
    cpu_keep_freed_memory: bool = True
    """On CPU, keep freed memory in the process rather than unmapping it (see
    moe/training/cpu_allocator.py): large activations are not page-faulted in again every step."""
    max_consecutive_skips: int = 5
    """Steps with a non-finite loss or gradient norm are skipped (no update); after this many in
    a row the run stops, keeping the last checkpoint."""
    recompute: RecomputeMode = "none"
    """Activation recompute (moe/model/recompute.py): none keeps every activation; full keeps
    only each block's inputs and the routed token layout; selective recomputes the norms (the
    query and key norms too), the experts' and FFNs' activation function and the attention
    core. Routing and the expert
    all-to-all never run again: gradients and MoE statistics equal those of none."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss spike detection, skipping and rollback (moe/training/resilience/spike_guard.py)."""
    hang_timeout_s: float = 1800.0
    """A rank that completes no step for this many seconds (checkpoint saves and validation
    included) writes every thread's stack to RUN_DIR/logs/hang_rank{R}.txt and exits with code
    70 (moe/training/resilience/watchdog.py); 0: off."""
    recompute_every_n_blocks: int = 1
    """Recompute blocks 0, N, 2N, ... only (1: every block); the others keep their activations."""
    compile: bool | None = None
    """null (the default): by device (RunConfig.for_device): true on CUDA for pretraining and
    finetune.method full, false on the CPU and for the adapter methods. Compile each transformer
    block with torch.compile (inductor), MoE layer included
    (moe/model/compile.py): one compile per distinct block graph in the first step, none after;
    the expert all-to-alls and the capacity cut run eagerly between the compiled pieces. The
    compiled blocks keep fewer activations (norms and activation functions are rebuilt in the
    backward), which moe-plan counts."""
    cuda_graphs: bool = False
    """Replay each compiled block as CUDA graphs (torch.compile's mode "reduce-overhead", CUDA
    graph trees): a block's kernels are launched as one recorded graph, not one by one. Needs
    train.compile, a CUDA device (refused at start on the CPU), static shapes (dropless routing,
    expert parallelism 1) and gradients that leave a graph's memory before its next replay
    overwrites them: parallel.zero_stage 2 (DeepSpeed's hooks copy each into its buckets) or
    train.immediate_grad_update. The chunked loss's compiled part stays without graphs."""

    optimizer_impl: Literal["auto", "for_loop", "foreach", "fused"] = "auto"
    """Which implementation of torch's AdamW steps the weights (under ZeRO 1/2: one flat fp32
    partition per parameter group, after DeepSpeed's gradient clipping). auto: by device
    (RunConfig.for_device): fused on CUDA, torch's own choice elsewhere (for_loop on the CPU);
    for_loop: one tensor at a time; foreach: torch's
    multi-tensor kernels; fused: one fused kernel per parameter group (CUDA and CPU), which
    reads and writes each weight, gradient and moment once. The same update up to rounding
    (fused differs in the last bits; tests/moe/training/test_optimizer_impl.py); checkpoints
    load across settings."""

    def adamw_options(self) -> dict:
        """Keyword arguments of torch.optim.AdamW for ``optimizer_impl``."""
        return {
            "auto": {},
            "for_loop": {"foreach": False},
            "foreach": {"foreach": True},
            "fused": {"fused": True},
        }[self.optimizer_impl]

    def problems(self) -> list[str]:
        out = minimums(
            self,
            max_steps=1,
            micro_batch_size=1,
            grad_accum_steps=1,
            warmup_steps=0,
            grad_clip=0,
            threads_per_rank=1,
            max_consecutive_skips=1,
            recompute_every_n_blocks=1,
            hang_timeout_s=0,
        )
        if self.lr <= 0:
            out.append(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            out.append(f"min_lr: must be between 0 and lr ({self.lr}), got {self.min_lr}")
        for name in ("router_lr_scale", "expert_lr_scale"):
            if not 0 <= getattr(self, name) < math.inf:
                out.append(f"{name}: must be a finite number >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                out.append(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.precision == "fp16":
            out.append(
                "precision: fp16 is not supported (it needs dynamic loss scaling, which "
                "this trainer does not do); use bf16 (same memory, fp32's exponent range, "
                "no loss scaling) or fp32"
            )
        return out


@dataclass
class ParallelConfig:
    world_size: int = 2
    """Ranks to start, whatever the scheduler (SLURM spreads them over launch.slurm.nodes)."""
    expert_parallel_size: int = 2
    """Ranks that split each MoE layer's experts; must divide the number of experts and the
    world size. The remaining factor is expert-data parallelism."""
    zero_stage: Literal[0, 1, 2] = 2
    """DeepSpeed ZeRO stage (DeepSpeed's MoE support ends at stage 2)."""

    def problems(self) -> list[str]:
        out = minimums(self, world_size=1, expert_parallel_size=1)
        if not out and self.world_size % self.expert_parallel_size:
            out.append(
                f"expert_parallel_size: {self.expert_parallel_size} must divide world_size "
                f"({self.world_size})"
            )
        return out


@dataclass
class LoggingConfig:
    log_every: int = 10
    """Steps between console lines and TensorBoard scalars."""
    tensorboard: bool = True
    peak_flops_per_device: float | None = None
    """Peak FLOP/s of one rank's device for model FLOPs utilization (train/mfu), e.g. 989e12
    for an H100's dense bf16; on the CPU, of one core (a rank's peak is this times its torch
    threads, train.threads_per_rank). null: a bf16 run on a GPU whose name
    moe/training/device.py knows uses its dense bf16 peak, other runs log no MFU. FLOPs per
    token: see moe/model/size.py."""

    def problems(self) -> list[str]:
        out = minimums(self, log_every=1)
        if self.peak_flops_per_device is not None and self.peak_flops_per_device <= 0:
            out.append(
                f"peak_flops_per_device: must be > 0 or null, got {self.peak_flops_per_device}"
            )
        return out


SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "TERM": signal.SIGTERM}
"""The signals ``checkpoint.save_on_signals`` may name."""


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int | None = None
    """Keep only the newest K complete checkpoints (null: keep all). Older ones are deleted only
    after a newer one is complete."""

    save_on_signals: list[str] = field(default_factory=lambda: ["USR1"])
    """Signals that make every rank save at the next step boundary and exit with code 75
    (preempted; SLURM jobs requeue and resume): any of USR1 (what the SLURM back end asks for
    before the time limit), USR2, TERM. With TERM listed, a first SIGTERM saves and a second
    one ends the process at once."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """When a save fails (disk full, permission lost, an I/O error) on any rank, the partial
    checkpoint is removed and the previous complete one stays the newest; then stop: every rank
    stops with an error naming the file and the cause; continue: warn and keep training, trying
    again at the next save (the steps since the last complete checkpoint are at risk). A run
    whose last save failed ends in an error naming the unsaved steps either way, and its
    train_summary.json names no checkpoint."""

    def problems(self) -> list[str]:
        out = minimums(self, every_n_steps=0, keep_last=1)
        for name in self.save_on_signals:
            if name not in SIGNALS:
                out.append(f"save_on_signals: {name!r} is not one of {sorted(SIGNALS)}")
        return out


@dataclass
class DownstreamConfig:
    """Downstream tasks of lm-evaluation-harness during training, logged to TensorBoard as
    downstream/TASK/METRIC (moe/training/downstream.py; needs pip install -e '.[eval]')."""

    tasks: list[str] = field(default_factory=list)
    """Tasks to run (empty: off): the bundled stdlib_sentence_mc, a task of include_path, or one
    of the harness's own (its data downloaded or cached). Log-likelihood tasks only (multiple
    choice, loglikelihood, loglikelihood_rolling); generation tasks run with moe-eval --tasks."""
    every_n_steps: int = 0
    """Evaluate every N steps and at the end; 0: at every checkpoint save
    (checkpoint.every_n_steps) and at the end."""
    limit: int | None = 100
    """The first K examples of each task, the same ones every time (null: all)."""
    num_fewshot: int = 0
    """Solved examples shown before each question (from the task's few-shot split)."""
    batch_size: int = 8
    """Continuations scored per forward pass."""
    ranks: Literal["all", "rank0"] = "all"
    """all: the examples are spread over every rank, each running the same number of forward
    passes; rank0: rank 0 alone (only without expert parallelism, whose forward is a
    collective)."""
    include_path: list[str] = field(default_factory=list)
    """Folders of more task YAML files (local data files named relative to the YAML)."""

    def problems(self) -> list[str]:
        out = minimums(self, every_n_steps=0, limit=1, num_fewshot=0, batch_size=1)
        if self.tasks and importlib.util.find_spec("lm_eval") is None:
            out.append(
                "tasks: downstream evaluation needs lm-evaluation-harness: pip install "
                "-c constraints.txt -e '.[eval]'"
            )
        return out


@dataclass
class EvalConfig:
    max_tokens: int | None = None
    """Evaluate on at most this many validation tokens (null: the whole split): the evaluation
    after training, moe-eval's default, and validation during training."""
    batch_size: int = 8
    every_n_steps: int = 0
    """Validation loss and perplexity during training every N steps and at the end (0: off),
    logged to TensorBoard as valid/loss and valid/perplexity."""
    in_training_max_tokens: int | None = None
    """Validation during training (every_n_steps) predicts at most this many tokens (and at
    most max_tokens), the same first ones of the validation split every time; null: max_tokens
    alone bounds it. A small share of the split keeps frequent validation cheap while the
    evaluation after training reads max_tokens."""
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    """Accuracy on downstream tasks during training (lm-evaluation-harness)."""

    def problems(self) -> list[str]:
        return minimums(self, batch_size=1, every_n_steps=0, max_tokens=1, in_training_max_tokens=1)

    @property
    def training_max_tokens(self) -> int | None:
        """The validation tokens of each evaluation during training (null: all)."""
        bounds = [n for n in (self.max_tokens, self.in_training_max_tokens) if n is not None]
        return min(bounds, default=None)


@dataclass
class FinetuneConfig:
    method: Literal["none", "full", "lora", "qlora", "esft", "prompt", "prefix", "adapter"] = arch(
        "none"
    )
    """none: not a fine-tuning run (pretraining, or continued training from model.init_from).
    full: every parameter trains, starting from model.init_from. lora: the base model is frozen
    (no gradient, no optimizer state) and LoRA factors train (finetune.lora;
    moe/model/adapters/lora.py). esft: only the routed experts the training data uses most
    train, everything else is frozen (finetune.esft). adapter: the base model is frozen and
    bottleneck adapters train (finetune.adapter). prompt: the base model is frozen and a soft
    prompt trains (finetune.prompt). prefix: the base model is frozen and per-layer key/value
    prefixes train (finetune.prefix). qlora: lora on a base whose linear and expert weights are
    held in 4-bit NormalFloat with double quantisation (moe/model/adapters/qlora.py; needs
    torchao: pip install torchao==0.18.0). All but none need model.init_from."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA's targets, rank, alpha, dropout, routed-expert rank and router (methods lora and
    qlora)."""
    esft: ESFTConfig = field(default_factory=ESFTConfig)
    """Method esft (expert-specialised fine-tuning; moe/model/adapters/esft.py): how routed
    experts are scored on the training data and the score share p the trained experts of each
    MoE layer reach; every other parameter is frozen."""
    adapter: BottleneckConfig = field(default_factory=BottleneckConfig)
    """Method adapter (bottleneck adapters, Houlsby et al.; moe/model/adapters/bottleneck.py):
    their width and after which sublayers of each block they go."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    """Method prompt (soft prompt tuning, Lester et al.; moe/model/adapters/prompt.py): the
    prompt's length and initialization."""
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    """Method prefix (prefix tuning, Li and Liang; moe/model/adapters/prefix.py): the key/value
    pairs each attention layer gains."""

    SECTIONS = {
        "lora": ("lora", "qlora"),
        "esft": ("esft",),
        "adapter": ("adapter",),
        "prompt": ("prompt",),
        "prefix": ("prefix",),
    }
    """Each method's own sub-section, by the methods that read it."""

    def problems(self) -> list[str]:
        out = []
        if self.method == "qlora" and (missing := torchao_missing()):
            out.append(
                f"method: qlora quantises the base with {missing} (or pip install -e .[qlora])"
            )
        for section, methods in self.SECTIONS.items():
            value, default = getattr(self, section), type(getattr(self, section))()
            changed = [
                f.name
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(default, f.name)
            ]
            if changed and self.method not in methods:
                # Refused, not ignored: a section left from another method's config would
                # otherwise look as if it shaped this run.
                out.append(
                    f"{section}: set ({', '.join(changed)}), but finetune.method "
                    f"{self.method} does not read it (it is for method "
                    f"{' or '.join(methods)}); remove it or change finetune.method"
                )
        return out


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    """The run directory is output_dir/name: resolved config, logs, TensorBoard, checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How the ranks are started: moe-launch's scheduler and its options."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Fine-tuning from model.init_from: which parameters train (docs/finetuning.md)."""

    def problems(self) -> list[str]:
        out = self._finetune_problems()
        ep = self.parallel.expert_parallel_size
        if ep >= 1 and self.model.moe.num_experts % ep:
            out.append(
                f"parallel.expert_parallel_size: {ep} must divide model.moe.num_experts "
                f"({self.model.moe.num_experts})"
            )
        if self.data.seq_len > self.model.max_seq_len:
            out.append(
                f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len "
                f"({self.model.max_seq_len})"
            )
        if self.train.spike.action != "off" and self.parallel.zero_stage == 0:
            out.append(
                f"parallel.zero_stage: train.spike.action {self.train.spike.action} needs "
                "ZeRO stage 1 or 2 (skipping a step relies on ZeRO's overflow check)"
            )
        if self.train.spike.action == "rollback" and self.checkpoint.every_n_steps == 0:
            out.append(
                "checkpoint.every_n_steps: train.spike.action rollback restores the newest "
                "checkpoint, so it needs periodic ones (set checkpoint.every_n_steps > 0, "
                "e.g. 200, or use train.spike.action skip)"
            )
        if self.train.precision == "bf16" and self.parallel.zero_stage == 0:
            out.append(
                "parallel.zero_stage: train.precision bf16 needs ZeRO stage 1 or 2 (the "
                "fp32 master weights live in the ZeRO optimizer; DeepSpeed 0.19.8 refuses "
                "bf16 weights with fp32 gradient accumulation at stage 0)"
            )
        bf16_optimizer = (
            self.train.precision == "bf16"
            and self.parallel.zero_stage == 1
            and self.train.grad_reduce_dtype == "fp32"
        )
        if self.train.immediate_grad_update and not bf16_optimizer:
            out.append(
                "train.immediate_grad_update: needs train.precision bf16, parallel.zero_stage 1 "
                "and train.grad_reduce_dtype fp32 (DeepSpeed's BF16 optimizer; got "
                f"{self.train.precision}, stage {self.parallel.zero_stage}, "
                f"{self.train.grad_reduce_dtype}): ZeRO 2 already moves each gradient into its "
                "buckets as it is produced, and fp32 has no separate accumulation buffer"
            )
        if self.train.flat_grad_ops and self.parallel.zero_stage == 0:
            out.append(
                "train.flat_grad_ops: needs parallel.zero_stage 1 or 2 (it replaces gradient "
                "work of DeepSpeed's ZeRO optimizers; at stage 0 there is none)"
            )
        out += self._cuda_graph_problems()
        if self.launch.elastic and self.parallel.zero_stage == 0:
            out.append(
                "parallel.zero_stage: launch.elastic needs ZeRO stage 1 or 2 (resuming "
                "on fewer ranks rebuilds the optimizer state from ZeRO's partitions)"
            )
        if self.launch.min_world_size > self.parallel.world_size:
            out.append(
                f"launch.min_world_size: {self.launch.min_world_size} exceeds "
                f"parallel.world_size ({self.parallel.world_size})"
            )
        if self.eval.downstream.ranks == "rank0" and ep > 1:
            out.append(
                f"eval.downstream.ranks: rank0 cannot run a model with expert parallelism "
                f"{ep} alone (its forward is a collective); use all"
            )
        if not self.name or "/" in self.name or self.name.startswith("."):
            out.append(f"name: {self.name!r} must be a plain directory name")
        return out

    def device_choices(self, device_type: str) -> dict[str, object]:
        """The value each by-device setting this config leaves open (null, or auto) takes on
        ``device_type`` ("cuda" or anything else), by dotted key. On CUDA: the settings that
        one H200 measured faster together (docs/gpu.md, "The defaults on CUDA"), each where it
        applies;
        elsewhere the plain ones, under which the CPU runs as before they existed."""
        t, cuda = self.train, device_type == "cuda"
        bf16_optimizer = (
            t.precision == "bf16"
            and self.parallel.zero_stage == 1
            and t.grad_reduce_dtype == "fp32"
        )
        # Adapter methods keep eager blocks and DeepSpeed's own gradient handling: their
        # frozen weights and added modules are not measured under those settings.
        whole_model = self.finetune.method in ("none", "full")
        values = {
            "train.compile": cuda and whole_model,
            "train.immediate_grad_update": cuda and whole_model and bf16_optimizer,
            "train.flat_grad_ops": cuda and whole_model and self.parallel.zero_stage >= 1,
            "train.optimizer_impl": "fused" if cuda else "auto",
            "model.cross_entropy": "chunked" if cuda else "full",
            "model.qkv_projection": "fused" if cuda else "separate",
            "model.moe.permute": "gather" if cuda else "index_add",
        }
        return {key: v for key, v in values.items() if _get(self, key) in (None, "auto")}

    def for_device(self, device_type: str) -> RunConfig:
        """A copy of this config with every by-device setting it leaves open set for a run on
        ``device_type`` (device_choices); values given in the config are kept. Training resolves
        its config with this once it knows its device; moe-plan and the benchmarks for the
        device they plan or measure."""
        cfg = copy.deepcopy(self)
        for key, value in self.device_choices(device_type).items():
            section, _, leaf = key.rpartition(".")
            setattr(_get(cfg, section), leaf, value)
        return cfg

    def _cuda_graph_problems(self) -> list[str]:
        if not self.train.cuda_graphs:
            return []
        # Graphs run on CUDA only: the settings left to the device are those CUDA takes.
        t, p = self.for_device("cuda").train, self.parallel
        out = []
        if not t.compile:
            out.append("train.cuda_graphs: needs train.compile true (it replays compiled blocks)")
        if p.zero_stage != 2 and not t.immediate_grad_update:
            out.append(
                f"train.cuda_graphs: at parallel.zero_stage {p.zero_stage} the gradients stay in "
                "the graph's memory, which its next replay overwrites: use parallel.zero_stage 2 "
                "or, with bf16 at stage 1, train.immediate_grad_update true"
            )
        if self.model.ffn == "moe" and p.expert_parallel_size > 1:
            out.append(
                f"train.cuda_graphs: needs parallel.expert_parallel_size 1 (got "
                f"{p.expert_parallel_size}): the rows an all-to-all brings vary in number, and "
                "each new count would record another graph"
            )
        if self.model.ffn == "moe" and self.model.moe.capacity_factor is not None:
            out.append(
                "train.cuda_graphs: needs dropless routing (model.moe.capacity_factor null): the "
                "kept copies vary in number, and each new count would record another graph"
            )
        return out

    def _finetune_problems(self) -> list[str]:
        method = self.finetune.method
        if method == "none":
            return []
        out = []
        if not self.model.init_from:
            out.append(
                f"model.init_from: finetune.method {method} starts from trained weights; "
                "set model.init_from to a checkpoint (or hf:DIR)"
            )
        if method in ("lora", "qlora") and not self.model.problems():
            # The targets and rank are checked against the model this config builds, on the
            # meta device (shapes only, no memory).
            with torch.device("meta"):
                model = MoETransformer(
                    dataclasses.replace(self.model, vocab_size=self.model.vocab_size or 4)
                )
            out += [f"finetune.lora.{p}" for p in lora_problems(model, self.finetune.lora)]
        if method == "esft" and not any(map(self.model.is_moe_layer, range(self.model.n_layers))):
            out.append(
                "finetune.method: esft trains selected routed experts, and this model "
                "has no MoE layer (model.ffn, model.moe.first_dense_layers, every_n_layers)"
            )
        if method == "adapter":
            out += [
                f"finetune.adapter.{p}"
                for p in bottleneck_problems(self.model.d_model, self.finetune.adapter)
            ]
        if method == "prompt":
            out += self._prompt_problems()
        if method == "prefix":
            out += prefix_problems(
                self.model.attention_backend, self.model.position, self.model.document_masking
            )
        return out

    def _prompt_problems(self) -> list[str]:
        out, n = [], self.finetune.prompt.tokens
        if self.model.document_masking:
            out.append(
                "model.document_masking: finetune.method prompt does not support packed "
                "documents (a soft prompt in front of a row would be seen by its first "
                "document only); set it false"
            )
        if self.model.position == "learned" and self.data.seq_len + n > self.model.max_seq_len:
            out.append(
                f"finetune.prompt.tokens: {n} prompt positions before data.seq_len "
                f"{self.data.seq_len} exceed model.max_seq_len ({self.model.max_seq_len}) "
                "of the learned position table; use at most "
                f"{self.model.max_seq_len - self.data.seq_len} tokens"
            )
        return out

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def run_files(self) -> RunDir:
        """The names of the run directory's files (moe/core/run_dir.py)."""
        return RunDir(self.run_dir)


def _get(cfg: RunConfig, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override {item!r}: expected key.path=value"])
        path, value = item.split("=", 1)
        node = raw
        keys = path.strip().split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError([f"override {item!r}: {k} is not a section"])
        try:
            node[keys[-1]] = load_yaml(value)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            reason = getattr(e, "problem", None) or str(e).splitlines()[0]
            if mark is not None:
                reason += f" at character {mark.column + 1}"
            raise ConfigError(
                [
                    f"override {item!r}: the value is not valid YAML ({reason}); quote a string "
                    f"that holds YAML's special characters, e.g. {path.strip()}=\"'...'\""
                ]
            ) from None
    return raw


def load_config(
    path: str | Path,
    overrides: list[str] | None = None,
    checks: Callable[[RunConfig], list[str]] | None = None,
) -> RunConfig:
    """The run config of a YAML file and ``key=value`` overrides. Every problem is reported in
    one ConfigError: each section's, those across sections, and ``checks``' (a caller's own,
    e.g. the scheduler's limits) once the config could be built."""
    path = Path(path)
    try:
        raw = load_yaml(path.read_text())
    except FileNotFoundError:
        raise ConfigError(["file not found"], str(path)) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], str(path)) from None
    raw = apply_overrides(raw or {}, overrides or [])
    return from_dict(RunConfig, raw, source=str(path), checks=checks)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
