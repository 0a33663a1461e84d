"""launch.elastic with the real launcher: rank 1 of a 2-rank expert-parallel run is killed with
SIGKILL in step 4, and the restart finds one usable slot (declared through launch/elastic.py's
test-only channel). The run resumes from the step-2 checkpoint on 1 rank with expert parallelism
1 and twice the gradient accumulation, finishes, and matches the uninterrupted 2-rank run: the
same global batch at every step, every sample consumed once, the same loss per step (the global
batch's mean) up to float reordering."""

import json

import pytest

from launch.elastic import USABLE_SLOTS_ENV
from tests.helpers.fault_runs import (
    checkpoint_problems,
    launch,
    restarts,
    sample_problems,
    step_records,
    write_run_config,
)
from tests.integration.conftest import REFERENCE_STEPS, reference_dict

pytestmark = pytest.mark.integration

MAX_STEPS, GLOBAL_BATCH = REFERENCE_STEPS, 4  # 2 sequences per micro-batch x 1 x 2 ranks


def config(tiny_data, tmp_path, name):
    d = reference_dict(tiny_data, tmp_path / "runs", name)
    d["launch"] = {"elastic": True, "max_restarts": 1}
    return write_run_config(tmp_path / f"{name}.yaml", d)


def global_losses(run_dir, ranks) -> dict[int, float]:
    per_rank = [{r["step"]: r["loss"] for r in step_records(run_dir, rank)} for rank in ranks]
    return {s: sum(p[s] for p in per_rank) / len(ranks) for s in per_rank[0]}


def test_a_lost_slot_resumes_on_one_rank_with_the_same_global_batch(
    tiny_data, tmp_path, reference_run
):
    usable = tmp_path / "usable.json"
    usable.write_text(json.dumps({"localhost": 1}))
    plan = {
        "fired_dir": str(tmp_path / "fired"),
        "faults": [{"id": 0, "kind": "kill", "rank": 1, "step": 4, "phase": "backward"}],
    }
    proc = launch(
        config(tiny_data, tmp_path, "elastic"), plan=plan, env={USABLE_SLOTS_ENV: str(usable)}
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    run_dir = tmp_path / "runs" / "elastic"

    assert (
        "elastic: localhost has 1 usable slot(s) of 2; resuming on 1 rank(s) (was 2), "
        "grad_accum 2 (was 1), expert_parallel_size 1 (was 2), same global batch of "
        f"{GLOBAL_BATCH} sequences"
    ) in out
    (record,) = restarts(run_dir)
    assert record["resume"].endswith("step_0000002")
    assert record["elastic"]["world_size"] == 1 and record["elastic"]["grad_accum_steps"] == 2
    assert (
        "was saved on 2 rank(s) with expert parallelism 2; converted to 1 rank(s)"
        in (run_dir / "logs" / "rank0.log").read_text()
    )

    assert sample_problems(run_dir, MAX_STEPS, GLOBAL_BATCH, ranks=(0,)) == []
    got = global_losses(run_dir, ranks=(0,))
    want = global_losses(reference_run, ranks=(0, 1))
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in range(3, MAX_STEPS + 1):  # on 1 rank from step 3 on
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), step
    assert checkpoint_problems(run_dir) == []
