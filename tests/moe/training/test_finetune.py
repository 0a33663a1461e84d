"""Fine-tuning through the real engine (build_engine, DeepSpeed ZeRO 2, expert parallelism):
frozen parameters hold no optimizer state; a LoRA step on 2 ranks with expert parallelism 2
equals the same global batch on one process; a LoRA run from a checkpoint trains only its
factors, records its trainable share, and resumes exactly."""

import copy
import dataclasses
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

import moe.training.trainer as trainer
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.model.transformer import MoETransformer
from moe.training.trainer import DistEnv, build_engine, train
from moe.weights.load import build_model, load_consolidated, load_model
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import global_params, run_distributed
from tests.helpers.finetune import trained_samples

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB = 64, 16, 2
TARGETS = ["attention.q", "attention.v", "shared_experts", "experts"]


def run_config(world: int, accum: int, targets: list[str]) -> dict:
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": SEQ,
            "init_from": "base",
            "moe": {"num_experts": 4, "expert_hidden": 16, "num_shared_experts": 1},
        },
        "data": {"seq_len": SEQ},
        "train": {"micro_batch_size": MB, "grad_accum_steps": accum, "grad_clip": 0.0, "seed": 11},
        "parallel": {"world_size": world, "expert_parallel_size": world, "zero_stage": 2},
        "finetune": {
            "method": "lora",
            "lora": {"targets": targets, "rank": 4, "train_router": True},
        },
    }


def _worker(rank, world, cases, batches, out_dir):
    # The base weights are the seeded initialization: this test is about the layouts, the
    # real loading from a checkpoint is tested by the trainer run below.
    trainer.initialize_from_checkpoint = lambda *args, **kwargs: None
    for tag, cfg_dict in cases:
        cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
        engine, model = build_engine(
            cfg,
            DistEnv(rank, world, rank, world),
            make_optimizer=lambda g: torch.optim.SGD(g, lr=1.0),
        )
        accum = cfg.train.grad_accum_steps
        snapshots, losses = [global_params(model, rank)], []
        for _ in range(2):  # B starts at zero: the second step moves A too
            for m in range(accum):
                batch = batches[m * world + rank]
                out = engine(batch[:, :-1], batch[:, 1:])
                engine.backward(out.loss)
                engine.step()
                losses.append(out.loss.detach())
            snapshots.append(global_params(model, rank))
        opt = engine.optimizer
        names = {id(p): n.replace(".deepspeed_moe.", ".") for n, p in model.named_parameters()}
        torch.save(
            {
                "snapshots": snapshots,
                "losses": torch.stack(losses),
                "trainable": sorted(
                    n.replace(".deepspeed_moe.", ".")
                    for n, p in model.named_parameters()
                    if p.requires_grad
                ),
                "optimized": sorted(names[id(p)] for g in opt.bit16_groups for p in g),
                "partition_numel": sum(t.numel() for t in opt.single_partition_of_fp32_groups),
                "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
            },
            f"{out_dir}/{tag}_rank{rank}.pt",
        )


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    torch.manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MB, SEQ + 1)) for _ in range(2)]
    out = tmp_path_factory.mktemp("lora_layouts")
    cases = {"experts": TARGETS, "no-experts": ["attention.q"]}
    for world, accum in ((1, 2), (2, 1)):
        run_distributed(
            _worker,
            world,
            [(f"{tag}-w{world}", run_config(world, accum, t)) for tag, t in cases.items()],
            batches,
            str(out),
        )
    return out


def _merged(out, tag, world):
    results = [
        torch.load(out / f"{tag}-w{world}_rank{r}.pt", weights_only=True) for r in range(world)
    ]
    snapshots = [{} for _ in results[0]["snapshots"]]
    for res in results:
        for merged, snap in zip(snapshots, res["snapshots"]):
            for name, value in snap.items():
                if name in merged:
                    torch.testing.assert_close(merged[name], value, rtol=0, atol=0)
                merged[name] = value
    return snapshots, torch.cat([r["losses"] for r in results]), results


