"""The settings matrix (benchmarks/gpu_speed_matrix.py): the order of its interleaved rounds, the
budget it enforces, the ratio arithmetic, and the summary it leaves when cut short, with a
stand-in runner on a simulated clock and, for the process handling, a stand-in worker
process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_speed_matrix as gm  # noqa: E402
from matrix_report import best_settings, summary_rows  # noqa: E402
from plain_settings import EAGER  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """Answers tasks at a cost in simulated seconds: ``cost(setting, model, nth)`` (nth: the
    pair's nth run, from 1) and ``speed(setting, model, nth)`` tokens/s; ``skip`` maps
    (setting, model) to a reason, ``errors`` holds the (setting, model, nth) runs that fail; a
    cost over the timeout is a run ended at it (None)."""

    def __init__(
        self, clock, cost=lambda s, m, n: 10.0, speed=lambda s, m, n: 100.0, skip=None, errors=()
    ):
        self.clock, self.cost, self.speed = clock, cost, speed
        self.skip, self.errors = skip or {}, set(errors)
        self.calls: list[tuple[str, str]] = []
        self.hello = {"device": "Fake GPU"}

    def run(self, task, timeout):
        s, m = task["label"], task["model"]
        if task.get("check"):
            reason = self.skip.get((s, m))
            return {"status": "skipped", "reason": reason} if reason else {"status": "ok"}
        self.calls.append((s, m))
        n = self.calls.count((s, m))
        cost = self.cost(s, m, n)
        if cost > timeout:
            self.clock.t += timeout
            return None
        self.clock.t += cost
        if (s, m, n) in self.errors:
            return {"status": "error", "reason": "CUDA out of memory"}
        row = {
            "tokens_per_s": self.speed(s, m, n),
            "mfu": self.speed(s, m, n) / 1000,
            "warmup_s": 1.0 + (cost - 10.0 if "+compile" in s or s == "compile" else 0.0),
        }
        return {
            "status": "ok",
            "row": row,
            "profile": {"model": m, "setting": s} if task.get("profile_steps") else None,
        }


def matrix(
    settings, runner, clock, *, models=("dense", "moe"), deadline=1000.0, run_deadline=900.0, **kw
) -> gm.Matrix:
    return gm.Matrix(
        settings,
        models,
        runner,
        clock=clock,
        deadline=deadline,
        run_deadline=run_deadline,
        run_estimate=10.0,
        compile_estimate=50.0,
        **kw,
    )


def plain(*names):
    return [gm.Setting("default")] + [gm.Setting(n, (f"x.{n}=1",)) for n in names]


def test_settings_are_the_default_each_lever_then_the_compiled_levers():
    levers = [
        gm.Lever("compile", ("train.compile=true",)),
        gm.Lever("a", ("x.a=1",), ("cuda",), compiled=True),
        gm.Lever("b", ("x.b=1",)),
    ]
    got = [(s.name, s.overrides, s.needs, s.compiled) for s in gm.settings_of(levers)]
    assert got == [
        ("default", (), (), False),
        ("compile", ("train.compile=true",), (), True),
        ("a", ("x.a=1",), ("cuda",), False),
        ("b", ("x.b=1",), (), False),
        ("a+compile", ("x.a=1", "train.compile=true"), ("cuda",), True),
    ]
    names = [lv.name for lv in gm.LEVERS]
    assert len(set(names)) == len(names) and names[:2] == ["eager", "compile"]
    # the CUDA defaults against the plain settings first, with graphs, then each undone
    ablations = [lv.name for lv in gm.ABLATIONS]
    assert names[2:4] == ["stack", "stack-no-graphs"] and names[4 : 4 + len(ablations)] == ablations
    assert names[4 + len(ablations)] == "cuda-graphs"
    eager = next(lv for lv in gm.LEVERS if lv.name == "eager")
    assert eager.overrides == EAGER and not eager.needs


def test_a_combination_sets_every_lever_and_keeps_model_levers_to_their_models():
    a = gm.Lever("a", ("x.a=1", "x.shared=2"), ("cuda",), compiled=True)
    b = gm.Lever("b", ("x.b=1", "x.shared=2"), ("bf16",))
    m = gm.Lever("m", ("x.m=1",), ("moe", "cuda"))
    ab_m = gm.combine("ab-m", [a, b, m], "note")
    assert ab_m.overrides == ("x.a=1", "x.shared=2", "x.b=1")  # once each, in order
    assert ab_m.needs == ("cuda", "bf16")  # "moe" does not skip the combination on dense
    assert ab_m.where == ((("x.m=1",), ("moe",)),)
    assert ab_m.note == "note" and not ab_m.compiled
    nested = gm.combine("nested", [ab_m, gm.Lever("c", ("x.c=1",))])
    assert nested.where == ab_m.where and nested.overrides[-1] == "x.c=1"
    with pytest.raises(ValueError, match="x.shared is set to both '2' and '3'"):
        gm.combine("bad", [a, gm.Lever("c", ("x.shared = 3",))])
    with pytest.raises(ValueError, match="x.m is set to both"):
        gm.combine("bad", [m, gm.Lever("c", ("x.m=2",))])
    (setting,) = [s for s in gm.settings_of([ab_m]) if s.name == "ab-m"]
    assert setting.where == ab_m.where
    task = matrix([setting], None, Clock()).task(setting, "moe")
    assert task["where"] == [[["x.m=1"], ["moe"]]] and task["needs"] == ["cuda", "bf16"]


def test_levers_given_with_a_plus_are_measured_together(capsys):
    args = gm.parse_args(["out", "--levers", "compile,adamw-fused+permute-gather,stack"])
    names = [lv.name for lv in args.lever_list]
    assert names == ["compile", "adamw-fused+permute-gather", "stack"]
    both = args.lever_list[1]
    assert both.overrides == ("train.optimizer_impl=fused",)
    assert both.where == ((("model.moe.permute=gather",), ("moe",)),)
    settings = [s.name for s in gm.settings_of(args.lever_list)]
    assert settings == ["default", "compile", "adamw-fused+permute-gather", "stack"]
    # "a+compile" given by hand is not measured twice
    args = gm.parse_args(["out", "--levers", "ce-chunked,ce-chunked+compile"])
    assert [s.name for s in gm.settings_of(args.lever_list)] == [
        "default",
        "ce-chunked",
        "ce-chunked+compile",
    ]
    for bad, said in (
        ("compile+nope", "unknown nope"),
        ("stack+zero-2", "parallel.zero_stage is set to both '1' and '2'"),
    ):
        with pytest.raises(SystemExit):
            gm.parse_args(["out", "--levers", bad])
        assert said in capsys.readouterr().err


def test_rounds_interleave_the_settings_with_a_default_run_in_every_round():
    clock = Clock()
    runner = FakeRunner(clock)
    m = matrix(plain("a", "b"), runner, clock)
    m.run()
    order = [s for s, _ in runner.calls[:-2]]  # the last two: the profiles of the fastest
    assert (
        order
        == ["default"] * 2
        + ["a"] * 2
        + ["b"] * 2
        + ["a"] * 2
        + ["b"] * 2
        + ["default"] * 2
        + ["b"] * 2
        + ["default"] * 2
        + ["a"] * 2
    )
    assert [mod for _, mod in runner.calls[:6]] == ["dense", "moe"] * 3
    assert m.status == "complete" and {r.round for r in m.runs} == {1, 2, 3}


def test_a_ratio_is_the_median_of_the_rounds_ratios_to_their_own_default():
    clock = Clock()
    speeds = {"default": [100, 300, 200], "a": [150, 300, 180]}  # the machine drifts
    runner = FakeRunner(clock, speed=lambda s, m, n: speeds[s][(n - 1) % 3])
    m = matrix(plain("a"), runner, clock, models=("moe",))
    m.run()
    rows = {r["setting"]: r for r in summary_rows(m)}
    a = rows["a"]
    # Ratios 1.5, 1.0, 0.9: median 1.0 (the medians' ratio, 180 / 200, would say 0.9).
    assert (a["ratio"], a["ratio_min"], a["ratio_max"]) == (1.0, 0.9, 1.5)
    assert (a["tokens_per_s"], a["tokens_per_s_min"], a["tokens_per_s_max"]) == (180, 150, 300)
    assert a["mfu"] == 0.18 and a["runs"] == 3 and a["device"] == "Fake GPU"
    assert rows["default"]["ratio"] == 1.0
    # Equal median ratios: the median tokens/s decides; that setting is profiled.
    assert best_settings(list(rows.values()))["moe"]["setting"] == "default"
    assert [p["setting"] for p in m.profiles] == ["default"]


def test_a_setting_is_admitted_only_when_all_its_rounds_fit():
    clock = Clock()
    settings = [
        gm.Setting("default"),
        gm.Setting("a", ("x.a=1",)),
        gm.Setting("b", ("x.b=1", gm.COMPILE)),
        gm.Setting("c", ("x.c=1",)),
    ]
    # 10 s a run; b's first run compiles for 50 s more (its estimate says 50 as well).
    runner = FakeRunner(clock, cost=lambda s, m, n: 60.0 if (s, n) == ("b", 1) else 10.0)
    m = matrix(settings, runner, clock, models=("moe",), run_deadline=160.0, deadline=200.0)
    m.run()
    # default, a, b (60) run round 1 by t = 80; c's 30 s do not fit with the 60 s promised to
    # the later rounds of the three (80 + 60 + 30 > 160); those rounds end at t = 140, and the
    # 20 s left hold one round of c with its own default run.
    assert m.status == "complete" and m.not_admitted == []
    assert [s for s, _ in runner.calls[:11]] == [
        "default",
        "a",
        "b",
        "a",
        "b",
        "default",
        "b",
        "default",
        "a",
        "default",
        "c",
    ]
    assert len(runner.calls) == 12 and clock.t == 170.0  # then one profile run
    # b's later rounds were estimated without its compile (from its warm-up over the default's).
    assert m.estimate(settings[2], "moe", first=False) == 10.0
    row_c = next(r for r in summary_rows(m) if r["setting"] == "c")
    assert row_c["runs"] == 1 and row_c["ratio"] == 1.0


def test_the_budget_ends_runs_that_overrun_and_starts_none_that_cannot_fit():
    clock = Clock()
    # Round 2 runs take 200 s instead of 10: each is ended at its time limit.
    runner = FakeRunner(clock, cost=lambda s, m, n: 200.0 if n == 2 else 10.0)
    m = matrix(plain("a"), runner, clock, models=("moe",), run_deadline=175.0, deadline=200.0)
    m.run()
    statuses = [(r.setting, r.round, r.status) for r in m.runs]
    # t = 20 after round 1; round 2's two runs are each ended after max(3 x 10, 10 + 60) = 70 s;
    # in round 3 the default runs (t = 170) and a, 10 s with 5 s left, is not started.
    assert statuses == [
        ("default", 1, "ok"),
        ("a", 1, "ok"),
        ("a", 2, "timeout"),
        ("default", 2, "timeout"),
        ("default", 3, "ok"),
        ("a", 3, "not run"),
    ]
    assert m.status == "out of time" and clock.t <= 200.0
    ended = next(r for r in m.runs if r.status == "timeout")
    assert ended.wall_s == pytest.approx(70.0)


def test_time_the_admitted_settings_leave_goes_to_the_others_with_default_runs():
    clock = Clock()
    # a's first run takes 30 s and promises 30 s rounds, which take 10: b and c are refused in
    # round 1 (40 + 80 promised + 30 > 130); at t = 80 the spare time runs rounds 4 and 5 of b,
    # each with a default run (b first in round 5), until a sixth would pass 130. c gets none.
    runner = FakeRunner(
        clock,
        cost=lambda s, m, n: 30.0 if (s, n) == ("a", 1) else 10.0,
        speed=lambda s, m, n: {"default": 100.0, "b": 150.0}.get(s, 90.0),
    )
    m = matrix(
        plain("a", "b", "c"), runner, clock, models=("moe",), run_deadline=130.0, deadline=200.0
    )
    m.run()
    assert [s for s, _ in runner.calls[:10]] == [
        "default",
        "a",
        "a",
        "default",
        "default",
        "a",
        "default",
        "b",
        "b",
        "default",
    ]
    assert [(r.setting, r.round) for r in m.runs[-4:]] == [
        ("default", 4),
        ("b", 4),
        ("b", 5),
        ("default", 5),
    ]
    assert m.not_admitted == ["c"] and m.status == "complete"
    rows = {r["setting"]: r for r in summary_rows(m)}
    assert rows["b"]["runs"] == 2 and rows["b"]["ratio"] == 1.5 and rows["default"]["runs"] == 5
    assert rows["c"]["runs"] == 0 and "not admitted" in rows["c"]["note"]


def test_skipped_pairs_and_failed_settings_are_reported_and_not_retried():
    clock = Clock()
    runner = FakeRunner(clock, skip={("a", "dense"): "needs moe"}, errors={("b", "dense", 1)})
    m = matrix(plain("a", "b"), runner, clock)
    m.run()
    assert ("a", "dense") not in runner.calls and runner.calls.count(("a", "moe")) == 3
    assert runner.calls.count(("b", "dense")) == 1 and runner.calls.count(("b", "moe")) == 3
    rows = {(r["model"], r["setting"]): r for r in summary_rows(m)}
    assert rows[("dense", "a")]["note"] == "needs moe" and rows[("dense", "a")]["runs"] == 0
    assert "round 1: error CUDA out of memory" in rows[("dense", "b")]["note"]


FAKE_WORKER = r"""
import json, os, sys, time
hang_at = int(os.environ.get("FAKE_HANG_AT", "0"))
die_at = int(os.environ.get("FAKE_DIE_AT", "0"))
print("noise before the protocol", flush=True)
print(json.dumps({"hello": {"device": "Fake GPU", "torch": "0"}}), flush=True)
with open(os.environ["FAKE_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\n")
n = 0
for line in sys.stdin:
    task = json.loads(line)
    if not task.get("check"):
        n += 1
        if n == hang_at:
            time.sleep(3600)
        if n == die_at and len(open(os.environ["FAKE_PIDS"]).read().split()) == 1:
            sys.exit(3)  # the first worker only
        time.sleep(float(os.environ.get("FAKE_SECONDS", "0.2")))
    row = {"tokens_per_s": 100.0 + n, "mfu": 0.1, "warmup_s": 0.1}
    row.update(peak_mem=11 * 2**30, peak_reserved=13 * 2**30, planned_mem=10 * 2**30)
    print(json.dumps({"id": task["id"], "status": "ok", "row": row}), flush=True)
"""


def start_matrix(tmp_path, budget, **env):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_speed_matrix.py"),
        str(out),
        "--budget",
        str(budget),
        "--levers",
        "compile,expert-loop",
        "--profile-reserve",
        "2",
        "--run-estimate",
        "1",
        "--compile-estimate",
        "1",
        "--worker-cmd",
        f"{sys.executable} {worker}",
    ]
    env = {**os.environ, "FAKE_PIDS": str(tmp_path / "pids"), **env}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ), out


def wait_for_runs(out: Path, n: int, timeout: float = 60) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            rows = json.loads((out / "matrix.json").read_text())["rows"]
            if sum(r["runs"] for r in rows) >= n:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} runs after {timeout} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_matrix_cut_short_leaves_its_summary(tmp_path, sig):
    proc, out = start_matrix(tmp_path, budget=300, FAKE_SECONDS="0.3")
    wait_for_runs(out, 3)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    summary = json.loads((out / "matrix.json").read_text())
    done = sum(r["runs"] for r in summary["rows"])
    assert done >= 3 and {r["device"] for r in summary["rows"]} == {"Fake GPU"}
    md = (out / "matrix.md").read_text()
    if sig == signal.SIGTERM:
        assert proc.returncode == 1 and summary["status"] == "cut short (SIGTERM)"
        assert md.startswith("# Settings matrix: cut short (SIGTERM)")
        pid = int((tmp_path / "pids").read_text().split()[0])
        assert not alive(pid)  # the worker was ended with the matrix
    else:  # nothing could run at the kill: the last summary, written after a run, is whole
        assert summary["status"] == "running" and md.startswith("# Settings matrix: running")
        os.killpg(int((tmp_path / "pids").read_text().split()[0]), signal.SIGKILL)


def test_a_hanging_run_is_ended_at_the_budget(tmp_path):
    t0 = time.monotonic()
    proc, out = start_matrix(tmp_path, budget=20, FAKE_HANG_AT="4", FAKE_SECONDS="0.05")
    stdout, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 35, stderr[-2000:]
    summary = json.loads((out / "matrix.json").read_text())
    assert proc.returncode == 1 and summary["status"] == "out of time", stdout[-2000:]
    rounds = [b for r in summary["rows"] for b in r["by_round"]]
    assert [b["status"] for b in rounds].count("timeout") == 1
    assert not alive(int((tmp_path / "pids").read_text().split()[0]))


def test_a_worker_that_dies_is_replaced_and_its_run_marked(tmp_path):
    proc, out = start_matrix(tmp_path, budget=60, FAKE_DIE_AT="3", FAKE_SECONDS="0.05")
    stdout, stderr = proc.communicate(timeout=120)
    summary = json.loads((out / "matrix.json").read_text())
    assert summary["status"] == "complete" and proc.returncode == 0, stdout[-2000:]
    rows = {(r["model"], r["setting"]): r for r in summary["rows"]}
    died = rows[("dense-125m", "compile")]
    assert died["runs"] == 0 and "the worker died (exit status 3" in died["note"]
    assert rows[("moe-125m", "compile")]["runs"] == 3  # the new worker ran the rest
    assert rows[("moe-125m", "compile")]["planned_mem"] == 10 * 2**30
    # the memory target's figure: the peak against moe-plan's total
    # and what the allocator held (a CUDA graph pool's memory shows there only)
    assert "| 11.0 | 13.0 | 1.10x |" in (out / "matrix.md").read_text()
    assert rows[("moe-125m", "expert-loop")]["runs"] == 3
    assert len((tmp_path / "pids").read_text().split()) == 2
    assert (out / "worker.log").read_text().count("starting the worker") == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_cpu_rehearsal_measures_and_profiles_through_the_real_worker(tmp_path):
    """The real worker (gpu_train_bench.py --serve) on the tiny models: every run measured,
    the lever that needs a GPU skipped, the fastest setting profiled."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_speed_matrix.py"),
            str(out),
            "--device",
            "cpu",
            "--tiny",
            "--models",
            "tiny-moe",
            "--levers",
            "recompute-full,flex",
            "--rounds",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--budget",
            "400",
            "--peak-flops",
            "1e12",
            "--run-estimate",
            "10",
            "--profile-reserve",
            "60",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads((out / "matrix.json").read_text())
    assert proc.returncode == 0 and summary["status"] == "complete", proc.stdout[-3000:]
    rows = {r["setting"]: r for r in summary["rows"]}
    assert rows["default"]["runs"] == rows["recompute-full"]["runs"] == 2
    assert rows["flex"]["runs"] == 0 and rows["flex"]["note"] == "needs cuda, flex"
    for r in (rows["default"], rows["recompute-full"]):
        assert r["device"] == "CPU" and r["model"] == "tiny-moe"
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["ratio"] > 0
    assert rows["default"]["ratio"] == 1.0
    for b in rows["default"]["by_round"]:  # where each run's wall time went
        assert 0 < b["build_s"] < b["wall_s"] and 0 < b["warmup_s"] < b["wall_s"], b
    entries = json.loads((out / "profile.json").read_text())["entries"]
    best = max(
        (rows["default"], rows["recompute-full"]), key=lambda r: (r["ratio"], r["tokens_per_s"])
    )
    assert [(e["model"], e["setting"]) for e in entries] == [("tiny-moe", best["setting"])]
    assert "Fastest per model: tiny-moe" in (out / "matrix.md").read_text()


def test_every_lever_is_a_valid_config_with_known_preconditions():
    """A typo in a lever's key or value, or an unknown precondition, fails here rather than as
    an error row on a GPU."""
    import torch
    from bench_steps import split_knobs
    from bench_worker import unmet
    from gpu_train_bench import preset

    from moe.core.errors import ConfigError
    from moe.model.loss import liger_problem

    cpu = torch.device("cpu")
    for setting in gm.settings_of(gm.LEVERS):
        overrides, _ = split_knobs(list(setting.overrides))
        if setting.where:  # a combination: every part together is a valid config too
            everything = [*setting.overrides, *(o for part, _ in setting.where for o in part)]
            preset("moe-125m", None, split_knobs(everything)[0])
        if "liger" in setting.needs and liger_problem():
            assert unmet(list(setting.needs), None, cpu) == ["cuda", "liger"]  # before building
            with pytest.raises(ConfigError, match="cross_entropy: liger"):
                preset("moe-125m", None, overrides)
            continue
        for model in gm.MODELS:
            cfg = preset(model, None, overrides)
            missing = unmet(list(setting.needs), cfg, cpu)
            assert ("cuda" in missing) == ("cuda" in setting.needs)
            if model == "dense-125m" and "moe" in setting.needs:
                assert "moe" in missing
    cfg = preset("moe-1b", None, [])
    assert unmet(["unaligned-experts"], cfg, cpu) == ["unaligned-experts"]  # 384 = 6 x 64
    assert unmet(["unaligned-experts"], preset("moe-125m", None, []), cpu) == []  # 432
    with pytest.raises(ConfigError, match="unknown precondition"):
        unmet(["gpu"], cfg, cpu)


def test_a_setting_that_trains_as_the_default_on_the_device_is_skipped():
    """On CUDA the default is the CUDA defaults: ``compile`` and ``stack-no-graphs`` train as it
    does and are skipped, ``eager`` and every ablation differ from it; on the CPU the ablations
    are the default. The MoE section of a dense model does not count."""
    import torch
    from bench_steps import split_knobs
    from bench_worker import same_run
    from gpu_train_bench import preset

    settings = {s.name: s for s in gm.settings_of(gm.LEVERS)}

    def pair(name, model):
        s = settings[name]
        overrides = [*s.overrides]
        if model.startswith("moe"):
            overrides += [o for part, _ in s.where for o in part]
        overrides, knobs = split_knobs(overrides)
        return preset(model, None, overrides), knobs

    for model in gm.MODELS:
        default = pair("default", model)
        for device, same, other in (
            ("cuda", ["compile", "stack-no-graphs", "ce-chunked+compile"], ["eager", "stack"]),
            # eager's AdamW is foreach, torch's choice on CUDA; on the CPU torch takes for_loop
            (
                "cpu",
                [lv.name for lv in gm.ABLATIONS if lv.name != "adamw-foreach"],
                ["compile", "adamw-fused", "eager", "adamw-foreach"],
            ),
        ):
            dev = torch.device(device)
            for name in same:
                assert same_run(pair(name, model), default, dev), (model, device, name)
            for name in other:
                assert not same_run(pair(name, model), default, dev), (model, device, name)
            if device == "cuda":
                for lv in gm.ABLATIONS:
                    applies = model.startswith("moe") or "moe" not in lv.needs
                    assert same_run(pair(lv.name, model), default, dev) != applies, lv.name
    expert_loop = pair("expert-loop", "moe-125m")  # a bench knob, not a config key
    assert not same_run(expert_loop, pair("default", "moe-125m"), torch.device("cpu"))


def test_missing_packages_are_installed_from_the_wheel_folder(tmp_path, monkeypatch):
    """As on a GPU machine without DeepSpeed: what the worker cannot import comes from the
    wheel folder into SCRATCH/site, first on the worker's PYTHONPATH; what no wheel provides
    is named in the error."""
    import matrix_worker

    from tests.benchmarks.test_gpu_proof import make_wheel

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "gpu-matrix-probe", "1.0")
    monkeypatch.setattr(matrix_worker, "NEEDED", ["yaml", "gpu_matrix_probe"])
    env = matrix_worker.ensure_packages(
        str(tmp_path / "scratch"), str(wheels), tmp_path / "worker.log", time.monotonic() + 120
    )
    site = tmp_path / "scratch" / "site"
    assert (site / "gpu_matrix_probe" / "__init__.py").exists()
    assert env["PYTHONPATH"].split(":")[:2] == [str(site), str(ROOT)]
    assert "install" in (tmp_path / "worker.log").read_text()
    monkeypatch.setattr(matrix_worker, "NEEDED", ["yaml", "no_such_module_anywhere"])
    with pytest.raises(RuntimeError, match="cannot import no_such_module_anywhere"):
        matrix_worker.ensure_packages(
            str(tmp_path / "s2"), str(wheels), tmp_path / "w.log", time.monotonic() + 120
        )


