"""The router's per-step bookkeeping: the auxiliary-loss-free bias update (DeepSeek-V3) and the
routing statistics of every MoE layer."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from moe.model.moe_layer import SUM
from moe.training.hooks import LoopPart, StepState


class RouterBalance(LoopPart):
    """After each step (:meth:`after_step`, before the guards decide) it sums every MoE layer's routing counters
    over the step's micro-batches and all ranks (one all-reduce for all layers), applies the
    auxiliary-loss-free bias update (training math: the next step routes with the new bias),
    publishes per-layer statistics in the step state for the loggers, and resets the counters.

    The all-reduce runs every step when some router uses the loss-free bias (every rank must
    apply the same update), otherwise only on logging steps."""

    def __init__(self, moe_layers: list, group=None):
        self.layers = moe_layers
        self.group = group
        self.bias_in_use = any(layer.router.cfg.bias_update_rate > 0 for layer in moe_layers)

    def after_step(self, s: StepState) -> None:
        if not self.layers:
            return
        if self.bias_in_use or s.is_log_step:
            E = self.layers[0].num_experts
            packed = torch.stack(
                [torch.cat([layer.step_load_E, layer.step_sums]) for layer in self.layers]
            )
            if dist.is_initialized():
                dist.all_reduce(packed, group=self.group)
            for layer, row in zip(self.layers, packed):
                layer.router.update_bias(row[:E])
            if s.is_log_step:
                self._publish(s, packed[:, :E], packed[:, E:])
        for layer in self.layers:
            layer.step_load_E.zero_()
            layer.step_sums.zero_()
            layer.batch_counts_E.zero_()  # global-batch counts belong to the step just done

    def _publish(self, s: StepState, loads_LE: torch.Tensor, sums_LS: torch.Tensor) -> None:
        # The one read of the routing statistics, on logging steps only: they accumulate on the
        # device over the step's micro-batches (moe_layer.py); all layers come in one copy.
        spread_L = torch.stack(
            [layer.router.score_bias.max() - layer.router.score_bias.min() for layer in self.layers]
        )
        E = loads_LE.shape[1]
        rows = torch.cat([loads_LE.float(), sums_LS.float(), spread_L.float()[:, None]], 1).tolist()
        for i, (row, layer) in enumerate(zip(rows, self.layers)):
            load, spread = row[:E], row[-1]
            sums = {name: row[E + j] for name, j in SUM.items()}
            mean = max(sum(load) / E, 1e-9)
            count = max(sums["micro_batches"], 1.0)
            p = f"moe/layer{i}"
            s.histograms[f"{p}/expert_load"] = torch.tensor(load)
            s.extra[f"{p}/max_over_mean_load"] = max(load) / mean
            s.extra[f"{p}/load_cv"] = statistics.pstdev(load) / mean
            s.extra[f"{p}/dropped_fraction"] = 1.0 - sum(load) / max(sums["routed"], 1.0)
            for name in ("router_entropy", "aux_loss", "z_loss"):  # per micro-batch means
                s.extra[f"{p}/{name}"] = sums[name] / count
            if layer.router.cfg.bias_update_rate > 0:
                s.extra[f"{p}/expert_bias_spread"] = spread