def assert_same_training(one, losses1, two, losses2) -> set[str]:
    """Two runs' merged parameters (``_merged``: before, after step 1 and after step 2) start
    equal bit for bit and take the same updates, with the same losses; returns the names of
    the parameters that moved."""
    torch.testing.assert_close(losses2.mean(), losses1.mean(), rtol=1e-6, atol=1e-6)
    assert one[0].keys() == two[0].keys()
    for name in one[0]:
        torch.testing.assert_close(two[0][name], one[0][name], rtol=0, atol=0, msg=name)
        for step in (1, 2):
            torch.testing.assert_close(
                two[step][name] - two[0][name],
                one[step][name] - one[0][name],
                rtol=1e-4,
                atol=1e-6,
                msg=f"update {step} of {name}",
            )
    return {n for n in one[0] if not torch.equal(one[2][n], one[0][n])}


@pytest.mark.parametrize("tag", ["experts", "no-experts"])
def test_lora_on_two_expert_parallel_ranks_equals_one_process(layouts, tag):
    one, losses1, _ = _merged(layouts, tag, 1)
    two, losses2, _ = _merged(layouts, tag, 2)
    moved = assert_same_training(one, losses1, two, losses2)
    # Only the factors and the (train_router) routers move; the base stays bit for bit.
    assert moved and all("lora_" in n or "router.weight" in n for n in moved), moved
    if tag == "experts":  # the check has teeth: both expert factors moved, for every expert
        assert {f"blocks.1.ffn.experts.w_in_lora_{f}[{e}]" for f in "AB" for e in range(4)} <= moved


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_parameters_have_no_optimizer_state(layouts, world):
    for tag in ("experts", "no-experts"):
        for res in _merged(layouts, tag, world)[2]:
            assert res["optimized"] == res["trainable"]
            assert all("lora_" in n or n.endswith("router.weight") for n in res["trainable"])
            if world == 1:  # one rank holds the whole fp32 master copy: exactly the trainable
                assert res["partition_numel"] == res["trainable_numel"]


def _train_worker(rank, world, cfg_dict, resume):
    train(
        from_dict(RunConfig, copy.deepcopy(cfg_dict)),
        DistEnv(rank, world, rank, world),
        resume=resume,
    )


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "logs" / "steps_rank0.jsonl").open()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def lora_runs(tiny_data, tmp_path_factory):
    """A 2-step base run on 2 ranks (EP 2), then LoRA fine-tuning from its checkpoint for 8
    steps, and the same 8 steps with a vanishing learning rate (the base's losses on the same
    batches). lr 1e-2: at 5e-2 Adam's first steps, every fresh B entry moved by the full
    learning rate, overshoot (on some data orders the loss rose above the base's for steps
    2 to 4)."""
    runs = tmp_path_factory.mktemp("lora_runs") / "runs"
    base = tiny_run_dict(tiny_data, runs, max_steps=2)
    base["name"] = "base"
    base["logging"]["tensorboard"] = False
    run_distributed(_train_worker, 2, base, "auto")
    base_ckpt = runs / "base" / "checkpoints" / "step_0000002"

    def lora_run(name, lr=1e-2):
        d = tiny_run_dict(tiny_data, runs, max_steps=8, lr=lr, min_lr=0.0, warmup_steps=1)
        d["name"] = name
        d["model"]["init_from"] = str(base_ckpt)
        d["checkpoint"] = {"every_n_steps": 4}
        d["finetune"] = {
            "method": "lora",
            "lora": {"targets": ["attention.q", "attention.v", "experts"], "rank": 4},
        }
        return d

    run_distributed(_train_worker, 2, lora_run("lora"), "auto")
    run_distributed(_train_worker, 2, lora_run("still", lr=1e-12), "auto")
    return runs, base_ckpt, lora_run


