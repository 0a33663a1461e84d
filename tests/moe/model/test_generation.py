"""Decoding strategies against references: enumeration of every continuation on a tiny model,
greedy as the limit of each sampling filter, reproducibility by seed."""

import itertools
import math

import pytest
import torch

from moe.core.errors import ConfigError
from moe.model.generation import (
    FullForwardDecoder,
    GenerationConfig,
    KVCacheDecoder,
    filter_logits,
    generate,
    next_tokens,
)
from moe.model.moe_layer import MoEConfig
from moe.model.transformer import ModelConfig, MoETransformer
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

V = 5
PROMPT = [1, 3]

# Decoders must satisfy the same contract; a KV-cached decoder joins this list.
DECODERS = [FullForwardDecoder, KVCacheDecoder]


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    torch.manual_seed(0)
    m = MoETransformer(
        ModelConfig(
            vocab_size=V,
            d_model=16,
            n_layers=2,
            n_heads=2,
            max_seq_len=16,
            moe=MoEConfig(num_experts=4, expert_hidden=16),
        )
    )
    with torch.no_grad():  # peaked, position-dependent next-token distributions
        m.lm_head.weight.mul_(60)
    return m.eval()


def sequence_logprobs(model, prompt, conts_NT) -> torch.Tensor:
    """Total log-probability of each continuation, from one forward of prompt + continuation."""
    ids = torch.cat([torch.tensor(prompt).expand(len(conts_NT), -1), conts_NT], dim=1)
    with torch.no_grad():
        logp = model(ids[:, :-1]).logits.double().log_softmax(-1)
    P = len(prompt)
    return logp[:, P - 1 :].gather(-1, ids[:, P:, None])[..., 0].sum(-1)


def run(model, eos=None, **kw):
    return generate(FullForwardDecoder(model), PROMPT, GenerationConfig(**kw), eos)


