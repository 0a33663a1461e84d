"""Text generation: greedy, temperature / top-k / top-p sampling and beam search.

The strategies are written against a small step interface (:class:`Decoder`) and never call the
model themselves, so how earlier tokens are remembered (re-running the whole prefix, or a KV
cache) is the decoder's business:

    logits_BV, state = decoder.step(prompt_1S, None)      # the prompt, one row
    state = decoder.reorder(state, rows_R)                 # expand / reorder rows (beams)
    logits_RV, state = decoder.step(next_R1, state)        # one new token per row

:class:`KVCacheDecoder` (used by the evaluation script) feeds only the new tokens and keeps the
prefix's keys and values in the model's :class:`~moe.attention.KVCache`, so a step costs the same
whatever the prefix length (plus attention over the cache). :class:`FullForwardDecoder` re-runs the
model over the whole prefix at every step; it is the reference the cached decoder is tested
against.

Shapes: B/R rows (samples or beams), S new tokens, L tokens so far, V vocabulary, W beam width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from moe.core.errors import ConfigError
from moe.model.attention import KVCache
from moe.model.transformer import MoETransformer

Strategy = Literal["greedy", "sample", "beam"]


@dataclass
class GenerationConfig:
    strategy: Strategy = "greedy"
    """``greedy``: the most likely token; ``sample``: draw from the (temperature-scaled, top-k /
    top-p filtered) distribution; ``beam``: beam search on total log-probability."""
    max_new_tokens: int = 32
    temperature: float = 1.0
    """Sampling only: logits are divided by it; 0 means greedy."""
    top_k: int | None = None
    """Sampling only: keep the k most likely tokens (null: all)."""
    top_p: float | None = None
    """Sampling only: keep the smallest set of most likely tokens whose probability reaches p
    (nucleus sampling; null: all)."""
    num_beams: int = 4
    """Beam search width."""
    num_return: int = 1
    """Sequences returned: independent samples (sample) or the best beams (beam, <= num_beams)."""
    length_penalty: float = 0.0
    """Beam search ranks hypotheses by logprob / length**length_penalty (0: total log-prob)."""
    seed: int = 0
    """Sampling draws from a generator seeded with this, per prompt: same seed, same text."""
    stop_at_eos: bool = True
    """A sequence ends at the end-of-sequence token."""

    def problems(self) -> list[str]:
        out = []
        if self.strategy not in ("greedy", "sample", "beam"):
            out.append(f"strategy: {self.strategy!r} is not one of greedy, sample, beam")
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            out.append(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            out.append(f"length_penalty: must be a finite number, got {self.length_penalty}")
        if self.top_k is not None and self.top_k < 1:
            out.append(f"top_k: must be >= 1 or null, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            out.append(f"top_p: must be in (0, 1] or null, got {self.top_p}")
        if self.num_beams < 1:
            out.append(f"num_beams: must be >= 1, got {self.num_beams}")
        if self.num_return < 1:
            out.append(f"num_return: must be >= 1, got {self.num_return}")
        elif self.strategy == "greedy" and self.num_return != 1:
            out.append(f"num_return: greedy decoding returns one sequence, got {self.num_return}")
        elif self.strategy == "beam" and self.num_return > self.num_beams:
            out.append(f"num_return: {self.num_return} exceeds num_beams ({self.num_beams})")
        return out


class Hypothesis(NamedTuple):
    tokens: list[int]  # generated tokens only (ending with EOS if it stopped there)
    logprob: float  # sum of the model's log-probabilities of these tokens (temperature 1)
    score: float  # what beam search ranks by (logprob / len**length_penalty); logprob otherwise


class Decoder(Protocol):
    """The step interface the strategies use."""

    max_tokens: int
    """Most tokens (prompt + generated) one row may hold."""

    def step(self, tokens_BS: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """Feed ``tokens_BS`` (int64, on the host): the prompt when ``state`` is None, otherwise
        the tokens chosen at the last step (S = 1). Returns the fp32 logits of the next token of
        each row, (B, V) on the host, and the new state (the old one may be reused or changed in
        place; it may live on the model's device)."""

    def reorder(self, state: Any, rows_R: torch.Tensor) -> Any:
        """The state of rows ``rows_R`` (int64 indices into the current rows, repeats allowed):
        expands one prompt row to R rows and follows beams to their parents."""


class _ModelDecoder:
    """What both decoders hold: the model, its device and how many tokens a row may hold."""

    def __init__(self, model: MoETransformer):
        self.model = model
        # A soft prompt takes up positions of the sequence the model holds.
        self.max_tokens = model.cfg.max_seq_len - model.prepended_positions
        self.device = next(model.parameters()).device


class FullForwardDecoder(_ModelDecoder):
    """Re-runs the model over the whole prefix at every step. The state is the prefix (B, L)."""

    @torch.no_grad()
    def step(self, tokens_BS: torch.Tensor, state: torch.Tensor | None):
        tokens_BS = tokens_BS.to(self.device)
        prefix_BL = tokens_BS if state is None else torch.cat((state, tokens_BS), dim=1)
        logits_BLV = self.model(prefix_BL).logits
        # The strategies run on the host: one (B, V) copy per step.
        return logits_BLV[:, -1].float().cpu(), prefix_BL

    def reorder(self, state: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
        return state.index_select(0, rows_R.to(state.device))


class KVCacheDecoder(_ModelDecoder):
    """Incremental decoding with the model's KV cache. The state is the cache."""

    @torch.no_grad()
    def step(self, tokens_BS: torch.Tensor, state: KVCache | None):
        cache = self.model.new_kv_cache() if state is None else state
        logits_BSV = self.model(tokens_BS.to(self.device), kv_cache=cache).logits
        return logits_BSV[:, -1].float().cpu(), cache

    def reorder(self, state: KVCache, rows_R: torch.Tensor) -> KVCache:
        rows_R = rows_R.to(self.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            # Positions are shared by all rows (batch dim 1) and broadcast as they are.
            return t if t is None or t.shape[0] == 1 else t.index_select(0, rows_R)

        out = KVCache(len(state.keys))
        out.keys = [None if k is None else k.index_select(0, rows_R) for k in state.keys]
        out.values = [None if v is None else v.index_select(0, rows_R) for v in state.values]
        out.positions_BL, out.doc_ids_BL = pick(state.positions_BL), pick(state.doc_ids_BL)
        return out


def filter_logits(logits_RV: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the nucleus of mass top_p. The most
    likely token always survives."""
    if top_k is not None and top_k < logits_RV.shape[-1]:
        kth_R1 = logits_RV.topk(top_k, dim=-1).values[:, -1:]
        logits_RV = logits_RV.masked_fill(logits_RV < kth_R1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_RV, order_RV = logits_RV.sort(dim=-1, descending=True)
        probs_RV = sorted_RV.softmax(dim=-1)
        # Mass of the tokens ranked strictly before each one: drop it once that already reaches p.
        before_RV = probs_RV.cumsum(dim=-1) - probs_RV
        drop_RV = torch.zeros_like(before_RV, dtype=torch.bool).scatter(
            -1, order_RV, before_RV >= top_p
        )
        logits_RV = logits_RV.masked_fill(drop_RV, float("-inf"))
    return logits_RV


def next_tokens(
    logits_RV: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row by the configured strategy (greedy or sampling)."""
    if cfg.strategy == "greedy" or cfg.temperature == 0:
        return logits_RV.argmax(dim=-1)
    filtered_RV = filter_logits(logits_RV / cfg.temperature, cfg.top_k, cfg.top_p)
    return torch.multinomial(filtered_RV.softmax(dim=-1), 1, generator=generator)[:, 0]


def generate(
    decoder: Decoder, prompt: list[int], cfg: GenerationConfig, eos_id: int | None = None
) -> list[Hypothesis]:
    """Continue ``prompt``; returns ``cfg.num_return`` hypotheses (beam search: best first)."""
    problems = cfg.problems()
    if not prompt:
        problems.append("prompt: must hold at least one token")
    if len(prompt) + cfg.max_new_tokens > decoder.max_tokens:
        problems.append(
            f"max_new_tokens: prompt ({len(prompt)} tokens) + max_new_tokens "
            f"({cfg.max_new_tokens}) exceeds the model's {decoder.max_tokens} tokens"
        )
    if problems:
        raise ConfigError(problems, "generation")
    eos = eos_id if cfg.stop_at_eos else None
    prompt_1S = torch.tensor([prompt], dtype=torch.long)
    if cfg.strategy == "beam":
        return _beam_search(decoder, prompt_1S, cfg, eos)
    return _sample(decoder, prompt_1S, cfg, eos)


def _sample(
    decoder: Decoder, prompt_1S: torch.Tensor, cfg: GenerationConfig, eos: int | None
) -> list[Hypothesis]:
    R = cfg.num_return
    generator = torch.Generator().manual_seed(cfg.seed)
    logits_1V, state = decoder.step(prompt_1S, None)
    state = decoder.reorder(state, torch.zeros(R, dtype=torch.long))
    logits_RV = logits_1V.expand(R, -1)
    done_R = torch.zeros(R, dtype=torch.bool)
    logprob_R = torch.zeros(R, dtype=torch.float64)
    chosen = []
    for t in range(cfg.max_new_tokens):
        tok_R = next_tokens(logits_RV, cfg, generator)
        lp_R = logits_RV.log_softmax(dim=-1).gather(1, tok_R[:, None])[:, 0]
        logprob_R += torch.where(done_R, 0.0, lp_R.double())
        chosen.append(tok_R)
        if eos is not None:
            done_R |= tok_R == eos
        if done_R.all() or t == cfg.max_new_tokens - 1:
            break
        logits_RV, state = decoder.step(tok_R[:, None], state)
    tokens_RT = torch.stack(chosen, dim=1).tolist()
    out = []
    for row, lp in zip(tokens_RT, logprob_R.tolist()):
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        out.append(Hypothesis(row, lp, lp))
    return out


def _beam_search(
    decoder: Decoder, prompt_1S: torch.Tensor, cfg: GenerationConfig, eos: int | None
) -> list[Hypothesis]:
    """Keeps the W prefixes of highest total log-probability; a hypothesis that emits EOS is
    set aside as finished. Without a length penalty, log-probabilities only fall as a sequence
    grows, so the search stops once W finished hypotheses all beat the best live one."""
    W = cfg.num_beams

    def score(logprob: float, length: int) -> float:
        return logprob / length**cfg.length_penalty if cfg.length_penalty else logprob

    logits_RV, state = decoder.step(prompt_1S, None)
    live_logprob_R = torch.zeros(1, dtype=torch.float64)
    live_tokens: list[list[int]] = [[]]
    finished: list[Hypothesis] = []
    for t in range(cfg.max_new_tokens):
        R, V = logits_RV.shape
        cand_RV = live_logprob_R[:, None] + logits_RV.log_softmax(dim=-1).double()
        # 2W candidates hold at least W that do not end (at most one EOS per live row).
        top = cand_RV.flatten().topk(min(2 * W, R * V))
        parents, tokens, logprobs = [], [], []
        for lp, flat in zip(top.values.tolist(), top.indices.tolist()):
            row, tok = divmod(flat, V)
            seq = live_tokens[row] + [tok]
            if eos is not None and tok == eos:
                finished.append(Hypothesis(seq, lp, score(lp, len(seq))))
                continue
            parents.append(row)
            tokens.append(tok)
            logprobs.append(lp)
            if len(parents) == W:
                break
        if not parents:  # every candidate ended (a vocabulary of EOS alone)
            live_tokens = []
            break
        live_tokens = [live_tokens[p] + [tok] for p, tok in zip(parents, tokens)]
        live_logprob_R = torch.tensor(logprobs, dtype=torch.float64)
        finished = sorted(finished, key=lambda h: -h.score)[:W]
        exact_stop = (
            cfg.length_penalty == 0 and len(finished) == W and finished[-1].score >= logprobs[0]
        )
        if exact_stop or t == cfg.max_new_tokens - 1:
            break
        state = decoder.reorder(state, torch.tensor(parents, dtype=torch.long))
        logits_RV, state = decoder.step(torch.tensor(tokens, dtype=torch.long)[:, None], state)
    live = [
        Hypothesis(seq, lp, score(lp, len(seq)))
        for seq, lp in zip(live_tokens, live_logprob_R.tolist())
    ]  # empty if all ended
    ranked = sorted(finished + live, key=lambda h: -h.score)
    return ranked[: cfg.num_return]