def test_a_cuda_graph_run_releases_its_graphs_even_when_it_fails(monkeypatch):
    """The worker keeps every setting's compiled blocks for the next round, but not the graphs
    and memory pool a train.cuda_graphs run recorded; here the run fails (no CUDA device) and
    they are released all the same. Releasing them drops the compiled code as well (code
    compiled for graph trees that were shut down fails when called again): a function compiled
    before compiles again after."""
    from argparse import Namespace

    import bench_worker
    import torch

    from moe.core.errors import ConfigError

    released = []
    monkeypatch.setattr(bench_worker, "release_cuda_graphs", lambda: released.append(1))
    args = Namespace(tiny=True, micro_batch=None, steps=1, warmup=0, peak_flops=None)
    graphs = ["train.compile=true", "train.cuda_graphs=true", "parallel.zero_stage=2"]
    with pytest.raises(ConfigError, match="train.cuda_graphs: needs a CUDA device"):
        bench_worker.run_task({"model": "tiny-moe", "overrides": graphs}, torch.device("cpu"), args)
    assert released == [1]
    monkeypatch.undo()

    from torch._dynamo.utils import counters

    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.ones(3)
    before = counters["stats"]["unique_graphs"]
    compiled(x)
    compiled(x)  # the cached code
    assert counters["stats"]["unique_graphs"] == before + 1
    bench_worker.release_cuda_graphs()  # no graph trees on this thread: none to shut down
    assert torch.equal(compiled(x), x * 2 + 1)
    assert counters["stats"]["unique_graphs"] == before + 2  # compiled again


