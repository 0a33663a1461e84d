"""What a training step of the real trainer keeps alive: the (B, S, V) logits of a micro-batch
are gone before its backward (and so before the next micro-batch's forward). Kept, they cost 2
bytes per logit in bf16 on top of the planner's working set: 1 GiB per rank at 8 x 2048 tokens
and a 32k vocabulary, the gap an H200 measured (BENCHMARKS.md, "Memory: the planner against
DeepSpeed's engine")."""

from __future__ import annotations

import json

import pytest

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

ACCUM, STEPS = 2, 3


def _train_watching_logits(rank, world, cfg_dict, out_path):
    import weakref

    from deepspeed.runtime.engine import DeepSpeedEngine

    from moe.model.transformer import MoETransformer
    from moe.training.trainer import DistEnv, resolve_vocab, train

    logits = []  # a weak reference to each training forward's logits
    alive_at_backward = []
    real_forward, real_backward = MoETransformer.forward, DeepSpeedEngine.backward

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training and out.loss is not None:
            logits.append(weakref.ref(out.logits))
        return out

    def backward(self, loss, *args, **kwargs):
        alive_at_backward.append(sum(ref() is not None for ref in logits))
        return real_backward(self, loss, *args, **kwargs)

    MoETransformer.forward, DeepSpeedEngine.backward = forward, backward
    train(resolve_vocab(from_dict(RunConfig, cfg_dict)), DistEnv(0, 1, 0, 1), resume="none")
    with open(out_path, "w") as f:
        json.dump({"forwards": len(logits), "alive": alive_at_backward}, f)


def test_no_logits_are_alive_at_a_backward(tiny_data, tmp_path):
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=STEPS, grad_accum_steps=ACCUM)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": 0}
    out = tmp_path / "alive.json"
    run_distributed(_train_watching_logits, 1, d, str(out))
    seen = json.loads(out.read_text())
    assert seen["forwards"] == STEPS * ACCUM, seen
    assert seen["alive"] == [0] * (STEPS * ACCUM), seen
