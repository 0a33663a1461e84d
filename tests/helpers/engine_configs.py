"""Run configs of a tiny model for tests that build the trainer's engine directly
(``build_engine``) rather than running the trainer on prepared data."""

from __future__ import annotations


def tiny_engine_dict(
    vocab: int, seq: int, moe: dict | None = None, train: dict | None = None, **parallel
) -> dict:
    """Two layers of width 32, four heads; four experts of width 16 with top-2 routing, updated
    by ``moe``; ``train`` and ``parallel`` (one rank, ZeRO 1 unless given) as given."""
    return {
        "model": {
            "vocab_size": vocab,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": seq,
            "moe": {"num_experts": 4, "expert_hidden": 16, "router": {"top_k": 2}, **(moe or {})},
        },
        "data": {"seq_len": seq},
        "train": dict(train or {}),
        "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1, **parallel},
    }
