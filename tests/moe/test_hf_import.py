"""Starting from open weights (moe/weights/hf.py, moe-import, ``model.init_from: hf:DIR``).

Every architecture is a tiny random transformers model built here from a config (no download),
its norm gains and biases moved off 1 and 0 so that a misplaced tensor shows, saved in fp32 in
several shards. Imported, it computes transformers' logits within 1e-4 with the same argmax
everywhere (dropless routing); the trainer's first loss equals transformers' loss on the same
batch; Mixtral, Qwen2-MoE and dense Llama export back to the very tensors they came from; a
dense Llama upcycles into MoE with unchanged logits; everything the model cannot express, and
every damaged directory, is refused before anything is written, by name, with exit code 2."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from launch.import_hf import main as import_main
from moe.core.errors import ConfigError
from moe.weights.hf import read_hf_model
from moe.weights.load import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def hf_config(arch: str, **over):
    c = dict(SMALL)
    if arch == "mixtral":
        c.update(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    elif arch == "qwen2_moe":
        # A dense first layer, a gated shared expert of 2 expert widths, q/k/v biases.
        c.update(
            intermediate_size=40,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        )
        cls = transformers.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        # Heads wider than hidden_size / heads, per-head q/k norms, renormalized top-k.
        c.update(
            intermediate_size=24,
            moe_intermediate_size=8,
            num_experts=4,
            head_dim=12,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        cls = transformers.Qwen3MoeConfig
    elif arch == "olmoe":
        # q/k norms over the whole projections, no renormalization.
        c.update(intermediate_size=8, num_experts=4, num_experts_per_tok=2, num_key_value_heads=4)
        cls = transformers.OlmoeConfig
    else:
        c.update(intermediate_size=24)
        cls = {
            "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
        }[arch]
        if arch == "mistral":
            c["sliding_window"] = None
    c.update(over)
    return cls(**c)


ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "mistral", "qwen2"]


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json of VOCAB ids (the tokenizers library)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def make_hf(tmp: Path, arch: str, seed: int = 0, **over) -> tuple[Path, torch.nn.Module]:
    """A random transformers model of ``arch`` saved sharded in fp32 at ``tmp / arch``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch, **over), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm gains and biases
                p.add_(torch.randn_like(p) * 0.3)
    out = tmp / arch
    model.save_pretrained(str(out), max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    write_tokenizer(out)
    return out, model


def ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def run_import(*argv) -> tuple[int, str]:
    try:
        import_main([str(a) for a in argv])
        return 0, ""
    except SystemExit as e:
        return e.code, ""


@pytest.mark.parametrize("arch", ARCHS)
def test_imported_model_computes_the_transformers_logits(arch, tmp_path, capsys):
    hf_dir, hf = make_hf(tmp_path, arch)
    rc, _ = run_import(hf_dir, tmp_path / "ckpt")
    assert rc == 0, capsys.readouterr().err
    model, cfg, _ = load_model(tmp_path / "ckpt")
    x = ids()
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(input_ids=x).logits
    assert (theirs - theirs.mean()).abs().max() > 0.1  # not a constant output
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (cfg.model.ffn == "dense") == (arch in ("llama", "mistral", "qwen2"))
    # model.init_from: the checkpoint, or the directory itself, gives the same weights.
    from moe.model.transformer import MoETransformer
    from moe.training.upcycle import initialize_from_checkpoint

    for source in (tmp_path / "ckpt", f"hf:{hf_dir}"):
        started = MoETransformer(cfg.model).eval()
        initialize_from_checkpoint(started, source)
        with torch.no_grad():
            assert torch.equal(started(x).logits, ours), source


def bpe_tokenizer_json(corpus: Path, out: Path) -> Path:
    """A byte-level BPE tokenizer.json trained with the tokenizers library, as open-weights
    models ship them (EOS <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def test_data_prepared_with_the_models_tokenizer_json_trains_from_hf_weights_with_its_loss(
    tiny_data, tmp_path, monkeypatch
):
    """Data prepared with a ``tokenizer.json`` (data.tokenizer.model_file), then through the
    real trainer (one gloo rank, ``model.init_from: hf:DIR``) for every architecture (Qwen2-MoE:
    shared expert gate, biases, a dense layer; Qwen3-MoE: head_dim, q/k norms; OLMoE: q/k norms
    over the projections; Mixtral; dense Llama, Mistral, Qwen2): the language-model loss of
    step 1 on the trainer's own batch equals transformers' loss on that batch. Data prepared
    with another tokenizer is refused, naming both hashes."""
    import copy
    import dataclasses
    import hashlib
    import shutil

    from data_pipeline.config import TokenizerConfig
    from data_pipeline.prepare import prepare
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict, to_dict
    from moe.tools.export import _one_rank_process_group
    from moe.training import trainer
    from tests.conftest import tiny_run_dict

    tok_json = bpe_tokenizer_json(Path(tiny_data.sources[0].paths[0]), tmp_path / "tok")
    data = dataclasses.replace(
        tiny_data, dir=str(tmp_path / "data"), tokenizer=TokenizerConfig(model_file=str(tok_json))
    )
    prepare(data, progress=False)
    seen = []

    class Recording(trainer.MoETransformer):
        def forward(self, input_ids_BS, targets_BS=None, **kw):
            out = super().forward(input_ids_BS, targets_BS, **kw)
            if self.training and targets_BS is not None and not seen:
                seen.append((input_ids_BS.clone(), targets_BS.clone(), out.lm_loss.detach()))
            return out

    monkeypatch.setattr(trainer, "MoETransformer", Recording)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_json)).get_vocab_size()
    with _one_rank_process_group():  # one group for every run (DeepSpeed keeps its groups)
        for arch in ARCHS:
            hf_dir, hf = make_hf(tmp_path, arch, vocab_size=vocab)
            shutil.copy(tok_json, hf_dir / "tokenizer.json")
            _, model_cfg, _ = read_hf_model(hf_dir)
            d = tiny_run_dict(data, tmp_path / "runs", max_steps=1, warmup_steps=0)
            d["data"]["tokenizer"] = {"model_file": str(tok_json)}
            d["name"] = arch
            d["model"] = to_dict(model_cfg)
            d["model"].update(init_from=f"hf:{hf_dir}", max_seq_len=64)
            d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
            d["logging"] = {"log_every": 1, "tensorboard": False}
            d["eval"] = {"every_n_steps": 0}
            seen.clear()
            trainer.train(
                from_dict(RunConfig, copy.deepcopy(d)), trainer.DistEnv(0, 1, 0, 1), resume="none"
            )
            x, y, loss = seen[0]
            assert int(x.max()) >= 300  # BPE merges of the tokenizer.json, not bytes alone
            with torch.no_grad():
                logits = hf(input_ids=x).logits
            want = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten(), ignore_index=-100
            )
            torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
            step = json.loads(
                (tmp_path / "runs" / arch / "logs" / "steps_rank0.jsonl")
                .read_text()
                .splitlines()[0]
            )
            aux = step["loss"] - float(loss)  # the logged loss adds the balancing loss
            if d["model"]["ffn"] == "moe":
                assert 0 <= aux < 0.1
            else:
                assert aux == pytest.approx(0, abs=1e-6)
        # The SentencePiece data of tiny_data with the same model: refused before training.
        other = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=1)
        # (vocab_size large enough for that tokenizer: the tokenizer check is what refuses)
        other.update(
            name="mismatch", model={**d["model"], "vocab_size": 512}, parallel=d["parallel"]
        )
        with pytest.raises(ConfigError) as e:
            trainer.train(from_dict(RunConfig, other), trainer.DistEnv(0, 1, 0, 1), resume="none")
    assert hashlib.sha256(tok_json.read_bytes()).hexdigest() in str(e.value)
    data_sha = json.loads((Path(tiny_data.dir) / "manifest.json").read_text())["tokenizer"][
        "sha256"
    ]
    assert data_sha in str(e.value)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama"])
def test_export_reproduces_every_tensor_of_the_original(arch, tmp_path, capsys):
    from safetensors import safe_open

    from launch.export import main as export_main

    # --arch auto: a dense model goes back to Llama; the special token ids come back too.
    hf_dir, _ = make_hf(tmp_path, arch, bos_token_id=1, eos_token_id=[2, 5], pad_token_id=4)
    assert run_import(hf_dir, tmp_path / "ckpt")[0] == 0
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--format", "hf", "--quiet"])

    def tensors(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
        return out

    original, back = tensors(hf_dir), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for k in original:
        assert torch.equal(original[k], back[k]), k
    config, back_config = (
        json.loads((d / "config.json").read_text()) for d in (hf_dir, tmp_path / "back")
    )
    for key in ("architectures", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert back_config[key] == config[key], key


def test_a_directory_without_tokenizer_files_imports_and_exports_without_one(tmp_path, capsys):
    """Weights and config only (a common case): the import says the checkpoint has no
    tokenizer, and both exports write the model and say the tokenizer is absent."""
    from launch.export import main as export_main
    from moe.weights.load import load_model

    hf_dir, hf = make_hf(tmp_path, "mixtral")
    (hf_dir / "tokenizer.json").unlink()
    assert run_import(hf_dir, tmp_path / "ckpt")[0] == 0
    assert "holds no tokenizer" in capsys.readouterr().err
    for fmt in ("hf", "fp32"):
        try:
            export_main([str(tmp_path / "ckpt"), str(tmp_path / fmt), "--format", fmt, "--quiet"])
        except SystemExit as e:
            pytest.fail(f"--format {fmt}: exit {e.code}: {capsys.readouterr().err}")
        err = capsys.readouterr().err
        assert f"note: {tmp_path / 'ckpt'} holds no tokenizer" in err and "Traceback" not in err
        names = {f.name for f in (tmp_path / fmt).iterdir()}
        assert not names & {"tokenizer.json", "tokenizer.model", "hf_tokenizer"}, names
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    model, _, _ = load_model(tmp_path / "ckpt")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=x).logits, hf(input_ids=x).logits, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(model(x).logits, hf(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    assert not list(tmp_path.glob(".hf*")) and not list(tmp_path.glob(".fp32*"))


def test_fp32_export_of_an_import_carries_its_tokenizer_files(tmp_path, capsys):
    from launch.export import main as export_main

    hf_dir, _ = make_hf(tmp_path, "llama")
    assert run_import(hf_dir, tmp_path / "ckpt")[0] == 0
    export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet"])
    copied = tmp_path / "out" / "hf_tokenizer" / "tokenizer.json"
    assert copied.read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert "no tokenizer" not in capsys.readouterr().err


def test_dense_llama_upcycles_into_moe_with_unchanged_logits(tmp_path):
    from moe.model.moe_layer import MoEConfig
    from moe.model.router import RouterConfig
    from moe.model.transformer import MoETransformer
    from moe.training.upcycle import initialize_from_checkpoint

    hf_dir, hf = make_hf(tmp_path, "llama")
    _, dense_cfg, _ = read_hf_model(hf_dir)
    cfg = copy_config(
        dense_cfg,
        ffn="moe",
        moe=MoEConfig(
            num_experts=4, expert_hidden=24, router=RouterConfig(top_k=2, renormalize=True)
        ),
    )
    model = MoETransformer(cfg).eval()
    initialize_from_checkpoint(model, f"hf:{hf_dir}")
    assert len(model.moe_layers()) == 3
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf(input_ids=x).logits, rtol=1e-4, atol=1e-4)


def copy_config(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


@pytest.mark.parametrize(
    "arch, over, named",
    [
        ("mistral", {"sliding_window": 16}, ["sliding_window: 16"]),
        (
            "llama",
            {
                "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                "attention_bias": True,
                "hidden_act": "gelu",
            },
            ["rope_parameters.rope_type: 'linear'", "attention_bias: True", "hidden_act: 'gelu'"],
        ),
        (
            "qwen2_moe",
            {"use_sliding_window": True, "shared_expert_intermediate_size": 12},
            ["use_sliding_window: True", "shared_expert_intermediate_size: 12"],
        ),
        ("olmoe", {"clip_qkv": 8.0}, ["clip_qkv: 8.0"]),
        ("qwen3_moe", {"mlp_only_layers": [2]}, ["mlp_only_layers: [2]"]),
    ],
)
def test_what_the_model_cannot_express_is_refused_by_name_before_any_work(
    arch, over, named, tmp_path, capsys, monkeypatch
):
    hf_dir, _ = make_hf(tmp_path, arch)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(over)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    opened = []
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a))
    rc, _ = run_import(hf_dir, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert str(hf_dir / "config.json") in err
    for text in named:
        assert text in err, err
    assert not opened and not (tmp_path / "ckpt").exists()
    assert not list(tmp_path.glob(".ckpt*"))


def test_unknown_fields_and_architectures_are_refused(tmp_path):
    hf_dir, _ = make_hf(tmp_path, "llama")
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"bits": 4}}))
    with pytest.raises(ConfigError, match="quantization_config: .*not understood"):
        read_hf_model(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        read_hf_model(hf_dir)


def _rewrite(hf_dir: Path, change, reindex: bool = True) -> None:
    """Apply ``change(tensors)`` to the shard holding the first MoE layer's router; the index
    follows the shard unless ``reindex`` is False."""
    from safetensors.torch import load_file, save_file

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    name = next(
        k
        for k in index["weight_map"]
        if k.endswith("layers.1.mlp.gate.weight")
        or k.endswith("layers.1.block_sparse_moe.gate.weight")
    )
    shard = hf_dir / index["weight_map"][name]
    tensors = load_file(str(shard))
    change(tensors, name)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    if not reindex:
        return
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name
    }
    index["weight_map"].update({k: shard.name for k in tensors})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("missing_shard", "shards listed in the index are missing"),
        ("wrong_shape", "shape (4, 31), config.json describes (4, 32)"),
        ("extra_tensor", "model.layers.1.mlp.extra.weight: no tensor of the model corresponds"),
        # In a shard but not in the index: transformers reads it anyway (as unexpected).
        ("unindexed_tensor", "model.layers.1.mlp.extra.weight: not listed in the index"),
        ("unindexed_needed", "model.layers.1.mlp.gate.weight: not listed in the index"),
        ("other_shard", "model.layers.1.mlp.gate.weight: the index places it in model-0000"),
        ("missing_tensor", "missing (needed for blocks.1.ffn.router.weight)"),
        ("int_dtype", "dtype I32"),
        ("nan_value", "1 of 128 values are NaN or infinite"),
        ("inf_value", "2 of 128 values are NaN or infinite"),
    ],
)
def test_damaged_weights_are_refused_with_file_and_tensor_named(damage, expected, tmp_path, capsys):
    hf_dir, _ = make_hf(tmp_path, "qwen3_moe")
    if damage == "missing_shard":
        next(hf_dir.glob("model-00002-*.safetensors")).unlink()
    elif damage == "wrong_shape":
        _rewrite(hf_dir, lambda t, n: t.__setitem__(n, t[n][:, :31].contiguous()))
    elif damage == "extra_tensor":
        _rewrite(
            hf_dir, lambda t, n: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(2))
        )
    elif damage == "missing_tensor":
        _rewrite(hf_dir, lambda t, n: t.pop(n))
    elif damage == "unindexed_tensor":
        _rewrite(
            hf_dir,
            lambda t, n: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(2)),
            reindex=False,
        )
    elif damage in ("unindexed_needed", "other_shard"):
        index_file = hf_dir / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        name = "model.layers.1.mlp.gate.weight"
        if damage == "unindexed_needed":
            del index["weight_map"][name]
        else:  # a second copy in another shard, which the index does not name
            _copy_into_another_shard(hf_dir, index, name)
        index_file.write_text(json.dumps(index))
    elif damage == "nan_value":  # a diverged run's weights: once imported silently
        _rewrite(hf_dir, lambda t, n: t[n].view(-1).__setitem__(5, float("nan")))
    elif damage == "inf_value":
        _rewrite(hf_dir, lambda t, n: t[n].view(-1)[:2].fill_(float("-inf")))
    else:
        _rewrite(hf_dir, lambda t, n: t.__setitem__(n, t[n].to(torch.int32)))
    rc, _ = run_import(hf_dir, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert expected in err, err
    if damage in (
        "wrong_shape",
        "extra_tensor",
        "int_dtype",
        "unindexed_tensor",
        "unindexed_needed",
        "other_shard",
    ):
        assert ".safetensors: model.layers.1." in err  # the file and the tensor
    if damage in ("nan_value", "inf_value"):  # the directory, their tensor and ours
        assert (
            f"{hf_dir}: model.layers.1.mlp.gate.weight (blocks.1.ffn.router.weight in our "
            "model)" in err
        )
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))


def _copy_into_another_shard(hf_dir: Path, index: dict, name: str) -> None:
    from safetensors.torch import load_file, save_file

    home = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    tensors = load_file(str(hf_dir / other))
    tensors[name] = load_file(str(hf_dir / home))[name]
    save_file(tensors, str(hf_dir / other), metadata={"format": "pt"})


def test_bf16_weights_are_read_exactly(tmp_path):
    hf_dir, hf = make_hf(tmp_path, "olmoe")
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"), max_shard_size="40KB")
    _, _, state = read_hf_model(tmp_path / "bf16")
    _, _, state32 = read_hf_model(hf_dir)
    for k, v in state.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, state32[k].to(torch.bfloat16).float()), k


def test_expert_parallel_size_is_recorded_and_checked(tmp_path, capsys):
    import yaml

    from moe.checkpoint.files import MARKER

    hf_dir, _ = make_hf(tmp_path, "mixtral")
    rc, _ = run_import(hf_dir, tmp_path / "ep3", "--expert-parallel-size", "3")
    assert rc == 2 and "expert_parallel_size" in capsys.readouterr().err
    assert not (tmp_path / "ep3").exists()
    assert run_import(hf_dir, tmp_path / "ep2", "--expert-parallel-size", "2")[0] == 0
    saved = yaml.safe_load((tmp_path / "ep2" / "run_config.yaml").read_text())
    assert saved["parallel"]["expert_parallel_size"] == 2
    marker = json.loads((tmp_path / "ep2" / MARKER).read_text())
    assert marker["expert_parallel_size"] == 2 and marker["num_moe_layers"] == 3
    assert marker["tokenizer"]["file"] == "tokenizer.json"
    assert (tmp_path / "ep2" / "hf_tokenizer" / "tokenizer.json").is_file()


def test_a_run_starting_from_open_weights_with_nan_values_is_refused(tmp_path):
    """model.init_from: hf:DIR reads the same weights: NaN refused there too, by name."""
    from moe.core.errors import CheckpointError
    from moe.model.transformer import MoETransformer
    from moe.training.upcycle import initialize_from_checkpoint
    from moe.weights.hf import read_hf_config

    hf_dir, _ = make_hf(tmp_path, "qwen3_moe")
    _, cfg = read_hf_config(hf_dir)
    model = MoETransformer(cfg)
    initialize_from_checkpoint(model, f"hf:{hf_dir}")  # the undamaged weights load
    _rewrite(hf_dir, lambda t, n: t[n].view(-1).__setitem__(3, float("nan")))
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.1.mlp.gate.weight \(blocks.1.ffn"
        r".router.weight in our model\): 1 of 128 values",
    ):
        initialize_from_checkpoint(MoETransformer(cfg), f"hf:{hf_dir}")


def _edit_config(hf_dir: Path, change) -> None:
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size: missing"),
        (lambda c: c.update(num_hidden_layers="3"), "num_hidden_layers: '3': must be an integer"),
        (lambda c: c.update(num_experts=None), "num_experts: None: must be an integer"),
        (lambda c: c.update(rope_parameters=[1]), "rope_parameters: [1]: must be a JSON object"),
        (lambda c: c.update(mlp_only_layers=5), "mlp_only_layers: 5: must be a list"),
        (lambda c: c.update(decoder_sparse_step="2"), "decoder_sparse_step: '2': must be an"),
        (lambda c: c.update(architectures=[{}]), "architectures: [{}]: the importer reads"),
    ],
)
def test_a_config_json_with_a_missing_or_mistyped_key_is_refused_by_name(
    change, named, tmp_path, capsys
):
    hf_dir, _ = make_hf(tmp_path, "qwen2_moe")
    _edit_config(hf_dir, change)
    rc, _ = run_import(hf_dir, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert str(hf_dir / "config.json") in err and named in err, err
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))


@pytest.mark.parametrize("damage", ["not_a_map", "parent_path", "absolute_path", "pickle_only"])
def test_an_index_naming_files_outside_its_directory_or_pickles_is_refused(
    damage, tmp_path, capsys
):
    """Shards are plain file names of the directory: a path in the index is never followed
    (not even to another model's safetensors), and a pickle (pytorch_model.bin) is never read."""
    hf_dir, _ = make_hf(tmp_path, "llama")
    index_file = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if damage == "not_a_map":
        index["weight_map"] = sorted(index["weight_map"])
        named = "weight_map must map tensor names to shard file names"
    elif damage in ("parent_path", "absolute_path"):
        (tmp_path / first).write_bytes((hf_dir / first).read_bytes())  # a valid file, outside
        (hf_dir / first).unlink()
        moved = f"../{first}" if damage == "parent_path" else str(tmp_path / first)
        index["weight_map"] = {
            k: moved if v == first else v for k, v in index["weight_map"].items()
        }
        named = f"shards must be files of its own directory, not paths: {moved!r}"
    else:
        torch.save({"x": torch.zeros(1)}, hf_dir / "pytorch_model.bin")
        for f in hf_dir.glob("model*.safetensors*"):
            f.unlink()
        named = "pytorch_model.bin: pickle files, which are never loaded"
    if damage != "pickle_only":
        index_file.write_text(json.dumps(index))
    rc, _ = run_import(hf_dir, tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert named in err, err
    assert not (tmp_path / "ckpt").exists()


def test_a_path_that_is_not_a_model_directory_is_refused_by_name(tmp_path, capsys):
    hf_dir, _ = make_hf(tmp_path, "llama")
    rc, _ = run_import(hf_dir / "config.json", tmp_path / "a")
    err = capsys.readouterr().err
    assert (
        rc == 2 and "Traceback" not in err and f"{hf_dir / 'config.json'}: not a directory" in err
    )
    (hf_dir / "config.json").unlink()
    (hf_dir / "config.json").mkdir()
    rc, _ = run_import(hf_dir, tmp_path / "b")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and f"{hf_dir / 'config.json'}: cannot be read" in err


class _FullDisk(io.RawIOBase):
    """A file on a full disk: every write fails with ENOSPC."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("command", ["import", "export"])
def test_a_full_disk_is_one_clear_error_and_leaves_nothing(command, tmp_path, capsys, monkeypatch):
    """torch.save and safetensors each report a full disk their own way (a RuntimeError over
    the OSError, a SafetensorError whose message ends in "(os error 28)"): both are the one
    storage error naming the output, exit code 2."""
    import safetensors
    import safetensors.torch

    from launch.export import main as export_main

    hf_dir, _ = make_hf(tmp_path, "mixtral")
    assert run_import(hf_dir, tmp_path / "ckpt")[0] == 0
    out = tmp_path / "out"
    if command == "import":
        real = torch.save
        monkeypatch.setattr(torch, "save", lambda obj, f: real(obj, _FullDisk()))
        main, argv = import_main, [str(hf_dir), str(out)]
    else:

        def save_file(tensors, path, metadata=None):  # what safetensors raises on a full disk
            Path(path).write_bytes(b"\0" * 8)
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        main, argv = export_main, [str(tmp_path / "ckpt"), str(out), "--quiet"]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert f"error: {out}: could not write: the disk holding it is full" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("command", ["import", "export"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_ctrl_c_or_sigterm_while_writing_leaves_nothing(
    command, signum, tmp_path, capsys, monkeypatch
):
    """The signal arrives while the files are written: one line, exit code 128 + signal, and
    no output or temporary directory (under SIGTERM's default action the temporary directory,
    the size of the model, stayed behind)."""
    import safetensors.torch

    from launch.export import main as export_main

    hf_dir, _ = make_hf(tmp_path, "mixtral")
    assert run_import(hf_dir, tmp_path / "ckpt")[0] == 0
    out = tmp_path / "out"

    def signalled(real):
        def save(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signum)  # after one file is written

        return save

    if command == "import":
        monkeypatch.setattr(torch, "save", signalled(torch.save))
        main, argv = import_main, [str(hf_dir), str(out)]
    else:
        monkeypatch.setattr(safetensors.torch, "save_file", signalled(safetensors.torch.save_file))
        main, argv = export_main, [str(tmp_path / "ckpt"), str(out), "--quiet"]

    def unhandled(signum, frame):  # where the command handles no signal: not this test's end
        raise AssertionError(f"signal {signum} reached the test")

    previous = signal.signal(signum, unhandled)
    try:
        with pytest.raises(SystemExit) as stop:
            main(argv)
    finally:
        signal.signal(signum, previous)
    assert signal.getsignal(signum) is previous  # the command's handler is gone
    err = capsys.readouterr().err
    assert stop.value.code == 128 + signum and "Traceback" not in err
    assert ("interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopped by SIGTERM") in err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_an_existing_output_even_a_dangling_link_is_never_replaced(tmp_path, capsys):
    hf_dir, _ = make_hf(tmp_path, "llama")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    for out in ("kept", "link"):
        rc, _ = run_import(hf_dir, tmp_path / out)
        err = capsys.readouterr().err
        assert rc == 2 and f"{tmp_path / out}: already exists" in err
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "link").is_symlink() and not list(tmp_path.glob(".link*"))
