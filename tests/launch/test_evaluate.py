"""moe-eval on real checkpoints written by the real launcher: one run on 2 ranks with expert
parallelism 2, one on 1 rank, both of the same weights (the learning rate is so small that no
update changes a float32 weight, and initialization does not depend on the layout)."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from data_pipeline.token_stream import TokenStream
from launch.evaluate import main
from moe.config.run import load_config
from moe.core.errors import ConfigError
from moe.evaluation.evaluate import EvalOptions, evaluate_checkpoint_dir, load_model
from moe.model.generation import GenerationConfig
from moe.model.transformer import MoETransformer
from moe.training.trainer import seed_everything
from tests.conftest import tiny_run_dict
from tests.helpers.reference import reference_loss
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("single_thread")]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-runs")
    layouts = {
        "ep2": {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 2, "steps": 2},
        "single": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2, "steps": 1},
    }
    procs = {}
    for name, p in layouts.items():
        d = tiny_run_dict(tiny_data, root / "runs", max_steps=p.pop("steps"), lr=1e-30, min_lr=0.0)
        d.update(name=name, parallel=p, checkpoint={"every_n_steps": 1})
        (root / f"{name}.yaml").write_text(yaml.safe_dump(d))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "launch.launch", str(root / f"{name}.yaml"), "--no-eval"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {out[-3000:]}"
    return {name: root / "runs" / name for name in layouts}


def test_two_layouts_of_the_same_weights_evaluate_identically(runs, tiny_data):
    ep2 = runs["ep2"] / "checkpoints" / "step_0000002"
    single = runs["single"] / "checkpoints" / "step_0000001"
    opts = EvalOptions(
        max_tokens=1200,
        data_prompts=1,
        generation=[
            GenerationConfig("greedy", max_new_tokens=6),
            GenerationConfig("beam", max_new_tokens=6, num_beams=3),
        ],
    )
    a, b = evaluate_checkpoint_dir(ep2, opts), evaluate_checkpoint_dir(single, opts)

    # The independent truth: the weights every layout initializes from, and a plain loop.
    cfg = load_config(ep2 / "run_config.yaml")
    seed_everything(cfg.train.seed)
    reference = MoETransformer(cfg.model).eval()
    loaded = load_model(ep2)[0].state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    stream = TokenStream(tiny_data.dir, "valid")
    tokens = stream.read(0, min(len(stream), 1201))
    ref_loss, ref_count = reference_loss(reference, tokens, cfg.data.seq_len)

    assert a["tokens"] == b["tokens"] == ref_count == len(tokens) - 1
    assert a["loss"] == b["loss"]
    assert math.isclose(a["loss"], ref_loss, rel_tol=1e-5)
    assert math.isclose(a["perplexity"], math.exp(ref_loss), rel_tol=1e-4)
    assert [x["kept_per_expert"] for x in a["experts"]] == [
        x["kept_per_expert"] for x in b["experts"]
    ]
    assert [g["outputs"] for g in a["generations"]] == [g["outputs"] for g in b["generations"]]


def valid_tokens(data) -> int:
    """Tokens a full pass over the tiny validation split predicts (the split is random)."""
    return len(TokenStream(data.dir, "valid")) - 1


def test_cli_writes_json_markdown_and_valid_pngs(runs, tiny_data, tmp_path):
    ckpt = runs["ep2"] / "checkpoints" / "step_0000002"
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            str(ckpt),
            "--max-tokens",
            "800",
            "--max-new-tokens",
            "6",
            "--num-prompts",
            "1",
            "--threads",
            "1",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    result = json.loads((out / "eval.json").read_text())
    (c,) = result["checkpoints"]
    tokens = min(800, valid_tokens(tiny_data))
    assert c["tag"] == "step_0000002" and c["step"] == 2 and c["tokens"] == tokens
    assert math.isfinite(c["loss"]) and abs(c["loss"] - math.log(512)) < 0.5
    assert math.isclose(c["perplexity"], math.exp(c["loss"]), rel_tol=1e-12)
    assert len(c["experts"]) == 2  # both blocks are MoE layers
    for layer in c["experts"]:
        assert sum(layer["kept_per_expert"]) == layer["routed_copies"] == tokens * 2
        assert layer["dropped_fraction"] == 0  # dropless
        assert 0 < layer["router_entropy"] <= layer["router_entropy_uniform"] + 1e-9
        assert layer["max_over_mean_load"] >= 1 and len(layer["top_tokens"]) == 4
    assert {g["strategy"] for g in c["generations"]} == {"greedy", "sample", "beam"}
    assert all(len(o["tokens"]) <= 6 for g in c["generations"] for o in g["outputs"])
    assert [s for s, _ in result["loss_curves"][str(runs["ep2"])]["train/loss"]] == [1, 2]

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["expert_load_step_0000002.png", "loss_curves.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            w, h = img.size
            assert w >= 300 and h >= 150 and np.asarray(img.convert("L")).std() > 5  # not blank
    report = (out / "report.md").read_text()
    for needle in (
        "# Evaluation report",
        "](expert_load_step_0000002.png)",
        "](loss_curves.png)",
        f"{c['perplexity']:.2f}",
        "Tokens each expert prefers",
        "Generations",
    ):
        assert needle in report
    assert "perplexity" in proc.stdout and f"{c['perplexity']:.2f}" in proc.stdout
    assert not list(tmp_path.glob(".*staging*"))


def test_all_checkpoints_of_a_run_in_one_table(runs, tiny_data, capsys):
    main([str(runs["ep2"]), "--all", "--no-generation", "--max-tokens", "300"])
    result = json.loads((runs["ep2"] / "eval" / "eval.json").read_text())
    assert [c["step"] for c in result["checkpoints"]] == [1, 2]
    assert all(c["tokens"] == min(300, valid_tokens(tiny_data)) for c in result["checkpoints"])
    printed = capsys.readouterr().out
    assert "step_0000001" in printed and "step_0000002" in printed
    assert (runs["ep2"] / "eval" / "report.md").read_text().count("## step_000000") == 2


def test_all_skips_an_incomplete_checkpoint(runs, tmp_path, capsys):
    """A save that was interrupted leaves a directory without a marker: --all evaluates the
    complete checkpoints and says which one it skipped."""
    import shutil

    run = tmp_path / "ep2"
    shutil.copytree(runs["ep2"] / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step_0000002" / "checkpoint.json").unlink()
    main(
        [
            str(run),
            "--all",
            "--no-generation",
            "--max-tokens",
            "100",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [c["step"] for c in result["checkpoints"]] == [1]
    assert "skipping" in capsys.readouterr().err


def test_checkpoints_of_different_runs_compared(runs, tmp_path, capsys):
    ckpts = [runs["ep2"] / "checkpoints" / "step_0000002", runs["single"]]
    main(
        [str(c) for c in ckpts]
        + ["--output", str(tmp_path / "cmp"), "--no-generation", "--max-tokens", "200"]
    )
    result = json.loads((tmp_path / "cmp" / "eval.json").read_text())
    assert [c["label"] for c in result["checkpoints"]] == [
        "ep2-step_0000002",
        "single-step_0000001",
    ]
    assert result["checkpoints"][0]["loss"] == result["checkpoints"][1]["loss"]  # same weights
    assert sorted(p.name for p in (tmp_path / "cmp").glob("expert_load_*.png")) == [
        "expert_load_ep2-step_0000002.png",
        "expert_load_single-step_0000001.png",
    ]
    assert "single-step_0000001" in capsys.readouterr().out


def test_text_files_on_the_command_line(runs, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("Return the number of items in the list.\n" * 4)
    main(
        [
            str(runs["single"]),
            "--text",
            str(text),
            "--no-generation",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    (c,) = json.loads((tmp_path / "o" / "eval.json").read_text())["checkpoints"]
    assert "1 text file(s)" in c["data"] and c["tokens"] > 20


def test_bad_arguments_exit_2_with_a_clear_message_and_write_nothing(runs, tmp_path, capsys):
    good = runs["single"] / "checkpoints" / "step_0000001"
    cases = [
        ([str(tmp_path / "nowhere")], "nowhere: no such checkpoint directory"),
        ([str(good), str(tmp_path / "gone")], "gone: no such checkpoint directory"),
        ([str(tmp_path / "nowhere"), "--all"], "nowhere: no such run directory"),
        ([str(good), str(runs["ep2"])], "--output: the checkpoints belong to different runs"),
        ([str(good), "--top-p", "2", "--num-beams", "0"], "--top-p: must be in (0, 1]"),
        ([str(good), "--num-beams", "0"], "--num-beams: must be >= 1"),
        ([str(good), "--text", str(tmp_path / "missing.txt")], "missing.txt: no such text file"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv + ["--no-expert-stats"])
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    assert not (good / "eval").exists()


def test_generations_that_do_not_fit_are_refused_before_the_loss_pass(
    runs, tmp_path, capsys, monkeypatch
):
    """A --max-new-tokens the model has no room for was refused by the first generation, after
    the whole loss pass."""
    import moe.evaluation.evaluate as evaluation

    def no_loss_pass(*args, **kwargs):
        raise AssertionError("the loss pass ran")

    monkeypatch.setattr(evaluation, "evaluate_loss", no_loss_pass)
    good = runs["single"] / "checkpoints" / "step_0000001"
    with pytest.raises(SystemExit) as e:
        main([str(good), "--prompt", "the", "--max-new-tokens", "64", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--max-new-tokens: the longest prompt (" in err, err
    assert "new tokens exceed the model's 64 tokens" in err
    assert not (good / "eval").exists()


def test_the_evaluation_after_training_shortens_generations_to_fit(runs):
    """moe-launch's evaluation after training generates 32 tokens: a model with less room
    after its prompts failed a finished run with an error about a flag nobody gave."""
    from launch.evaluate import default_generation

    good = runs["single"] / "checkpoints" / "step_0000001"
    opts = EvalOptions(
        max_tokens=64,
        expert_stats=False,
        data_prompts=1,
        prompt_tokens=40,  # an EOS and 40 tokens: 23 of the model's 64 left
        generation=default_generation(("greedy",), max_new_tokens=32),
        fit_generation=True,
    )
    result = evaluate_checkpoint_dir(good, opts)
    (gen,) = result["generations"]
    assert len(gen["prompt"]) == 41  # generate() refuses more than the room left
    assert len(gen["outputs"][0]["tokens"]) <= 23
    with pytest.raises(ConfigError, match="--max-new-tokens: the longest prompt \\(41 tokens\\)"):
        evaluate_checkpoint_dir(good, replace(opts, fit_generation=False))


def test_tasks_of_every_checkpoint_of_a_run_in_one_table(runs, tmp_path, capsys):
    """moe-eval --all --tasks: the harness's results with their standard errors per checkpoint;
    the same weights saved with two layouts score the same."""
    pytest.importorskip("lm_eval")
    main(
        [
            str(runs["ep2"]),
            "--all",
            "--tasks",
            "stdlib_sentence_mc,stdlib_next_word",
            "--limit",
            "6",
            "--num-fewshot",
            "1",
            "--batch-size",
            "5",
            "--output",
            str(tmp_path / "tasks"),
        ]
    )
    result = json.loads((tmp_path / "tasks" / "eval.json").read_text())
    assert [c["step"] for c in result["checkpoints"]] == [1, 2]
    rows = {(r["task"], r["metric"]): r for r in result["checkpoints"][-1]["downstream"]}
    assert set(rows) == {
        ("stdlib_sentence_mc", "acc"),
        ("stdlib_sentence_mc", "acc_norm"),
        ("stdlib_next_word", "exact_match"),
    }
    acc = rows[("stdlib_sentence_mc", "acc")]
    assert (
        acc["samples"] == 6
        and acc["num_fewshot"] == 1
        and acc["value"] in {i / 6 for i in range(7)}
    )
    p = acc["value"]
    assert acc["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 5), abs=1e-9)  # the harness's
    report = (tmp_path / "tasks" / "report.md").read_text()
    assert "stdlib_sentence_mc acc" in report and f"{p:.4f} ± {acc['stderr']:.4f}" in report
    assert "stdlib_sentence_mc acc_norm" in capsys.readouterr().out
    main(
        [
            str(runs["single"]),
            "--tasks",
            "stdlib_sentence_mc",
            "--limit",
            "6",
            "--num-fewshot",
            "1",
            "--output",
            str(tmp_path / "single"),
        ]
    )
    single = json.loads((tmp_path / "single" / "eval.json").read_text())["checkpoints"][0]
    ep2_step1 = result["checkpoints"][0]["downstream"]
    assert [r["value"] for r in single["downstream"]] == [r["value"] for r in ep2_step1[:2]]


def test_bad_task_arguments_exit_2_and_write_nothing(runs, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    good = runs["single"] / "checkpoints" / "step_0000001"
    cases = [
        (
            ["--tasks", "stdlib_sentence"],
            "unknown task(s): stdlib_sentence (nearest: stdlib_sentence_mc",
        ),
        (["--tasks", "stdlib_sentence_mc", "--limit", "0"], "--limit: must be >= 1"),
        (["--tasks", ","], "--tasks: name at least one task"),
        (
            ["--tasks", "stdlib_sentence_mc", "--include-path", str(tmp_path / "none")],
            "none: no such directory",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main([str(good), "--output", str(tmp_path / "out"), *argv])
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    with pytest.raises(SystemExit):
        main([str(good), "--tasks", "stdlib_sentence_mc", "--output", str(tmp_path / "out")])
    assert "pip install -c constraints.txt -e '.[eval]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
