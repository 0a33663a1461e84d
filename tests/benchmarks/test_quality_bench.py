"""benchmarks/quality_bench.py --quick trains through the real entry point and reports numbers
that follow from the validation losses the runs logged."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks import quality_bench

pytestmark = pytest.mark.multiprocess


def logged_valid(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("valid/loss")]


def test_quick_run_reports_what_the_runs_logged(tiny_data, tmp_path, capsys):
    out = tmp_path / "bench"
    summary = quality_bench.main(
        [
            "--quick",
            "--steps",
            "20",
            "--variants",
            "top1",
            "--seeds",
            "1",
            "--out",
            str(out),
            f"data.dir={tiny_data.dir}",
        ]
    )
    printed = capsys.readouterr().out
    assert (out / "validation_loss.png").stat().st_size > 1000
    assert (out / "results.json").exists()

    curves = {name: logged_valid(out / "runs" / f"{name}-seed0") for name in ("dense", "top1")}
    dense_final = curves["dense"][-1][1]
    for name, curve in curves.items():
        assert [s for s, _ in curve] == [10, 20]  # validation every 10 steps in --quick
        row = next(line for line in printed.splitlines() if line.startswith(name + " "))
        assert f"{curve[-1][1]:.4f} +- 0.0000" in row  # the final logged loss, printed
        assert summary[name]["final_mean"] == pytest.approx(curve[-1][1], abs=1e-6)
        # The crossing of dense's final loss, recomputed from the logged points.
        (s0, v0), (s1, v1) = curve
        if v0 <= dense_final:
            expected = s0 / 20
        elif v1 <= dense_final:
            expected = (s0 + (s1 - s0) * (v0 - dense_final) / (v0 - v1)) / 20
        else:
            expected = None
        got = summary[name]["steps_to_dense_ratio"]
        assert (got is None) == (expected is None)
        if expected is not None:
            assert got == pytest.approx(expected, abs=1e-9)
            assert f"{expected:.3f}" in row
        else:
            assert "not reached" in row
    assert summary["dense"]["steps_to_dense_ratio"] == pytest.approx(1.0)
    assert summary["dense"]["step_time_ratio"] == pytest.approx(1.0)
    assert summary["top1"]["step_time_ratio"] > 0
    # The variants really differ (top1 trains another model).
    assert curves["top1"] != curves["dense"]


def test_first_crossing_interpolates_between_evaluations():
    assert quality_bench.first_crossing([50, 100, 150], [5.0, 4.0, 3.0], 3.5) == 125.0
    assert quality_bench.first_crossing([50, 100], [3.0, 2.0], 3.5) == 50.0
    assert quality_bench.first_crossing([50, 100], [5.0, 4.0], 3.5) is None


def test_variants_keep_the_active_width():
    for name in quality_bench.VARIANTS:
        over = dict(o.split("=") for o in quality_bench.variant_overrides(name, 64, 2))
        if name == "dense":
            continue
        hidden = int(over.get("model.moe.expert_hidden", 64))
        k = int(over.get("model.moe.router.top_k", 2))
        shared = int(over.get("model.moe.num_shared_experts", 0))
        assert (k + shared) * hidden == 128, name


def test_levers_start_from_a_plain_moe_of_the_configs_active_width_and_recipe_restores_it():
    from moe.config.run import load_config

    cfg = load_config("configs/default.yaml")
    m = cfg.model.moe
    active = (m.router.top_k + m.num_shared_experts) * m.expert_hidden
    plain, recipe, hidden = quality_bench.plain_moe(m, cfg.train)
    assert hidden == active // 2
    base = load_config("configs/default.yaml", plain)
    assert (
        base.model.moe.num_experts,
        base.model.moe.router.top_k,
        base.model.moe.num_shared_experts,
        base.model.moe.router.renormalize,
        base.train.expert_lr_scale,
    ) == (8, 2, 0, False, 1.0)
    assert 2 * base.model.moe.expert_hidden == active
    again = load_config("configs/default.yaml", [*plain, *recipe])
    assert again.model.moe == m and again.train.expert_lr_scale == cfg.train.expert_lr_scale
