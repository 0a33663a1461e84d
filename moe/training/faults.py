"""Fault injection for tests: ``train(cfg, env, faults=...)`` calls these at fixed points of
every step, so that tests can feed a bad batch, change the learning rate or stall a rank. No
config key or command line creates one: a user's run always has ``faults=None``."""

from __future__ import annotations


class FaultInjector:
    """Does nothing; tests override what they need."""

    def batches(self, step: int, packed: list) -> list:
        """The micro-batches step ``step`` trains on (``packed``: the reader's)."""
        return packed

    def before_update(self, step: int, engine) -> None:
        """Called after the batches are read and before the first forward of step ``step``."""