def test_the_worker_applies_a_combinations_model_levers_only_where_they_apply(monkeypatch):
    """A combination's ``where`` overrides reach the config of the MoE model and not the dense
    one, whose run goes ahead without them (rather than being skipped); the row says which
    were applied."""
    from argparse import Namespace

    import bench_worker
    import torch

    seen = {}

    def fake_bench(name, cfg, device, args, knobs, label):
        seen[name] = cfg
        return {"model": name, "tokens_per_s": 1.0}, None

    monkeypatch.setattr(bench_worker, "bench", fake_bench)
    args = Namespace(tiny=True, micro_batch=None, steps=1, warmup=0, peak_flops=None)
    task = {
        "overrides": ["model.cross_entropy=chunked"],
        "where": [[["model.moe.permute=gather"], ["moe"]], [["train.compile=true"], ["cuda"]]],
    }
    cpu = torch.device("cpu")
    moe = bench_worker.run_task({**task, "model": "tiny-moe"}, cpu, args)
    dense = bench_worker.run_task({**task, "model": "tiny-dense"}, cpu, args)
    assert moe["row"]["applied"] == ["model.moe.permute=gather"]
    assert dense["status"] == "ok" and dense["row"]["applied"] == []
    assert seen["tiny-moe"].model.moe.permute == "gather"
    assert seen["tiny-dense"].model.moe.permute == "auto"  # left to the device: untouched
    for cfg in seen.values():  # the shared overrides everywhere, the CUDA-only part nowhere
        assert cfg.model.cross_entropy == "chunked" and not cfg.train.compile