def test_lora_run_from_a_checkpoint_trains_only_its_factors(lora_runs, tiny_data):
    runs, base_ckpt, _ = lora_runs
    losses = _losses(runs / "lora")
    # gain: how much lower the LoRA run's loss is than the base's on each step's batch, before
    # the step trains on it. One batch of 4 samples is noisy (single steps ranged from -0.013
    # to 0.12 over data seeds 7 to 14): the last 4 steps together measured 0.047 to 0.096.
    gain = {s: _losses(runs / "still")[s] - losses[s] for s in losses}
    assert gain[1] == 0, gain  # B starts at zero: the base's function
    assert sum(gain[s] for s in range(5, 9)) / 4 > 0.02, gain
    # On the 32 samples it trained on, the tuned model (factors merged) beats its base:
    # measured 0.080 to 0.083 lower over data seeds 7, 8, 9.
    samples = trained_samples(tiny_data, 8, per_step=4)  # 2 ranks x micro-batch 2
    with torch.no_grad():
        loss = {
            name: load_model(path)[0](samples[:, :-1], samples[:, 1:]).lm_loss.item()
            for name, path in (("base", base_ckpt), ("lora", runs / "lora"))
        }
    assert loss["lora"] < loss["base"] - 0.03, loss

    base_state, _, _ = load_consolidated(base_ckpt)
    tuned, cfg, _ = load_consolidated(runs / "lora")
    factors = {k for k in tuned if "lora_" in k}
    assert tuned.keys() == base_state.keys() | factors
    assert factors == {
        *(
            f"blocks.{i}.attn.{p}.lora_{f}"
            for i in range(2)
            for p in ("q_proj", "v_proj")
            for f in "AB"
        ),
        *(
            f"blocks.{i}.ffn.experts.w_{w}_lora_{f}"
            for i in range(2)
            for w in ("in", "out")
            for f in "AB"
        ),
    }
    for key, value in base_state.items():
        assert torch.equal(tuned[key], value), f"base weight {key} changed"
    assert all(tuned[k].abs().sum() > 0 for k in factors if "lora_B" in k)  # the factors trained

    # TensorBoard's hparams record the trainable parameters and their share.
    acc = EventAccumulator(str(runs / "lora" / "tensorboard"))
    acc.Reload()
    (hp,) = [
        data.session_start_info.hparams
        for data in (
            plugin_data_pb2.HParamsPluginData.FromString(m.plugin_data.content)
            for m in acc.summary_metadata.values()
            if m.plugin_data.plugin_name == "hparams"
        )
        if data.HasField("session_start_info")
    ]
    trainable = sum(v.numel() for k, v in tuned.items() if k in factors)
    assert hp["params.trainable_params"].number_value == trainable
    total = sum(p.numel() for p in build_model(cfg).parameters())
    assert hp["params.total_params"].number_value == total
    assert hp["params.trainable_share"].number_value == pytest.approx(trainable / total)
    assert hp["finetune.method"].string_value == "lora"


