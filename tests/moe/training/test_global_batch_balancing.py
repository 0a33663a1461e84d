"""router.aux_loss_scope: global_batch balances over the whole global batch of a step: the same
global batch gives the same aux loss and the same gradients whether it is split into 4
micro-batches on 1 rank or 2 micro-batches on each of 2 ranks, and both equal the global batch
taken as one micro-batch with micro-batch balancing. Runs the real engine (build_engine, ZeRO 2,
gloo) and the trainer's counting pass (count_global_routing); plain SGD (lr 1), so a parameter's
update is its gradient."""

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from moe.training.step import count_global_routing
from moe.training.trainer import DistEnv, build_engine
from tests.helpers.distributed import run_distributed
from tests.moe.training.test_layout_equivalence import global_params

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, GLOBAL = 64, 16, 8  # 8 sequences per optimizer step


def run_config(world: int, accum: int, scope: str, ep: int = 1) -> dict:
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": SEQ,
            "moe": {
                "num_experts": 4,
                "expert_hidden": 16,
                "router": {"top_k": 2, "aux_loss_coef": 1.0, "aux_loss_scope": scope},
            },
        },
        "data": {"seq_len": SEQ},
        "train": {
            "micro_batch_size": GLOBAL // (world * accum),
            "grad_accum_steps": accum,
            "grad_clip": 0.0,
            "seed": 5,
        },
        "parallel": {"world_size": world, "expert_parallel_size": ep, "zero_stage": 2},
    }


def _worker(rank, world, cfg_dicts, batch, out_dir):
    for i, cfg_dict in enumerate(cfg_dicts):
        cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
        engine, model = build_engine(
            cfg,
            DistEnv(rank, world, rank, world),
            make_optimizer=lambda g: torch.optim.SGD(g, lr=1.0),
        )
        ep = cfg.parallel.expert_parallel_size
        before = global_params(model, rank % ep)
        mb, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
        # Micro-step m of rank r takes rows [(m * world + r) * mb, ...) of the global batch.
        micro = [batch[(m * world + rank) * mb : (m * world + rank + 1) * mb] for m in range(accum)]
        count_global_routing(engine, [(b[:, :-1], None) for b in micro])
        aux = []
        for b in micro:
            out = engine(b[:, :-1], b[:, 1:])
            engine.backward(out.loss)
            engine.step()
            aux.append(out.aux_loss.detach())
        torch.save(
            {"before": before, "after": global_params(model, rank % ep), "aux": torch.stack(aux)},
            f"{out_dir}/run{i}_rank{rank}.pt",
        )


def run_layouts(tmp_path, world, configs, batch, tag):
    out = tmp_path / tag
    out.mkdir()
    run_distributed(_worker, world, configs, batch, str(out))
    results = []
    for i in range(len(configs)):
        ranks = [torch.load(out / f"run{i}_rank{r}.pt", weights_only=True) for r in range(world)]
        grads = {}
        for res in ranks:
            for name in res["before"]:
                grads[name] = res["before"][name] - res["after"][name]
        # The step's aux loss: the mean over micro-batches and ranks (what DeepSpeed averages).
        results.append((torch.cat([r["aux"] for r in ranks]).mean(), grads))
    return results


def test_global_batch_balancing_is_independent_of_the_split(tmp_path):
    torch.manual_seed(0)
    batch = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1))
    (g14, g14_grads), (m14, _), (whole, whole_grads) = run_layouts(
        tmp_path,
        1,
        [
            run_config(1, 4, "global_batch"),
            run_config(1, 4, "micro_batch"),
            run_config(1, 1, "micro_batch"),
        ],
        batch,
        "one_rank",
    )
    [(g22, g22_grads), (g22ep, g22ep_grads)] = run_layouts(
        tmp_path,
        2,
        [run_config(2, 2, "global_batch"), run_config(2, 2, "global_batch", ep=2)],
        batch,
        "two_ranks",
    )

    # The global batch as one micro-batch is the reference; the option must reproduce it.
    for aux in (g14, g22, g22ep):
        torch.testing.assert_close(aux, whole, rtol=1e-6, atol=1e-7)
    # Teeth: micro-batch balancing of 4 micro-batches is a different loss.
    assert abs(m14 - whole) > 1e-4
    for grads in (g14_grads, g22_grads, g22ep_grads):
        assert grads.keys() == whole_grads.keys()
        for name in whole_grads:
            torch.testing.assert_close(
                grads[name], whole_grads[name], rtol=1e-4, atol=1e-6, msg=f"gradient of {name}"
            )
    assert any(g.abs().max() > 1e-4 for n, g in whole_grads.items() if "router" in n)


def test_counting_pass_sets_f_and_leaves_step_counters_alone():
    torch.manual_seed(0)
    cfg = MoEConfig(
        num_experts=4, expert_hidden=8, router=RouterConfig(top_k=1, aux_loss_scope="global_batch")
    )
    layer = MoELayer(16, cfg).train()
    x = torch.randn(2, 8, 16)
    from moe.model.moe_layer import counting_routes

    with torch.no_grad(), counting_routes([layer]):
        layer(x)
    assert layer.batch_counts_E.sum() == 16 and layer.step_sums.sum() == 0
    # Pretend the rest of the global batch went all to expert 0: f changes, so does the loss.
    _, own = layer(x)
    layer.batch_counts_E.copy_(torch.tensor([100.0, 0, 0, 0]))
    _, skewed = layer(x)
    probs = layer.router(x.reshape(16, 16)).scores_TE.mean(0)
    torch.testing.assert_close(skewed, cfg.router.aux_loss_coef * 4 * probs[0])
    assert not torch.allclose(own, skewed)


def test_global_batch_needs_batch_level_aux_loss():
    problems = RouterConfig(aux_loss_scope="global_batch", aux_loss_type="sequence").problems(8)
    assert any("aux_loss_scope" in p for p in problems)


def test_router_init_std_sets_the_router_weight_scale():
    from moe.model.router import TopKRouter

    torch.manual_seed(0)
    wide = TopKRouter(256, 64, RouterConfig(init_std=0.2)).weight.std()
    torch.manual_seed(0)
    default = TopKRouter(256, 64, RouterConfig()).weight.std()
    torch.testing.assert_close(wide, torch.tensor(0.2), rtol=0.02, atol=0)
    torch.testing.assert_close(default, torch.tensor(0.02), rtol=0.02, atol=0)
    assert RouterConfig(init_std=0.0).problems(8)
