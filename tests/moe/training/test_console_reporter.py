"""The console line of a logging step: the gradient norm to three significant digits, so that
the small norms of adapter methods (prefix tuning: about 4e-4) do not read as 0.000."""

import logging

import pytest

from moe.training.hooks import ConsoleReporter, StepState


def line(grad_norm: float | None, caplog) -> str:
    state = StepState(
        step=3,
        max_steps=10,
        loss=2.5,
        lm_loss=2.4,
        aux_loss=0.1,
        lr=1e-3,
        grad_norm=grad_norm,
        step_seconds=0.5,
        tokens_per_step=1024,
        samples_per_step=4,
        is_log_step=True,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moe"):
        ConsoleReporter(rank=0).on_step_end(state)
    return caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    "norm, shown",
    [(0.000412, "0.000412"), (1.23456, "1.23"), (15.67, "15.7"), (2346.0, "2.35e+03")],
)
def test_the_gradient_norm_keeps_three_significant_digits(norm, shown, caplog):
    assert f"| grad norm {shown} |" in line(norm, caplog)


def test_no_norm_no_field(caplog):
    assert "grad norm" not in line(None, caplog)
