"""A model started from open weights (``model.init_from: hf:DIR``) on 2 ranks with expert
parallelism 2: each rank keeps its half of the imported experts, and the first loss of each
rank's micro-batch equals transformers' loss on it (the all-to-all dispatch moves tokens to the
imported experts that transformers computes them with)."""

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict, to_dict
from moe.training.trainer import DistEnv, build_engine
from moe.weights.hf import read_hf_model
from tests.helpers.distributed import run_distributed
from tests.moe.test_hf_import import make_hf

pytestmark = pytest.mark.multiprocess

SEQ = 16


def _worker(rank, world, hf_dir, batches, out_dir):
    _, model_cfg, _ = read_hf_model(hf_dir)
    model = to_dict(model_cfg)
    model["init_from"] = f"hf:{hf_dir}"
    cfg = from_dict(
        RunConfig,
        {
            "model": model,
            "data": {"seq_len": SEQ},
            "train": {"micro_batch_size": 2, "seed": 5},
            "parallel": {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 2},
        },
    )
    engine, wrapped = build_engine(cfg, DistEnv(rank, world, rank, world))
    experts = [layer.experts.w_in.shape[0] for layer in wrapped.moe_layers()]
    batch = batches[rank]
    with torch.no_grad():
        out = engine(batch[:, :-1], batch[:, 1:])
    torch.save(
        {"lm_loss": out.lm_loss, "local_experts": torch.tensor(experts)}, f"{out_dir}/rank{rank}.pt"
    )


def test_two_ranks_with_expert_parallelism_start_from_hf_weights(tmp_path):
    hf_dir, hf = make_hf(tmp_path, "mixtral")
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 96, (2, SEQ + 1), generator=g) for _ in range(2)]
    run_distributed(_worker, 2, str(hf_dir), batches, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert res["local_experts"].tolist() == [2, 2, 2]  # 4 experts over 2 ranks
        x, y = batches[rank][:, :-1], batches[rank][:, 1:]
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(
                hf(input_ids=x).logits.flatten(0, 1), y.flatten()
            )
        torch.testing.assert_close(res["lm_loss"], want, rtol=1e-4, atol=1e-4)
