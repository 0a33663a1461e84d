"""The one place that knows DeepSpeed's MoE conventions and the expert-parallel process groups.

DeepSpeed recognizes MoE layers only through ``isinstance(module, deepspeed.moe.layer.MoE)``:
then it reduces expert gradients over the expert-data-parallel group, keeps expert optimizer
state apart, and writes one checkpoint file per expert, finding experts by the key pattern
``<layer>.deepspeed_moe.experts.deepspeed_experts.<global id>.<name>``. :class:`DeepSpeedMoE`
wraps our single-device :class:`~moe.model.moe_layer.MoELayer` so that all of that holds:

- the wrapped layer sits at ``deepspeed_moe``; its stacked expert weights (E_local, ...) appear in
  state dicts as per-expert keys ``deepspeed_moe.experts.deepspeed_experts.<i>.<name>`` (a state
  dict hook splits them, a load pre-hook stacks them back);
- expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<N>"``;
- nothing else under the layer has "expert" in its state-dict key (DeepSpeed would move it into
  the expert files): the router and shared MLP are named ``router`` and ``shared_mlp``;
- ``set_deepspeed_parallelism`` (called by the engine) creates the groups and swaps in the
  all-to-all dispatcher (:class:`~moe.model.dispatcher.ExpertParallelDispatcher`).

Checkpoints stay readable by DeepSpeed's own ``zero_to_fp32`` (see :func:`optimizer_param_groups`
and :func:`report_global_expert_shapes`): the per-expert files live in an ``experts/``
subdirectory of the tag directory, where that tool's ``*_model_states.pt`` glob does not reach.

What DeepSpeed's own code does not allow is changed by :func:`install`, for the one DeepSpeed
release it is written against (SUPPORTED_DEEPSPEED); its docstring lists each change and why.
The trainer calls it where it builds the engine; importing this module changes nothing. The
DeepSpeed config of a run is derived here too (:func:`deepspeed_config`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

import deepspeed
import deepspeed.comm.comm as ds_comm
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS
from deepspeed.comm.torch import TorchBackend
from deepspeed.moe.layer import MoE as _DeepSpeedMoEBase
from deepspeed.moe.utils import is_moe_param, is_moe_param_group
from deepspeed.runtime import bf16_optimizer as ds_bf16_optimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import groups
from torch import nn

from moe.checkpoint.consolidate import EXPERT_KEY
from moe.checkpoint.files import EXPERT_DIR
from moe.checkpoint.fingerprints import expert_fingerprints, fingerprint_problems
from moe.config.run import RunConfig
from moe.core.errors import MoEError
from moe.model.dispatcher import ExpertParallelDispatcher
from moe.model.moe_layer import MoELayer
from moe.model.router import TopKRouter
from moe.model.transformer import MoETransformer

_EXPERT_NAMES = ("w_in", "w_out")

SUPPORTED_DEEPSPEED = "0.19.8"
"""The DeepSpeed release :func:`install` patches: constraints.txt pins it, and
benchmarks/gpu_wheels.sh builds the GPU machines' wheel of it (docs/gpu.md). The patched
methods are DeepSpeed internals, which another release may rename or change."""


class DeepSpeedVersionError(MoEError):
    """The installed DeepSpeed is not the release this project's changes to it are written for."""


def check_deepspeed_version() -> None:
    """Refuse any DeepSpeed but SUPPORTED_DEEPSPEED (a local build suffix, ``+hash``, aside)."""
    installed = str(deepspeed.__version__)
    if installed.split("+")[0] != SUPPORTED_DEEPSPEED:
        raise DeepSpeedVersionError(
            f"DeepSpeed {installed} is installed, but this project supports DeepSpeed "
            f"{SUPPORTED_DEEPSPEED} only (it changes DeepSpeed internals of that release; see "
            f"moe/parallel/deepspeed_adapter.py, install): install it with "
            f"python3 -m pip install deepspeed=={SUPPORTED_DEEPSPEED} (constraints.txt pins it)"
        )


_ORIGINALS: dict[str, Callable] = {}
log = logging.getLogger(__name__)
"""DeepSpeed's own functions that :func:`install` replaced, by ``Class.name``: ours call them."""


