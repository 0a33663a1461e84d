"""RouterBalance reads every layer's routing counters in one copy on logging steps only, and
publishes the same numbers the counters hold."""

from __future__ import annotations

import pytest
import torch

from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from moe.training.hooks import StepState
from moe.training.routing import RouterBalance
from tests.helpers.syncs import count_host_reads


def state(is_log: bool) -> StepState:
    return StepState(
        step=1,
        max_steps=2,
        loss=0.0,
        lm_loss=0.0,
        aux_loss=0.0,
        lr=0.0,
        grad_norm=None,
        step_seconds=1.0,
        tokens_per_step=1,
        samples_per_step=1,
        is_log_step=is_log,
    )


@pytest.mark.parametrize("is_log", [False, True])
def test_reads_once_per_logging_step_and_publishes_the_counters(is_log):
    torch.manual_seed(0)
    cfg = MoEConfig(
        num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2, bias_update_rate=0.01)
    )
    layers = [MoELayer(16, cfg), MoELayer(16, cfg)]
    for layer in layers:
        for _ in range(2):  # two micro-batches
            layer(torch.randn(2, 10, 16))
    loads = [layer.step_load_E.clone() for layer in layers]
    s = state(is_log)
    with count_host_reads() as reads:
        RouterBalance(layers).after_step(s)
    assert sum(reads.values()) == (1 if is_log else 0), reads
    for layer in layers:  # counters reset, bias moved either way
        assert layer.step_load_E.sum() == 0 and layer.router.score_bias.abs().sum() > 0
    if not is_log:
        assert not s.extra
        return
    for i, load in enumerate(loads):
        assert torch.equal(s.histograms[f"moe/layer{i}/expert_load"], load)
        assert s.extra[f"moe/layer{i}/dropped_fraction"] == pytest.approx(0.0)  # dropless
        assert s.extra[f"moe/layer{i}/max_over_mean_load"] == pytest.approx(
            float(load.max() / load.mean())
        )
        bias = layers[i].router.score_bias
        assert s.extra[f"moe/layer{i}/expert_bias_spread"] == pytest.approx(
            float(bias.max() - bias.min())
        )
