"""The PEFT layout of a LoRA fine-tune (moe/tools/peft_export.py), checked by the peft library
itself: for Mixtral (fused experts and router as target_parameters), Qwen2-MoE (also shared
experts and a dense layer as target_modules) and Llama (every layer dense), our adapted model's
logits equal those of peft's PeftModel.from_pretrained on the transformers export of the base.
Every B factor is random, so any misplaced or mis-shaped factor shows in the logits."""

import dataclasses
import json

import pytest
import torch

from moe.config.run import FinetuneConfig, RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import CheckpointError
from moe.model.adapters.lora import is_factor
from moe.tools.export import hf_model
from moe.tools.peft_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_base,
    peft_adapter,
    peft_problems,
)
from moe.weights.load import build_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATTENTION = ["attention.q", "attention.k", "attention.v", "attention.o"]
MOE = {"num_experts": 4, "expert_hidden": 24}
CASES = {
    # D (32) differs from the experts' hidden width (24): gate_up_proj's and down_proj's factors
    # cannot trade places unnoticed. A routed scaling factor scales down_proj and its B.
    "mixtral": (
        {
            "n_kv_heads": 2,
            "moe": {
                **MOE,
                "router": {"top_k": 2, "order": "topk_then_softmax", "scaling_factor": 1.5},
            },
        },
        {"targets": [*ATTENTION, "experts", "router"], "dropout": 0.1},
    ),
    # An ungated shared expert is exported times 2 on down_proj; the dense first layer's FFN.
    "qwen2_moe": (
        {
            "n_layers": 3,
            "qkv_bias": True,
            "moe": {
                **MOE,
                "num_shared_experts": 1,
                "first_dense_layers": 1,
                "router": {"top_k": 2},
            },
        },
        {
            "targets": ["attention.q", "attention.v", "ffn", "shared_experts", "experts", "router"],
            "expert_rank": "per_top_k",
        },
    ),
    "llama": (
        {"ffn": "dense", "moe": {"dense_hidden": 48}},
        {"targets": [*ATTENTION, "ffn"], "dropout": 0.1},
    ),
    # Routers trained in full and with LoRA: each saved whole (modules_to_save), LoRA folded in.
    "mixtral+train_router": (
        {"moe": {**MOE, "router": {"top_k": 2, "renormalize": True}}},
        {"targets": ["attention.o", "experts", "router"], "train_router": True},
    ),
}


def _adapted(case: str) -> tuple[torch.nn.Module, RunConfig, dict]:
    """Our model with LoRA on every target of the case and every factor random (and the routers
    moved, where they train), and the base weights it started from."""
    model, lora = CASES[case]
    cfg = from_dict(
        RunConfig,
        {
            "model": {
                "vocab_size": 96,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "max_seq_len": 32,
                "init_from": "base",
                **model,
            },
            "data": {"seq_len": 32},
            "finetune": {"method": "lora", "lora": {"rank": 4, "alpha": 6.0, **lora}},
        },
    )
    torch.manual_seed(0)
    ours = build_model(cfg)
    base = {k: v.clone() for k, v in ours.state_dict().items() if not is_factor(k)}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_factor(name) or name.endswith("router.weight") and lora.get("train_router"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return ours.eval(), cfg, base


def _save_base(base_state: dict, cfg: RunConfig, arch: str, out) -> None:
    """The Hugging Face export of the fine-tune's base, as export_hf writes it."""
    plain_cfg = dataclasses.replace(cfg, finetune=FinetuneConfig())
    hf_model(base_state, plain_cfg, arch).save_pretrained(str(out))


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_the_adapter_onto_the_base_with_our_logits(case, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import save_file

    arch = case.split("+")[0]
    ours, cfg, base_state = _adapted(case)
    state = ours.state_dict()
    _save_base(base_state, cfg, arch, tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    config, tensors = peft_adapter(state, cfg, arch)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.model.vocab_size, (3, 24), generator=gen)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        want = ours(ids).logits
        got = model(input_ids=ids).logits
    # peft placed every tensor of the file and created no factor the file lacks.
    loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == tensors.keys(), loaded.keys() ^ tensors.keys()
    for k, t in tensors.items():
        torch.testing.assert_close(loaded[k], t, rtol=0, atol=0, msg=k)
    assert (want - plain).abs().max() > 0.05  # the adapter changes the function
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    lora = cfg.finetune.lora
    moe = arch != "llama"
    assert (config["target_parameters"] is not None) == moe
    if moe:  # fused experts: peft's parameter targets, and no dropout there
        router = [] if lora.train_router else ["mlp.gate.weight"]
        assert sorted(config["target_parameters"]) == sorted(
            ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *router]
        )
        assert config["lora_dropout"] == 0.0
    else:
        assert config["lora_dropout"] == lora.dropout
    assert config["modules_to_save"] == (["mlp.gate"] if lora.train_router else None)
    if lora.expert_rank == "per_top_k":  # rank 4 // top_k 2 for the routed experts alone
        assert config["rank_pattern"] == {"mlp.experts.gate_up_proj": 2, "mlp.experts.down_proj": 2}


def test_only_lora_adapters_of_the_base_export():
    _, cfg, _ = _adapted("mixtral")
    assert peft_problems(cfg) == []
    for method in ("full", "esft", "adapter", "prompt", "prefix"):
        (problem,) = peft_problems(
            dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, method=method))
        )
        assert problem.startswith(f"finetune.method: {method}: only LoRA")


