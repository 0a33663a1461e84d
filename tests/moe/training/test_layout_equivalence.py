"""Same global batch, same weights: 2 ranks with expert parallelism 2 must give the same loss,
the same gradient for every parameter and the same gradient norm as one process.

Both layouts use DeepSpeed ZeRO stage 2 and plain SGD (lr 1, no clipping), so a parameter's
update is exactly minus its reduced gradient; comparing updates compares gradients (Adam's first
step would hide a wrong gradient scale)."""

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.trainer import DistEnv, build_engine
from tests.helpers.distributed import global_params, run_distributed

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB = 64, 16, 2


def run_config(world: int, ep: int, accum: int, zero: int, moe: dict) -> dict:
    moe = dict(moe)
    model = moe.pop("model", {})  # model options beside the MoE ones
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": SEQ,
            "moe": {"num_experts": 4, "expert_hidden": 16, **moe},
            **model,
        },
        "data": {"seq_len": SEQ},
        "train": {"micro_batch_size": MB, "grad_accum_steps": accum, "grad_clip": 0.0, "seed": 11},
        "parallel": {"world_size": world, "expert_parallel_size": ep, "zero_stage": zero},
    }


def _worker(rank, world, cases, batches, out_dir):
    """Each case (tag, config) in turn, each with its own engine, in one process per rank."""
    for tag, cfg_dict in cases:
        cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
        ep = cfg.parallel.expert_parallel_size
        engine, model = build_engine(
            cfg,
            DistEnv(rank, world, rank, world),
            make_optimizer=lambda g: torch.optim.SGD(g, lr=1.0),
        )
        before = global_params(model, rank % ep)
        accum = cfg.train.grad_accum_steps
        losses = []
        for m in range(accum):
            batch = batches[m * world + rank]  # the global batch, split over ranks and micro-steps
            out = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.detach())
        after = global_params(model, rank % ep)
        torch.save(
            {
                "before": before,
                "after": after,
                "losses": torch.stack(losses),
                "grad_norm": torch.tensor(float(engine.get_global_grad_norm())),
            },
            f"{out_dir}/{tag}_rank{rank}.pt",
        )


def merged_results(out, tag, world):
    results = [
        torch.load(out / f"world{world}" / f"{tag}_rank{r}.pt", weights_only=True)
        for r in range(world)
    ]
    merged = {"before": {}, "after": {}}
    for res in results:
        for key in ("before", "after"):
            for name, value in res[key].items():
                if name in merged[key]:  # replicated parameters must agree across ranks
                    torch.testing.assert_close(merged[key][name], value, rtol=0, atol=0)
                merged[key][name] = value
    # Every rank's loss: the global batch's mean loss is their mean.
    losses = torch.cat([r["losses"] for r in results])
    return merged, losses.mean(), results[0]["grad_norm"]


MOES = {
    "dropless-top2": {},
    "dropping-shared-top1": {
        "capacity_factor": 1.0,
        "num_shared_experts": 1,
        "router": {"top_k": 1, "z_loss_coef": 0.01},
    },
    # Qwen2/3-MoE's and OLMoE's options: a gated shared expert (a replicated parameter
    # beside the experts), head_dim, q/k/v biases, query/key norms.
    "open-weights-options": {
        "num_shared_experts": 1,
        "shared_expert_gate": True,
        "router": {"renormalize": True},
        "model": {"head_dim": 12, "qkv_bias": True, "qk_norm": "head"},
    },
}
ZEROS = (1, 2)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every case on one process and on 2 ranks with expert parallelism 2: one start of each
    layout for all cases (a start costs more than the cases' steps)."""
    torch.manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MB, SEQ + 1)) for _ in range(2)]
    out = tmp_path_factory.mktemp("layouts")
    cases = [(f"{moe_id}-zero{zero}", moe, zero) for moe_id, moe in MOES.items() for zero in ZEROS]
    for world, ep, accum in ((1, 1, 2), (2, 2, 1)):
        (out / f"world{world}").mkdir()
        run_distributed(
            _worker,
            world,
            [(tag, run_config(world, ep, accum, zero, moe)) for tag, moe, zero in cases],
            batches,
            str(out / f"world{world}"),
        )
    return out


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("moe_id", list(MOES))
def test_ep2_on_two_ranks_equals_one_process(layouts, zero, moe_id):
    single, loss1, norm1 = merged_results(layouts, f"{moe_id}-zero{zero}", 1)
    multi, loss2, norm2 = merged_results(layouts, f"{moe_id}-zero{zero}", 2)

    assert single["before"].keys() == multi["before"].keys()
    for name in single["before"]:
        torch.testing.assert_close(single["before"][name], multi["before"][name], rtol=0, atol=0)
    torch.testing.assert_close(loss1, loss2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm1, norm2, rtol=1e-5, atol=1e-7)
    for name in single["before"]:
        g1 = single["before"][name] - single["after"][name]
        g2 = multi["before"][name] - multi["after"][name]
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
    # The check has teeth: expert gradients are not all zero.
    assert any(
        (single["before"][n] - single["after"][n]).abs().max() > 1e-6
        for n in single["before"]
        if "experts.w_in" in n
    )
