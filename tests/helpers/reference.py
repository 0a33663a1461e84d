"""Reference computations the evaluation code is checked against, written as plainly as possible."""

import numpy as np
import torch
import torch.nn.functional as F


def reference_loss(model, tokens: np.ndarray, seq_len: int) -> tuple[float, int]:
    """Mean next-token loss over ``tokens``, one window of seq_len + 1 tokens at a time (windows
    overlap by one token); returns (loss, tokens predicted)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, seq_len):
            w = torch.from_numpy(tokens[start : start + seq_len + 1].astype(np.int64))[None]
            logits = model(w[:, :-1]).logits
            total += float(F.cross_entropy(logits.float().flatten(0, 1), w[0, 1:], reduction="sum"))
            count += w.shape[1] - 1
    return total / count, count
