"""The model's profiler ranges (moe/model/regions.py): every range opens under a profiler, none
opens without one (the no-op is returned and record_function is never called), and inside
compiled blocks they are no-ops that add no graph break and no recompile, also when a
profiler is turned on after the blocks were compiled."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moe.model import regions
from moe.model.compile import compile_blocks
from moe.model.moe_layer import MoEConfig
from moe.model.recompute import apply_recompute
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig, MoETransformer

VOCAB, B, S = 64, 2, 16


def tiny_model(seed: int = 0) -> MoETransformer:
    """A dense first layer, then MoE layers with a shared expert: every range is reached."""
    torch.manual_seed(seed)
    moe = MoEConfig(
        num_experts=4,
        expert_hidden=16,
        num_shared_experts=1,
        first_dense_layers=1,
        router=RouterConfig(top_k=2),
    )
    return MoETransformer(
        ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, max_seq_len=S, moe=moe)
    )


def step(model: MoETransformer, g: torch.Generator) -> torch.Tensor:
    x_BS = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    loss = model(x_BS[:, :-1], x_BS[:, 1:]).loss
    loss.backward()
    return loss.detach()


def range_names(prof) -> set[str]:
    return {e.name for e in prof.events() if e.name in regions.RANGES}


def test_every_range_opens_under_a_profiler():
    model = tiny_model()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, torch.Generator().manual_seed(1))
    assert range_names(prof) == set(regions.RANGES)


def test_without_a_profiler_no_range_is_opened(monkeypatch):
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler running")

    monkeypatch.setattr(regions, "record_function", refuse)
    assert regions.region(regions.HEAD) is regions.region(regions.ATTENTION) is regions._OFF
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    loss = step(tiny_model(), g1)
    monkeypatch.undo()
    with profile(activities=[ProfilerActivity.CPU]):
        profiled = step(tiny_model(), g2)
    assert torch.equal(loss, profiled)  # the ranges change nothing that is computed


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_neither_break_nor_recompile_for_the_ranges(recompute):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    apply_recompute(model, recompute)
    compile_blocks(model, backend="eager")  # dynamo's tracing and guards; no code generation
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        step(model, g)
    graphs = counters["stats"]["unique_graphs"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, g)
    step(model, g)
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs  # no recompile
    assert sum(counters["graph_break"].values()) == 0
    # Inside the compiled blocks the ranges are no-ops; around them (head, embedding) they open.
    # (With recompute, the "eager" back end reruns the checkpointed Python code in the
    # backward, outside any traced graph, where its ranges open.)
    names = range_names(prof)
    assert {regions.HEAD, regions.EMBEDDING} <= names
    if recompute == "none":
        assert not names & {regions.BLOCK, regions.NORM, regions.EXPERTS, regions.ROUTER}
