"""Batched scoring for evaluation harnesses: the log-likelihood of continuations given contexts,
and batched generation, on one device.

Requests are token ids. Contexts are batched by length (longest first, so a batch pads little)
and each distinct context runs once: its keys and values go into the model's KV cache, which is
copied to one row per continuation, and only the continuations run after it. A multiple-choice
question with four answers costs one context plus four short continuations instead of four
full sequences. Contexts of different lengths in one batch are padded on the left as a document
of their own (document id 0, the real tokens id 1), so no real token attends to padding and
positions start at 0 at the first real token; models that cannot take document ids (soft
prompts, prefix tuning) batch only contexts of equal length.

Shapes: B contexts, R continuation rows, C context tokens, T continuation tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from moe.model.adapters.prefix import PrefixAttention
from moe.model.attention import KVCache
from moe.model.generation import GenerationConfig, next_tokens
from moe.model.transformer import MoETransformer


class Score(NamedTuple):
    logprob: float  # sum of the continuation tokens' log-probabilities
    greedy: bool  # every continuation token is the argmax of its distribution


class Group(NamedTuple):
    context: tuple[int, ...]
    members: list[tuple[int, list[int]]]  # (request index, continuation tokens)


def can_pad(model: MoETransformer) -> bool:
    """Whether contexts of different lengths may share a forward (left padding as a document of
    its own): not for soft prompts or key/value prefixes, which refuse document ids."""
    return model.prepended_positions == 0 and not any(
        isinstance(m, PrefixAttention) for m in model.modules()
    )


def truncate(
    context: list[int], continuation: list[int], max_length: int
) -> tuple[tuple[int, ...], list[int]]:
    """Drop context tokens from the left until context + continuation - 1 fits the model (the
    last continuation token is predicted, never fed); the continuation stays whole."""
    if not continuation:
        raise ValueError("a request needs at least one continuation token")
    if len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens exceeds the model's {max_length}"
        )
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    ctx = whole[: len(whole) - len(continuation)]
    if not ctx:
        raise ValueError("a request needs at least one context token")
    return tuple(ctx), list(continuation)


def plan_batches(
    requests: list[tuple[list[int], list[int]]], batch_size: int, max_length: int, pad: bool = True
) -> list[list[Group]]:
    """Requests grouped by their (truncated) context and the groups batched: longest context
    first, up to ``batch_size`` continuations per batch (a larger group goes alone), only equal
    context lengths together when ``pad`` is False."""
    groups: dict[tuple[int, ...], Group] = {}
    for i, (ctx, cont) in enumerate(requests):
        ctx_t, cont = truncate(ctx, cont, max_length)
        groups.setdefault(ctx_t, Group(ctx_t, [])).members.append((i, cont))
    ordered = sorted(groups.values(), key=lambda g: (-len(g.context), g.context))
    batches: list[list[Group]] = []
    rows = 0
    for g in ordered:
        fits = (
            batches
            and rows + len(g.members) <= batch_size
            and (pad or len(batches[-1][0].context) == len(g.context))
        )
        if not fits:
            batches.append([])
            rows = 0
        batches[-1].append(g)
        rows += len(g.members)
    return batches


def _left_padded(contexts: list[tuple[int, ...]], pad_id: int):
    """(B, C) ids and document ids (None when every context has the same length)."""
    C = max(len(c) for c in contexts)
    ids_BC = torch.full((len(contexts), C), pad_id, dtype=torch.long)
    doc_BC = torch.zeros((len(contexts), C), dtype=torch.long)
    for b, c in enumerate(contexts):
        ids_BC[b, C - len(c) :] = torch.tensor(c, dtype=torch.long)
        doc_BC[b, C - len(c) :] = 1
    same = all(len(c) == C for c in contexts)
    return ids_BC, None if same else doc_BC


def _rows(cache: KVCache, rows_R: torch.Tensor) -> KVCache:
    out = KVCache(len(cache.keys))
    out.keys = [None if k is None else k.index_select(0, rows_R) for k in cache.keys]
    out.values = [None if v is None else v.index_select(0, rows_R) for v in cache.values]
    pick = lambda t: t if t is None or t.shape[0] == 1 else t.index_select(0, rows_R)
    out.positions_BL, out.doc_ids_BL = pick(cache.positions_BL), pick(cache.doc_ids_BL)
    return out


@torch.no_grad()
def score_batch(
    model: MoETransformer, batch: list[Group], pad_id: int = 0, always_two_forwards: bool = False
) -> list[tuple[int, Score]]:
    """(request index, score) of every continuation of ``batch``: one forward over the contexts
    (into a KV cache) and one over the continuations after them; the second is skipped when
    every continuation is one token unless ``always_two_forwards`` (ranks that must make the
    same calls, e.g. under expert parallelism)."""
    device = next(model.parameters()).device
    ids_BC, doc_BC = _left_padded([g.context for g in batch], pad_id)
    cache = KVCache(model.cfg.n_layers)
    out = model(
        ids_BC.to(device), doc_ids_BS=None if doc_BC is None else doc_BC.to(device), kv_cache=cache
    )
    first_BV = out.logits[:, -1].float().log_softmax(-1)
    owners = [(b, i, cont) for b, g in enumerate(batch) for i, cont in g.members]
    rows_R = torch.tensor([b for b, _, _ in owners], device=device)
    T = max(len(cont) for _, _, cont in owners)
    logp_RTV = first_BV.index_select(0, rows_R)[:, None]
    if T > 1 or always_two_forwards:
        feed_R = torch.full((len(owners), max(T - 1, 1)), pad_id, dtype=torch.long)
        for r, (_, _, cont) in enumerate(owners):
            feed_R[r, : len(cont) - 1] = torch.tensor(cont[:-1], dtype=torch.long)
        doc = None if doc_BC is None else torch.ones_like(feed_R, device=device)
        rest = model(feed_R.to(device), doc_ids_BS=doc, kv_cache=_rows(cache, rows_R)).logits
        if T > 1:
            logp_RTV = torch.cat((logp_RTV, rest.float().log_softmax(-1)[:, : T - 1]), dim=1)
    scores = []
    for r, (_, i, cont) in enumerate(owners):
        cont_T = torch.tensor(cont, device=device)
        logp_TV = logp_RTV[r, : len(cont)]
        logprob = logp_TV.gather(1, cont_T[:, None]).sum()
        greedy = bool((logp_TV.argmax(-1) == cont_T).all())
        scores.append((i, Score(float(logprob), greedy)))
    return scores


def score_requests(
    model: MoETransformer,
    requests: list[tuple[list[int], list[int]]],
    batch_size: int = 8,
    max_length: int | None = None,
    pad_id: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[Score]:
    """The score of each (context, continuation) request, in request order. Contexts longer
    than ``max_length`` (default: the model's) lose tokens on the left."""
    limit = max_length or model.cfg.max_seq_len - model.prepended_positions
    out: list[Score | None] = [None] * len(requests)
    for batch in plan_batches(requests, batch_size, limit, can_pad(model)):
        for i, score in score_batch(model, batch, pad_id):
            out[i] = score
        if progress is not None:
            progress(sum(len(g.members) for g in batch))
    return out  # type: ignore[return-value]


@torch.no_grad()
def generate_batch(
    model: MoETransformer,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_id: int | None,
    done: Callable[[int, list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Continue every prompt of one batch with the model's KV cache, greedy or sampled (``cfg``:
    strategy, temperature, top-k, top-p, max_new_tokens). A row ends at ``eos_id`` (kept out of
    its tokens) or once ``done(row, tokens so far)`` says so (a stop sequence); the batch ends
    when every row has. Prompts of different lengths need a model that takes document ids."""
    if cfg.strategy == "beam":
        raise ValueError("generate_batch samples or decodes greedily; beam search is generate()")
    device = next(model.parameters()).device
    ids_BC, doc_BC = _left_padded([tuple(p) for p in prompts], pad_id)
    cache = KVCache(model.cfg.n_layers)
    logits_BV = (
        model(
            ids_BC.to(device),
            doc_ids_BS=None if doc_BC is None else doc_BC.to(device),
            kv_cache=cache,
        )
        .logits[:, -1]
        .float()
        .cpu()
    )
    B = len(prompts)
    out: list[list[int]] = [[] for _ in range(B)]
    finished = [False] * B
    for t in range(cfg.max_new_tokens):
        tok_B = next_tokens(logits_BV, cfg, generator)
        for b, tok in enumerate(tok_B.tolist()):
            if finished[b]:
                continue
            if eos_id is not None and tok == eos_id:
                finished[b] = True
                continue
            out[b].append(tok)
            finished[b] = done is not None and done(b, out[b])
        if all(finished) or t == cfg.max_new_tokens - 1:
            break
        doc = None if doc_BC is None else torch.ones((B, 1), dtype=torch.long, device=device)
        logits_BV = (
            model(tok_B[:, None].to(device), doc_ids_BS=doc, kv_cache=cache)
            .logits[:, -1]
            .float()
            .cpu()
        )
    return out
