"""The settings a config leaves to the device (``RunConfig.device_choices`` and ``for_device``):
on the CPU the plain ones, under which CPU runs train as before the setting existed; on CUDA
the measured levers, each only where it applies; values a config gives are kept; the
trainer's engine resolves its config for the device it runs on."""

from __future__ import annotations

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from tests.helpers.distributed import run_distributed
from tests.helpers.engine_configs import tiny_engine_dict

LEFT = {
    "train.compile",
    "train.immediate_grad_update",
    "train.flat_grad_ops",
    "train.optimizer_impl",
    "model.cross_entropy",
    "model.qkv_projection",
    "model.moe.permute",
}
PLAIN = {
    "train.compile": False,
    "train.immediate_grad_update": False,
    "train.flat_grad_ops": False,
    "train.optimizer_impl": "auto",
    "model.cross_entropy": "full",
    "model.qkv_projection": "separate",
    "model.moe.permute": "index_add",
}


def config(train: dict | None = None, zero: int = 1, method: str = "none") -> RunConfig:
    d = tiny_engine_dict(64, 16, train={"precision": "bf16", **(train or {})}, zero_stage=zero)
    if method != "none":
        d["finetune"] = {"method": method}
        d["model"]["init_from"] = "runs/base/checkpoints/step_0000010"
    return from_dict(RunConfig, d)