def install() -> None:
    """Change DeepSpeed's internals as the table says, after checking that the installed
    DeepSpeed is SUPPORTED_DEEPSPEED (:class:`DeepSpeedVersionError` otherwise, with nothing
    changed). Idempotent: the methods are replaced once per process, however often it is
    called, and a communication back end made before the call (``deepspeed.init_distributed``
    makes one per process group) gets the all-gather its replaced method gives later ones.
    Importing this module changes nothing; the trainer calls this where it builds the engine.

    ==================================================  ============================================
    replaced                                            why
    ==================================================  ============================================
    ``DeepSpeedEngine._get_expert_ckpt_name``           per-expert files go one directory down, into
                                                        ``experts/``, where ``zero_to_fp32`` does
                                                        not take them for model states
                                                        (:func:`_expert_ckpt_name`)
    ``DeepSpeedZeroOptimizer._configure_moe_settings``  a model whose expert parameters are all
                                                        frozen (fine-tuning) has no MoE optimizer
                                                        group, which ZeRO 1/2 otherwise asserts
                                                        (:func:`_moe_settings`)
    ``DeepSpeedEngine.load_module_state_dict``          rank 0's frozen parameters, saved beside the
                                                        module states, are not copied into every
                                                        rank's frozen experts
                                                        (:func:`_load_module_state_dict`)
    ``TorchBackend.get_all_gather_function``            DeepSpeed's communication back end
    (``deepspeed.comm.torch``; and the all-gather of    all-gathers through torch's
    the back end that exists, ``comm.cdb``)             ``all_gather_single`` where torch has it:
                                                        torch 2.13 deprecates
                                                        ``all_gather_into_tensor`` (a warning on
                                                        every rank; :func:`_current_name`)
    ``BF16_Optimizer._configure_moe_settings``          the same for DeepSpeed's BF16 optimizer
                                                        (bf16 at ZeRO 1, fp32 gradient reduction):
                                                        a fine-tuning run that trains no routed
                                                        expert parameter (LoRA on attention,
                                                        adapters, prompt, prefix) has no MoE group
                                                        (:func:`_bf16_moe_settings`)
    ``BF16_Optimizer.get_grads_for_norm``               a run that trains nothing but routed
                                                        experts (ESFT) has no non-expert gradient,
                                                        whose norm the step stacks from an empty
                                                        list: a zero stands for it
                                                        (:func:`_bf16_grads_for_norm`)
    ``see_memory_usage`` as the BF16 optimizer          the optimizer's memory report before and
    (``deepspeed.runtime.bf16_optimizer``) calls it     after each parameter group, forced on: a
                                                        full ``gc.collect()``, four lines on stdout
                                                        and a reset of the device's peak memory,
                                                        per group; it goes to this module's debug
                                                        log, without the collection or the reset
                                                        (:func:`_memory_report`)
    ==================================================  ============================================

    Two more changes to DeepSpeed's state are made per engine or per world, not here:
    :func:`report_global_expert_shapes` replaces an engine's ``_get_zero_param_shapes`` (the
    shapes written into its checkpoints), and :func:`wrap_moe_layers` drops DeepSpeed's cached
    expert groups of an earlier process group. With ``train.flat_grad_ops``,
    moe/parallel/flat_grads.py replaces methods of an engine and its ZeRO optimizer, for the
    same release."""
    check_deepspeed_version()
    if not _ORIGINALS:
        for owner, name, ours in _patches():
            _ORIGINALS[f"{owner.__name__}.{name}"] = getattr(owner, name)
            setattr(owner, name, ours)
    backend = ds_comm.cdb
    if backend is not None and hasattr(backend, "all_gather_function"):
        backend.all_gather_function = _current_name(backend.all_gather_function)


def _patches() -> list[tuple[type, str, object]]:
    """(class, attribute, our replacement) for each method :func:`install` replaces."""
    return [
        # Save and load both go through this static method (load calls it on the class).
        (DeepSpeedEngine, "_get_expert_ckpt_name", staticmethod(_expert_ckpt_name)),
        (DeepSpeedZeroOptimizer, "_configure_moe_settings", _moe_settings),
        (DeepSpeedEngine, "load_module_state_dict", _load_module_state_dict),
        (TorchBackend, "get_all_gather_function", classmethod(_all_gather_function)),
        (ds_bf16_optimizer, "see_memory_usage", _memory_report),
        (BF16_Optimizer, "_configure_moe_settings", _bf16_moe_settings),
        (BF16_Optimizer, "get_grads_for_norm", _bf16_grads_for_norm),
    ]


