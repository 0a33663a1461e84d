"""Resuming on another parallel layout: a checkpoint saved with expert parallelism 2 on 2 ranks
continues on 1 rank, and a 1-rank checkpoint continues on 2 ranks with expert parallelism 2. The
steps after resuming must match continuing on the original layout (same global batch: 2 ranks x 1
micro-batch or 1 rank x 2 micro-batches read the same samples), which needs the weights, both Adam
moments of expert and non-expert parameters, the LR schedule and the router's score_bias. A part
with state that only registers itself (Tally) is carried through all of it, on the same layout
and on another, with no change to the checkpointer."""

import copy
import json

import pytest
import torch

from moe.checkpoint.files import MAIN_STATES, load_file
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.parallel.layout import read_layout_free
from moe.training.checkpoint import RESERVED_NAMES
from moe.training.hooks import LoopPart
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


class Tally(LoopPart):
    """A new part with state, known to nothing else: the steps it saw and the sum of their
    losses. Each rank appends what it was given on resume to RUN_DIR/tally_rank{R}.jsonl."""

    state_key = "tally"

    def __init__(self, run):
        self.path = run.cfg.run_dir / f"tally_rank{run.env.rank}.jsonl"
        self.steps, self.loss_sum = 0, 0.0

    def after_step(self, state):
        self.steps, self.loss_sum = self.steps + 1, self.loss_sum + state.loss

    def state_dict(self) -> dict:
        return {"steps": self.steps, "loss_sum": self.loss_sum}

    def load_state_dict(self, state) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(state) + "\n")
        self.steps, self.loss_sum = state["steps"], state["loss_sum"]


def _train_worker(rank, world, cfg_dict, resume, again=None):
    """Train ``cfg_dict`` from ``resume``; ``again``: then (config, checkpoint) of a run resumed
    on the same layout."""
    for d, start in ((cfg_dict, resume), *([again] if again else [])):
        cfg = from_dict(RunConfig, copy.deepcopy(d))
        train(cfg, DistEnv(rank, world, rank, world), resume=start, parts=[Tally])


def tally(tag_dir) -> dict:
    return load_file(tag_dir / MAIN_STATES)["tally"]


def loaded_tallies(run_dir, world) -> list[dict]:
    """What each rank's Tally was given (one resume per run)."""
    out = []
    for r in range(world):
        [line] = (run_dir / f"tally_rank{r}.jsonl").read_text().splitlines()
        out.append(json.loads(line))
    return out


def layout_dict(tiny_data, out_dir, name, world, max_steps, every):
    d = tiny_run_dict(
        tiny_data,
        out_dir,
        max_steps=max_steps,
        grad_accum_steps=2 // world,
        warmup_steps=1,
        lr=3e-3,
    )
    d["name"] = name
    d["parallel"] = {"world_size": world, "expert_parallel_size": world, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": every}
    d["logging"] = {"log_every": 1, "tensorboard": False}
    # Auxiliary-loss-free balancing: the router's score_bias buffer changes every step and
    # steers the expert choice, so it must be carried over too.
    d["model"]["moe"]["router"]["bias_update_rate"] = 0.01
    return d


def global_losses(run_dir, world) -> dict[int, float]:
    """The global batch's mean loss per step: the mean of the ranks' own losses."""
    per_rank = []
    for r in range(world):
        rows = [json.loads(line) for line in (run_dir / "logs" / f"steps_rank{r}.jsonl").open()]
        per_rank.append({row["step"]: row["loss"] for row in rows})
    return {s: sum(p[s] for p in per_rank) / world for s in per_rank[0]}


def assert_same_state(a_dir, b_dir):
    """Same weights, Adam moments and step, and the same router score_bias."""
    a, b = read_layout_free(a_dir), read_layout_free(b_dir)
    assert a["params"].keys() == b["params"].keys()
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name in a[key]:
            torch.testing.assert_close(
                b[key][name], a[key][name], rtol=1e-4, atol=1e-6, msg=f"{key} of {name}"
            )
    assert a["step"] == b["step"]
    bias_a = load_file(a_dir / MAIN_STATES)["module"]
    bias_b = load_file(b_dir / MAIN_STATES)["module"]
    for name in bias_a:
        if name.endswith("score_bias"):
            torch.testing.assert_close(bias_b[name], bias_a[name], rtol=0, atol=1e-6)


def assert_losses_match(got: dict, want: dict, steps: list[int]):
    assert sorted(got) == steps
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), step


