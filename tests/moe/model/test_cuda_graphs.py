"""``train.cuda_graphs`` (docs/gpu.md, "Speed levers"): what the CPU can check.

A recorded graph's memory is overwritten by its next replay, and a new shape records a new
graph: the settings that would break either (gradients left in ``.grad`` at ZeRO 1 without
``train.immediate_grad_update``, expert parallelism, a capacity factor) and a missing
``train.compile`` are refused by config validation, by name; a CPU run is refused when the
engine is built. ``compile_blocks`` hands the blocks, and not the chunked loss's compiled part,
to torch.compile in mode "reduce-overhead"; inductor runs them on the CPU without graphs and
counts the skip, with eager's loss. tests/gpu/test_levers.py replays them on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.compile import compile_blocks
from moe.model.transformer import ModelConfig, MoETransformer
from tests.helpers.engine_configs import tiny_engine_dict

VOCAB, SEQ = 64, 16


def run_dict(moe: dict | None = None, **train) -> dict:
    train = {"compile": True, "cuda_graphs": True, **train}
    return tiny_engine_dict(VOCAB, SEQ, moe, train, zero_stage=2)


def test_the_settings_it_needs_are_accepted():
    for d in (
        run_dict(),  # ZeRO 2: DeepSpeed's hooks copy each gradient into its buckets
        {
            **run_dict(precision="bf16", immediate_grad_update=True),
            "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1},
        },
    ):
        assert from_dict(RunConfig, d).train.cuda_graphs


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d["train"].update(compile=False), "needs train.compile true"),
        (
            lambda d: d["parallel"].update(zero_stage=1),
            "at parallel.zero_stage 1 the gradients stay in the graph's memory",
        ),
        (
            lambda d: d["parallel"].update(world_size=2, expert_parallel_size=2),
            "needs parallel.expert_parallel_size 1 \\(got 2\\)",
        ),
        (
            lambda d: d["model"]["moe"].update(capacity_factor=1.25),
            "needs dropless routing",
        ),
    ],
    ids=["no-compile", "zero1-without-immediate", "expert-parallel", "capacity"],
)
def test_what_a_graph_cannot_keep_safe_is_refused_by_name(edit, message):
    d = run_dict()
    edit(d)
    with pytest.raises(ConfigError, match=f"train.cuda_graphs: {message}"):
        from_dict(RunConfig, d)


def test_a_run_without_cuda_is_refused_before_deepspeed_starts(monkeypatch):
    import deepspeed

    from moe.training.trainer import DistEnv, build_engine

    def never(*args, **kwargs):
        raise AssertionError("DeepSpeed was initialised")

    monkeypatch.setattr(deepspeed, "initialize", never)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = from_dict(RunConfig, run_dict())
    with pytest.raises(ConfigError, match="train.cuda_graphs: needs a CUDA device"):
        build_engine(cfg, DistEnv(0, 1, 0, 1))


def _model(**model) -> MoETransformer:
    d = copy.deepcopy(run_dict()["model"])
    d.update(model)
    torch.manual_seed(0)
    return MoETransformer(from_dict(ModelConfig, d))


def test_the_blocks_are_compiled_to_replay_graphs_and_the_loss_part_is_not(monkeypatch):
    modes = []
    real = torch.compile

    def recording(fn=None, **kwargs):
        modes.append((getattr(fn, "__name__", type(fn).__name__), kwargs.get("mode")))
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    model = _model(cross_entropy="chunked", cross_entropy_chunk_tokens=8)
    compile_blocks(model, backend="eager", cuda_graphs=True)
    assert modes.count(("_call_impl", "reduce-overhead")) == len(model.blocks) == 2
    assert ("chunk_loss_and_grads", None) in modes and len(modes) == 3
    modes.clear()
    compile_blocks(_model(), backend="eager")
    assert modes == [("_call_impl", None)] * 2


@pytest.mark.slow  # two inductor compiles of two blocks: about 20 s on 2 cores
def test_inductor_gets_the_mode_and_the_cpu_runs_it_without_graphs():
    from torch._dynamo.utils import counters

    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    want = _model()(ids[:, :-1], ids[:, 1:]).loss
    skips = {}
    for cuda_graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        compile_blocks(model, cuda_graphs=cuda_graphs)
        for _ in range(2):
            out = model(ids[:, :-1], ids[:, 1:])
            out.loss.backward()
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)
        skips[cuda_graphs] = counters["inductor"]["cudagraph_skips"]
    assert skips[False] == 0 and skips[True] >= 1, skips
