"""Named profiler ranges around the model's regions, so that a profile can say which part of a
step each kernel belongs to (benchmarks/profile_summary.py maps them to its regions: attention,
expert GEMMs, permutation and combine, router, norms, head and loss, ...).

``with region(ATTENTION): ...`` opens a ``torch.profiler.record_function`` range only while a
profiler is recording. Otherwise it returns one shared no-op context: a training step pays a
C call per range (``_profiler_enabled``), not the range itself, which costs a dispatcher call
and an allocation even with no profiler. Inside a graph that dynamo traces it is the no-op as
well, with no guard on the profiler's state, so turning a profiler on never recompiles a
compiled block; the kernels of compiled code are attributed by name instead.

Ranges nest: a kernel belongs to the innermost range around the operator that launched it
(``block`` holds the residual additions of a block; its norms, attention and feed-forward
have ranges of their own; ``ffn`` holds a dense FFN, or an MoE layer's shared experts and what
its own ranges leave). Backward kernels are attributed through the autograd sequence
number of the forward operator they differentiate.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from moe.model.compile import is_compiling

BLOCK = "block"
ATTENTION = "attention"
NORM = "norm"
FFN = "ffn"
ROUTER = "moe.router"
DISPATCH = "moe.dispatch"
EXPERTS = "moe.experts"
COMBINE = "moe.combine"
EMBEDDING = "embedding"
HEAD = "head"
RANGES = (BLOCK, ATTENTION, NORM, FFN, ROUTER, DISPATCH, EXPERTS, COMBINE, EMBEDDING, HEAD)
"""Every range name the model opens (the profile summary maps each to a region)."""

_OFF = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def region(name: str):
    """A ``record_function(name)`` range while a profiler records, else a shared no-op."""
    if is_compiling() or not _profiler_enabled():
        return _OFF
    return record_function(name)
