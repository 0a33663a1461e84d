"""One optimizer step of the training loop: the step's micro-batches to the device, the global
routing counts of ``aux_loss_scope: global_batch`` routers, the weights of masked data, forward
and backward of each micro-batch, and the step's figures read in one transfer
(:class:`~moe.training.hooks.StepState`). The loop around it is moe/training/trainer.py."""

from __future__ import annotations

import hashlib
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from moe.config.run import RunConfig
from moe.model.moe_layer import counting_routes
from moe.training.device import to_device
from moe.training.downstream import downstream_due
from moe.training.hooks import StepState
from moe.training.prefetch import PrefetchingReader
from moe.training.resilience.nan_guard import poison_nonfinite
from moe.training.resilience.spike_guard import LossSpikeGuard


def train_step(
    engine,
    loader: PrefetchingReader,
    cfg: RunConfig,
    world_size: int,
    step: int,
    spike: LossSpikeGuard | None = None,
) -> StepState:
    """One optimizer step over ``grad_accum_steps`` micro-batches, on ``world_size`` ranks.

    Host syncs of our code in a step (DeepSpeed's own optimizer step reads the gradient norm
    and the overflow flag besides): the loss sums and gradient norm are read once, after the
    optimizer step, in one transfer (the non-finite guard and the per-step record need them
    every step). Nothing is read per micro-batch: the losses add up on the device, and a
    micro-batch's copy to the device is asynchronous from pinned memory."""
    t = cfg.train
    t0 = time.time()
    packed = loader.next_step()
    samples = t.micro_batch_size * t.grad_accum_steps * world_size
    batches = []
    for p in packed:
        p_dev = to_device(p, engine.device)
        doc_ids = None if p_dev.doc_ids_BS is None else p_dev.doc_ids_BS[:, :-1]
        batches.append((p_dev.tokens_BS[:, :-1], p_dev.targets(), doc_ids))
    count_global_routing(engine, [(x, d) for x, _, d in batches])
    weights, trained = trained_token_weights(
        [t for _, t, _ in batches], world_size, packed[0].targets_BS is not None
    )
    spike_ref = spike.reference() if spike is not None else None
    sums, z_max = accumulate(engine, batches, weights, spike, spike_ref)
    skipped = not engine.was_step_applied()
    is_log = is_log_step(cfg, step)
    # The spike guard's window needs the loss averaged over the ranks every step.
    mean_over_ranks = (is_log or spike is not None) and dist.is_initialized()
    local_sum = sums[:1].clone()
    if mean_over_ranks:
        dist.all_reduce(sums)
    sums /= t.grad_accum_steps * (world_size if mean_over_ranks else 1)
    grad_norm = engine.get_global_grad_norm()
    norm = (
        grad_norm.detach().float().reshape(1).to(sums.device)
        if torch.is_tensor(grad_norm)
        else torch.full(
            (1,), math.nan if grad_norm is None else float(grad_norm), device=sums.device
        )
    )
    # The step's one read of ours (a host sync on GPUs).
    loss, lm_loss, aux_loss, local_sum, norm_value, z_value, *n = torch.cat(
        [sums, local_sum, norm, z_max, *([] if trained is None else [trained.reshape(1)])]
    ).tolist()
    return StepState(
        step=step,
        max_steps=t.max_steps,
        loss=loss,
        lm_loss=lm_loss,
        aux_loss=aux_loss,
        lr=engine.get_lr()[0],
        grad_norm=None if grad_norm is None else norm_value,
        step_seconds=time.time() - t0,
        tokens_per_step=samples * cfg.data.seq_len,
        samples_per_step=samples,
        is_log_step=is_log,
        local_loss=local_sum / t.grad_accum_steps,
        tokens_sha256=_token_hash([p.tokens_BS for p in packed]),
        skipped=skipped,
        spike_zscore=z_value if spike_ref is not None and z_value > spike.cfg.zscore else None,
        consumed_samples=int(loader.state_dict()["consumed_samples"]),
        extra={} if trained is None else {"train/trained_tokens": n[0]},
    )