def _memory_report(message: str, force: bool = False) -> None:
    """DeepSpeed's BF16 optimizer reports memory around each parameter group with
    ``force=True``: each report collects garbage (54 collections for moe-125m's 26 groups,
    11 of its 16 s of engine set-up on the CPU, more in a process holding compiled code), prints
    four lines and resets the device's peak memory statistics. Here: one debug line, nothing
    collected or reset (the trainer reports memory itself)."""
    if log.isEnabledFor(logging.DEBUG):
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        log.debug("deepspeed: %s (%.2f GiB allocated)", message, allocated / 2**30)


def _expert_ckpt_name(
    checkpoints_path, layer_id, expert_id, tag, mpu=None, checkpoint_mp_rank=None
):
    """DeepSpeed's per-expert file name, moved into ``EXPERT_DIR``. DeepSpeed's
    ``zero_to_fp32`` takes every ``*_model_states.pt`` file beside the ZeRO files for a model
    state file and fails on the expert files; one directory down, it never sees them. A
    checkpoint with its expert files beside the others still loads."""
    native = _ORIGINALS["DeepSpeedEngine._get_expert_ckpt_name"](
        checkpoints_path, layer_id, expert_id, tag, mpu, checkpoint_mp_rank
    )
    moved = os.path.join(os.path.dirname(native), EXPERT_DIR, os.path.basename(native))
    return native if os.path.exists(native) and not os.path.exists(moved) else moved


def _moe_settings(self) -> None:
    """DeepSpeed's ZeRO 1/2 asserts that a model with MoE layers has an MoE optimizer group.
    A fine-tuning run that adapts no routed expert (moe/training/finetune.py) has none: every
    expert parameter is frozen, so there is nothing to reduce over the expert groups, and the
    layers stay MoE layers for dispatch and the per-expert checkpoint files."""
    if any(self.is_moe_group(g) for g in self.optimizer.param_groups):
        _ORIGINALS["DeepSpeedZeroOptimizer._configure_moe_settings"](self)
    else:
        self.is_moe_param_group = [False] * len(self.optimizer.param_groups)


def _bf16_moe_settings(self) -> None:
    """DeepSpeed's BF16 optimizer asserts, as ZeRO 1/2 does (:func:`_moe_settings`), that a
    model with MoE layers has an MoE optimizer group; with none (every routed-expert parameter
    frozen), no group reduces over an expert group, and what its method sets up besides (an
    empty list of expert gradients per expert group) is set up the same."""
    if any(is_moe_param_group(g) for g in self.optimizer.param_groups):
        _ORIGINALS["BF16_Optimizer._configure_moe_settings"](self)
    else:
        self.expert_gradients = {k: [] for k in groups._get_expert_data_parallel_group_dict()}


def _bf16_grads_for_norm(self, for_clipping: bool = False):
    """DeepSpeed's BF16 optimizer's gradients for the norm; where only routed experts train
    (ESFT), the non-expert list, which its step stacks, is empty: one fp32 zero stands for it,
    which adds nothing to the norm."""
    out = _ORIGINALS["BF16_Optimizer.get_grads_for_norm"](self, for_clipping)
    if for_clipping or out[0]:
        return out
    device = self.fp32_groups_flat_partition[0].device
    return [torch.zeros((), dtype=torch.float32, device=device)], out[1]


def _load_module_state_dict(self, checkpoint, *args, **kwargs):
    """DeepSpeed saves rank 0's frozen parameters beside the module states and, on load, copies
    them by name into every rank's frozen parameters: a frozen expert stack of expert-parallel
    rank 1 would get rank 0's experts. At ZeRO 1/2 the module states (and the per-expert files)
    hold every parameter, frozen ones included, so they alone are loaded; the saved copy stays
    in the file for DeepSpeed's zero_to_fp32."""
    checkpoint = {k: v for k, v in checkpoint.items() if k != FROZEN_PARAM_FRAGMENTS}
    return _ORIGINALS["DeepSpeedEngine.load_module_state_dict"](self, checkpoint, *args, **kwargs)


