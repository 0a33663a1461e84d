"""Activation recompute on 2 ranks with expert parallelism 2, through the trainer's engine
(``train.recompute`` applied by build_engine): the same gradients, losses and MoE step counters
as without recompute, and the all-to-all runs exactly as often per step (recompute never sends
tokens again)."""

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.trainer import DistEnv, build_engine
from tests.helpers.distributed import count_all_to_all, global_params, run_distributed

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB = 64, 16, 2
MODES = ("none", "full", "selective")


def run_config(mode: str) -> dict:
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 3,
            "n_heads": 4,
            "max_seq_len": SEQ,
            "moe": {
                "num_experts": 4,
                "expert_hidden": 16,
                "num_shared_experts": 1,
                "first_dense_layers": 1,
                "capacity_factor": 1.0,
                "router": {"top_k": 2, "z_loss_coef": 0.01, "bias_update_rate": 0.01},
            },
        },
        "data": {"seq_len": SEQ},
        "train": {
            "micro_batch_size": MB,
            "grad_accum_steps": 2,
            "grad_clip": 0.0,
            "seed": 11,
            "recompute": mode,
        },
        "parallel": {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 2},
    }


def _worker(rank, world, batches, out_dir):
    calls = count_all_to_all()
    results = {}
    for mode in MODES:
        cfg = from_dict(RunConfig, copy.deepcopy(run_config(mode)))
        engine, model = build_engine(
            cfg,
            DistEnv(rank, world, rank, world),
            make_optimizer=lambda g: torch.optim.SGD(g, lr=1.0),
        )
        assert any(b.recompute_attention for b in model.blocks) == (mode == "full")
        before = global_params(model, rank)
        calls[0] = 0
        losses = []
        for m in range(2):
            batch = batches[2 * m + rank]
            out = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(out.loss)
            losses.append(torch.stack([out.loss, out.aux_loss]).detach())
            engine.step()
        after = global_params(model, rank)
        results[mode] = {
            "grads": {n: before[n] - after[n] for n in before},
            "losses": torch.stack(losses),
            "counters": torch.stack(
                [torch.cat([layer.step_load_E, layer.step_sums]) for layer in model.moe_layers()]
            ),
            "all_to_all_calls": torch.tensor(calls[0]),
        }
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_recompute_on_two_ranks_changes_no_gradient_and_sends_no_token_again(tmp_path):
    torch.manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MB, SEQ + 1)) for _ in range(4)]
    run_distributed(_worker, 2, batches, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        ref = res["none"]
        # 2 MoE layers x 2 micro-batches x (forward: counts, tokens, weights, combine;
        # backward: tokens, weights, combine).
        assert int(ref["all_to_all_calls"]) == 2 * 2 * 7
        assert any(g.abs().max() > 1e-6 for n, g in ref["grads"].items() if "experts.w_in" in n)
        for mode in ("full", "selective"):
            got = res[mode]
            assert int(got["all_to_all_calls"]) == int(ref["all_to_all_calls"]), mode
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=0)
            torch.testing.assert_close(
                got["counters"],
                ref["counters"],
                rtol=0,
                atol=0,
                msg=f"rank {rank}, {mode}: MoE step counters",
            )
            for name, g in ref["grads"].items():
                torch.testing.assert_close(
                    got["grads"][name],
                    g,
                    rtol=1e-6,
                    atol=1e-12,
                    msg=f"rank {rank}, {mode}: gradient of {name}",
                )