def test_a_compiled_variant_that_trains_as_its_lever_on_cuda_is_skipped():
    """On CUDA blocks are compiled by default, so a lever's "+compile" variant is the lever's own
    run there (ce-chunk-4096, flex, recompute-selective, ...): skipped, naming it, rather than
    measured twice in a short loan. Where compiling is not the default (the CPU; adapter
    methods, which keep eager blocks on CUDA) it is a setting of its own."""
    from argparse import Namespace

    import bench_worker
    import torch

    args = Namespace(tiny=True, micro_batch=None, steps=1, warmup=0, peak_flops=None)
    settings = {s.name: s for s in gm.settings_of(gm.LEVERS)}
    m = gm.Matrix(
        list(settings.values()), ["tiny-moe"], None, clock=Clock(), deadline=1, run_deadline=1
    )

    def check(name, device):
        task = {**m.task(settings[name], "tiny-moe"), "check": True}
        return bench_worker.run_task(task, torch.device(device), args)

    for name in ("ce-chunk-4096", "recompute-selective", "micro-batch-16"):
        assert check(f"{name}+compile", "cuda") == {
            "status": "skipped",
            "reason": f"the same run as {name} on cuda",
        }
        assert check(f"{name}+compile", "cpu") == {"status": "ok"}
    assert check("lora+compile", "cpu") == {"status": "ok"}
    # LoRA's blocks are eager on CUDA by default: compiled, it is another run there.
    lora, compiled = (
        bench_worker.config_for(m.task(settings[n], "tiny-moe"), True, None)
        for n in ("lora", "lora+compile")
    )
    assert not bench_worker.same_run(lora, compiled, torch.device("cuda"))
    assert bench_worker.same_run(
        *(
            bench_worker.config_for(m.task(settings[n], "tiny-moe"), True, None)
            for n in ("flex", "flex+compile")
        ),
        torch.device("cuda"),
    )


