"""ESFT in the trainer (``finetune.method: esft``; the rule is moe/model/adapters/esft.py).

Before the first step of a new run, every routed expert of every MoE layer is scored on the
run's own training data: this rank's first ``finetune.esft.max_batches`` micro-batches (the
ones the run then trains on first), a forward pass with no gradient in eval mode (no jitter,
noise or dropout) of the base model. The router's selection is counted before any capacity
drop. The sums are all-reduced over every rank: the routers are replicated and their scores
cover all experts, so the statistics are over global expert ids under any expert-parallel
layout. The selection is written to ``RUN_DIR/esft_selection.json`` and into every checkpoint's
client state (:class:`ExpertSelection`, registered with the checkpointer); a resumed run takes
it from its checkpoint, saved on any layout, and never scores again.

What the optimizer holds: the routed experts' stacks are the only parameters that train (one
optimizer group each, moe/parallel/deepspeed_adapter.py), with their Adam moments for the whole
stack. The unselected experts' gradient rows are zeroed before they accumulate, so their moments
stay exactly zero and Adam's update m / (sqrt(v) + eps) is exactly zero for them; the stacks'
weight decay is set to 0, since AdamW's decoupled decay would shrink those rows with a zero
gradient. The unselected experts' weights are therefore bitwise unchanged after any number of
steps (tests/moe/model/adapters/test_esft.py), and the selected experts train without weight decay."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from data_pipeline.reader import PackedReader
from moe.checkpoint.consolidate import single_device_name
from moe.config.run import RunConfig
from moe.core.errors import CheckpointError, ConfigError
from moe.core.fileio import write_atomic
from moe.model.adapters.esft import mask_expert_rows, select_experts
from moe.model.moe_layer import MoELayer
from moe.training.device import to_device
from moe.training.finetune import log_parameter_counts, parameter_counts

log = logging.getLogger("moe.train")

SELECTION_FILE = "esft_selection.json"


@torch.no_grad()
def score_experts(model: torch.nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """{"gate": (L, E) average gate score per token, "token_share": (L, E) share of the layer's
    token selections, "tokens": () tokens scored} over ``batches`` ((input ids, document ids
    or None) on the model's device) on every rank, MoE layers in ``model.moe_layers()`` order."""
    layers: list[MoELayer] = model.moe_layers()
    E = layers[0].num_experts
    device = layers[0].router.weight.device
    sums_L2E = torch.zeros(len(layers), 2, E, dtype=torch.float64, device=device)
    tokens = torch.zeros(1, dtype=torch.float64, device=device)

    def hook(i: int):
        def record(router, args, routing) -> None:
            idx = routing.indices_TK.flatten()
            gate = routing.scores_TE.gather(1, routing.indices_TK).flatten().double()
            sums_L2E[i, 0].index_add_(0, idx, gate)
            sums_L2E[i, 1].index_add_(0, idx, torch.ones_like(gate))

        return record

    handles = [layer.router.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    was_training = model.training
    cuda = [device] if device.type == "cuda" else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=cuda):
            for input_ids_BS, doc_ids_BS in batches:
                model(input_ids_BS, doc_ids_BS=doc_ids_BS)
                tokens += input_ids_BS.numel()
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if dist.is_initialized():
        dist.all_reduce(sums_L2E)
        dist.all_reduce(tokens)
    top_k = torch.tensor(
        [layer.cfg.router.top_k for layer in layers], dtype=torch.float64, device=device
    )
    return {
        "gate": (sums_L2E[:, 0] / tokens).cpu(),
        "token_share": (sums_L2E[:, 1] / (tokens * top_k[:, None])).cpu(),
        "tokens": tokens.cpu()[0],
    }


def _layer_names(model: torch.nn.Module) -> list[str]:
    # The single-device names (an expert-parallel layer is blocks.i.ffn.deepspeed_moe).
    return [
        single_device_name(n + ".")[:-1]
        for n, m in model.named_modules()
        if isinstance(m, MoELayer)
    ]


def new_selection(
    model: torch.nn.Module, reader: PackedReader, cfg: RunConfig, device: torch.device
) -> dict:
    """Score the experts on this rank's first ``max_batches`` micro-batches and select; the
    reader is left where it was."""
    esft = cfg.finetune.esft
    start = reader.state_dict()
    packed = [to_device(b, device) for b in reader.next_step(esft.max_batches)]
    reader.load_state_dict(start)
    batches = [
        (b.tokens_BS[:, :-1], None if b.doc_ids_BS is None else b.doc_ids_BS[:, :-1])
        for b in packed
    ]
    scores = score_experts(model, batches)
    try:
        chosen = select_experts(scores[esft.score], esft.p)
    except ValueError as e:
        raise ConfigError([f"finetune.esft: {e}"]) from None
    return {
        "score": esft.score,
        "p": esft.p,
        "max_batches": esft.max_batches,
        "tokens": int(scores["tokens"]),
        "layers": [
            {"name": name, "selected": sel, "gate": g.tolist(), "token_share": s.tolist()}
            for name, sel, g, s in zip(
                _layer_names(model), chosen, scores["gate"], scores["token_share"]
            )
        ],
    }


def install_selection(model: torch.nn.Module, optimizer, selection: dict, ep_rank: int) -> None:
    """Zero the gradient rows of every unselected expert this rank holds (global ids: rank
    ``ep_rank`` holds experts ``ep_rank * E_local`` to ``(ep_rank + 1) * E_local - 1``), mark
    each stack's trainable fraction for the parameter counts, and set every optimizer group's
    weight decay to 0 (the stacks are the only trainable parameters)."""
    layers = model.moe_layers()
    if len(layers) != len(selection["layers"]):
        raise CheckpointError(
            f"the ESFT selection has {len(selection['layers'])} MoE layers, the model {len(layers)}"
        )
    for layer, chosen in zip(layers, selection["layers"]):
        local = layer.experts.num_experts
        ids_E = torch.arange(ep_rank * local, (ep_rank + 1) * local)
        keep_E = torch.isin(ids_E, torch.tensor(chosen["selected"], dtype=torch.long))
        for w in mask_expert_rows(layer.experts, keep_E):
            w.trainable_fraction = len(chosen["selected"]) / layer.num_experts
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0


class ExpertSelection:
    """The experts that train in a ``finetune.method: esft`` run. A new run scores them on its
    own first batches (:meth:`select`); a resumed one takes its checkpoint's, on any layout
    (:meth:`load_state_dict`, through the checkpointer's registry under :attr:`state_key`).
    Either way the selection is installed in the model and the optimizer, logged, and written
    to ``RUN_DIR/esft_selection.json`` by rank 0."""

    state_key = "esft"

    def __init__(
        self, model, optimizer, cfg: RunConfig, rank: int, ep_rank: int, device: torch.device
    ):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.rank, self.ep_rank, self.device = rank, ep_rank, device
        self.selection: dict | None = None

    def select(self, reader: PackedReader) -> None:
        """Score the experts on this rank's first batches of ``reader`` (left where it was) and
        install the selection."""
        selection = new_selection(self.model, reader, self.cfg, self.device)
        self._install(selection, f"scored on {selection['tokens']:,} tokens")

    def state_dict(self) -> dict:
        return self.selection

    def load_state_dict(self, selection: dict | None) -> None:
        """The checkpoint's selection; after a rollback, the installed one again (a run never
        changes its selection)."""
        if self.selection is not None:
            if selection != self.selection:
                raise CheckpointError("its ESFT selection differs from the one this run trains")
            return
        if selection is None:  # its settings are checked with the run config's (fixed fields)
            raise CheckpointError(
                "saved without an ESFT selection (not a finetune.method esft "
                "run): start a new run from it with model.init_from instead "
                "of resuming it"
            )
        self._install(selection, "from the checkpoint")

    def _install(self, selection: dict, how: str) -> None:
        install_selection(self.model, self.optimizer, selection, self.ep_rank)
        self.selection = selection
        if self.rank != 0:
            return
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.cfg.run_dir / SELECTION_FILE, json.dumps(selection, indent=1).encode())
        log.info(
            f"ESFT ({selection['score']}, p={selection['p']}), {how}: "
            + "; ".join(
                f"{layer['name']}: experts {layer['selected']}" for layer in selection["layers"]
            )
            + "; the experts train without weight decay (docs/finetuning.md)"
        )
        ep = self.cfg.parallel.expert_parallel_size
        log_parameter_counts(parameter_counts(self.model, ep), "esft")
