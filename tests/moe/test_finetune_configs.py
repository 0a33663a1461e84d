"""Every fine-tuning method has a config under configs/ that loads once given its base."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.config.run import load_config
from moe.errors import ConfigError
from moe.model.adapters.qlora import torchao_missing

CONFIGS = sorted(Path("configs").glob("finetune-*.yaml"))


def test_one_config_per_method():
    assert {p.stem.removeprefix("finetune-") for p in CONFIGS} == {
        "full", "lora", "qlora", "esft", "adapter", "prompt", "prefix"}


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

    cfg = load_config("configs/finetune-lora.yaml",
                      ["model.init_from=runs/default", "model.vocab_size=4096"])
    model = MoETransformer(cfg.model)
    prepare_finetune(model, cfg.finetune)
    assert 0.005 < parameter_counts(model)["trainable_share"] <= 0.02
