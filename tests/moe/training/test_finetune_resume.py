"""Kill and resume is exact for every fine-tuning method: a run stopped after step 3 and resumed
from that checkpoint (2 ranks, expert parallelism 2, ZeRO 2) computes steps 4-6 bit for bit as
the uninterrupted run, and ends with the same weights. LoRA's own test is in test_finetune.py.

One spawn does all the work: the base run, then per method the uninterrupted and the resumed
run, each a real ``train`` (the process group lives on between them)."""

import copy
import json

import pytest
import torch

from moe.config.run import RunConfig
from moe.config_schema import from_dict
from moe.load import load_consolidated
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

STOP, STEPS = 3, 6
METHODS = {
    "full": {},
    "esft": {"esft": {"p": 0.5, "max_batches": 2}},
    "adapter": {"adapter": {"hidden": 8}},
    "prompt": {"prompt": {"tokens": 4}},
    "prefix": {"prefix": {"tokens": 4}},
}


def _config(data, runs, name: str, **finetune) -> dict:
    # Router jitter and weight decay: a resumed run must restore the random state and every
    # optimizer moment, not only the weights.
    d = tiny_run_dict(data, runs, max_steps=STEPS if finetune else 2, lr=2e-2, min_lr=0.0,
                      warmup_steps=1, weight_decay=0.1)
    d["model"]["moe"]["router"]["jitter_eps"] = 0.01
    d.update(name=name, checkpoint={"every_n_steps": STOP})
    d["logging"]["tensorboard"] = False
    if finetune:
        d["model"]["init_from"] = str(runs / "base" / "checkpoints" / "step_0000002")
        d["finetune"] = finetune
    return d


def _worker(rank, world, data, runs):
    def run(d, resume):
        train(from_dict(RunConfig, copy.deepcopy(d)), DistEnv(rank, world, rank, world), resume)

    run(_config(data, runs, "base"), "auto")
    for method, settings in METHODS.items():
        d = _config(data, runs, method, method=method, **settings)
        run(d, "auto")
        run({**d, "name": f"{method}-resumed"},
            str(runs / method / "checkpoints" / f"step_{STOP:07d}"))


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("finetune_resume") / "runs"
    run_distributed(_worker, 2, tiny_data, runs)
    return runs


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "logs" / "steps_rank0.jsonl").open()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize("method", METHODS)
def test_stopped_run_resumes_exactly(runs, method):
    whole, resumed = _losses(runs / method), _losses(runs / f"{method}-resumed")
    assert sorted(whole) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == whole[step], (step, resumed[step], whole[step])
    assert whole[STEPS] != whole[STOP + 1]  # the steps compared train something
    tuned, cfg, _ = load_consolidated(runs / method)
    again, _, _ = load_consolidated(runs / f"{method}-resumed")
    assert again.keys() == tuned.keys()
    for key, value in tuned.items():
        assert torch.equal(again[key], value), key
    base, _, _ = load_consolidated(runs / "base")
    moved = [k for k in tuned if k not in base or not torch.equal(tuned[k], base[k])]
    added = {"full": [], "esft": [], "adapter": [".adapter."], "prompt": ["embed.prompt"],
             "prefix": [".prefix_"]}[method]
    if method == "full":
        # every parameter trained (the routers' selection bias is a buffer, off here)
        assert {k for k in base if k not in moved} == {f"blocks.{i}.ffn.router.score_bias"
                                                       for i in range(2)}
    elif method == "esft":
        assert moved and all(".experts.w_" in k for k in moved), moved
    else:  # the added parameters only, and they trained
        assert moved and all(any(a in k for a in added) for k in moved), moved
