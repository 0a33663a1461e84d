"""train.router_lr_scale and train.expert_lr_scale: the routers' and the routed experts' learning
rates as multiples of train.lr, through the real engine (build_engine, ZeRO 2, the configured
AdamW and warm-up schedule). AdamW's first update is lr times a step that does not depend on lr
(m / sqrt(v) is the gradient's sign, up to eps), so from the same weights and batch each
parameter moves exactly its group's multiple of the unscaled run's update."""

import copy

import pytest
import torch

from moe.config.run import RunConfig, load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.training.trainer import DistEnv, build_engine
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ = 64, 16


def run_config(router: float, expert: float) -> dict:
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": SEQ,
            "moe": {"num_experts": 4, "expert_hidden": 16, "num_shared_experts": 1},
        },
        "data": {"seq_len": SEQ},
        "train": {
            "micro_batch_size": 4,
            "seed": 5,
            "router_lr_scale": router,
            "expert_lr_scale": expert,
            "warmup_steps": 2,
        },
        "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2},
    }


def _worker(rank, world, cfg_dicts, batch, out_file):
    deltas = []
    for cfg_dict in cfg_dicts:
        cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
        engine, model = build_engine(cfg, DistEnv(rank, world, rank, world))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(out.loss)
        engine.step()
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    torch.save(deltas, out_file)


def test_router_and_expert_learning_rates_scale_their_updates(tmp_path):
    torch.manual_seed(0)
    batch = torch.randint(0, VOCAB, (4, SEQ + 1))
    scales = [(1.0, 1.0), (3.0, 0.5), (0.0, 0.0)]
    run_distributed(_worker, 1, [run_config(*s) for s in scales], batch, str(tmp_path / "d.pt"))
    base, scaled, frozen = torch.load(tmp_path / "d.pt", weights_only=True)
    kinds = {"router": 0, "expert": 0, "other": 0}
    for name, d in base.items():
        if name.endswith("router.weight"):
            kind, factor = "router", 3.0
        elif ".experts." in name:
            kind, factor = "expert", 0.5
        else:
            kind, factor = "other", 1.0
        kinds[kind] += 1
        assert d.abs().max() > 0, name  # the unscaled run moves every parameter
        torch.testing.assert_close(scaled[name], factor * d, rtol=1e-4, atol=1e-9, msg=name)
        if kind == "other":
            assert torch.equal(frozen[name], d), name
        else:
            assert torch.equal(frozen[name], torch.zeros_like(d)), name
    # Two MoE layers: a router, the routed experts' tensors, and the shared experts (dense).
    assert kinds["router"] == 2 and kinds["expert"] >= 4 and kinds["other"] > 0


@pytest.mark.parametrize("key", ["router_lr_scale", "expert_lr_scale"])
def test_negative_or_infinite_scales_are_refused(tmp_path, key):
    for value in ("-1", "inf"):
        with pytest.raises(ConfigError, match=f"train.{key}"):
            load_config("configs/default.yaml", [f"train.{key}={value}"])
