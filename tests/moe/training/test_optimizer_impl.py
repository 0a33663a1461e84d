"""``train.optimizer_impl`` and ``model.cross_entropy`` through the trainer's own engine
(``build_engine``: DeepSpeed ZeRO 1, one rank on gloo).

- optimizer_impl: DeepSpeed steps torch's AdamW once per parameter group on its flat fp32
  partition; the setting decides which of torch's implementations runs (counted by patching
  them), and the losses of four steps agree with for_loop: foreach exactly (the same arithmetic
  on the CPU), fused within rtol = atol = 1e-5 (its fused kernel rounds differently in the last
  bits; four steps at lr 1e-2 keep that far below 1e-5 in the loss). A checkpoint saved with
  one implementation loads into another and training goes on as if it had not changed.
- cross_entropy chunked: the same losses as full (fp32, 1e-5) and DeepSpeed's gradient norm
  likewise: the engine's hooks see the head weight's gradient of the chunked loss.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.helpers.distributed import run_distributed
from tests.helpers.engine_configs import tiny_engine_dict

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # nine engines: about 90 s

VOCAB, SEQ, MB, STEPS = 64, 16, 2, 4
IMPLS = ("for_loop", "foreach", "fused", "auto")


def run_config(**train) -> dict:
    return tiny_engine_dict(
        VOCAB,
        SEQ,
        train={"micro_batch_size": MB, "seed": 5, "lr": 1e-2, "warmup_steps": 0, **train},
    )


def _train(engine, batches) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for batch in batches:
        out = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def _worker(rank, world, batches, ckpt_dir, out_file):
    import torch.optim.adam as adam

    from moe.checkpoint.files import EXPERT_DIR
    from moe.training.trainer import DistEnv, build_engine

    calls = {}

    def counting(name, real):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return counted

    for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
        setattr(adam, name, counting(name, getattr(adam, name)))

    env = DistEnv(rank, world, rank, world)

    def engine_for(**train):
        return build_engine(from_dict(RunConfig, copy.deepcopy(run_config(**train))), env)[0]

    results = {}
    for impl in IMPLS:
        calls.clear()
        engine = engine_for(optimizer_impl=impl)
        losses, norms = _train(engine, batches)
        results[impl] = {
            "losses": losses,
            "calls": dict(calls),
            "groups": len(engine.optimizer.optimizer.param_groups),
        }
        if impl == "for_loop":
            results["full_norms"] = norms
    for impl in ("for_loop", "fused"):  # two steps, a save, then two more in another engine
        engine = engine_for(optimizer_impl=impl)
        _train(engine, batches[:2])
        (Path(ckpt_dir) / impl / EXPERT_DIR).mkdir(parents=True)  # the trainer's checkpointer does
        engine.save_checkpoint(ckpt_dir, tag=impl)
        other = engine_for(optimizer_impl="fused" if impl == "for_loop" else "for_loop")
        other.load_checkpoint(ckpt_dir, tag=impl)
        results[f"resumed_from_{impl}"] = _train(other, batches[2:])[0]
    chunked = build_engine(
        from_dict(
            RunConfig,
            {
                **copy.deepcopy(run_config(optimizer_impl="for_loop")),
                "model": {
                    **run_config()["model"],
                    "cross_entropy": "chunked",
                    "cross_entropy_chunk_tokens": 7,
                },
            },
        ),
        env,
    )[0]
    assert chunked.module.head_loss is not None
    results["chunked"], results["chunked_norms"] = _train(chunked, batches)
    torch.save(results, out_file)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("impl")
    torch.manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MB, SEQ + 1)) for _ in range(STEPS)]
    run_distributed(_worker, 1, batches, str(tmp / "ckpt"), str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt", weights_only=True)


def test_each_setting_runs_its_implementation_once_per_group_and_step(results):
    want = {
        "for_loop": "_single_tensor_adam",
        "foreach": "_multi_tensor_adam",
        "fused": "_fused_adam",
        "auto": "_single_tensor_adam",
    }  # auto on the CPU: for_loop
    for impl, name in want.items():
        r = results[impl]
        assert r["calls"] == {name: STEPS * r["groups"]}, (impl, r)


def test_the_losses_agree_with_for_loop(results):
    ref = torch.tensor(results["for_loop"]["losses"])
    assert torch.equal(torch.tensor(results["foreach"]["losses"]), ref)
    assert torch.equal(torch.tensor(results["auto"]["losses"]), ref)
    fused = torch.tensor(results["fused"]["losses"])
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    assert ref[-1] < ref[0]  # it trains


def test_a_checkpoint_loads_into_another_implementation(results):
    ref = torch.tensor(results["for_loop"]["losses"][2:])
    for impl in ("for_loop", "fused"):
        torch.testing.assert_close(
            torch.tensor(results[f"resumed_from_{impl}"]), ref, rtol=1e-5, atol=1e-5
        )


def test_the_chunked_loss_trains_as_the_full_loss_through_the_engine(results):
    torch.testing.assert_close(
        torch.tensor(results["chunked"]),
        torch.tensor(results["for_loop"]["losses"]),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        torch.tensor(results["chunked_norms"]),
        torch.tensor(results["full_norms"]),
        rtol=1e-5,
        atol=1e-5,
    )
