"""Every fine-tuning method through the real trainer (2 ranks, expert parallelism 2, ZeRO 2):
kill and resume is exact (a run stopped after step 3 and resumed from that checkpoint computes
steps 4-6 bit for bit as the uninterrupted run, and ends with the same weights), and moe-eval
and generation on the fine-tuned checkpoint compute with its adapters.

One spawn does all the training: the base run, then per method the uninterrupted and the
resumed run, each a real ``train`` (the process group lives on between them)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.token_stream import TokenStream, token_windows
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.model.generation import FullForwardDecoder, GenerationConfig, KVCacheDecoder, generate
from moe.training.trainer import DistEnv, train
from moe.weights.load import build_model, load_consolidated, load_model
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

STOP, STEPS = 3, 6
METHODS = {
    "full": {},
    "lora": {"lora": {"targets": ["attention.q", "attention.v", "experts"], "rank": 4}},
    "esft": {"esft": {"p": 0.5, "max_batches": 2}},
    "adapter": {"adapter": {"hidden": 8}},
    "prompt": {"prompt": {"tokens": 4}},
    "prefix": {"prefix": {"tokens": 4}},
}


def _config(data, runs, name: str, **finetune) -> dict:
    # Router jitter and weight decay: a resumed run must restore the random state and every
    # optimizer moment, not only the weights.
    d = tiny_run_dict(
        data,
        runs,
        max_steps=STEPS if finetune else 2,
        lr=2e-2,
        min_lr=0.0,
        warmup_steps=1,
        weight_decay=0.1,
    )
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
        run(
            {**d, "name": f"{method}-resumed"},
            str(runs / method / "checkpoints" / f"step_{STOP:07d}"),
        )


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
    added = {
        "full": [],
        "esft": [],
        "lora": ["lora_"],
        "adapter": [".adapter."],
        "prompt": ["embed.prompt"],
        "prefix": [".prefix_"],
    }[method]
    if method == "full":
        # every parameter trained (the routers' selection bias is a buffer, off here)
        assert {k for k in base if k not in moved} == {
            f"blocks.{i}.ffn.router.score_bias" for i in range(2)
        }
    elif method == "esft":
        assert moved and all(".experts.w_" in k for k in moved), moved
    else:  # the added parameters only, and they trained
        assert moved and all(any(a in k for a in added) for k in moved), moved


EVAL_TOKENS, NEW_TOKENS = 512, 6


def _direct_loss(model, windows) -> float:
    """Token-weighted next-token loss of ``model`` over ``windows``, from its logits."""
    total = count = 0.0
    with torch.no_grad():
        for w in windows:
            logits_SV = model(w.tokens_S[None, :-1]).logits[0].double()
            keep = w.targets_S != -100
            total += F.cross_entropy(logits_SV[keep], w.targets_S[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def _adapted(run_dir):
    """The fine-tuned run's model as it trained: its adapters as modules (LoRA unmerged)."""
    state, cfg, _ = load_consolidated(run_dir)
    model = build_model(cfg)
    model.load_state_dict(state, strict=not cfg.model.tie_embeddings)
    return model.eval(), cfg


@pytest.mark.parametrize("method", [m for m in METHODS if m != "full"])
def test_moe_eval_and_generation_use_the_adapters(runs, method, tmp_path):
    from launch.evaluate import main

    main(
        [
            str(runs / method),
            "--output",
            str(tmp_path),
            "--quiet",
            "--threads",
            "1",
            "--max-tokens",
            str(EVAL_TOKENS),
            "--strategy",
            "greedy",
            "beam",
            "--num-beams",
            "2",
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--num-prompts",
            "2",
        ]
    )
    (result,) = json.loads((tmp_path / "eval.json").read_text())["checkpoints"]

    tuned, cfg = _adapted(runs / method)
    base, _ = _adapted(runs / "base")
    windows = list(token_windows(TokenStream(cfg.data.dir, "valid"), cfg.data.seq_len, EVAL_TOKENS))
    want, before = _direct_loss(tuned, windows), _direct_loss(base, windows)
    # moe-eval sums fp32 batch losses; LoRA is evaluated merged (rounding).
    assert result["loss"] == pytest.approx(want, rel=1e-5 if method == "lora" else 1e-6)
    assert abs(want - before) > 1e-3, (want, before)
    assert result["experts"]  # the expert statistics ran over the same forwards

    loaded = load_model(runs / method)[0]  # what moe-eval generates with
    greedy = [g for g in result["generations"] if g["strategy"] == "greedy"]
    assert len(greedy) == 2 and all(g["outputs"][0]["tokens"] for g in result["generations"])
    for g in greedy:
        prompt = torch.tensor([g["prompt"]])
        with torch.no_grad():
            first, first_base = tuned(prompt).logits[0, -1], base(prompt).logits[0, -1]
        cached, _ = KVCacheDecoder(loaded).step(prompt, None)
        torch.testing.assert_close(cached[0], first, rtol=0, atol=2e-5)
        assert (first - first_base).abs().max() > 1e-3  # the adapters change the next token's
        # The whole greedy continuation is the adapted model's, each step recomputed in full.
        (hyp,) = generate(
            FullForwardDecoder(tuned),
            g["prompt"],
            GenerationConfig(max_new_tokens=NEW_TOKENS),
            eos_id=None,
        )
        assert g["outputs"][0]["tokens"] == hyp.tokens[: len(g["outputs"][0]["tokens"])]


@pytest.mark.parametrize(
    "method, key, value",
    [
        ("adapter", "hidden", 4),
        ("adapter", "placement", "ffn"),
        ("prompt", "tokens", 5),
        ("prefix", "tokens", 5),
    ],
)
def test_resume_refuses_other_adapter_shapes_by_key(runs, tiny_data, method, key, value):
    from moe.checkpoint.files import verify_checkpoint
    from moe.core.errors import CheckpointError

    tag = runs / method / "checkpoints" / f"step_{STOP:07d}"
    d = _config(tiny_data, runs, method, method=method, **METHODS[method])
    d["model"]["vocab_size"] = 512  # resolved from the tokenizer, as the trainer does
    verify_checkpoint(tag, from_dict(RunConfig, copy.deepcopy(d)))  # the same: accepted
    d["finetune"][method] = {**d["finetune"][method], key: value}
    with pytest.raises(CheckpointError, match=f"finetune.{method}.{key}: the checkpoint has"):
        verify_checkpoint(tag, from_dict(RunConfig, d))
