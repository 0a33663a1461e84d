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


def two_rank_results(worker, tmp, vocab: int, rows: int, seq: int, accum: int, steps: int):
    """``worker(rank, world, batches, ckpt_dir)`` on 2 gloo ranks, with ``steps`` steps of the
    same ``accum`` micro-batches of ``rows`` x ``seq + 1`` tokens (so its loss must fall);
    returns what it returned on rank 0."""
    import torch

    from tests.helpers.distributed import run_distributed

    torch.manual_seed(0)
    step = [torch.randint(0, vocab, (rows, seq + 1)) for _ in range(accum)]
    run_distributed(_rank0_saves, 2, worker, [step] * steps, str(tmp / "ckpt"), tmp / "out.pt")
    return torch.load(tmp / "out.pt", weights_only=True)


def _rank0_saves(rank, world, worker, batches, ckpt_dir, out_file) -> None:
    import torch

    results = worker(rank, world, batches, ckpt_dir)
    if rank == 0:
        torch.save(results, out_file)


def resumed_losses(saving, resuming, steps: list, ckpt_dir, train) -> list[float]:
    """``train(engine, steps)`` (returning a dict with ``losses``) of ``saving`` on the first two
    steps, a checkpoint of it (with the expert directory the trainer makes) loaded into
    ``resuming``, and the losses of ``resuming`` on the other steps."""
    from pathlib import Path

    from moe.checkpoint.files import EXPERT_DIR

    train(saving, steps[:2])
    (Path(ckpt_dir) / "off" / EXPERT_DIR).mkdir(parents=True, exist_ok=True)
    saving.save_checkpoint(ckpt_dir, tag="off")
    resuming.load_checkpoint(ckpt_dir, tag="off")
    return train(resuming, steps[2:])["losses"]
