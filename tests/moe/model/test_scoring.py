"""Batched scoring and generation for evaluation harnesses against one full forward per request:
prefix sharing through the KV cache, left padding as a document of its own, truncation."""

import pytest
import torch

from moe.model.generation import GenerationConfig, KVCacheDecoder, generate
from moe.model.moe_layer import MoEConfig
from moe.model.scoring import can_pad, generate_batch, plan_batches, score_requests, truncate
from moe.model.transformer import ModelConfig, MoETransformer
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

V = 11


@pytest.fixture(scope="module", params=["rope", "learned"])
def model(request) -> MoETransformer:
    torch.manual_seed(0)
    m = MoETransformer(
        ModelConfig(
            vocab_size=V,
            d_model=32,
            n_layers=2,
            n_heads=4,
            max_seq_len=24,
            position=request.param,
            moe=MoEConfig(num_experts=4, expert_hidden=16),
        )
    )
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # peaked distributions: argmax ties are unlikely
    return m.eval()


def reference(model, ctx, cont):
    """One float64 log-softmax over one unpadded full forward of context + continuation."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(ids[:, :-1]).logits[0].double().log_softmax(-1)[len(ctx) - 1 :]
    cont_T = torch.tensor(cont)
    return float(logp.gather(1, cont_T[:, None]).sum()), bool((logp.argmax(-1) == cont_T).all())


def requests():
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(0, V, (n,), generator=g).tolist()

    shared = toks(6)
    out = [(shared, toks(k)) for k in (1, 3, 2, 1)]  # one context, four answers
    out += [(toks(n), toks(k)) for n, k in ((1, 1), (9, 2), (4, 5), (9, 1), (2, 2))]
    cont = toks(1)
    out.append((toks(3), cont))
    out.append((out[-1][0], cont + toks(1)))  # a continuation extending another's
    return out


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_scores_equal_one_full_forward_per_request(model, batch_size):
    greedy = generate(KVCacheDecoder(model), [2, 3], GenerationConfig(max_new_tokens=3))[0].tokens
    reqs = requests() + [([2, 3], greedy)]
    got = score_requests(model, reqs, batch_size=batch_size)
    for (ctx, cont), score in zip(reqs, got):
        logprob, greedy = reference(model, ctx, cont)
        assert score.logprob == pytest.approx(logprob, abs=1e-5)
        assert score.greedy == greedy
    assert got[-1].greedy and not all(s.greedy for s in got)


def test_a_context_runs_once_and_long_contexts_lose_tokens_on_the_left(model):
    reqs = requests()
    batches = plan_batches(reqs, 64, 24)
    contexts = [g.context for b in batches for g in b]
    assert len(contexts) == len(set(contexts)) == len({tuple(c) for c, _ in reqs})
    assert [len(c) for c in contexts] == sorted((len(c) for c in contexts), reverse=True)
    ctx, cont = truncate(list(range(30)), [1, 2, 3], 24)
    assert len(ctx) + len(cont) == 25 and ctx[-1] == 29 and cont == [1, 2, 3]
    long = [(list(range(V)) * 3, [4, 5])]
    (score,) = score_requests(model, long, max_length=24)
    assert score.logprob == pytest.approx(reference(model, long[0][0][-23:], [4, 5])[0], abs=1e-5)


def test_without_padding_only_equal_contexts_share_a_batch(model):
    batches = plan_batches(requests(), 64, 24, pad=False)
    for b in batches:
        assert len({len(g.context) for g in b}) == 1
    assert can_pad(model)


@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_batched_generation_equals_one_prompt_at_a_time(model, strategy):
    prompts = [[1, 4, 2, 7, 3], [5], [8, 8, 1]]
    cfg = GenerationConfig(strategy=strategy, max_new_tokens=6, temperature=0.7, top_k=5)
    if strategy == "greedy":
        batched = generate_batch(model, prompts, cfg, eos_id=None)
        single = [generate(KVCacheDecoder(model), p, cfg)[0].tokens for p in prompts]
        assert batched == single
    else:  # each row alone draws from the same distribution: same seed, same text
        a = generate_batch(model, prompts, cfg, None, generator=torch.Generator().manual_seed(3))
        b = generate_batch(model, prompts, cfg, None, generator=torch.Generator().manual_seed(3))
        c = generate_batch(model, prompts, cfg, None, generator=torch.Generator().manual_seed(4))
        assert a == b and a != c and all(len(r) == 6 for r in a)


def test_generation_stops_at_eos_and_when_told(model):
    prompts = [[1, 4, 2, 7, 3], [5]]
    cfg = GenerationConfig(max_new_tokens=8)
    free = generate_batch(model, prompts, cfg, eos_id=None)
    eos = free[0][2]
    cut = generate_batch(model, prompts, cfg, eos_id=eos)
    assert cut[0] == free[0][: free[0].index(eos)]
    stopped = generate_batch(model, prompts, cfg, None, done=lambda row, toks: len(toks) == 2 + row)
    assert [len(r) for r in stopped] == [2, 3] and stopped[1] == free[1][:3]