def test_docs_name_every_lever_of_the_matrix():
    text = (ROOT / "docs" / "gpu.md").read_text()
    missing = [lv.name for lv in gm.LEVERS if f"`{lv.name}`" not in text]
    assert not missing, f"docs/gpu.md does not name {missing}"


def test_on_the_gpu_presets_only_the_machine_or_the_kind_of_model_skips_a_lever():
    """The worker's check of every setting on dense-125m and moe-125m: each applies, or is
    skipped for what this CPU lacks (cuda, flex, liger) or, on the dense model, for its
    experts. A model's needs are judged before the setting changes it: experts-448 makes
    moe-125m's experts aligned, and still applies to it."""
    from argparse import Namespace

    import bench_worker
    import torch

    args = Namespace(tiny=False, micro_batch=None, steps=1, warmup=0, peak_flops=None)
    machine = {"cuda", "flex", "liger"}
    for setting in gm.settings_of(gm.LEVERS):
        m = gm.Matrix([setting], gm.MODELS, None, clock=Clock(), deadline=1, run_deadline=1)
        for model in gm.MODELS:
            res = bench_worker.run_task(
                {**m.task(setting, model), "check": True}, torch.device("cpu"), args
            )
            if res["status"] == "ok":
                continue
            assert res["status"] == "skipped", (setting.name, model, res)
            if res["reason"] == "already the default on cpu":  # the CUDA defaults undone
                assert setting.name in [lv.name for lv in gm.ABLATIONS], setting.name
                continue
            said = set(res["reason"].removeprefix("needs ").split(", "))
            allowed = machine | ({"moe", "unaligned-experts"} if model == "dense-125m" else set())
            assert said <= allowed, (setting.name, model, res)
    check = {**m.task(gm.Setting("x", needs=("unaligned-experts",)), "moe-125m"), "check": True}
    check["overrides"] = ["model.moe.expert_hidden=448"]
    assert bench_worker.run_task(check, torch.device("cpu"), args) == {"status": "ok"}


