"""Host reads of tensor values (syncs on a GPU) in a training step of the real trainer.

Documented, per optimizer step: one ``tolist`` of the step's losses and gradient norm
(step.py) and one ``item`` of the all-reduced preemption flag (preemption.py); ``numpy`` of the
micro-batches' host copies for the step's token hash (not a device read). Per MoE layer
and micro-batch: none with the grouped expert kernel and local experts; one ``tolist`` of the
expert counts with the loop fallback (expert parallelism has its split-size read in its place,
tested in tests/moe/parallel). Statistics are read on logging steps only."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

ACCUM, MOE_LAYERS = 2, 2


def _train_counting(rank, world, cfg_dict, out_path, loop_fallback):
    from moe.model import experts
    from moe.training import prefetch
    from moe.training.trainer import DistEnv, resolve_vocab, train
    from tests.helpers.syncs import count_host_reads

    if loop_fallback:
        experts.grouped_mm_supported = lambda dtype, device: False
    cfg = resolve_vocab(from_dict(RunConfig, cfg_dict))
    snapshots = []
    real_next = prefetch.PrefetchingReader.next_step
    with count_host_reads() as reads:

        def marked(self):
            snapshots.append(Counter(reads))  # everything before belongs to the previous step
            return real_next(self)

        prefetch.PrefetchingReader.next_step = marked
        train(cfg, DistEnv(0, 1, 0, 1), resume="none")
    snapshots.append(Counter(reads))
    steps = [dict(b - a) for a, b in zip(snapshots, snapshots[1:])]
    with open(out_path, "w") as f:
        json.dump(steps, f)


def _by_site(reads: dict) -> Counter:
    """'training/trainer.py:231 tolist' -> 'training/trainer.py tolist' (line numbers move)."""
    out: Counter = Counter()
    for key, n in reads.items():
        where, method = key.split(" ")
        out[f"{where.split(':')[0]} {method}"] += n
    return out


@pytest.mark.parametrize(
    "loop_fallback,levers",
    [(False, False), (True, False), (False, True)],
    ids=["grouped", "loop", "grouped+levers"],
)
def test_a_non_logging_step_reads_only_what_is_documented(
    tiny_data, tmp_path, loop_fallback, levers
):
    """``levers``: the chunked loss, fused AdamW and the gather permutation (docs/gpu.md, "Speed
    levers") add no read."""
    import torch

    from moe.model.experts import grouped_mm_supported

    if not loop_fallback and not grouped_mm_supported(torch.float32, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take fp32 on the CPU in this torch")
    train = {"optimizer_impl": "fused"} if levers else {}
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=4, grad_accum_steps=ACCUM, **train)
    if levers:
        d["model"].update(cross_entropy="chunked", cross_entropy_chunk_tokens=20)
        d["model"]["moe"]["permute"] = "gather"
    d["model"]["moe"]["router"]["bias_update_rate"] = 0.001  # its update must not read either
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["logging"] = {"log_every": 1000}
    d["checkpoint"] = {"every_n_steps": 0}
    out = tmp_path / "reads.json"
    run_distributed(_train_counting, 1, d, str(out), loop_fallback)
    steps = json.loads(out.read_text())
    assert len(steps) == 4
    # numpy: the step's token hash for the step record, of the batches' host copies (never a
    # device read: the device gets its own copies).
    want = Counter(
        {
            "training/step.py tolist": 1,
            "training/resilience/preemption.py item": 1,
            "training/step.py numpy": ACCUM,
        }
    )
    if loop_fallback:
        want["model/experts.py tolist"] = MOE_LAYERS * ACCUM
    for step in (2, 3):  # steps 1 and 4 log (and step 4 saves)
        assert _by_site(steps[step - 1]) == want, steps[step - 1]
    # A logging step reads the routing statistics once, not per layer or micro-batch.
    logged = _by_site(steps[0])
    assert logged["training/routing.py tolist"] == 1
    assert logged["model/experts.py tolist"] == want["model/experts.py tolist"]
