"""``finetune.lora.init_from`` (moe/training/finetune.py): an adapter file puts its factors
back, and a file that is not one, or whose metadata is damaged, is refused naming the key and
the file, as a ConfigError (a configuration no restart fixes), never a traceback."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moe.config.run import FinetuneConfig
from moe.core.config_schema import from_dict, to_dict
from moe.core.errors import ConfigError
from moe.model.adapters.lora import BASE_DTYPES, LoRAConfig, base_fingerprint, is_factor
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import adapter_file_problem, prepare_finetune

LORA = {"targets": ["attention.q", "experts"], "rank": 2}


def tiny_model() -> MoETransformer:
    torch.manual_seed(0)
    cfg = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 16,
        "moe": {"num_experts": 4, "expert_hidden": 16},
    }
    return MoETransformer(from_dict(ModelConfig, cfg))


def finetune(**lora) -> FinetuneConfig:
    return from_dict(FinetuneConfig, {"method": "lora", "lora": {**LORA, **lora}})


def adapter_file(path, metadata_changes: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """An adapter file of random factors for :func:`tiny_model`, as ``moe-export --format
    adapters`` writes it, with ``metadata_changes`` applied (None: the key removed)."""
    model = tiny_model()
    prepare_finetune(model, finetune())
    gen = torch.Generator().manual_seed(1)
    factors = {
        n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters() if is_factor(n)
    }
    params = dict(model.named_parameters())
    metadata = {
        "format": "pt",
        "base_dtype": "float32",
        "base_sha256": base_fingerprint(params, BASE_DTYPES["float32"]),
        "lora": json.dumps(to_dict(from_dict(LoRAConfig, LORA))),
    }
    for key, value in metadata_changes.items():
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    save_file(factors, str(path), metadata=metadata)
    return str(path), factors


def test_an_adapter_file_puts_its_factors_back(tmp_path):
    path, factors = adapter_file(tmp_path / "adapter.safetensors", {})
    assert adapter_file_problem(path) is None
    model = tiny_model()
    prepare_finetune(model, finetune(init_from=path))
    ours = {n: p for n, p in model.named_parameters() if is_factor(n)}
    assert ours.keys() == factors.keys()
    for name, p in ours.items():
        assert torch.equal(p, factors[name]), name


@pytest.mark.parametrize(
    "changes",
    [
        {"lora": "{not json"},  # damaged settings
        {"lora": "[1, 2]"},  # settings that are not an object
        {"lora": None},
        {"base_sha256": None},
    ],
    ids=["lora-not-json", "lora-not-an-object", "no-lora", "no-base-fingerprint"],
)
def test_damaged_metadata_is_refused_naming_the_key(tmp_path, changes):
    path, _ = adapter_file(tmp_path / "adapter.safetensors", changes)
    expected = f"finetune.lora.init_from: {path} is not an adapter file"
    assert adapter_file_problem(path).startswith(expected)
    with pytest.raises(ConfigError) as e:
        prepare_finetune(tiny_model(), finetune(init_from=path))
    (problem,) = e.value.problems
    assert problem.startswith(expected)


def test_unreadable_files_are_refused_naming_the_key(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\0" * 100)
    odd_dtype = adapter_file(tmp_path / "odd-dtype.safetensors", {"base_dtype": "int8"})[0]
    for path, says in [
        (str(tmp_path / "absent.safetensors"), "cannot read"),
        (str(garbage), "cannot read"),
        (str(tmp_path), "is a directory; name the adapter file itself"),
        (odd_dtype, "says base_dtype 'int8'"),
    ]:
        assert adapter_file_problem(path).startswith("finetune.lora.init_from: "), path
        assert says in adapter_file_problem(path)
        with pytest.raises(ConfigError, match="finetune.lora.init_from: "):
            prepare_finetune(tiny_model(), finetune(init_from=path))