def test_a_lever_that_needs_bf16_is_skipped_on_an_fp32_model_not_refused():
    from argparse import Namespace

    import bench_worker
    import torch

    (lever,) = [lv for lv in gm.LEVERS if lv.name == "immediate-grads"]
    task = {"model": "tiny-moe", "overrides": list(lever.overrides), "needs": list(lever.needs)}
    args = Namespace(tiny=True, micro_batch=None, steps=1, warmup=0, peak_flops=None)
    res = bench_worker.run_task({**task, "check": True}, torch.device("cpu"), args)
    assert res == {"status": "skipped", "reason": "needs bf16"}


@pytest.mark.parametrize("healthy", [True, False])
def test_a_worker_whose_cuda_context_is_lost_answers_and_exits(monkeypatch, healthy):
    """After a failing run the worker goes on, unless its device no longer runs anything (a
    sticky CUDA error): then it answers that run and exits, and the matrix's next run starts
    a new worker instead of failing in a broken process."""
    import io
    from argparse import Namespace

    import bench_worker
    import torch

    def failing(task, device, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert bench_worker.device_healthy(torch.device("cpu"))  # nothing to lose on the CPU
    monkeypatch.setattr(bench_worker, "run_task", failing)
    monkeypatch.setattr(bench_worker, "device_healthy", lambda device: healthy)
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": 1}\n{"id": 2}\n'))
    proto = io.StringIO()
    args = Namespace(peak_flops=1e12)
    if healthy:
        bench_worker.serve(torch.device("cpu"), args, proto)
    else:
        with pytest.raises(SystemExit) as e:
            bench_worker.serve(torch.device("cpu"), args, proto)
        assert e.value.code == bench_worker.CONTEXT_LOST
    answers = [json.loads(line) for line in proto.getvalue().splitlines()[1:]]
    assert [a["id"] for a in answers] == ([1, 2] if healthy else [1])
    assert all(a["status"] == "error" and "illegal memory access" in a["reason"] for a in answers)
    assert ("CUDA context is lost" in answers[0]["reason"]) == (not healthy)
