"""Our lm-evaluation-harness model against the harness's own ``hf`` model on our Hugging Face
export of the same weights: every request's log-likelihood within 1e-4, the same greedy flags,
the same generations and the same task accuracies; for a model we trained (expert parallelism
2), an imported Mixtral (its own byte-level BPE tokenizer.json) and a LoRA fine-tune (adapters
merged on load and on export)."""

import json
import math
from pathlib import Path

import pytest
import torch

from launch.export import main as export_main
from launch.import_hf import main as import_main
from moe.evaluation.harness import harness_model
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed
from tests.helpers.finetune import base_and_finetune
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)
from tests.moe.test_hf_import import bpe_tokenizer_json, make_hf

pytest.importorskip("lm_eval")  # before the module that imports it
from moe.training.lm_harness import load_tasks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

MC, GEN = "stdlib_sentence_mc", "stdlib_next_word"
TEXTS = [
    "Return a new list of the items.\n\nRaise ValueError when the list is empty. " * 6,
    "A",
    "Parse the command line and return the namespace.",
]


def _train(rank, world, cfg):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, train

    for c in cfg:
        train(from_dict(RunConfig, c), DistEnv(rank, world, rank, world))


def _export(checkpoint, out, *flags):
    export_main([str(checkpoint), str(out), "--format", "hf", "--quiet", *flags])
    return out


@pytest.fixture(scope="module")
def models(tiny_data, tmp_path_factory):
    """name -> (our checkpoint, its Hugging Face export)."""
    root = tmp_path_factory.mktemp("harness")
    ours = tiny_run_dict(tiny_data, root / "runs", max_steps=6, lr=3e-3)
    ours["name"] = "ours"
    base, lora = base_and_finetune(
        tiny_data,
        root / "runs",
        {
            "method": "lora",
            "lora": {"rank": 4, "targets": ["attention.q", "attention.v", "experts"]},
        },
        max_steps=8,
        lr=1e-2,
    )
    run_distributed(_train, 2, [ours, base, lora])
    hf_dir, _ = make_hf(root / "hf", "mixtral", vocab_size=400)
    bpe_tokenizer_json(Path(tiny_data.sources[0].paths[0]), hf_dir)
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<pad>",
            }
        )
    )
    import_main([str(hf_dir), str(root / "mixtral")])
    return {
        "ours": (root / "runs" / "ours", _export(root / "runs" / "ours", root / "ours-hf")),
        "mixtral": (root / "mixtral", _export(root / "mixtral", root / "mixtral-hf")),
        "lora": (
            root / "runs" / "ft",
            _export(root / "runs" / "ft", root / "lora-hf", "--merge-adapters"),
        ),
    }


def hf_model(hf_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4, dtype="float32")


def requests(tasks, num_fewshot, limit):
    task_dict = load_tasks(tasks, num_fewshot=num_fewshot)
    out = {}
    for name, task in task_dict["tasks"].items():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        out[name] = task.instances
    return out


@pytest.mark.parametrize("kind", ["ours", "mixtral", "lora"])
def test_every_request_scores_as_the_harness_hf_model_scores_it(models, kind):
    from lm_eval.api.instance import Instance

    checkpoint, hf_dir = models[kind]
    ours, theirs = harness_model(checkpoint, batch_size=5, device="cpu"), hf_model(hf_dir)
    assert (ours.prefix_token_id, ours.eot_token_id) == (
        theirs.prefix_token_id,
        theirs.eot_token_id,
    )
    for name, reqs in requests([MC, GEN], 1, 6).items():
        kind_of = reqs[0].request_type
        a, b = getattr(ours, kind_of)(reqs), getattr(theirs, kind_of)(reqs)
        if kind_of == "loglikelihood":
            assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) <= 1e-4, name
            assert [x[1] for x in a] == [y[1] for y in b], name
            assert all(math.isfinite(x[0]) and x[0] < 0 for x in a)
        else:
            assert a == b, name
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(TEXTS)]
    a, b = ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert a == pytest.approx(b, abs=1e-4) and len(set(a)) == len(TEXTS)


@pytest.mark.parametrize("kind", ["ours", "lora"])
def test_task_accuracies_equal_the_harness_hf_model_s(models, kind):
    from lm_eval.evaluator import evaluate

    checkpoint, hf_dir = models[kind]
    results = {}
    for name, lm in (
        ("ours", harness_model(checkpoint, batch_size=8, device="cpu")),
        ("hf", hf_model(hf_dir)),
    ):
        r = evaluate(
            lm, load_tasks([MC], num_fewshot=0), limit=40, bootstrap_iters=0, log_samples=False
        )["results"][MC]
        results[name] = (r["acc,none"], r["acc_norm,none"])
    assert results["ours"] == results["hf"]


def test_a_lora_fine_tune_is_evaluated_with_its_adapters(models):
    ckpt = models["lora"][0]
    reqs = requests([MC], 0, 4)[MC]
    tuned = harness_model(ckpt, device="cpu").loglikelihood(reqs)
    base = harness_model(ckpt.parent / "base", device="cpu").loglikelihood(reqs)
    assert max(abs(x[0] - y[0]) for x, y in zip(tuned, base)) > 1e-3
    assert torch.isfinite(torch.tensor([x[0] for x in tuned])).all()
