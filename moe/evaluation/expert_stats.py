"""Expert statistics over an evaluation pass, read from the MoE layers' own routing.

Nothing here routes tokens: forward hooks read what each layer's router decided
(``Routing.indices_TK``, the selection dispatch uses) and what the layer recorded
(``MoELayer.stats``: copies kept per expert after the capacity limit, dropped fraction, router
entropy). Summed over every forward of the pass they give, per MoE layer: the load distribution,
the dropped fraction at the trained capacity factor, the mean router entropy, and which input
tokens each expert prefers (as in the ST-MoE analysis: how often a token is routed to an expert,
relative to how often it occurs). A prompt-tuned model routes its soft prompt's positions too:
they count in the load, dropped fraction and entropy (the experts did that work), not in the
token preferences (they are no input token).

Shapes: L MoE layers, E experts, V vocabulary, T tokens of one forward, K experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe.model.moe_layer import MoELayer
from moe.model.transformer import MoETransformer


class ExpertStatsCollector:
    """Use as a context manager around forwards; call :meth:`observe` with each batch's input
    ids before its forward (token preferences need to know which token each row of the routing
    is)."""

    def __init__(self, model: MoETransformer):
        self.model = model
        self.blocks = [i for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoELayer)]
        self.layers: list[MoELayer] = [model.blocks[i].ffn for i in self.blocks]
        L = len(self.layers)
        E = self.layers[0].num_experts if L else 0
        V = model.cfg.vocab_size
        self.top_k = self.layers[0].cfg.router.top_k if L else 0
        self.kept_LE = torch.zeros(L, E, dtype=torch.int64)
        self.selected_LE = torch.zeros(L, E, dtype=torch.int64)
        self.dropped_L = torch.zeros(L, dtype=torch.float64)
        self.entropy_sum_L = torch.zeros(L, dtype=torch.float64)
        self.tokens_L = torch.zeros(L, dtype=torch.int64)
        # Router selections of each (expert, input token) pair: the ST-MoE preference table.
        self.pairs_LEV = torch.zeros(L, E, V, dtype=torch.int64)
        self.token_freq_V = torch.zeros(V, dtype=torch.int64)
        self._tokens_T: torch.Tensor | None = None
        self._selection: list[torch.Tensor | None] = [None] * L
        self._handles = []

    def __enter__(self) -> ExpertStatsCollector:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(self._router_hook(i)))
            self._handles.append(layer.register_forward_hook(self._layer_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def observe(self, input_ids_BS: torch.Tensor) -> None:
        ids_BS = input_ids_BS.cpu()
        self.token_freq_V += torch.bincount(ids_BS.reshape(-1), minlength=self.token_freq_V.numel())
        # The routing's rows: the model's prepended positions (id -1: no token), then the ids.
        self._tokens_T = F.pad(ids_BS, (self.model.prepended_positions, 0), value=-1).reshape(-1)

    def _router_hook(self, i: int) -> Callable:
        def hook(module, args, routing):
            self._selection[i] = routing.indices_TK.detach().cpu()

        return hook

    def _layer_hook(self, i: int) -> Callable:
        def hook(module: MoELayer, args, output):
            stats = module.stats
            indices_TK = self._selection[i]
            T, K = indices_TK.shape
            E = self.kept_LE.shape[1]
            self.kept_LE[i] += stats["tokens_per_expert"].cpu().long()
            self.selected_LE[i] += torch.bincount(indices_TK.reshape(-1), minlength=E)
            self.dropped_L[i] += float(stats["dropped_fraction"]) * T * K
            self.entropy_sum_L[i] += float(stats["router_entropy"]) * T
            self.tokens_L[i] += T
            if self._tokens_T is None or self._tokens_T.numel() != T:
                raise RuntimeError(
                    "ExpertStatsCollector.observe(input_ids) must be called with "
                    "each batch before its forward"
                )
            V = self.pairs_LEV.shape[2]
            tokens_N = self._tokens_T.repeat_interleave(K)
            pair_N = (indices_TK.reshape(-1) * V + tokens_N)[tokens_N >= 0]
            self.pairs_LEV[i].view(-1).index_add_(0, pair_N, torch.ones_like(pair_N))
            self._selection[i] = None

        return hook

    def summary(
        self, decode_piece: Callable[[int], str] | None = None, top_n: int = 8, min_count: int = 5
    ) -> list[dict]:
        """One dict per MoE layer. ``decode_piece`` turns a token id into text for the
        preference tables; tokens seen fewer than ``min_count`` times are left out of them (a
        token seen once is routed 100% somewhere)."""
        out = []
        for i, block in enumerate(self.blocks):
            kept_E = self.kept_LE[i].double()
            routed = int(self.tokens_L[i]) * self.top_k
            mean = kept_E.mean().clamp_min(1e-12)
            E = kept_E.numel()
            out.append(
                {
                    "block": block,
                    "tokens": int(self.tokens_L[i]),
                    "routed_copies": routed,
                    "selected_per_expert": self.selected_LE[i].tolist(),
                    "kept_per_expert": self.kept_LE[i].tolist(),
                    "load_fraction": (kept_E / kept_E.sum().clamp_min(1)).tolist(),
                    "max_over_mean_load": float(kept_E.max() / mean),
                    "load_cv": float(kept_E.std(unbiased=False) / mean),
                    "dropped_fraction": float(self.dropped_L[i]) / max(routed, 1),
                    "router_entropy": float(self.entropy_sum_L[i]) / max(int(self.tokens_L[i]), 1),
                    "router_entropy_uniform": math.log(E),
                    "top_tokens": self._preferences(i, decode_piece, top_n, min_count),
                    **self._specialisation(i, decode_piece, top_n, min_count),
                }
            )
        return out

    def _specialisation(self, i: int, decode_piece, top_n: int, min_count: int) -> dict:
        """Per expert: its most over-represented tokens, by lift = (the token's share of the
        expert's routed copies) / (its share of the data), tokens seen at least ``min_count``
        times; and how concentrated the expert's tokens are: the effective number of distinct
        tokens exp(entropy of its token distribution), next to the data's own."""
        pairs_EV = self.pairs_LEV[i].double()
        freq_V = self.token_freq_V.double()
        data_p_V = freq_V / freq_V.sum().clamp_min(1)
        expert_p_EV = pairs_EV / pairs_EV.sum(1, keepdim=True).clamp_min(1)
        lift_EV = expert_p_EV / data_p_V.clamp_min(1e-30)
        lift_EV[:, self.token_freq_V < min_count] = -1.0

        def effective(p: torch.Tensor) -> float:
            return math.exp(float(-(p * p.clamp_min(1e-30).log()).sum()))

        over = []
        for e, lift_V in enumerate(lift_EV):
            best = [
                v
                for v in lift_V.argsort(descending=True, stable=True)[:top_n].tolist()
                if lift_V[v] > 0
            ]
            over.append(
                [
                    {
                        "id": v,
                        "piece": decode_piece(v) if decode_piece else str(v),
                        "lift": round(float(lift_V[v]), 4),
                        "expert_share": round(float(expert_p_EV[e, v]), 6),
                        "data_share": round(float(data_p_V[v]), 6),
                        "routed": int(pairs_EV[e, v]),
                        "count": int(freq_V[v]),
                    }
                    for v in best
                ]
            )
        return {
            "over_represented": over,
            "effective_tokens": [effective(p_V) for p_V in expert_p_EV],
            "data_effective_tokens": effective(data_p_V),
        }

    def _preferences(self, i: int, decode_piece, top_n: int, min_count: int) -> list[list[dict]]:
        freq_V = self.token_freq_V
        # Fraction of a token's occurrences that chose the expert (its K experts are distinct,
        # so at most 1); K/E would be indifference.
        share_EV = self.pairs_LEV[i].double() / freq_V.double().clamp_min(1)
        share_EV[:, freq_V < min_count] = -1.0
        by_count_V = freq_V.argsort(descending=True, stable=True)
        experts = []
        for e, share_V in enumerate(share_EV):
            # Highest share first; among equal shares the more frequent token.
            order = by_count_V[share_V[by_count_V].argsort(descending=True, stable=True)]
            best = [v for v in order[:top_n].tolist() if share_V[v] >= 0]
            experts.append(
                [
                    {
                        "id": v,
                        "piece": decode_piece(v) if decode_piece else str(v),
                        "share": round(float(share_V[v]), 4),
                        "routed": int(self.pairs_LEV[i, e, v]),
                        "count": int(freq_V[v]),
                    }
                    for v in best
                ]
            )
        return experts
