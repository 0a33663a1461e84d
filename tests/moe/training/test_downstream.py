"""Downstream evaluation during training (eval.downstream): when it runs, what it refuses, and
that it leaves training as it was: per-step losses bitwise those of a run without it, a resume
exact, its TensorBoard accuracy equal to the harness's on the saved checkpoint."""

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from data_pipeline.prepared import PreparedData
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError, EvaluationError
from moe.evaluation.report import read_scalars
from moe.model.transformer import MoETransformer
from moe.training.downstream import DownstreamEvaluator, downstream_due
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
MC = "stdlib_sentence_mc"


def config(tiny_data, tmp_path, **downstream) -> RunConfig:
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=10)
    d["model"]["vocab_size"] = 512
    d["checkpoint"] = {"every_n_steps": 4}
    d["eval"] = {"downstream": downstream}
    return from_dict(RunConfig, d)


def test_it_runs_at_checkpoints_every_n_steps_and_at_the_end(tiny_data, tmp_path):
    at_saves = config(tiny_data, tmp_path, tasks=[MC])
    assert [s for s in range(1, 11) if downstream_due(at_saves, s)] == [4, 8, 10]
    every3 = config(tiny_data, tmp_path, tasks=[MC], every_n_steps=3)
    assert [s for s in range(1, 11) if downstream_due(every3, s)] == [3, 6, 9, 10]
    off = config(tiny_data, tmp_path, every_n_steps=3)
    assert not any(downstream_due(off, s) for s in range(1, 11))


def test_config_problems_are_named(tiny_data, tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as e:
        config(
            tiny_data, tmp_path, tasks=[MC], ranks="rank0", limit=0, every_n_steps=-1, colour="red"
        )
    text = str(e.value)
    assert "eval.downstream.colour: unknown key" in text
    assert "eval.downstream.limit: must be >= 1" in text
    assert "eval.downstream.every_n_steps: must be >= 0" in text
    with pytest.raises(
        ConfigError,
        match="eval.downstream.ranks: rank0 cannot run a model with expert parallelism 2",
    ):
        config(tiny_data, tmp_path, tasks=[MC], ranks="rank0")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"eval.downstream.tasks: .*pip install -c "
        r"constraints.txt -e '.\[eval\]'",
    ):
        config(tiny_data, tmp_path, tasks=[MC])
    config(tiny_data, tmp_path)  # off: no harness needed


def evaluator(cfg, tiny_data):
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    engine = SimpleNamespace(module=model, device=torch.device("cpu"))
    return DownstreamEvaluator(engine, cfg, 0, 1, PreparedData(tiny_data.dir).tokenizer_file())


