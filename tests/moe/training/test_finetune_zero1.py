"""Every fine-tuning method trains under DeepSpeed's BF16 optimizer (bf16, ZeRO 1, fp32
gradient reduction) as under its ZeRO 2 optimizer: the same losses and gradient norms. Without
moe/parallel/deepspeed_adapter.py's two changes to it, a run that trains no routed-expert
parameter (LoRA on attention, adapters, prompt, prefix) stopped at the engine's build (no MoE
optimizer group), and ESFT at its first step (no non-expert gradient for the norm)."""

from __future__ import annotations

import json

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.helpers.distributed import run_distributed
from tests.moe.tools.test_planning_finetune import VOCAB, engine_config

METHODS = ("lora", "adapter", "prompt", "prefix", "esft", "qlora")
STEPS = 3


def _trajectories(rank, world, cases, out_dir):
    """Losses and gradient norms of STEPS steps per (method, zero) case on this rank."""
    import moe.training.trainer as trainer
    from moe.training.trainer import DistEnv, build_engine

    trainer.initialize_from_checkpoint = lambda *args, **kwargs: None  # the seeded weights
    g = torch.Generator().manual_seed(11 + rank)
    batches = [torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(STEPS)]
    out = {}
    for method, zero in cases:
        raw = engine_config(method, "bf16", zero, world)
        if method == "lora":  # the configs' default targets: no routed-expert factor
            raw["finetune"]["lora"] = {"targets": ["attention.q", "attention.v"]}
        raw["train"]["grad_reduce_dtype"] = "fp32"
        engine, model = build_engine(from_dict(RunConfig, raw), DistEnv(rank, world, rank, world))
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        losses, norms = [], []
        for ids in batches:
            loss = engine(ids[:, :-1], ids[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            norms.append(float(engine.get_global_grad_norm()))
        moved = sorted(
            n for n, p in model.named_parameters() if not torch.equal(p.float(), before[n])
        )
        optimizer = type(engine.optimizer).__name__
        out[f"{method}-{zero}"] = {
            "losses": losses,
            "norms": norms,
            "moved": moved,
            "optimizer": optimizer,
        }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world, methods in ((1, METHODS), (2, ("lora", "esft"))):
        d = tmp_path_factory.mktemp(f"zero1_w{world}")
        cases = [(m, z) for m in methods for z in (1, 2)]
        run_distributed(_trajectories, world, cases, str(d))
        out[world] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, method", [(1, m) for m in METHODS] + [(2, "lora"), (2, "esft")])
def test_zero_1_trains_every_method_as_zero_2(runs, world, method):
    for rank, got in enumerate(runs[world]):
        one, two = got[f"{method}-1"], got[f"{method}-2"]
        assert one["optimizer"] == "BF16_Optimizer", one["optimizer"]
        assert two["optimizer"] == "DeepSpeedZeroOptimizer", two["optimizer"]
        torch.testing.assert_close(one["losses"], two["losses"], rtol=2e-3, atol=0)
        torch.testing.assert_close(one["norms"], two["norms"], rtol=2e-3, atol=0)
        assert all(n > 0 for n in one["norms"]), one["norms"]
        # The same parameters train, and only what the method trains.
        assert one["moved"] == two["moved"] and one["moved"], rank
        if method == "esft":
            assert all(".experts." in n for n in one["moved"]), one["moved"]
