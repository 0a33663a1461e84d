"""Every fine-tuning method has a config under configs/ that loads once given its base."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.config.run import load_config
from moe.core.errors import ConfigError
from moe.model.adapters.qlora import torchao_missing

CONFIGS = sorted(Path("configs").glob("finetune-*.yaml"))


def test_one_config_per_method():
    assert {p.stem.removeprefix("finetune-") for p in CONFIGS} == {
        "full",
        "lora",
        "qlora",
        "esft",
        "adapter",
        "prompt",
        "prefix",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_config_asks_for_its_base_and_loads_with_it(path):
    if path.stem == "finetune-qlora" and torchao_missing():
        pytest.skip("needs torchao (the test extra installs it)")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert any(p.startswith("model.init_from:") for p in e.value.problems)
    cfg = load_config(str(path), ["model.init_from=runs/default"])
    assert cfg.finetune.method == path.stem.removeprefix("finetune-")
    assert cfg.name == path.stem


def test_the_lora_config_trains_at_most_two_percent():
    """The share benchmarks/finetune_bench.py holds LoRA to, on the default-size model (the
    default tokenizer's 4096 ids)."""
    from moe.model.transformer import MoETransformer
    from moe.training.finetune import parameter_counts, prepare_finetune

    cfg = load_config(
        "configs/finetune-lora.yaml", ["model.init_from=runs/default", "model.vocab_size=4096"]
    )
    model = MoETransformer(cfg.model)
    prepare_finetune(model, cfg.finetune)
    assert 0.005 < parameter_counts(model)["trainable_share"] <= 0.02


@pytest.mark.parametrize(
    "method,setting",
    [
        ("lora", "lora.rank=4"),
        ("qlora", "lora.rank=4"),
        ("esft", "esft.p=0.3"),
        ("adapter", "adapter.hidden=8"),
        ("prompt", "prompt.tokens=5"),
        ("prefix", "prefix.tokens=5"),
    ],
)
def test_a_methods_section_under_another_method_is_refused_by_key(method, setting):
    """A config copied from one method's and switched to another keeps a section the new
    method never reads: refused by key, not silently ignored."""
    if method == "qlora" and torchao_missing():
        pytest.skip("needs torchao (the test extra installs it)")
    path, section = f"configs/finetune-{method}.yaml", setting.split(".")[0]
    load_config(path, ["model.init_from=runs/default", f"finetune.{setting}"])  # its own method
    other = "prefix" if method == "prompt" else "prompt"
    with pytest.raises(ConfigError) as e:
        load_config(
            path,
            ["model.init_from=runs/default", f"finetune.{setting}", f"finetune.method={other}"],
        )
    (problem,) = [p for p in e.value.problems if p.startswith(f"finetune.{section}:")]
    assert f"but finetune.method {other} does not read it" in problem
    assert setting.split(".")[1].split("=")[0] in problem  # names the key set


def test_a_pretraining_config_with_a_fine_tuning_section_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"finetune.prompt: set \(tokens\), but finetune.method "
        "none does not read it",
    ):
        load_config("configs/default.yaml", ["finetune.prompt.tokens=8"])
    # A section at its defaults is not "set".
    load_config("configs/default.yaml", ["finetune.lora.dropout=0.0"])