def _all_gather_function(cls):
    """The all-gather a new communication back end calls: DeepSpeed's choice, under torch's
    current name for it (:func:`_current_name`)."""
    return _current_name(_ORIGINALS["TorchBackend.get_all_gather_function"]())


def _current_name(all_gather):
    """``torch.distributed.all_gather_single`` for ``all_gather_into_tensor`` where torch has
    it. DeepSpeed 0.19.8 picks ``all_gather_into_tensor`` when torch has that; torch 2.13
    deprecates the name (a FutureWarning on every rank at ZeRO's first all-gather) and only
    forwards it to ``all_gather_single``, which takes the same arguments. Older torch (2.11)
    keeps DeepSpeed's choice."""
    if hasattr(dist, "all_gather_single") and all_gather is dist.all_gather_into_tensor:
        return dist.all_gather_single
    return all_gather


class DeepSpeedMoE(_DeepSpeedMoEBase):
    """Makes a :class:`MoELayer` an MoE layer in DeepSpeed's eyes (see the module docstring).

    DeepSpeed's own ``MoE.__init__`` is not called: it would build DeepSpeed's gate and experts.
    """

    def __init__(self, layer: MoELayer, ep_size: int, ep_rank: int):
        nn.Module.__init__(self)
        num_experts = layer.num_experts
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {ep_size} ranks")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = ep_rank
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        _keep_local_experts(layer, ep_rank, self.num_local_experts)
        for p in layer.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name
        layer.experts.register_state_dict_post_hook(_split_experts_hook)
        layer.experts.register_load_state_dict_pre_hook(_stack_experts_hook)
        self.deepspeed_moe = layer

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
            )
        if groups._get_expert_parallel_rank(self.expert_group_name) != self.ep_rank:
            raise RuntimeError(
                "DeepSpeed's expert-parallel rank differs from the slice of experts "
                "this rank holds; expert groups must be consecutive ranks"
            )
        if self.ep_size > 1:
            group = groups._get_expert_parallel_group(self.expert_group_name)
            self.deepspeed_moe.dispatcher = ExpertParallelDispatcher(
                self.num_experts, group, self.ep_size, self.deepspeed_moe.dispatcher.permute
            )

    def forward(self, x_BSD: torch.Tensor):
        return self.deepspeed_moe(x_BSD)


def _stacked_names(experts: nn.Module) -> list[str]:
    """The experts module's own parameters and buffers, all stacked (E, ...): the weights, any
    adapter stacks (moe/model/adapters/), which live, reduce and are saved with their experts,
    and a quantised base's NF4 stacks (adapters/qlora.py), saved with their experts too."""
    return [
        *(name for name, _ in experts.named_parameters(recurse=False)),
        *(name for name, _ in experts.named_buffers(recurse=False)),
    ]


def _keep_local_experts(layer: MoELayer, ep_rank: int, num_local: int) -> None:
    # Parameters only: a QLoRA base is quantised after this, by each rank for its own experts.
    lo = ep_rank * num_local
    for name, full in list(layer.experts.named_parameters(recurse=False)):
        setattr(
            layer.experts,
            name,
            nn.Parameter(full.data[lo : lo + num_local].clone(), requires_grad=full.requires_grad),
        )


def _split_experts_hook(module, state_dict, prefix, local_metadata):
    for name in _stacked_names(module):
        stacked = state_dict.pop(prefix + name)
        for i in range(stacked.shape[0]):
            state_dict[f"{prefix}{EXPERT_KEY}.{i}.{name}"] = stacked[i]