@pytest.mark.parametrize("make_decoder", DECODERS)
def test_decoder_contract_matches_full_forward_logits(model, make_decoder):
    dec = make_decoder(model)
    seq = torch.tensor([[1, 3, 0, 4, 2, 2]])
    with torch.no_grad():
        full_LV = model(seq).logits[0].float()
    logits, state = dec.step(seq[:, :2], None)
    torch.testing.assert_close(logits[0], full_LV[1], rtol=1e-5, atol=1e-5)
    # Expand to 3 rows, feed different tokens per row, then follow row 2's history.
    state = dec.reorder(state, torch.tensor([0, 0, 0]))
    logits, state = dec.step(torch.tensor([[1], [0], [2]]), state)
    torch.testing.assert_close(logits[1], full_LV[2], rtol=1e-5, atol=1e-5)
    state = dec.reorder(state, torch.tensor([1, 2]))
    logits, state = dec.step(torch.tensor([[4], [4]]), state)
    torch.testing.assert_close(logits[0], full_LV[3], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        other = model(torch.tensor([[1, 3, 2, 4]])).logits[0, -1].float()
    torch.testing.assert_close(logits[1], other, rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_at_every_step_and_reports_its_logprob(model):
    (h,) = run(model, strategy="greedy", max_new_tokens=6)
    ids = list(PROMPT)
    for tok in h.tokens:
        with torch.no_grad():
            assert tok == int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
    ref = sequence_logprobs(model, PROMPT, torch.tensor([h.tokens]))
    assert math.isclose(h.logprob, float(ref), rel_tol=1e-5)


def test_every_sampling_limit_is_greedy(model):
    (greedy,) = run(model, strategy="greedy", max_new_tokens=8)
    limits = [dict(top_k=1), dict(top_p=1e-6), dict(temperature=0.0), dict(temperature=1e-6)]
    for kw in limits:
        (h,) = run(model, strategy="sample", max_new_tokens=8, seed=5, **kw)
        assert h.tokens == greedy.tokens, kw
    (beam1,) = run(model, strategy="beam", num_beams=1, max_new_tokens=8)
    assert beam1.tokens == greedy.tokens
    assert math.isclose(beam1.logprob, greedy.logprob, rel_tol=1e-9)


def test_sampling_is_reproducible_by_seed(model):
    kw = dict(strategy="sample", max_new_tokens=10, num_return=4, temperature=1.5)
    a, b, c = run(model, seed=7, **kw), run(model, seed=7, **kw), run(model, seed=8, **kw)
    assert [h.tokens for h in a] == [h.tokens for h in b]
    # 4 x 10 draws from V=5 tokens at temperature 1.5: another seed repeating them all is
    # (far) less likely than 1e-6.
    assert [h.tokens for h in a] != [h.tokens for h in c]
    for h in a:  # reported log-probabilities are the model's (temperature 1)
        ref = sequence_logprobs(model, PROMPT, torch.tensor([h.tokens]))
        assert math.isclose(h.logprob, float(ref), rel_tol=1e-5)


def test_beam_search_exhaustive_width_returns_the_exact_top_sequences(model):
    T = 3
    conts = torch.tensor(list(itertools.product(range(V), repeat=T)))
    ref = sequence_logprobs(model, PROMPT, conts)
    W = V ** (T - 1)  # every prefix survives until the last step: the search is exhaustive
    beams = run(model, strategy="beam", num_beams=W, num_return=W, max_new_tokens=T)
    order = ref.argsort(descending=True)[:W]
    assert [h.tokens for h in beams] == conts[order].tolist()
    torch.testing.assert_close(
        torch.tensor([h.logprob for h in beams], dtype=torch.float64),
        ref[order],
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("width", [2, 3, 4])
def test_beam_search_is_ordered_and_beats_greedy(model, width):
    T = 4
    (greedy,) = run(model, strategy="greedy", max_new_tokens=T)
    beams = run(model, strategy="beam", num_beams=width, num_return=width, max_new_tokens=T)
    scores = [h.logprob for h in beams]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(h.tokens) for h in beams}) == width
    assert beams[0].logprob >= greedy.logprob - 1e-9
    conts = torch.tensor([h.tokens for h in beams])
    torch.testing.assert_close(
        torch.tensor(scores, dtype=torch.float64),
        sequence_logprobs(model, PROMPT, conts),
        rtol=1e-5,
        atol=1e-6,
    )


def test_generation_stops_at_eos(model):
    (free,) = run(model, strategy="greedy", max_new_tokens=6)
    eos = free.tokens[2]
    (h,) = run(model, eos=eos, strategy="greedy", max_new_tokens=6)
    assert h.tokens == free.tokens[: free.tokens.index(eos) + 1]
    for b in run(model, eos=eos, strategy="beam", num_beams=3, num_return=3, max_new_tokens=6):
        assert eos not in b.tokens[:-1]
        assert b.tokens[-1] == eos or len(b.tokens) == 6


def test_filters_keep_the_top_k_and_the_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda f: (f > float("-inf")).nonzero()[:, 1].tolist()
    assert kept(filter_logits(logits, 2, None)) == [1, 3]
    assert kept(filter_logits(logits, None, 0.5)) == [1]
    assert kept(filter_logits(logits, None, 0.79)) == [1, 3]
    assert kept(filter_logits(logits, None, 0.81)) == [1, 2, 3]
    assert kept(filter_logits(logits, None, 1.0)) == [0, 1, 2, 3]
    # Draws only ever come from the kept set.
    g = torch.Generator().manual_seed(0)
    cfg = GenerationConfig(strategy="sample", top_p=0.79)
    draws = {int(next_tokens(logits, cfg, g)) for _ in range(200)}
    assert draws == {1, 3}


def test_invalid_settings_are_listed_together(model):
    with pytest.raises(ConfigError) as e:
        run(model, strategy="sample", max_new_tokens=20, top_p=1.5, temperature=-1)
    msg = str(e.value)
    assert "top_p" in msg and "temperature" in msg and "exceeds the model's 16 tokens" in msg


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="greedy"),
        dict(strategy="beam", num_beams=3),
        dict(strategy="sample", temperature=0.8, top_k=3, seed=5),
    ],
    ids=["greedy", "beam3", "sample"],
)
def test_kv_cache_decoding_equals_full_forward(model, kw):
    cfg = GenerationConfig(max_new_tokens=8, **kw)
    cached = generate(KVCacheDecoder(model), PROMPT, cfg, None)
    full = generate(FullForwardDecoder(model), PROMPT, cfg, None)
    assert [h.tokens for h in cached] == [h.tokens for h in full]
    for a, b in zip(cached, full):
        assert abs(a.logprob - b.logprob) < 1e-4


def test_kv_cache_work_grows_linearly_with_length(model):
    """Tokens fed through the model: prompt + one per new token with the cache, the whole
    prefix every step without it."""
    fed = []
    handle = model.embed.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    try:
        generate(KVCacheDecoder(model), PROMPT, GenerationConfig(max_new_tokens=8), None)
        cached, fed[:] = sum(fed), []
        generate(FullForwardDecoder(model), PROMPT, GenerationConfig(max_new_tokens=8), None)
        full = sum(fed)
    finally:
        handle.remove()
    n = len(PROMPT)
    assert cached == n + 7
    assert full == sum(n + i for i in range(8))
