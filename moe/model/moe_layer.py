"""The MoE feed-forward layer: router -> dispatch -> experts -> combine (+ shared experts)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from moe.core.config_schema import arch, minimums, runtime
from moe.model.dispatcher import (
    LocalDispatcher,
    PermuteImpl,
    capacity_keep_mask,
    count_ids,
)
from moe.model.experts import Activation, DenseFFN, GroupedExperts
from moe.model.recompute import outside_recompute, recompute
from moe.model.regions import COMBINE, DISPATCH, EXPERTS, ROUTER, region
from moe.model.router import RouterConfig, TopKRouter, at_least_fp32, capacity

STEP_SUMS = ("routed", "router_entropy", "aux_loss", "z_loss", "micro_batches")
"""What ``MoELayer.step_sums`` adds up over a step's training micro-batches, one entry each:
routed token copies, and router entropy, aux loss and z-loss summed per micro-batch, and the
micro-batches. Read by name (:data:`SUM`), never by position."""
SUM = {name: i for i, name in enumerate(STEP_SUMS)}


@dataclass
class MoEConfig:
    num_experts: int = arch(8)
    """Routed experts per MoE layer."""
    expert_hidden: int = arch(256)
    """Hidden width of each routed expert (independent of the model width: fine-grained experts
    use a small width and a larger top_k)."""
    activation: Activation = arch("swiglu")
    router: RouterConfig = field(default_factory=RouterConfig)
    capacity_factor: float | None = arch(None)
    """Token copies an expert accepts, as a multiple of the balanced share T*K/E; copies over it
    are dropped (lowest router weight first) and pass through the residual only. null: dropless."""
    num_shared_experts: int = arch(0)
    """Always-on experts (DeepSeek-MoE), fused into one dense FFN of width
    num_shared_experts * expert_hidden, added to the routed output."""
    shared_expert_gate: bool = arch(False)
    """Scale the shared experts' output per token by sigmoid(x . g), g a learned vector
    (Qwen2-MoE's shared_expert_gate); needs num_shared_experts >= 1."""
    every_n_layers: int = arch(1)
    """Layer i (0-based) is MoE when i >= first_dense_layers and (i - first_dense_layers) %
    every_n_layers == 0; other layers are dense FFNs."""
    first_dense_layers: int = arch(0)
    dense_hidden: int | None = arch(None)
    """Hidden width of the dense layers (default: (top_k + num_shared_experts) * expert_hidden,
    the active expert width of an MoE layer)."""
    permute: PermuteImpl = runtime("auto")
    """How token copies move to their experts and back (moe/model/dispatcher.py). ``auto`` (the
    default): by device, for a training run (RunConfig.for_device): gather on CUDA, index_add
    elsewhere; a layer built outside a run takes index_add. ``index_add``:
    a gather there and a scatter-add back (and in the gradient of the gather: atomic adds in the
    rows' dtype on CUDA). ``gather``: gathers only, through the inverse of the expert sort; each
    token's K outputs (and, in the backward, its copies' gradients) summed in one reduction, in
    fp32 for bf16 rows and in a fixed order."""

    def problems(self) -> list[str]:
        out = minimums(
            self,
            num_experts=1,
            expert_hidden=1,
            num_shared_experts=0,
            every_n_layers=1,
            first_dense_layers=0,
            dense_hidden=1,
        )
        out += [f"router.{p}" for p in self.router.problems(self.num_experts)]
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            out.append(
                f"capacity_factor: must be > 0 or null (dropless), got {self.capacity_factor}"
            )
        if self.shared_expert_gate and not self.num_shared_experts:
            out.append(
                "shared_expert_gate: true needs num_shared_experts >= 1 (there is no "
                "shared expert to gate)"
            )
        return out

    def is_moe_layer(self, index: int) -> bool:
        i = index - self.first_dense_layers
        return i >= 0 and i % self.every_n_layers == 0

    @property
    def dense_width(self) -> int:
        return (
            self.dense_hidden or (self.router.top_k + self.num_shared_experts) * self.expert_hidden
        )


class MoELayer(nn.Module):
    """Sparse feed-forward layer on one device. Expert parallelism swaps ``self.dispatcher`` for
    one that moves token copies between ranks and shrinks ``self.experts`` to the local ones;
    this class does not know about ranks."""

    def __init__(
        self,
        d_model: int,
        cfg: MoEConfig,
        init_std: float = 0.02,
        out_init_std: float | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.router = TopKRouter(d_model, cfg.num_experts, cfg.router)
        self.experts = GroupedExperts(
            cfg.num_experts, d_model, cfg.expert_hidden, cfg.activation, init_std, out_init_std
        )
        self.shared_mlp = (
            DenseFFN(
                d_model,
                cfg.num_shared_experts * cfg.expert_hidden,
                cfg.activation,
                init_std,
                out_init_std,
            )
            if cfg.num_shared_experts
            else None
        )
        # Not "expert" in its name: DeepSpeed would move it into the expert files.
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, std=init_std)
        self.dispatcher = LocalDispatcher(
            cfg.num_experts, "index_add" if cfg.permute == "auto" else cfg.permute
        )
        # Sums over the micro-batches of one optimizer step, read (and reset) by the training
        # part that updates the loss-free bias and logs: kept copies per expert, and STEP_SUMS.
        self.register_buffer("step_load_E", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("step_sums", torch.zeros(len(STEP_SUMS)), persistent=False)
        # Routed copies per expert over the global batch (router.aux_loss_scope: global_batch),
        # filled by a counting pass (counting_routes) and summed over ranks by the trainer.
        self.register_buffer("batch_counts_E", torch.zeros(cfg.num_experts), persistent=False)
        self.counting = False
        self.stats: dict[str, torch.Tensor] = {}
        # Full recompute (moe/model/recompute.py): the routed and shared experts are
        # checkpointed regions; routing, dispatch, combine and _record never are.
        self.recompute_experts = False

    def _apply(self, fn, recurse=True):
        # The step counters stay fp32 under any cast: bf16 counts exactly only up to 256.
        super()._apply(fn, recurse)
        self.step_load_E, self.step_sums, self.batch_counts_E = map(
            at_least_fp32, (self.step_load_E, self.step_sums, self.batch_counts_E)
        )
        return self

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer output and this layer's weighted balancing loss (a scalar)."""
        outside_recompute("MoELayer routing and dispatch")
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        rc = self.cfg.router
        global_counts = rc.aux_loss_scope == "global_batch" and self.training
        with region(ROUTER):
            routing = self.router(
                x_TD, seq_len=S, batch_counts_E=self.batch_counts_E if global_counts else None
            )
        if self.counting:
            with torch.no_grad():
                self.batch_counts_E += count_ids(  # not bincount: a host sync on CUDA
                    routing.indices_TK.flatten(), self.num_experts
                ).to(self.batch_counts_E.dtype)

        keep_TK = None
        if self.cfg.capacity_factor is not None:
            cap = capacity(B * S, self.num_experts, self.cfg.router.top_k, self.cfg.capacity_factor)
            keep_TK = capacity_keep_mask(
                routing.indices_TK, routing.weights_TK, self.num_experts, cap
            )

        with region(DISPATCH):
            plan = self.dispatcher.plan(routing.indices_TK, keep_TK)
            x_ND, w_N, local_counts = self.dispatcher.dispatch(x_TD, routing.weights_TK, plan)
        with region(EXPERTS):
            y_ND = recompute(
                self.experts,
                x_ND,
                local_counts,
                w_N,
                plan.counts_host,
                enabled=self.recompute_experts,
            )
        with region(COMBINE):
            y_TD = self.dispatcher.combine(y_ND, plan)
        if self.shared_mlp is not None:
            shared_TD = recompute(self.shared_mlp, x_TD, enabled=self.recompute_experts)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD  # gate (T, 1)
            y_TD = y_TD + shared_TD

        if not self.counting:  # a counting pass is not a training micro-batch
            with region(ROUTER):
                self._record(routing, plan.counts_E, B * S)
        loss = rc.aux_loss_coef * routing.aux_loss + rc.z_loss_coef * routing.z_loss
        return y_TD.view(B, S, D), loss

    @torch.no_grad()
    def _record(self, routing, counts_E: torch.Tensor, num_tokens: int) -> None:
        # Tensors only (no .item()): reading them is the monitor's choice, not a sync per layer.
        routed = num_tokens * self.cfg.router.top_k
        aux, z = routing.aux_loss.detach(), routing.z_loss.detach()
        if self.training:  # step counters describe training steps only, not validation passes
            self.step_load_E += counts_E.to(self.step_load_E.dtype)
            sums = self.step_sums  # torch.full fills on the device: no host-to-device copy
            added = {
                "routed": torch.full((), routed, dtype=sums.dtype, device=sums.device),
                "router_entropy": routing.entropy,
                "aux_loss": aux,
                "z_loss": z,
                "micro_batches": torch.ones((), dtype=sums.dtype, device=sums.device),
            }
            sums += torch.stack([added[name].to(sums.dtype) for name in STEP_SUMS])
        self.stats = {
            "tokens_per_expert": counts_E.detach(),
            "dropped_fraction": (routed - counts_E.sum()).float() / routed,
            "router_entropy": routing.entropy,
            "aux_loss": aux,
            "z_loss": z,
            "expert_bias": self.router.score_bias,
        }


@contextmanager
def counting_routes(layers: list[MoELayer]):
    """Forward passes inside this block add each layer's routed copies per expert to its
    ``batch_counts_E`` (zeroed on entry) and leave the step counters alone."""
    for layer in layers:
        layer.batch_counts_E.zero_()
        layer.counting = True
    try:
        yield
    finally:
        for layer in layers:
            layer.counting = False
