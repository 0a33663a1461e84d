"""One classification per config field (arch / fixed / runtime field metadata) of the model and
the fine-tuning section, and everything that reads it: the resume checks, the Hugging Face export
statement, upcycling, adapter files, planning's capacity."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from moe.checkpoint.files import config_mismatches, finetune_mismatches
from moe.config.run import FinetuneConfig
from moe.core.config_schema import (
    arch,
    field_roles,
    fixed,
    function_classes,
    function_keys,
    resume_keys,
    runtime,
    to_dict,
)
from moe.model.adapters.lora import LoRAConfig
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig
from moe.tools import hf_support, planning


def test_every_model_config_field_is_classified():
    classes = function_classes(ModelConfig)  # raises on an unclassified field
    assert classes["position"] and classes["moe.router.renormalize"]
    assert not classes["init_std"] and not classes["moe.router.aux_loss_coef"]


@dataclass
class _Inner:
    width: int = arch(4)
    bias: bool = False


@dataclass
class _Outer:
    depth: int = runtime(2)
    inner: _Inner = field(default_factory=_Inner)


def test_an_unclassified_field_is_named():
    with pytest.raises(TypeError, match=r"\['inner.bias'\] are not classified"):
        function_classes(_Outer)


def test_a_saved_config_without_a_newer_key_holds_its_default():
    """Checkpoints written before an option existed resume: the missing key is the default."""
    saved = to_dict(ModelConfig())
    del saved["rope_theta"], saved["moe"]["router"]["renormalize"]
    assert config_mismatches(saved, ModelConfig()) == []
    assert config_mismatches(saved, ModelConfig(rope_theta=5e5)) == [
        "model.rope_theta: the checkpoint has 10000.0, the config has 500000.0"
    ]


def test_only_function_changing_fields_are_compared():
    saved = to_dict(ModelConfig())
    changed = ModelConfig(init_std=0.5, attention_backend="reference", document_masking=True)
    assert config_mismatches(saved, changed) == []
    changed.moe.router = RouterConfig(scaling_factor=2.5, z_loss_coef=1.0)
    assert config_mismatches(saved, changed) == [
        "model.moe.router.scaling_factor: the checkpoint has 1.0, the config has 2.5"
    ]
    assert "moe.router.scaling_factor" in function_keys(ModelConfig)


@pytest.mark.parametrize("target", sorted(hf_support.TARGETS))
def test_every_exporter_holds_or_refuses_each_function_changing_field(target):
    """A function-changing field is never ignored as 'training only' by an exporter, and every
    field it ignores is one the classification says leaves the function unchanged."""
    rules = hf_support.TARGETS[target]
    for path, changes in function_classes(ModelConfig).items():
        assert path in rules, (target, path)
        assert (rules[path].how != "training") == changes, (target, path, rules[path].how)


def test_planning_counts_capacity_with_the_routers_own_function(monkeypatch):
    cfg = ModelConfig()
    cfg.moe.capacity_factor = 1.0
    monkeypatch.setattr(planning, "capacity", lambda tokens, experts, top_k, factor: 3)
    assert planning.routed_copies(cfg, 1000) == cfg.moe.num_experts * 3


def test_every_finetune_field_is_classified():
    roles = field_roles(FinetuneConfig)  # raises on an unclassified field
    assert set(resume_keys(FinetuneConfig)) == {
        "method",
        "lora.targets",
        "lora.rank",
        "lora.alpha",
        "lora.expert_rank",
        "lora.train_router",
        "esft.score",
        "esft.p",
        "esft.max_batches",
        "adapter.hidden",
        "adapter.placement",
        "prompt.tokens",
        "prefix.tokens",
    }
    assert roles["lora.train_router"] == roles["esft.p"] == "fixed"
    assert roles["lora.dropout"] == roles["lora.init_from"] == roles["prompt.init"] == "runtime"
    # What an adapter file must share with the run that applies it.
    assert function_keys(LoRAConfig) == ["targets", "rank", "alpha", "expert_rank"]


def test_a_new_finetune_field_is_checked_on_resume_or_named_unclassified():
    @dataclass
    class WithKnob(FinetuneConfig):
        knob: int = fixed(0)
        loose: int = runtime(0)

    saved = to_dict(FinetuneConfig(method="full"))  # a checkpoint older than both fields
    assert finetune_mismatches(saved, WithKnob(method="full", loose=3)) == []
    assert finetune_mismatches(saved, WithKnob(method="full", knob=2)) == [
        "finetune.knob: the checkpoint has 0, the config has 2"
    ]

    @dataclass
    class Unclassified(FinetuneConfig):
        knob: int = 0

    with pytest.raises(TypeError, match=r"\['knob'\] are not classified"):
        finetune_mismatches(saved, Unclassified(method="full"))
