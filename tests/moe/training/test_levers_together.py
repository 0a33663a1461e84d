"""Every speed lever of the GPU stack at once (docs/gpu.md, the matrix's ``stack-no-graphs``:
compiled blocks, the chunked loss, the gather permutation, the fused query/key/value product,
fused AdamW, bf16 gradients folded as they are produced and DeepSpeed's gradient work by group)
through the trainer's own engine on 2 gloo ranks with expert parallelism 2, bf16, ZeRO 1, 2
micro-batches a step and clipping: the layout a multi-GPU run of the stack has, which one GPU
does not show.

- The stack trains as the default does: its losses within 2e-3 (relative) of the default's over
  four steps, and falling.
- The compiled blocks compile in the first step only (the expert all-to-alls run between
  compiled pieces on every rank).
- A checkpoint saved by the default resumes under the stack, and one saved by the stack under
  the default, each with the losses the other would have had, within the same rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.helpers.engine_configs import resumed_losses, tiny_engine_dict, two_rank_results

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB, ACCUM, STEPS = 64, 32, 2, 2, 4

STACK = {
    "model": {
        "cross_entropy": "chunked",
        "cross_entropy_chunk_tokens": 24,
        "qkv_projection": "fused",
    },
    "moe": {"permute": "gather"},
    "train": {
        "compile": True,
        "optimizer_impl": "fused",
        "immediate_grad_update": True,
        "flat_grad_ops": True,
    },
}


def run_config(stack: bool) -> dict:
    train = {"micro_batch_size": MB, "grad_accum_steps": ACCUM, "seed": 5, "lr": 1e-2}
    train.update(warmup_steps=0, precision="bf16", grad_clip=0.5)
    moe = {"num_shared_experts": 1}
    if stack:
        train.update(STACK["train"])
        moe.update(STACK["moe"])
    d = tiny_engine_dict(VOCAB, SEQ, moe, train, world_size=2, expert_parallel_size=2)
    if stack:
        d["model"].update(STACK["model"])
    return d


def _train(engine, batches) -> dict:
    from torch._dynamo.utils import counters

    out = {"losses": [], "graphs": []}
    for step in batches:
        losses = []
        for batch in step:
            loss = engine(batch[:, :-1], batch[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"].append(sum(losses) / len(losses))
        out["graphs"].append(counters["stats"]["unique_graphs"])
    return out


def _worker(rank, world, batches, ckpt_dir):
    import torch._dynamo

    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    my = [[b[rank::world] for b in step] for step in batches]  # each rank's share

    def engine_for(stack):
        torch._dynamo.reset()
        return build_engine(from_dict(RunConfig, copy.deepcopy(run_config(stack))), env)[0]

    results = {"default": _train(engine_for(False), my), "stack": _train(engine_for(True), my)}
    results["kinds"] = type(engine_for(True).optimizer).__name__
    results["default_then_stack"] = resumed_losses(
        engine_for(False), engine_for(True), my, f"{ckpt_dir}/a", _train
    )
    results["stack_then_default"] = resumed_losses(
        engine_for(True), engine_for(False), my, f"{ckpt_dir}/b", _train
    )
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("levers_together")
    return two_rank_results(_worker, tmp, VOCAB, 2 * MB, SEQ, ACCUM, STEPS)


def close(a: list[float], b: list[float]) -> None:
    # bf16 weights and activations, compiled against eager kernels, a chunked against a full
    # loss, gathers against scatter-adds: the same steps up to bf16 rounding (seen: at most
    # 7e-4 relative over four steps)
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=2e-3, atol=0)


def test_the_stack_trains_as_the_default_does(results):
    default, stack = results["default"]["losses"], results["stack"]["losses"]
    assert results["kinds"] == "BF16_Optimizer"
    assert stack[-1] < stack[0] and default[-1] < default[0]
    assert stack != default  # the levers did change the arithmetic
    close(stack, default)


def test_the_compiled_blocks_compile_in_the_first_step_only(results):
    graphs = results["stack"]["graphs"]
    assert graphs[0] > results["default"]["graphs"][-1]
    assert graphs[1:] == [graphs[0]] * (STEPS - 1), graphs


def test_checkpoints_resume_across_the_stack_both_ways(results):
    close(results["default_then_stack"], results["default"]["losses"][2:])
    close(results["stack_then_default"], results["stack"]["losses"][2:])