def _stack_experts_hook(
    module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
):
    for name in _stacked_names(module):
        pattern = re.compile(
            re.escape(f"{prefix}{EXPERT_KEY}.") + r"(\d+)\." + re.escape(name) + "$"
        )
        found = {int(m.group(1)): k for k in list(state_dict) if (m := pattern.match(k))}
        if found:
            if sorted(found) != list(range(len(found))):
                errors.append(
                    f"{prefix}{name}: expert ids {sorted(found)} are not 0..{len(found) - 1}"
                )
                continue
            state_dict[prefix + name] = torch.stack(
                [state_dict.pop(found[i]) for i in range(len(found))]
            )


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict:
    """The DeepSpeed config of a run on ``world_size`` ranks, derived from its run config (as
    resolved for the device, RunConfig.for_device; a setting still left open counts as off)."""
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        # We pass torch optimizers; ZeRO 1/2 only needs them to step flat fp32 partitions.
        "zero_allow_untested_optimizer": True,
        "bf16": (
            {"enabled": True, "immediate_grad_update": bool(t.immediate_grad_update)}
            if t.precision == "bf16"
            else {"enabled": False}
        ),
        **(_bf16_reduction(t.grad_reduce_dtype) if t.precision == "bf16" else {}),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _bf16_reduction(dtype: str) -> dict:
    # DeepSpeed's bf16 defaults reduce and accumulate gradients in bf16; ZeRO 1/2 keep an
    # fp32 partition for them when grad_accum_dtype is fp32 and cast bf16 gradients to
    # fp32 before the all-reduce when communication_data_type is fp32.
    return {"communication_data_type": dtype, "data_types": {"grad_accum_dtype": dtype}}


def expert_parallel_rank(rank: int, ep_size: int) -> int:
    """DeepSpeed's default layout puts consecutive ranks in one expert-parallel group."""
    return rank % ep_size


def wrap_moe_layers(model: MoETransformer, ep_size: int, ep_rank: int) -> MoETransformer:
    """Replace each MoELayer in the model by a DeepSpeedMoE that holds only this rank's experts.

    The full model is built first with the same seed on every rank, so each rank keeps its own
    slice of identically initialized experts: initialization does not depend on the layout."""
    _forget_groups_of_an_earlier_world()
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            block.ffn = DeepSpeedMoE(block.ffn, ep_size, ep_rank)
    return model


_GROUPS_WORLD: list = [None]
"""The default process group DeepSpeed's cached expert groups were made in."""


def _forget_groups_of_an_earlier_world() -> None:
    """DeepSpeed keeps its expert and expert-data groups in module globals. A process that
    destroys its process group and makes another (an in-process conversion such as
    ``moe-export --format deepspeed``, or tests) would reuse groups the new world does not
    know ("Group ... is not registered"): drop them when the world changed."""
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if world is not _GROUPS_WORLD[0]:
        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release(None)  # every group DeepSpeed keeps: expert, data, world, sequence
        else:  # DeepSpeed releases without it
            for cache in (
                groups._EXPERT_PARALLEL_GROUP,
                groups._EXPERT_PARALLEL_GROUP_RANKS,
                groups._EXPERT_DATA_PARALLEL_GROUP,
                groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
            ):
                cache.clear()
        _GROUPS_WORLD[0] = world


def optimizer_param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float | None = None,
    router_lr_scale: float = 1.0,
    expert_lr_scale: float = 1.0,
) -> list[dict]:
    """Parameter groups as DeepSpeed's ZeRO optimizer expects them: the non-expert parameters in
    two groups (norm weights and biases get no weight decay), and **one group per expert
    tensor**, marked ``moe`` with its expert group's name.

    DeepSpeed's own splitter puts all expert tensors of an expert group into one group. One
    tensor per group costs nothing measurable and makes each rank's ZeRO partition of an expert
    group exactly its slice of the stacked experts: when the expert-parallel size equals the
    world size, concatenating the ranks' partitions in rank order (what ``zero_to_fp32`` does)
    gives the whole stacked tensor, experts in global order.

    With ``lr`` given, a ``router_lr_scale`` other than 1 puts the routers' weights in a group of
    their own at ``lr * router_lr_scale``, and the expert groups get ``lr * expert_lr_scale``.
    At scale 1 the groups are exactly those above, so earlier checkpoints still load."""
    routers = set()
    if lr is not None and router_lr_scale != 1.0:
        routers = {id(m.weight) for m in model.modules() if isinstance(m, TopKRouter)}
    decay, no_decay, router, experts = [], [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_moe_param(p):
            experts.append(p)
        elif id(p) in routers:
            router.append(p)
        else:
            (no_decay if p.ndim < 2 else decay).append(p)
    # A group left empty (fine-tuning freezes the parameters it would hold) is left out:
    # DeepSpeed drops empty groups, and the LR schedule must see the groups it steps.
    out = [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        )
        if g["params"]
    ]
    if router:
        out.append(
            {
                "params": router,
                "weight_decay": weight_decay,
                "name": "router",
                "lr": lr * router_lr_scale,
            }
        )
    for p in experts:
        group = {
            "params": [p],
            "weight_decay": weight_decay if p.ndim >= 2 else 0.0,
            "name": p.group_name,
            "moe": True,
        }
        if lr is not None:
            group["lr"] = lr * expert_lr_scale
        out.append(group)
    return out