def get(cfg: RunConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def test_on_the_cpu_every_setting_left_open_takes_its_plain_value():
    cfg = config()
    assert set(cfg.device_choices("cpu")) == LEFT
    assert cfg.device_choices("cpu") == PLAIN
    resolved = cfg.for_device("cpu")
    assert {k: get(resolved, k) for k in LEFT} == PLAIN
    assert resolved.train.adamw_options() == {}  # torch's own choice, as before


def test_on_cuda_the_measured_levers_where_each_applies():
    bf16_zero1 = config().device_choices("cuda")
    assert bf16_zero1 == {
        "train.compile": True,
        "train.immediate_grad_update": True,
        "train.flat_grad_ops": True,
        "train.optimizer_impl": "fused",
        "model.cross_entropy": "chunked",
        "model.qkv_projection": "fused",
        "model.moe.permute": "gather",
    }
    # Gradients folded as produced only under DeepSpeed's BF16 optimizer (bf16, ZeRO 1, fp32
    # reduction), the flat gradient work only at ZeRO 1 or 2: otherwise refused, so not chosen.
    for cfg in (
        config(zero=2),
        config({"grad_reduce_dtype": "bf16"}),
        config({"precision": "fp32"}),
    ):
        got = cfg.for_device("cuda")
        assert got.train.immediate_grad_update is False and got.train.flat_grad_ops is True
        assert not got.problems()
    fp32_zero0 = config({"precision": "fp32"}, zero=0).for_device("cuda")
    assert fp32_zero0.train.flat_grad_ops is False and fp32_zero0.train.compile is True
    assert not fp32_zero0.problems()


def test_adapter_methods_keep_eager_blocks_and_deepspeeds_gradient_handling():
    for method in ("lora", "esft", "prompt", "prefix", "adapter"):
        cfg = config(method=method).for_device("cuda")
        t = cfg.train
        assert (t.compile, t.immediate_grad_update, t.flat_grad_ops) == (False, False, False)
        assert t.optimizer_impl == "fused" and cfg.model.cross_entropy == "chunked", method
        assert cfg.model.qkv_projection == "fused", method  # adapted projections fall back
    full = config(method="full").for_device("cuda")
    assert full.train.compile and full.train.flat_grad_ops


def test_values_given_are_kept_and_resolving_again_changes_nothing():
    given = {
        "compile": False,
        "immediate_grad_update": False,
        "flat_grad_ops": False,
        "optimizer_impl": "foreach",
    }
    cfg = config(given)
    cfg.model.cross_entropy, cfg.model.moe.permute = "full", "index_add"
    cfg.model.qkv_projection = "separate"
    assert cfg.device_choices("cuda") == {}
    assert cfg.for_device("cuda") == cfg
    partly = config({"compile": False})
    cuda = partly.for_device("cuda")
    assert cuda.train.compile is False and cuda.train.flat_grad_ops is True
    assert cuda.device_choices("cuda") == {} and cuda.for_device("cuda") == cuda
    assert cuda.for_device("cpu") == cuda  # resolved once: another device changes nothing
    before = copy.deepcopy(partly)
    partly.for_device("cuda")
    assert partly == before  # a copy: the config itself is untouched


def test_cuda_graphs_are_judged_with_what_cuda_would_choose():
    """train.cuda_graphs (CUDA only) needs compiled blocks and, at bf16 ZeRO 1, gradients folded
    as produced: left to the device, CUDA chooses both; given otherwise, refused by name."""
    assert not config({"cuda_graphs": True}).problems()
    with pytest.raises(ConfigError, match="train.cuda_graphs: needs train.compile true"):
        config({"cuda_graphs": True, "compile": False})
    with pytest.raises(ConfigError, match="train.immediate_grad_update true"):
        config({"cuda_graphs": True, "grad_reduce_dtype": "bf16"})


def test_a_model_built_outside_a_run_computes_the_plain_way():
    """``auto`` reaches the model only where no run resolved it (evaluation, export): the full
    loss with logits, the scatter-add permutation, three projections."""
    from moe.model.transformer import MoETransformer

    cfg = config()
    assert (cfg.model.cross_entropy, cfg.model.moe.permute) == ("auto", "auto")
    model = MoETransformer(cfg.model)
    assert model.head_loss is None
    assert {layer.dispatcher.permute for layer in model.moe_layers()} == {"index_add"}
    assert not any(block.attn.fused_qkv for block in model.blocks)
    resolved = MoETransformer(cfg.for_device("cuda").model)
    assert resolved.head_loss is not None and resolved.head_loss.impl == "chunked"
    assert {layer.dispatcher.permute for layer in resolved.moe_layers()} == {"gather"}
    assert all(block.attn.fused_qkv for block in resolved.blocks)


def _engine_as_on(rank, world, device, out):
    """build_engine of a bf16 ZeRO 1 config that leaves everything to the device, with the
    device said to be ``device`` (compiling skipped: only whether it was asked for)."""
    import json

    import torch.optim.adam as adam

    from moe.parallel.flat_grads import _step_with_one_read
    from moe.training import trainer

    compiled = []
    trainer.device_type = lambda: device
    trainer.compile_blocks = lambda model, cuda_graphs=False: compiled.append(cuda_graphs)
    fused = []
    real = adam._fused_adam
    adam._fused_adam = lambda *a, **k: (fused.append(1), real(*a, **k))[1]
    cfg = config()
    engine, model = trainer.build_engine(cfg, trainer.DistEnv(rank, world, rank, world))
    batch = torch.randint(0, 64, (2, 17))
    engine.backward(engine(batch[:, :-1], batch[:, 1:]).loss)
    engine.step()
    opt = engine.optimizer
    result = {
        "compiled": compiled,
        "fused": len(fused),
        "chunked": model.head_loss is not None,
        "gather": [m.dispatcher.permute == "gather" for m in model.moe_layers()],
        "fused_qkv": [block.attn.fused_qkv for block in model.blocks],
        "one_read_step": getattr(opt.step, "__func__", None) is _step_with_one_read,
        "immediate": bool(opt.immediate_grad_update),
        "left_open": cfg.train.compile is None,  # the caller's config is not changed
    }
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.mark.multiprocess
def test_the_engine_takes_what_the_device_chooses(tmp_path):
    """One gloo rank on the CPU, told it runs on CUDA: blocks compiled (asked for), fused AdamW
    steps, the chunked loss, the gather permutation, DeepSpeed's bf16 step replaced by the
    one-read step, gradients folded as produced, the fused projections; told it runs on the CPU: none of it."""
    import json

    got = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / f"{device}.json"
        run_distributed(_engine_as_on, 1, device, str(out))
        got[device] = json.loads(out.read_text())
    cuda, cpu = got["cuda"], got["cpu"]
    assert cuda["compiled"] == [False] and cuda["fused"] > 0 and cuda["chunked"]
    assert cuda["gather"] == [True, True] and cuda["one_read_step"] and cuda["immediate"]
    assert cuda["fused_qkv"] == [True, True] and cpu["fused_qkv"] == [False, False]
    assert cpu["compiled"] == [] and cpu["fused"] == 0 and not cpu["chunked"]
    assert cpu["gather"] == [False, False] and not cpu["one_read_step"] and not cpu["immediate"]
    assert cuda["left_open"] and cpu["left_open"]


def test_the_benchmarks_plain_settings_leave_nothing_to_the_device():
    """benchmarks/plain_settings.py (the proof's eager pass, the matrix's ``eager``) gives
    every setting left to the device, with the CPU's values (and foreach AdamW, torch's own
    choice on CUDA)."""
    import sys
    from pathlib import Path

    from moe.config.run import apply_overrides

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from plain_settings import EAGER

    d = apply_overrides(tiny_engine_dict(64, 16, train={"precision": "bf16"}), list(EAGER))
    cfg = from_dict(RunConfig, d)
    assert cfg.device_choices("cuda") == {} == cfg.device_choices("cpu")
    assert {k: get(cfg, k) for k in LEFT} == {**PLAIN, "train.optimizer_impl": "foreach"}