def test_resume_on_another_layout_matches_the_original_layout(tiny_data, tmp_path):
    """EP 2 on 2 ranks -> 1 rank (EP 1) -> back to 2 ranks (EP 2). Each resumed run is compared
    with the run it was converted from, which went on without interruption (exact resume on
    the same layout is bitwise, so that is the same as continuing from the checkpoint)."""
    runs = tmp_path / "runs"
    # A: 2 ranks, EP 2, steps 1-7, checkpoints at 3, 6 and 7.
    run_distributed(_train_worker, 2, layout_dict(tiny_data, runs, "a", 2, 7, every=3), "auto")
    a3 = runs / "a" / "checkpoints" / "step_0000003"
    saved_bias = {
        k: v for k, v in load_file(a3 / MAIN_STATES)["module"].items() if k.endswith("score_bias")
    }
    assert any(v.abs().sum() > 0 for v in saved_bias.values())  # the check has teeth
    check_layout_free_state(a3)

    a_tally = tally(a3)
    assert a_tally["steps"] == 3 and a_tally["loss_sum"] > 0  # saved without the checkpointer
    client_names = {"data", "history", "nonfinite_guard", "tally"}
    main = load_file(a3 / MAIN_STATES)
    assert client_names <= main.keys()
    assert main.keys() - client_names <= set(RESERVED_NAMES)  # DeepSpeed's own entries

    # B: 1 rank, EP 1, resumed from A at step 3, steps 4-7, a checkpoint every step; then b2,
    # the same layout, resumed from B at step 5 to step 6.
    b2 = layout_dict(tiny_data, runs, "b2", 1, 6, every=1)
    b5 = runs / "b" / "checkpoints" / "step_0000005"
    run_distributed(
        _train_worker, 1, layout_dict(tiny_data, runs, "b", 1, 7, every=1), str(a3), (b2, str(b5))
    )
    assert loaded_tallies(runs / "b", 1) == [a_tally]  # another layout
    assert loaded_tallies(runs / "b2", 1) == [tally(b5)]  # the same layout
    assert tally(b5)["steps"] == 5
    a7, b7 = (tally(runs / name / "checkpoints" / "step_0000007") for name in ("a", "b"))
    assert b7["steps"] == a7["steps"] == 7 and b7["loss_sum"] == pytest.approx(a7["loss_sum"])
    assert tally(runs / "b2" / "checkpoints" / "step_0000006") == tally(
        runs / "b" / "checkpoints" / "step_0000006"
    )
    b_losses = global_losses(runs / "b", 1)
    assert_losses_match(b_losses, global_losses(runs / "a", 2), [4, 5, 6, 7])
    assert_same_state(
        runs / "a" / "checkpoints" / "step_0000007", runs / "b" / "checkpoints" / "step_0000007"
    )
    check_layout_free_state(b5)

    # C: 2 ranks, EP 2, resumed from B's 1-rank checkpoint at step 5, steps 6-7.
    run_distributed(_train_worker, 2, layout_dict(tiny_data, runs, "c", 2, 7, every=2), str(b5))
    assert loaded_tallies(runs / "c", 2) == [tally(b5)] * 2
    assert_losses_match(global_losses(runs / "c", 2), b_losses, [6, 7])
    assert_same_state(
        runs / "b" / "checkpoints" / "step_0000007", runs / "c" / "checkpoints" / "step_0000007"
    )


def check_layout_free_state(tag_dir):
    """The fp32 master weights rebuilt from the ZeRO partitions equal the module weights that
    DeepSpeed saved (non-expert file and per-expert files), and the moments are non-zero.
    DeepSpeed's own zero_to_fp32 agrees on these layouts (expert parallelism = world size; see
    test_zero_to_fp32.py for the layouts it cannot merge)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from moe.evaluation.evaluate import load_model
    from moe.parallel.layout import single_device_name

    state = read_layout_free(tag_dir)
    model, _, _ = load_model(tag_dir)
    params = dict(model.named_parameters())
    assert state["params"].keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(state["params"][name], p.detach(), rtol=0, atol=0, msg=name)
        assert state["exp_avg_sq"][name].abs().sum() > 0, name
    marker = json.loads((tag_dir / "checkpoint.json").read_text())
    assert set(state["step"].values()) == {float(marker["step"])}
    if marker["world_size"] == marker["expert_parallel_size"]:
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name)
        theirs = {single_device_name(k): v for k, v in theirs.items()}
        for name, p in params.items():
            torch.testing.assert_close(theirs[name], p.detach(), rtol=0, atol=0, msg=name)
