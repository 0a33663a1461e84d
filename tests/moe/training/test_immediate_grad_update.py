"""``train.immediate_grad_update`` through the trainer's own engine (``build_engine``: bf16,
DeepSpeed ZeRO 1, which runs DeepSpeed's BF16 optimizer, on 2 gloo ranks with expert
parallelism 2 and 2 micro-batches per step).

Off, each bf16 gradient stays in ``.grad`` until the backward ends and is then added into the
fp32 accumulation buffer; on, a hook adds it as soon as the backward has produced it and frees
it. The same additions happen either way: the losses and gradient norms of three steps are
bitwise equal, and after each backward no parameter holds a bf16 gradient when it is on (and
every trained one does when it is off). A checkpoint saved with it off resumes with it on
exactly as with it off.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.helpers.engine_configs import resumed_losses, tiny_engine_dict, two_rank_results

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB, ACCUM, STEPS = 64, 16, 2, 2, 3


def run_config(immediate: bool) -> dict:
    train = {"micro_batch_size": MB, "grad_accum_steps": ACCUM, "seed": 5, "lr": 1e-2}
    train.update(warmup_steps=0, precision="bf16", immediate_grad_update=immediate)
    return tiny_engine_dict(
        VOCAB, SEQ, {"num_shared_experts": 1}, train, world_size=2, expert_parallel_size=2
    )


def _train(engine, batches) -> dict:
    """Steps over ``batches`` (ACCUM micro-batches each); per step the mean loss and the
    gradient norm, and per backward how many trained parameters still hold a gradient."""
    out = {"losses": [], "norms": [], "held": []}
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    for step in batches:
        losses = []
        for batch in step:
            loss = engine(batch[:, :-1], batch[:, 1:]).loss
            engine.backward(loss)
            out["held"].append(sum(p.grad is not None for p in trained))
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            losses.append(loss.item())
        out["losses"].append(sum(losses) / len(losses))
        out["norms"].append(float(engine.get_global_grad_norm()))
    out["trained"] = len(trained)
    return out


def _worker(rank, world, batches, ckpt_dir):
    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    my = [[b[rank::world] for b in step] for step in batches]  # each rank's share

    def engine_for(immediate):
        cfg = from_dict(RunConfig, copy.deepcopy(run_config(immediate)))
        return build_engine(cfg, env)[0]

    results = {}
    for immediate in (False, True):
        engine = engine_for(immediate)
        results[immediate] = _train(engine, my)
        results[f"optimizer_{immediate}"] = type(engine.optimizer).__name__
    results["resumed"] = resumed_losses(engine_for(False), engine_for(True), my, ckpt_dir, _train)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("immediate")
    return two_rank_results(_worker, tmp, VOCAB, 2 * MB, SEQ, ACCUM, STEPS)


def test_deepspeeds_bf16_optimizer_runs(results):
    assert results["optimizer_False"] == results["optimizer_True"] == "BF16_Optimizer"


def test_the_same_losses_and_norms_bitwise(results):
    off, on = results[False], results[True]
    assert torch.equal(torch.tensor(on["losses"]), torch.tensor(off["losses"]))
    assert torch.equal(torch.tensor(on["norms"]), torch.tensor(off["norms"]))
    assert off["losses"][-1] < off["losses"][0]  # it trains


def test_no_bf16_gradient_outlives_its_backward(results):
    off, on = results[False], results[True]
    assert on["held"] == [0] * (STEPS * ACCUM)
    assert off["held"] == [off["trained"]] * (STEPS * ACCUM)


def test_a_checkpoint_saved_without_it_resumes_with_it(results):
    assert torch.equal(torch.tensor(results["resumed"]), torch.tensor(results[False]["losses"][2:]))