def test_settings_reach_the_harness(tiny_data, tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    rows = [{"q": f"Is {i} even", "choices": [" yes", " no"], "gold": i % 2} for i in range(9)]
    (folder / "parity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "parity.yaml").write_text(
        "task: parity\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: parity.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    cfg = config(
        tiny_data,
        tmp_path,
        tasks=[MC, "parity"],
        include_path=[str(folder)],
        limit=5,
        num_fewshot=2,
        batch_size=3,
    )
    ev = evaluator(cfg, tiny_data)
    assert ev.lm.batch_size == 3
    assert ev.task_dict["tasks"][MC].config.num_fewshot == 2
    state = SimpleNamespace(step=4, rollback_to=None, extra={})
    ev.on_step_end(state)
    assert set(state.extra) == {
        f"downstream/{MC}/acc",
        f"downstream/{MC}/acc_norm",
        "downstream/parity/acc",
    }
    assert all(0 <= v <= 1 for v in state.extra.values())
    assert ev.samples == {MC: 5, "parity": 5}
    skipped = SimpleNamespace(step=5, rollback_to=None, extra={})
    ev.on_step_end(skipped)
    rolled = SimpleNamespace(step=8, rollback_to=4, extra={})
    ev.on_step_end(rolled)
    assert skipped.extra == rolled.extra == {}


def test_generation_and_unknown_tasks_are_refused(tiny_data, tmp_path):
    # More solved examples than the task has: refused before training, not at its first
    # evaluation (the harness stopped there with a ValueError).
    with pytest.raises(
        EvaluationError,
        match=r"num_fewshot: task stdlib_sentence_mc has 32 examples to draw 40 solved",
    ):
        evaluator(config(tiny_data, tmp_path, tasks=[MC], num_fewshot=40), tiny_data)
    with pytest.raises(ConfigError, match="stdlib_next_word generate text"):
        evaluator(config(tiny_data, tmp_path, tasks=["stdlib_next_word"]), tiny_data)
    with pytest.raises(
        EvaluationError,
        match=r"unknown task\(s\): stdlib_sentence \(nearest: "
        r"stdlib_sentence_mc",
    ):
        evaluator(config(tiny_data, tmp_path, tasks=["stdlib_sentence"]), tiny_data)


def _train_three_ways(rank, world, runs):
    """plain (no downstream), with (downstream at every save), resumed (with: trained to step
    4, its step-4 checkpoint removed, resumed from step 2's)."""
    import shutil

    import torch.distributed as dist

    from moe.training.trainer import DistEnv, train

    env = DistEnv(rank, world, rank, world)
    for name in ("plain", "with", "resumed"):
        train(from_dict(RunConfig, copy.deepcopy(runs[name])), env)
    ckpts = from_dict(RunConfig, copy.deepcopy(runs["resumed"])).run_dir / "checkpoints"
    if rank == 0:
        shutil.rmtree(ckpts / "step_0000004")
    dist.barrier()
    train(from_dict(RunConfig, copy.deepcopy(runs["resumed"])), env)


def losses(run_dir, rank):
    rows = [
        json.loads(x)
        for x in (run_dir / "logs" / f"steps_rank{rank}.jsonl").read_text().splitlines()
    ]
    return [(r["step"], repr(r["loss"]), r["tokens_sha256"]) for r in rows]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["all-ep2", "rank0-ep1"])
def test_training_is_unchanged_and_the_logged_accuracy_is_the_harness_s(
    tiny_data, tmp_path, layout
):
    from moe.evaluation.harness import harness_model, run_tasks

    ranks, ep = layout.split("-ep")
    runs = {}
    for name in ("plain", "with", "resumed"):
        d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=4, lr=3e-3)
        d["name"] = name
        d["parallel"]["expert_parallel_size"] = int(ep)
        d["logging"] = {"log_every": 100}
        if name != "plain":
            d["eval"] = {"downstream": {"tasks": [MC], "limit": 6, "ranks": ranks}}
        runs[name] = d
    run_distributed(_train_three_ways, 2, runs)
    root = tmp_path / "runs"
    for rank in (0, 1):
        assert losses(root / "with", rank) == losses(root / "plain", rank)
        assert losses(root / "resumed", rank) == losses(root / "plain", rank)
    logged = {run: read_scalars(root / run / "tensorboard") for run in ("with", "resumed")}
    acc = logged["with"][f"downstream/{MC}/acc"]
    assert [s for s, _ in acc] == [2, 4] and logged["resumed"][f"downstream/{MC}/acc"] == acc
    assert f"downstream/{MC}/acc" not in read_scalars(root / "plain" / "tensorboard")
    lm = harness_model(root / "with" / "checkpoints" / "step_0000004", batch_size=5)
    offline = run_tasks(lm, [MC], num_fewshot=0, limit=6)["tasks"]
    by_metric = {r["metric"]: r["value"] for r in offline}
    assert acc[-1][1] == pytest.approx(by_metric["acc"], abs=1e-6)
    assert logged["with"][f"downstream/{MC}/acc_norm"][-1][1] == pytest.approx(
        by_metric["acc_norm"], abs=1e-6
    )