def accumulate(
    engine, batches: list, weights: list, spike: LossSpikeGuard | None, spike_ref
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every micro-batch (the last one's ``engine.step()`` updates the
    weights): the (loss, lm loss, aux loss) sums on the device, and the largest loss z-score
    of the spike guard (-inf without one)."""
    sums = torch.zeros(3, device=engine.device)  # (loss, lm loss, aux loss) summed
    z_max = torch.full((1,), -math.inf, device=engine.device)
    for (inputs, targets, doc_ids), weight in zip(batches, weights):
        # Only the losses are kept: the (B, S, V) logits would otherwise stay alive through this
        # micro-batch's backward and the next one's forward (2 bytes per logit in bf16).
        out = engine(inputs, targets, doc_ids_BS=doc_ids)._replace(logits=None)
        scored = out.loss  # the micro-batch's own mean: what the spike guard compares
        if weight is not None:  # masked data: each micro-batch's mean weighed by its targets
            out = out._replace(
                loss=out.lm_loss * weight + out.aux_loss, lm_loss=out.lm_loss * weight
            )
        loss = out.loss
        if spike_ref is not None:
            loss, z = spike.check(scored, spike_ref, loss)
            z_max = torch.maximum(z_max, z.reshape(1))
        engine.backward(poison_nonfinite(loss))
        engine.step()  # the last micro-batch's step() updates the weights
        sums += torch.stack(
            [out.loss.detach(), out.lm_loss.detach(), out.aux_loss.detach()]
        ).float()
    return sums, z_max


def is_log_step(cfg: RunConfig, step: int) -> bool:
    """Whether ``step`` is logged: the first and last, every ``logging.log_every``, and the
    steps of an evaluation."""
    return (
        step == 1
        or step % cfg.logging.log_every == 0
        or step == cfg.train.max_steps
        or bool(cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0)
        or downstream_due(cfg, step)
    )


def trained_token_weights(
    targets: list[torch.Tensor], world_size: int, masked: bool
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """For data with a loss mask (targets holding -100): per micro-batch, the factor that turns
    its mean loss (over its own trained targets) into its share of the mean over every trained
    target of the step on all ranks, ``n_mb * A * W / N``, since the engine averages the
    micro-batches' gradients and the ranks'; and ``N``, the step's trained targets. Computed on
    the device (one all-reduce, no host read). Without a mask (``masked`` False: the same on
    every rank, they read the same data) every micro-batch has the same number of targets:
    ``[None, ...]`` and None."""
    if not masked:
        return [None] * len(targets), None
    counts = torch.stack([(t != -100).sum() for t in targets]).float()
    total = counts.sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    weights = counts * (len(targets) * world_size) / total.clamp(min=1.0)
    return list(weights), total


def count_global_routing(engine, batches: list) -> None:
    """For routers with ``aux_loss_scope: global_batch``: route every micro-batch of the step
    once without gradients, sum the routed copies per expert over the micro-batches and all
    ranks, and leave them in each layer's ``batch_counts_E`` for the step's training forwards.

    ``batches``: the step's micro-batches as (input ids, document ids or None), on the device.
    The random state is restored afterwards, so jitter and logit noise draw the same values in
    the training forwards and the counted routing is the routing they use."""
    layers = [
        m for m in engine.module.moe_layers() if m.cfg.router.aux_loss_scope == "global_batch"
    ]
    if not layers:
        return
    cuda = [engine.device] if engine.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), counting_routes(layers):
        for input_ids_BS, doc_ids_BS in batches:
            engine.module(input_ids_BS, doc_ids_BS=doc_ids_BS)
    counts_LE = torch.stack([m.batch_counts_E for m in layers])
    if dist.is_initialized():
        dist.all_reduce(counts_LE)  # every expert's routed copies over all data-parallel ranks
    for m, row in zip(layers, counts_LE):
        m.batch_counts_E.copy_(row)


def _token_hash(batches: list[torch.Tensor]) -> str:
    """Of the host copies of the batches (the device has its own): no device read."""
    h = hashlib.sha256()
    for b in batches:
        h.update(b.numpy().astype(np.int64).tobytes())
    return h.hexdigest()[:16]