def test_stopped_lora_run_resumes_exactly(lora_runs):
    """Stopped after step 4 and resumed (on 2 ranks, expert parallelism 2: each rank must get
    its own frozen experts back): steps 5-8 as in the uninterrupted run, bit for bit."""
    runs, _, lora_run = lora_runs
    run_distributed(
        _train_worker, 2, lora_run("resumed"), str(runs / "lora" / "checkpoints" / "step_0000004")
    )
    losses, resumed = _losses(runs / "lora"), _losses(runs / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == losses[step], step
    again, _, _ = load_consolidated(runs / "resumed")
    tuned, _, _ = load_consolidated(runs / "lora")
    for key, value in tuned.items():
        assert torch.equal(again[key], value), key


def test_export_merges_adapters_on_request(lora_runs, tmp_path, capsys):
    from safetensors.torch import load_file

    from launch.export import main
    from moe.config.run import load_config

    runs = lora_runs[0]
    with pytest.raises(SystemExit) as e:
        main([str(runs / "lora"), str(tmp_path / "plain"), "--quiet"])
    assert e.value.code == 2 and "--merge-adapters" in capsys.readouterr().err
    assert not (tmp_path / "plain").exists()

    # A checkpoint without adapters: the flag would do nothing, so it is refused.
    with pytest.raises(SystemExit) as e:
        main([str(lora_runs[1]), str(tmp_path / "base"), "--quiet", "--merge-adapters"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds no LoRA adapters to merge (finetune.method none" in err
    assert not (tmp_path / "base").exists()

    main([str(runs / "lora"), str(tmp_path / "plain"), "--quiet", "--merge-adapters"])
    cfg = load_config(tmp_path / "plain" / "run_config.yaml")
    assert cfg.finetune.method == "none"
    plain = MoETransformer(cfg.model)
    plain.load_state_dict(load_file(tmp_path / "plain" / "model.safetensors"))
    state, tuned_cfg, _ = load_consolidated(runs / "lora")
    adapted = build_model(tuned_cfg)
    adapted.load_state_dict(state)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = adapted.eval()(ids).logits
        got = plain.eval()(ids).logits
    assert (want - MoETransformer(cfg.model).eval()(ids).logits).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_adapters_alone_apply_to_their_base_only(lora_runs, tmp_path):
    from launch.export import main
    from moe.config.run import FinetuneConfig
    from moe.core.errors import ConfigError
    from moe.training.finetune import prepare_finetune
    from moe.training.upcycle import initialize_from_checkpoint

    runs, base_ckpt, _ = lora_runs
    main([str(runs / "lora"), str(tmp_path / "ad"), "--format", "adapters", "--quiet"])
    adapter = tmp_path / "ad" / "adapter.safetensors"
    main_states = runs / "lora" / "checkpoints" / "step_0000008" / "mp_rank_00_model_states.pt"
    assert adapter.stat().st_size < main_states.stat().st_size / 4  # small: the factors alone

    state, cfg, _ = load_consolidated(runs / "lora")
    adapted = build_model(cfg)
    adapted.load_state_dict(state)
    lora = dataclasses.replace(cfg.finetune.lora, init_from=str(adapter))
    model = MoETransformer(cfg.model)
    initialize_from_checkpoint(model, base_ckpt)
    prepare_finetune(model, FinetuneConfig("lora", lora))  # the base and the file
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(ids).logits, adapted.eval()(ids).logits, rtol=0, atol=0
        )

    with pytest.raises(ConfigError) as e:  # another base: the seeded initialization
        prepare_finetune(MoETransformer(cfg.model), FinetuneConfig("lora", lora))
    assert e.value.problems[0].startswith(
        f"finetune.lora.init_from: {adapter} was trained on another base model"
    )
    base = MoETransformer(cfg.model)
    initialize_from_checkpoint(base, base_ckpt)
    with pytest.raises(ConfigError) as e:
        prepare_finetune(base, FinetuneConfig("lora", dataclasses.replace(lora, rank=8)))
    assert e.value.problems == [f"finetune.lora.rank: 8 here, 4 in {adapter}"]


def test_adapters_of_a_bf16_run_apply_to_their_fp32_base(lora_runs, tmp_path):
    """A bf16 run holds its frozen base in bf16, so its checkpoint's base is the fp32 base
    rounded to bf16. Its adapter file must still apply to the fp32 checkpoint it was trained
    from (it was refused as "another base") and still refuse another base."""
    from launch.export import main
    from moe.config.run import FinetuneConfig
    from moe.core.errors import ConfigError
    from moe.training.finetune import prepare_finetune
    from moe.training.upcycle import initialize_from_checkpoint

    runs, base_ckpt, lora_run = lora_runs
    d = lora_run("bf16")
    d["train"].update(precision="bf16", max_steps=2)
    d["checkpoint"] = {"every_n_steps": 2}
    run_distributed(_train_worker, 2, d, "auto")
    state, cfg, _ = load_consolidated(runs / "bf16")
    base_state, _, _ = load_consolidated(base_ckpt)
    embed = "embed.weight"
    assert not torch.equal(state[embed], base_state[embed])  # rounded to bf16 ...
    assert state[embed].dtype == torch.bfloat16 and torch.equal(
        state[embed], base_state[embed].bfloat16()
    )
    main([str(runs / "bf16"), str(tmp_path / "ad"), "--format", "adapters", "--quiet"])
    lora = dataclasses.replace(
        cfg.finetune.lora, init_from=str(tmp_path / "ad" / "adapter.safetensors")
    )
    model = MoETransformer(cfg.model)
    initialize_from_checkpoint(model, base_ckpt)
    prepare_finetune(model, FinetuneConfig("lora", lora))  # ... and accepted
    adapted = build_model(cfg)
    adapted.load_state_dict(state)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():  # the base as the run held it: the same
            if "lora_" not in name:  # function then
                p.copy_(p.bfloat16())
        torch.testing.assert_close(
            model.eval()(ids).logits, adapted.eval()(ids).logits, rtol=0, atol=0
        )
    with pytest.raises(ConfigError) as e:
        prepare_finetune(MoETransformer(cfg.model), FinetuneConfig("lora", lora))
    assert "was trained on another base model" in e.value.problems[0]


def test_resume_refuses_other_adapters_by_key(lora_runs):
    from moe.checkpoint.files import verify_checkpoint
    from moe.core.errors import CheckpointError

    runs, _, lora_run = lora_runs
    tag = runs / "lora" / "checkpoints" / "step_0000004"

    def config(method="lora", **lora):
        d = lora_run("again")
        d["model"]["vocab_size"] = 512  # resolved from the tokenizer, as the trainer does
        d["finetune"]["method"] = method
        d["finetune"]["lora"].update(lora)
        if method != "lora":  # a lora section with another method is a config error
            del d["finetune"]["lora"]
        return from_dict(RunConfig, d)

    verify_checkpoint(tag, config())  # the same: accepted
    verify_checkpoint(tag, config(dropout=0.1))  # dropout changes no parameter
    with pytest.raises(
        CheckpointError, match="finetune.lora.rank: the checkpoint has 4, the config has 8"
    ):
        verify_checkpoint(tag, config(rank=8))
    with pytest.raises(CheckpointError, match="finetune.lora.targets: the checkpoint has"):
        verify_checkpoint(tag, config(targets=["attention.q"]))
    with pytest.raises(CheckpointError, match="finetune.method: the checkpoint has 'lora'"):
        verify_checkpoint(tag, config(method="full"))


def test_peft_export_goes_onto_the_base_export_only(lora_runs, tmp_path, capsys):
    """moe-export --format peft on the trained LoRA run (attention q/v and routed experts, EP 2):
    refused without its base's Hugging Face export, for a run that is not LoRA, and onto another
    base, each time with nothing written; then peft loads it onto the base export (given, or
    found through adapter_config.json) with our logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from launch.export import main

    runs, base_ckpt, _ = lora_runs
    out = tmp_path / "peft"

    def refused(*args) -> str:
        with pytest.raises(SystemExit) as e:
            main([*map(str, args), "--format", "peft", "--quiet"])
        assert e.value.code == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(made)  # nothing written
        return capsys.readouterr().err

    made = []
    err = refused(runs / "lora", out)
    assert "--base-hf" in err and f"moe-export {base_ckpt} DIR --format hf" in err
    main([str(base_ckpt), str(tmp_path / "hf_base"), "--format", "hf", "--quiet"])
    main(
        [
            str(runs / "lora"),
            str(tmp_path / "hf_tuned"),
            "--format",
            "hf",
            "--quiet",
            "--merge-adapters",
        ]
    )
    made = ["hf_base", "hf_tuned"]
    assert "finetune.method: none" in refused(runs / "base", out, "--base-hf", tmp_path / "hf_base")
    err = refused(runs / "lora", out, "--base-hf", tmp_path / "hf_tuned")
    assert "not the base model the adapters" in err and "blocks.0.attn.q_proj.weight" in err

    main(
        [
            str(runs / "lora"),
            str(out),
            "--format",
            "peft",
            "--quiet",
            "--base-hf",
            str(tmp_path / "hf_base"),
        ]
    )
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf_base").resolve())
    assert config["target_modules"] == ["self_attn.q_proj", "self_attn.v_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    state, cfg, _ = load_consolidated(runs / "lora")
    ours = build_model(cfg)
    ours.load_state_dict(state)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_base"))
    with torch.no_grad():
        want = ours.eval()(ids).logits
        assert (want - base.eval()(input_ids=ids).logits).abs().max() > 1e-3  # trained factors
        for model in (
            peft.PeftModel.from_pretrained(base, str(out)),
            peft.AutoPeftModelForCausalLM.from_pretrained(str(out)),
        ):
            got = model.eval()(input_ids=ids).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
