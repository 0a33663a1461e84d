"""What moe-scaling reads back from a sweep's runs (launch/scaling_sweep.py): the training
curves of the step records, and the bytes per token of the validation text for bits per
byte."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from data_pipeline.prepared import PreparedData
from data_pipeline.text_bytes import predicted_text_bytes
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from launch import scaling_sweep
from moe.core.run_dir import RunDir
from moe.tools import scaling_report, scaling_text
from tests.conftest import tiny_run_dict


def test_the_training_curve_is_the_mean_over_the_ranks_step_records(tmp_path):
    """Each rank's own loss per step, averaged over the ranks; a line cut short by a kill and a
    non-finite loss are left out; no records: no curve."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    assert scaling_sweep.training_curve(run.path) is None
    rank0 = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    rank1 = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 3.0}]
    run.step_records(0).write_text("".join(json.dumps(r) + "\n" for r in rank0) + '{"step": 4, "lo')
    run.step_records(1).write_text("".join(json.dumps(r) + "\n" for r in rank1))
    assert scaling_sweep.training_curve(run.path) == ([1, 2, 3], [4.0, 3.0, 2.5])


@pytest.fixture
def sweep(tiny_data, tmp_path):
    """A sweep directory whose one run config evaluates 500 validation predictions."""
    d = tiny_run_dict(tiny_data, tmp_path / "runs")
    d["eval"] = {"max_tokens": 500}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "r1.yaml").write_text(yaml.safe_dump(d))
    return tmp_path


def test_bytes_per_token_are_those_of_the_runs_validation_predictions(sweep, tiny_data):
    """The bytes per token of the predictions the runs' evaluations made (eval.max_tokens of
    their configs); left out, saying why, when those data are not the runs' or are unreadable;
    and a warning when the evaluated tokens reach into few of the split's documents."""
    data = PreparedData.from_config(tiny_data)
    seen = predicted_text_bytes(TokenStream(data, "valid"), Tokenizer(data.tokenizer_file()), 500)
    assert seen.targets == 500 and 1.5 < seen.bytes / seen.targets < 8
    rows = [{"name": "r1", "eval_tokens": 500}, {"name": "r2", "eval_tokens": 500}]
    value, notes = scaling_sweep.validation_text(sweep, rows)
    assert value == seen.bytes / seen.targets
    split = data.manifest.splits["valid"]
    assert seen.documents < split.documents / 2
    (w,) = notes
    assert w.startswith(
        f"the runs are scored on the first 500 validation tokens (eval.max_tokens "
        f"500), which reach into {seen.documents} of the split's "
        f"{split.documents} documents"
    )
    value, (why,) = scaling_sweep.validation_text(sweep, [{"name": "r1", "eval_tokens": 400}])
    assert value is None and "evaluated on 400 validation targets" in why and "gives 500" in why
    value, (why,) = scaling_sweep.validation_text(sweep, [{"name": "gone", "eval_tokens": 500}])
    assert value is None and "gone.yaml is unreadable" in why


def test_runs_scored_on_the_whole_split_get_no_coverage_warning(sweep, tiny_data):
    data = PreparedData.from_config(tiny_data)
    whole = predicted_text_bytes(TokenStream(data, "valid"), Tokenizer(data.tokenizer_file()))
    config = sweep / "configs" / "r1.yaml"
    d = yaml.safe_load(config.read_text())
    d["eval"] = {"max_tokens": None}
    config.write_text(yaml.safe_dump(d))
    value, notes = scaling_sweep.validation_text(
        sweep, [{"name": "r1", "eval_tokens": whole.targets}]
    )
    assert value == whole.bytes / whole.targets and notes == []
    assert whole.documents == data.manifest.splits["valid"].documents


def test_fit_and_predict_give_losses_in_bits_per_byte_beside_nats():
    """With the validation text's bytes per token, every loss the summary, the report and a
    prediction print is also given in bits per byte: nats / ln 2 / bytes per token."""
    from tests.moe.tools.test_scaling import _ladder_runs

    bpt = 3.5
    analysis = scaling_report.analyse(
        _ladder_runs((1e18, 3e18, 1e19)), bootstrap=5, bytes_per_token=bpt
    )
    text = scaling_text.summary(analysis)
    m = analysis["families"]["dense"]["minima"][0]
    bits = m.loss_opt / math.log(2) / bpt
    assert f"loss {m.loss_opt:.4f} ({bits:.4f} bits/byte)" in text
    law = analysis["families"]["dense"]["fit"].law
    assert f"E = {law.E / math.log(2) / bpt:.4f} bits/byte" in text
    assert text.startswith(
        "losses: nats per token of the validation text; bits per byte = nats / ln 2 / 3.5000"
    )
    p = scaling_report.predict(analysis, "dense", 1e20)
    lo, hi = p["loss_interval"]
    assert (
        f"in bits per byte     {p['loss'] / math.log(2) / bpt:.4f}  (95%: "
        f"{lo / math.log(2) / bpt:.4f} to {hi / math.log(2) / bpt:.4f})"
    ) in scaling_text.prediction_text(p)
    analysis["bytes_per_token"] = None  # the data unreadable: nats per token only
    assert "bits" not in scaling_text.summary(analysis)
    assert np.isclose(scaling_text.bits_per_byte(2.0, 2.0), 1 / math.log(2))
