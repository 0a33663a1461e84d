"""Expert fingerprints: one float64 number per expert that identifies its weights on any layout
and device, recorded in the completion marker at save time and checked on every load, so that a
checkpoint in which experts were saved under the wrong ids cannot load silently."""

from __future__ import annotations

import torch


def duplicated_experts(w_E: torch.Tensor) -> list[tuple[int, int]]:
    """Pairs of experts with bitwise identical weights: the signature of a checkpoint in which
    expert-parallel ranks saved the same local experts under different global ids (used when a
    checkpoint records no fingerprints)."""
    E = w_E.shape[0]
    flat = w_E.reshape(E, -1)
    first: dict[bytes, int] = {}
    pairs = []
    for e in range(E):
        key = flat[e].detach().cpu().contiguous().numpy().tobytes()
        if key in first:
            pairs.append((first[key], e))
        else:
            first[key] = e
    return pairs


_PROBE_LEN = 1 << 20


@torch.no_grad()
def expert_fingerprints(w_E: torch.Tensor) -> list[float]:
    """Per expert, the float64 dot product of its weights with a fixed pseudo-random vector
    (repeated in chunks of ``_PROBE_LEN``): the same weights give the same number on any layout
    and device (up to summation order), different weights a different one. Recorded at save
    time, it lets a load check that each expert id holds the weights saved under it, which also
    accepts experts that were legitimately identical when saved (freshly upcycled)."""
    E = w_E.shape[0]
    flat = w_E.detach().reshape(E, -1)
    n = flat.shape[1]
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(min(n, _PROBE_LEN), generator=g, dtype=torch.float64).to(flat.device)
    out = torch.zeros(E, dtype=torch.float64, device=flat.device)
    for lo in range(0, n, probe.numel()):
        chunk = flat[:, lo : lo + probe.numel()].double()
        out += chunk @ probe[: chunk.shape[1]]
    return out.cpu().tolist()


def fingerprints_match(saved: float, loaded: float) -> bool:
    return abs(saved - loaded) <= 1e-6 * (abs(saved) + abs(loaded)) + 1e-12


def fingerprint_problems(
    key: str, w_E: torch.Tensor | list[float], saved: list[float] | None
) -> list[str]:
    """What is wrong with the stacked experts of parameter ``key`` (single-device name), given
    as the weights ``w_E`` or as their fingerprints, against the fingerprints recorded at save
    time (None: the checkpoint recorded none, so only duplicates can be detected)."""
    if saved is None:
        if not isinstance(w_E, torch.Tensor):  # fingerprints: equal ones mean equal weights
            w_E = torch.tensor(w_E, dtype=torch.float64)[:, None]
        dup = duplicated_experts(w_E)
        return (
            [f"{key}: experts {dup} hold identical weights (saved twice under different ids?)"]
            if dup
            else []
        )
    loaded = expert_fingerprints(w_E) if isinstance(w_E, torch.Tensor) else w_E
    if len(saved) != len(loaded):
        return [f"{key}: {len(loaded)} experts, the checkpoint recorded {len(saved)}"]
    wrong = [e for e, (a, b) in enumerate(zip(saved, loaded)) if not fingerprints_match(a, b)]
    if not wrong:
        return []
    holds = {e: [o for o, a in enumerate(saved) if fingerprints_match(a, loaded[e])] for e in wrong}
    detail = ", ".join(
        f"expert {e} holds "
        + (
            "the weights saved as expert " + "/".join(map(str, holds[e]))
            if holds[e]
            else "weights saved under no expert id"
        )
        for e in wrong[:8]
    )
    return [f"{key}: {detail}"]