def test_the_base_directory_must_hold_the_fine_tunes_base(tmp_path):
    ours, cfg, base_state = _adapted("qwen2_moe")
    state = ours.state_dict()
    _save_base(base_state, cfg, "qwen2_moe", tmp_path / "base")
    assert check_base(tmp_path / "base", state, cfg, tmp_path) == "qwen2_moe"
    # A bf16 run holds its frozen base in bf16: the fp32 export rounded alike.
    half = {k: v if is_factor(k) else v.to(torch.bfloat16) for k, v in state.items()}
    assert check_base(tmp_path / "base", half, cfg, tmp_path) == "qwen2_moe"

    moved = dict(state)
    moved["blocks.1.ffn.experts.w_out"] = state["blocks.1.ffn.experts.w_out"] * (1 + 1e-4)
    with pytest.raises(
        CheckpointError,
        match=r"^--base-hf .*: not the base model the adapters "
        r"of .* were trained on \(model.init_from: base\): 1 of \d+ weights "
        r"differ \(blocks.1.ffn.experts.w_out\); the --format hf export of "
        r"this run's base \(model.init_from: base\); export it with: "
        r"moe-export base DIR --format hf, then pass --base-hf DIR",
    ):
        check_base(tmp_path / "base", moved, cfg, tmp_path)
    with pytest.raises(CheckpointError, match="^--base-hf .*: not a model the importer reads"):
        check_base(tmp_path / "nowhere", state, cfg, tmp_path)
    # Routers trained in full are the run's own (saved whole): the base's are not compared.
    ours, cfg, base_state = _adapted("mixtral+train_router")
    _save_base(base_state, cfg, "mixtral", tmp_path / "mixtral")
    assert check_base(tmp_path / "mixtral", ours.state_dict(), cfg, tmp_path) == "mixtral"
    frozen = dataclasses.replace(
        cfg,
        finetune=dataclasses.replace(
            cfg.finetune, lora=dataclasses.replace(cfg.finetune.lora, train_router=False)
        ),
    )
    with pytest.raises(CheckpointError, match=r"2 of \d+ weights differ \(blocks.0.ffn.router"):
        check_base(tmp_path / "mixtral", ours.state_dict(), frozen, tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "hf", "--base-hf", "x"], "--base-hf goes with --format peft"),
        (["--format", "peft", "--base-hf", "x", "--arch", "llama"], "--arch goes with --format hf"),
        (
            ["--format", "peft", "--merge-adapters"],
            "--merge-adapters goes with --format fp32 or hf",
        ),
    ],
)
def test_options_that_do_not_go_with_the_format_are_refused(args, message, tmp_path, capsys):
    from launch.export import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "ckpt"), str(tmp_path / "out"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "init_from, hint",
    [
        # An hf: base is the directory itself: the hint names it (not "moe-export hf:DIR ...").
        (
            "hf:/models/my base",
            "this run's base (model.init_from: hf:/models/my base) is that "
            "directory: --base-hf '/models/my base'",
        ),
        (
            "runs/base",
            "export it with: moe-export runs/base DIR --format hf, then pass --base-hf DIR",
        ),
    ],
)
def test_a_missing_base_hf_names_the_directory_to_pass(init_from, hint, tmp_path, capsys):
    import yaml

    from launch.export import main
    from moe.checkpoint.files import MARKER, RUN_CONFIG
    from moe.core.config_schema import to_dict

    _, cfg, _ = _adapted("llama")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / MARKER).write_text("{}")
    run = to_dict(cfg)
    run["model"]["init_from"] = init_from
    (ckpt / RUN_CONFIG).write_text(yaml.safe_dump(run))
    with pytest.raises(SystemExit) as e:
        main([str(ckpt), str(tmp_path / "out"), "--format", "peft"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--format peft needs --base-hf DIR" in err and hint in err, err
    assert "moe-export hf:" not in err and not (tmp_path / "out").exists()