def report_global_expert_shapes(engine) -> list[str]:
    """Make the ``param_shapes`` DeepSpeed writes into each checkpoint give the stacked experts'
    global shape (E, ...) wherever ``zero_to_fp32``'s reconstruction is then right: the tensor
    is alone in its optimizer group (see :func:`optimizer_param_groups`), that group is not
    partitioned further (expert-data-parallel size 1, i.e. expert parallelism = world size) and
    has no padding. Elsewhere the local shape stays, and ``zero_to_fp32`` refuses the checkpoint
    (its numel check fails) instead of merging partitions of different experts.

    Only the recorded shapes change; DeepSpeed does not use them when it loads. Returns the
    names of the parameters that get the global shape."""
    opt = engine.optimizer
    partition_count = getattr(opt, "partition_count", None)
    fp32_parts = getattr(opt, "single_partition_of_fp32_groups", None)
    bit16_groups = getattr(opt, "bit16_groups", None)
    if partition_count is None or fp32_parts is None or bit16_groups is None:
        return []
    stacked = {}
    for module in engine.module.modules():
        if isinstance(module, DeepSpeedMoE) and module.ep_size > 1:
            for p in module.deepspeed_moe.experts.parameters():
                stacked[id(p)] = torch.Size((module.num_experts, *p.shape[1:]))
    global_shape = {}
    for g, params in enumerate(bit16_groups):
        if (
            len(params) == 1
            and id(params[0]) in stacked
            and partition_count[g] == 1
            and fp32_parts[g].numel() == params[0].numel()
        ):
            global_shape[engine.param_names[params[0]]] = stacked[id(params[0])]
    if not global_shape:
        return []
    local_shapes = engine._get_zero_param_shapes

    def param_shapes():
        groups_ = local_shapes()
        for shapes in groups_:
            for name in shapes:
                if name in global_shape:
                    shapes[name] = global_shape[name]
        return groups_

    engine._get_zero_param_shapes = param_shapes
    return sorted(global_shape)


def _moe_modules(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, DeepSpeedMoE):
            yield name, module


def _gathered_experts(module: DeepSpeedMoE, local_E: torch.Tensor) -> torch.Tensor:
    if module.ep_size == 1:
        return local_E
    group = groups._get_expert_parallel_group(module.expert_group_name)
    parts = [torch.empty_like(local_E) for _ in range(module.ep_size)]
    dist.all_gather(parts, local_E.contiguous(), group=group)
    return torch.cat(parts)


@torch.no_grad()
def gather_expert_fingerprints(model: nn.Module) -> dict[str, list[float]]:
    """{single-device expert parameter name: fingerprint of every global expert}. Collective
    over each expert-parallel group: every rank must call it."""
    out = {}
    for name, module in _moe_modules(model):
        for pname in _EXPERT_NAMES:
            w = getattr(module.deepspeed_moe.experts, pname)
            local = torch.tensor(expert_fingerprints(w), dtype=torch.float64, device=w.device)
            out[f"{name}.experts.{pname}"] = _gathered_experts(module, local).cpu().tolist()
    return out


@torch.no_grad()
def check_loaded_experts(
    model: nn.Module, saved: dict[str, list[float]] | None = None
) -> list[str]:
    """After an engine loaded a checkpoint: every expert of every layer holds the weights the
    checkpoint saved under its id (``saved``: the fingerprints it recorded), or, for a
    checkpoint without fingerprints, no two experts hold identical weights. Collective."""
    problems = []
    for key, loaded in gather_expert_fingerprints(model).items():
        problems += fingerprint_problems(key, loaded, None if saved is None else saved.get(key))
    return problems
