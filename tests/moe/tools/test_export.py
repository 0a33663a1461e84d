"""moe-export on checkpoints saved by 2 ranks with expert parallelism 2: the consolidated fp32
safetensors equal the checkpoint's weights, and the Hugging Face exports (Mixtral; Qwen2-MoE with
a shared expert and a dense first layer) load with transformers and give our logits within 1e-4,
with a tokenizer that gives SentencePiece's ids."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_pipeline.tokenizer import Tokenizer
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import CheckpointError
from moe.evaluation.evaluate import load_model
from moe.tools.export import FP32_FILE, export_fp32, export_hf, hf_problems
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

ARCHS = {
    "mixtral": {"n_kv_heads": 2, "moe": {"router": {"top_k": 2, "order": "topk_then_softmax"}}},
    "qwen2_moe": {
        "n_layers": 3,
        "moe": {"num_shared_experts": 1, "first_dense_layers": 1, "router": {"top_k": 2}},
    },
}


def _train_worker(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def trained(request, tiny_data, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    cfg = tiny_run_dict(tiny_data, out / "runs", max_steps=2)
    cfg["name"] = arch
    cfg["logging"] = {"log_every": 1, "tensorboard": False}
    for key, value in ARCHS[arch].items():
        if key == "moe":
            cfg["model"]["moe"].update({k: v for k, v in value.items() if k != "router"})
            cfg["model"]["moe"]["router"].update(value["router"])
        else:
            cfg["model"][key] = value
    run_distributed(_train_worker, 2, cfg)
    return arch, out / "runs" / arch, out


def test_fp32_export_equals_the_checkpoint(trained):
    from safetensors.torch import load_file

    arch, run_dir, out = trained
    model, cfg, tag_dir = load_model(run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "launch.export", str(run_dir), str(out / "fp32")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Not a terminal: the progress of reading the checkpoint comes as log lines, here the last.
    assert f"export: read {tag_dir}: " in proc.stderr and "(100%)" in proc.stderr
    assert proc.stderr.rstrip().endswith("(done)"), proc.stderr[-2000:]
    state = load_file(str(out / "fp32" / FP32_FILE))
    expected = model.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    assert (out / "fp32" / "tokenizer.model").read_bytes() == (
        tag_dir / "tokenizer.model"
    ).read_bytes()
    # The destination exists now: a second export is refused and changes nothing.
    before = (out / "fp32" / FP32_FILE).stat().st_mtime_ns
    with pytest.raises(CheckpointError, match="already exists"):
        export_fp32(run_dir, out / "fp32")
    assert (out / "fp32" / FP32_FILE).stat().st_mtime_ns == before


def test_hugging_face_export_matches_our_logits_and_tokenizer(trained, tiny_data):
    arch, run_dir, out = trained
    model, cfg, tag_dir = load_model(run_dir)
    hf_dir = export_hf(run_dir, out / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    hf.eval()
    assert hf.config.model_type == arch
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (3, 48))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (ours - ours.mean()).abs().max() > 0.1  # not a constant output

    if arch == "mixtral":
        # Also as Qwen2-MoE: renormalized top-k routing and a zero-width shared expert.
        qwen = transformers.AutoModelForCausalLM.from_pretrained(
            str(export_hf(run_dir, out / "hf_qwen", arch="qwen2_moe")), dtype=torch.float32
        )
        with torch.no_grad():
            torch.testing.assert_close(
                qwen.eval()(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-4
            )

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    sp = Tokenizer(tag_dir / "tokenizer.model")
    corpus = Path(tiny_data.sources[0].paths[0])
    texts = [p.read_text()[:3000] for p in sorted(corpus.glob("*.txt"))]
    texts += ["  Leading and  double  spaces\n\nand lines\tand tabs  ", "ﬁ ligature ① — naïve 日本"]
    for text in texts:
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text[:60]
    assert tok.eos_token_id == sp.eos_id and tok.pad_token_id == sp.pad_id


def test_models_without_a_hugging_face_equivalent_are_refused(trained):
    arch, run_dir, out = trained
    _, cfg, _ = load_model(run_dir)
    cfg.model.moe.capacity_factor = 1.25
    cfg.model.moe.router.score_func = "sigmoid"
    problems = hf_problems(cfg, "mixtral", {})
    assert any(p.startswith("model.moe.capacity_factor: 1.25: ") for p in problems)
    assert any(p.startswith("model.moe.router.score_func: 'sigmoid': ") for p in problems)
    if arch == "qwen2_moe":
        assert any("num_shared_experts" in p for p in hf_problems(cfg, "mixtral", {}))
        with pytest.raises(CheckpointError, match="cannot be exported as mixtral"):
            export_hf(run_dir, out / "refused", arch="mixtral")
        assert not (out / "refused").exists()


def test_export_progress_logs_each_file_off_a_terminal(trained, capsys, monkeypatch):
    from data_pipeline import progress as progress_module
    from launch.export import main
    from moe.checkpoint.consolidate import state_files
    from moe.checkpoint.files import resolve_checkpoint

    arch, run_dir, out = trained
    real = progress_module.Progress
    monkeypatch.setattr(
        "moe.tools.export.Progress", lambda *a, **kw: real(*a, **{**kw, "interval": 0.0})
    )
    tag_dir = resolve_checkpoint(run_dir)
    files = len(state_files(tag_dir))
    assert files > 2  # the main states and an expert file per expert
    main([str(run_dir), str(out / "fp32-progress")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("export:")]
    assert [line.split(": ")[2].split(" of ")[0] for line in lines] == [
        str(i) for i in range(1, files + 1)
    ] + [str(files)]
    assert lines[0].startswith(f"export: read {tag_dir}: 1 of {files} files")
    assert lines[-1].endswith("(done)")
    main([str(run_dir), str(out / "fp32-quiet"), "--quiet"])
    assert "export:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "method, added",
    [
        ("prompt", ["embed.prompt"]),
        ("prefix", ["blocks.0.attn.prefix_k", "blocks.0.attn.prefix_v"]),
        ("adapter", [f"blocks.{i}.ffn.adapter.{n}" for i in range(5) for n in ("up", "down")]),
    ],
)
def test_a_method_that_adds_modules_is_refused_by_its_key(method, added):
    """Prompt, prefix and bottleneck-adapter checkpoints hold tensors no target has: every
    target refuses them by finetune.method, naming the tensors, and none is offered instead."""
    from moe.config.run import load_config
    from moe.model.transformer import MoETransformer
    from moe.tools.export import choose_arch

    overrides = [f"finetune.method={method}", "model.init_from=x", "model.vocab_size=512"]
    cfg = load_config("configs/default.yaml", overrides)
    with torch.device("meta"):
        state = dict(MoETransformer(cfg.model).state_dict())
    plain = {a: hf_problems(cfg, a, state) for a in ("mixtral", "qwen2_moe")}
    assert not any(p.startswith("finetune.method") for ps in plain.values() for p in ps)
    state.update({name: torch.zeros(1) for name in added})
    for arch in ("mixtral", "qwen2_moe"):
        first = hf_problems(cfg, arch, state)[0]
        assert first.startswith(f"finetune.method: {method!r}: a {arch} model has no place")
        assert added[0] in first and (len(added) <= 3 or f"({len(added)} in all)" in first)
    with pytest.raises(CheckpointError) as e:
        choose_arch(cfg, "qwen2_moe", state, Path("run_config.yaml"))
    assert "can hold it" not in str(e.value) and "--format fp32" in str(e.value)
