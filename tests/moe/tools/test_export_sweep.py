"""The export sweep: every option of the model config, derived from the config dataclasses, on a
tiny model with random weights saved by the trainer's own save path; for every Hugging Face
target (and ``--arch auto``) ``moe-export`` either refuses it (exit 2, the varied key named,
nothing written) or writes a model whose logits equal ours within 1e-4 with the same argmax
everywhere. The fp32 export of every variant loads back to our logits, and ``moe-eval``
evaluates every variant.

Variants: each value of every ``Literal`` field and the flip of every ``bool`` field of the
model config (nested MoE and router configs included), one at a time against a small base that
every target holds; the numeric settings in ``NUMERIC`` (each numeric field is either there or
in ``NOT_VARIED`` with the reason, checked below, so a new field fails until someone decides);
and the interacting pairs in ``PAIRS``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.evaluation.evaluate import load_model
from moe.model.transformer import ModelConfig, MoETransformer
from moe.tools import hf_support
from moe.training import trainer
from tests.conftest import tiny_run_dict

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]

DENSE_TARGETS = ("llama",)
"""Targets whose layers are all dense: every MoE model is refused there."""
BASE = {
    "d_model": 32,
    "n_layers": 3,
    "n_heads": 4,
    "max_seq_len": 64,
    "moe": {"num_experts": 4, "expert_hidden": 16, "router": {"top_k": 2, "renormalize": True}},
}
"""Held exactly by every target but the dense ones: the reference point of the one-at-a-time
variants."""

NUMERIC = {
    "vocab_size": [600],
    "d_model": [48],
    "n_layers": [2],
    "n_heads": [2],
    "n_kv_heads": [1, 2],
    "max_seq_len": [48],
    "rope_theta": [500.0],
    "norm_eps": [1e-2],
    "init_std": [0.05],
    "t5_num_buckets": [8],
    "t5_max_distance": [20],
    "moe.num_experts": [6],
    "moe.expert_hidden": [24],
    "moe.capacity_factor": [1.25],
    "moe.num_shared_experts": [1],
    "moe.every_n_layers": [2],
    "moe.first_dense_layers": [1],
    "moe.dense_hidden": [24],
    "moe.router.top_k": [1, 3],
    "moe.router.scaling_factor": [2.5],
    "moe.router.jitter_eps": [0.1],
    "moe.router.logit_noise_std": [0.5],
    "moe.router.aux_loss_coef": [0.1],
    "moe.router.z_loss_coef": [1e-3],
    "moe.router.bias_update_rate": [0.01],
    "moe.router.init_std": [0.1],
    "head_dim": [12],
}
NOT_VARIED = {
    "init_from": "needs another run's checkpoint; only chooses the starting weights",
    "upcycle_noise_std": "read only with init_from",
    "cross_entropy_chunk_tokens": "the block size of the training loss cross_entropy chunked "
    "(varied); tests/moe/model/test_loss.py varies it",
}
UNAVAILABLE = {
    ("cross_entropy", "liger"): "Liger-Kernel's Triton kernels run on CUDA only "
    "(tests/gpu/test_levers.py); full and chunked are swept",
}
"""Values that cannot train on a CPU, with the reason; the field's other values are swept."""


