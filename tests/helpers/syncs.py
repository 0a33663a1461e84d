"""Counting the calls of our code that read a tensor's value on the host (a CPU-GPU sync on a
GPU): ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool/int/float(tensor)``.

Only calls made directly from files under ``moe/`` (not tests, not DeepSpeed or torch) and from
the thread that counts are recorded, with the caller's file and line."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
OURS = str(Path(__file__).resolve().parents[2] / "moe") + "/"


@contextmanager
def count_host_reads():
    """Yields a Counter of ``"file:line method"`` -> calls, filled while the block runs."""
    calls: Counter = Counter()
    thread = threading.get_ident()
    saved = {name: getattr(torch.Tensor, name) for name in METHODS}

    def wrap(name, real):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1)
            if threading.get_ident() == thread and caller.f_code.co_filename.startswith(OURS):
                where = caller.f_code.co_filename[len(OURS) :]
                calls[f"{where}:{caller.f_lineno} {name}"] += 1
            return real(self, *args, **kwargs)

        return counted

    for name, real in saved.items():
        setattr(torch.Tensor, name, wrap(name, real))
    try:
        yield calls
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
