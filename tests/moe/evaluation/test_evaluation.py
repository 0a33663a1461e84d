"""Perplexity against a plain reference loop, on prepared data and on text files; the checks on
which tokens a model may be evaluated on."""

import math

import numpy as np
import pytest
import torch

from data_pipeline.errors import DataError
from data_pipeline.prepared import PreparedData
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.evaluation.evaluate import (
    evaluate_loss,
    evaluate_perplexity,
    open_eval_data,
    token_windows,
)
from moe.model.transformer import MoETransformer
from tests.conftest import tiny_run_dict
from tests.helpers.other_tokenizer import copy_with_other_tokenizer
from tests.helpers.reference import reference_loss
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def run_cfg(tiny_data, tmp_path_factory) -> RunConfig:
    d = tiny_run_dict(tiny_data, tmp_path_factory.mktemp("runs"))
    d["model"]["vocab_size"] = 512
    return from_dict(RunConfig, d)


@pytest.fixture(scope="module")
def model(run_cfg) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(run_cfg.model).eval()


@pytest.mark.parametrize("max_tokens", [None, 1000])
def test_perplexity_is_exp_of_the_mean_token_loss(model, tiny_data, max_tokens):
    stream = TokenStream(tiny_data.dir, "valid")
    n = len(stream) if max_tokens is None else min(len(stream), max_tokens + 1)  # random split
    ref_loss, ref_count = reference_loss(model, stream.read(0, n), tiny_data.seq_len)
    r = evaluate_perplexity(
        model, tiny_data.dir, tiny_data.seq_len, batch_size=5, max_tokens=max_tokens
    )
    assert r["tokens"] == ref_count == n - 1
    assert math.isclose(r["loss"], ref_loss, rel_tol=1e-5)
    assert math.isclose(r["perplexity"], math.exp(ref_loss), rel_tol=1e-4)


def test_text_files_are_tokenized_with_the_runs_tokenizer(model, run_cfg, tiny_data, tmp_path):
    texts = ["The quick brown fox returns a list of values.\n", "Raise ValueError if empty."]
    files = []
    for i, t in enumerate(texts):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(t, encoding="utf-8")
    data = open_eval_data(run_cfg, text_files=[str(f) for f in files])
    tok = Tokenizer(PreparedData(tiny_data.dir).tokenizer_file())
    expected = np.array([i for t in texts for i in tok.encode(t) + [tok.eos_id]])
    assert np.array_equal(data.tokens.read(0, len(data.tokens)), expected)
    r = evaluate_loss(model, token_windows(data.tokens, 8), batch_size=3)
    ref_loss, ref_count = reference_loss(model, expected, 8)
    assert r["tokens"] == ref_count and math.isclose(r["loss"], ref_loss, rel_tol=1e-5)


def test_bad_evaluation_data_names_the_problem(run_cfg, tiny_data, tmp_path):
    with pytest.raises(DataError, match="nowhere.txt: no such text file"):
        open_eval_data(run_cfg, text_files=[str(tmp_path / "nowhere.txt")])
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="latin1.txt: not UTF-8"):
        open_eval_data(run_cfg, text_files=[str(tmp_path / "latin1.txt")])
    with pytest.raises(DataError, match="no prepared data"):
        open_eval_data(run_cfg, data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="not both"):
        open_eval_data(run_cfg, data_dir=tiny_data.dir, text_files=["x.txt"])
    # Data tokenized by another tokenizer: its ids would mean other text to the model.
    other = copy_with_other_tokenizer(tiny_data.dir, tmp_path / "other")
    with pytest.raises(DataError, match="another tokenizer"):
        open_eval_data(run_cfg, data_dir=str(other))
    (tmp_path / "empty.txt").write_text("")
    data = open_eval_data(run_cfg, text_files=[str(tmp_path / "empty.txt")])
    with pytest.raises(DataError, match="no tokens to evaluate"):
        evaluate_loss(
            MoETransformer(run_cfg.model), token_windows(data.tokens, 8), 2, source="empty"
        )


def test_evaluation_progress_counts_the_predicted_tokens(model, tiny_data):
    import io

    from data_pipeline.progress import Progress
    from launch.evaluate import options_from_args, parse_args
    from moe.evaluation.evaluate import batches

    out = io.StringIO()  # not a terminal: log lines
    windows = token_windows(TokenStream(tiny_data.dir, "valid"), tiny_data.seq_len, 500)
    bar = Progress("evaluate x", 500, stream=out, interval=0.0, unit="tokens")
    r = evaluate_loss(model, windows, 4, progress=bar)
    lines = out.getvalue().splitlines()
    forwards = len(
        list(batches(token_windows(TokenStream(tiny_data.dir, "valid"), tiny_data.seq_len, 500), 4))
    )
    assert r["tokens"] == 500 and len(lines) == forwards + 1  # a line per forward, then done
    assert lines[-1].startswith("evaluate x: 500 of 500 tokens (100%)") and "(done)" in lines[-1]
    assert options_from_args(parse_args(["ckpt"])).progress
    assert not options_from_args(parse_args(["ckpt", "--quiet"])).progress


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--temperature", "nan"], "--temperature: must be a finite number >= 0, got nan"),
        (["--length-penalty", "inf"], "--length-penalty: must be a finite number, got inf"),
        (["--min-token-count", "0"], "--min-token-count: must be >= 1, got 0"),
        (["--threads", "-2"], "--threads: must be >= 1, got -2"),
        (["--num-prompts", "-1"], "--num-prompts: must be >= 0, got -1"),
        (["--top-tokens", "-1"], "--top-tokens: must be >= 0, got -1"),
    ],
)
def test_moe_eval_refuses_flags_outside_their_range_before_anything_runs(argv, problem, capsys):
    """NaN passed the temperature check (every comparison with NaN is false) and a negative
    thread count reached torch before any check."""
    from launch.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(["a-checkpoint-that-is-never-opened", *argv])
    assert e.value.code == 2
    assert problem in capsys.readouterr().err