def _literal_and_bool_fields(cls=ModelConfig, prefix=""):
    """(dotted path, every value) of each Literal and bool field, nested configs included;
    numeric and other fields as (dotted path, None)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _literal_and_bool_fields(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is typing.Literal:
            yield prefix + f.name, list(typing.get_args(hint))
        elif hint is bool:
            yield prefix + f.name, [False, True]
        else:
            yield prefix + f.name, None


FIELDS = dict(_literal_and_bool_fields())
POSITIONS = FIELDS["position"]


def _get(d: dict, path: str):
    for k in path.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def _base_value(path: str):
    value = _get(BASE, path)
    if value != {}:
        return value
    obj = ModelConfig()
    for k in path.split("."):
        obj = getattr(obj, k)
    return obj


PAIRS = [
    {"moe.num_shared_experts": 1, "moe.every_n_layers": 2},
    *({"n_kv_heads": 2, "position": p} for p in POSITIONS if p != _base_value("position")),
    {"moe.router.score_func": "sigmoid", "moe.router.bias_update_rate": 0.01},
    {"moe.router.order": "topk_then_softmax", "moe.router.top_k": 1},
    {"ffn": "dense", "moe.num_shared_experts": 1},
    {"norm": "layernorm", "norm_placement": "post"},
    {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 20},
    {"tie_embeddings": True, "moe.num_shared_experts": 1, "moe.first_dense_layers": 1},
    {
        "qkv_bias": True,
        "head_dim": 12,
        "moe.num_shared_experts": 2,
        "moe.shared_expert_gate": True,
        "moe.router.renormalize": False,
    },
]
COMPANIONS = {("moe.shared_expert_gate", True): {"moe.num_shared_experts": 1}}
"""A value that is valid only with another setting, which its variant then also takes."""


def variants() -> dict[str, dict]:
    out = {"base": {}}
    for path, values in FIELDS.items():
        for v in values or NUMERIC.get(path, []):
            if v != _base_value(path) and (path, v) not in UNAVAILABLE:
                out[f"{path}={v}"] = {path: v, **COMPANIONS.get((path, v), {})}
    for pair in PAIRS:
        out["+".join(f"{k}={v}" for k, v in pair.items())] = pair
    return out


VARIANTS = variants()
TARGETS = [*hf_support.TARGETS, "auto"]


def test_every_numeric_field_is_varied_or_excused():
    numeric = {p for p, values in FIELDS.items() if values is None}
    assert numeric == NUMERIC.keys() | NOT_VARIED.keys()
    assert not NUMERIC.keys() & NOT_VARIED.keys()


def test_every_target_states_every_config_field():
    fields = set(FIELDS)
    for arch, rules in hf_support.TARGETS.items():
        assert set(rules) == fields, arch
        for path, rule in rules.items():
            assert rule.how in ("config", "training", "limited"), (arch, path)
            assert (rule.refuse is not None) == (rule.how == "limited"), (arch, path)


def test_an_option_without_a_rule_is_refused_by_name(monkeypatch):
    rules = dict(hf_support.TARGETS["mixtral"])
    del rules["moe.router.z_loss_coef"]
    monkeypatch.setitem(hf_support.TARGETS, "mixtral", rules)
    problems = hf_support.problems(from_dict(ModelConfig, copy.deepcopy(BASE)), "mixtral", {})
    assert problems == [
        "model.moe.router.z_loss_coef: 0.0: the mixtral export has no rule for "
        "this option yet (moe/tools/hf_support.py)"
    ]


# --- checkpoints ------------------------------------------------------------------------------


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer away from its initial value (norm gains off 1, biases and the
    router's selection bias off 0), so that a tensor placed wrongly changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.is_floating_point() and p.numel() and (p.requires_grad or "score_bias" in name):
                p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 0.3))


class _RandomModel(MoETransformer):
    def __init__(self, cfg):
        super().__init__(cfg)
        _randomize(self, seed=len(repr(cfg)))


def _run_dict(data, out_dir, name: str, overrides: dict) -> dict:
    d = tiny_run_dict(data, out_dir, max_steps=1, warmup_steps=0)
    d["name"] = name.replace("=", "_").replace("+", "__")
    d["model"] = copy.deepcopy(BASE)
    for path, value in overrides.items():
        node = d["model"]
        *parents, leaf = path.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["logging"] = {"log_every": 1, "tensorboard": False}
    d["eval"] = {"every_n_steps": 0}
    return d


@pytest.fixture(scope="module")
def checkpoints(tiny_data, tmp_path_factory):
    """variant name -> run directory, trained for one step (random weights, then the trainer's
    own step and save: ZeRO partitions, per-expert files, marker) on one gloo rank."""
    from moe.tools.export import _one_rank_process_group

    root = tmp_path_factory.mktemp("sweep")
    mp = pytest.MonkeyPatch()
    mp.setattr(trainer, "MoETransformer", _RandomModel)
    runs = {}
    try:
        with _one_rank_process_group():
            for name, overrides in VARIANTS.items():
                d = _run_dict(tiny_data, root / "runs", name, overrides)
                cfg = from_dict(RunConfig, d)
                trainer.train(cfg, trainer.DistEnv(0, 1, 0, 1), resume="none")
                runs[name] = cfg.run_dir
    finally:
        mp.undo()
    return types.SimpleNamespace(runs=runs, root=root)


def _export(run_dir, out, *args, capsys) -> tuple[int, str]:
    from launch.export import main

    try:
        main([str(run_dir), str(out), *args])
        rc = 0
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow  # every variant trained, exported and loaded back
@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_export_is_exact_or_refused_by_name(checkpoints, variant, arch, capsys):
    run_dir = checkpoints.runs[variant]
    out = checkpoints.root / "hf" / arch / run_dir.name / "model"
    rc, err = _export(run_dir, out, "--format", "hf", "--arch", arch, capsys=capsys)
    if rc != 0:
        assert rc == 2, err
        assert not out.parent.exists(), "the refusal wrote files"
        assert "--format fp32" in err
        named = [p for p in VARIANTS[variant] if f"model.{p}: " in err]
        # The dense target refuses the MoE base itself, by its ffn key.
        named += ["ffn"] if arch in DENSE_TARGETS and "model.ffn: 'moe': " in err else []
        assert named, f"the refusal names none of the varied keys {list(VARIANTS[variant])}:\n{err}"
        if arch == "auto":
            assert all(f"  {a}:\n" in err for a in hf_support.TARGETS), err
        return
    model, cfg, _ = load_model(run_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    if arch != "auto":
        assert hf.config.model_type == arch
    ids = _ids(cfg.model.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(input_ids=ids).logits
    assert (ours - ours.mean()).abs().max() > 0.1  # not a constant output
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


@pytest.mark.slow  # every variant trained, exported and loaded back
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_export_loads_back_to_our_logits(checkpoints, variant, capsys):
    from safetensors.torch import load_file

    from moe.config.run import load_config
    from moe.tools.export import FP32_FILE

    run_dir = checkpoints.runs[variant]
    out = checkpoints.root / "fp32" / run_dir.name
    rc, err = _export(run_dir, out, "--format", "fp32", capsys=capsys)
    assert rc == 0, err
    cfg = load_config(out / "run_config.yaml")
    back = MoETransformer(cfg.model)
    back.load_state_dict(load_file(str(out / FP32_FILE)), strict=not cfg.model.tie_embeddings)
    model, _, _ = load_model(run_dir)
    ids = _ids(cfg.model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow  # every variant trained, exported and loaded back
def test_moe_eval_evaluates_every_variant(checkpoints):
    report = checkpoints.root / "eval"
    runs = [str(checkpoints.runs[v]) for v in sorted(VARIANTS)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            *runs,
            "--output",
            str(report),
            "--max-tokens",
            "64",
            "--no-generation",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((report / "eval.json").read_text())["checkpoints"]
    assert len(results) == len(runs)
    for r in results:
        assert 0 < r["loss"] < 20, r


# --- the weight mapping, on a state dict without a checkpoint ---------------------------------


def _base_state(arch: str):
    from moe.tools.export import _hf_state

    model_cfg = from_dict(ModelConfig, {**copy.deepcopy(BASE), "vocab_size": 64})
    # _hf_state reads the run config's model section only
    return types.SimpleNamespace(model=model_cfg), MoETransformer(model_cfg).state_dict(), _hf_state


@pytest.mark.parametrize("arch", sorted(hf_support.TARGETS))
def test_the_mapping_names_a_tensor_it_does_not_place_or_cannot_find(arch):
    from moe.core.errors import CheckpointError

    cfg, state, hf_state = _base_state(arch)
    assert len(hf_state(dict(state), cfg, arch)) > 0
    extra = {**state, "positions.weight": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"does not place: \['positions.weight'\]"):
        hf_state(extra, cfg, arch)
    missing = {k: v for k, v in state.items() if k != "blocks.1.ffn_norm.weight"}
    with pytest.raises(CheckpointError, match=r"no tensor blocks.1.ffn_norm.weight"):
        hf_state(missing, cfg, arch)


def test_a_zero_selection_bias_exports_and_a_learned_one_is_refused():
    cfg, state, _ = _base_state("mixtral")
    cfg.model.moe.router.bias_update_rate = 0.01
    assert hf_support.problems(cfg.model, "mixtral", state) == []
    state["blocks.0.ffn.router.score_bias"] = torch.tensor([0.0, 0.02, -0.01, 0.0])
    assert [p.split(":")[0] for p in hf_support.problems(cfg.model, "mixtral", state)] == [
        "model.moe.router.bias_update_rate"
    ]
