"""Soft prompt tuning (finetune.method prompt): a vocab-initialised soft prompt computes what
the same hard prompt does (positions and masks of every encoding and back end), the loss is the
sequence's own, the KV cache, the frozen base, the config checks, and a real trainer run."""

import pytest
import torch
import torch.nn.functional as F

from moe.config.run import load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.evaluation.expert_stats import ExpertStatsCollector
from moe.model.generation import FullForwardDecoder, GenerationConfig, KVCacheDecoder, generate
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import parameter_counts, prepare_finetune
from tests.helpers.finetune import finetune_over_frozen_base

N = 5
IDS = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))


def models(init="vocab", **model) -> tuple[MoETransformer, MoETransformer, torch.Tensor]:
    """(base, prompted copy of it, the ids the vocab prompt was drawn from)."""

    def build():
        torch.manual_seed(0)
        return MoETransformer(
            from_dict(
                ModelConfig,
                {
                    "vocab_size": 64,
                    "d_model": 32,
                    "n_layers": 2,
                    "n_heads": 4,
                    "max_seq_len": 24,
                    "moe": {"num_experts": 4, "expert_hidden": 16},
                    **model,
                },
            )
        )

    base, prompted = build(), build()
    cfg = load_config(
        "configs/default.yaml",
        [
            "finetune.method=prompt",
            "model.init_from=x",
            f"finetune.prompt.tokens={N}",
            f"finetune.prompt.init={init}",
        ],
    ).finetune
    torch.manual_seed(3)
    prepare_finetune(prompted, cfg)
    torch.manual_seed(3)
    drawn = torch.randint(0, 64, (N,))  # apply_prompt's draw, repeated
    return base.eval(), prompted.eval(), drawn


@pytest.mark.parametrize(
    "model",
    [
        {"position": "rope"},
        {"position": "learned"},
        {"position": "alibi"},
        {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 24},
        {"position": "sinusoidal", "attention_backend": "reference"},
        {"position": "rope", "attention_backend": "flex"},
    ],
)
def test_a_vocab_prompt_computes_what_the_hard_prompt_does(model):
    base, prompted, drawn = models(**model)
    torch.testing.assert_close(prompted.embed.prompt, base.embed.weight[drawn], rtol=0, atol=0)
    hard = torch.cat((drawn.expand(2, N), IDS), dim=1)
    with torch.no_grad():
        got = prompted(IDS).logits
        want = base(hard).logits[:, N:]
    assert got.shape == (2, 13, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_loss_is_over_the_sequence_only_and_only_the_prompt_trains():
    base, prompted, _ = models(init="random")
    prompted.train()
    out = prompted(IDS[:, :-1], IDS[:, 1:])
    want = F.cross_entropy(out.logits.flatten(0, 1), IDS[:, 1:].flatten())
    torch.testing.assert_close(out.lm_loss, want, rtol=0, atol=1e-6)
    out.loss.backward()
    for name, p in prompted.named_parameters():
        assert (p.grad is not None) == (name == "embed.prompt"), name
    assert prompted.embed.prompt.grad.abs().sum() > 0
    assert parameter_counts(prompted)["trainable_params"] == N * 32
    # The random prompt changes the function; without it the model is the base.
    with torch.no_grad():
        assert not torch.allclose(prompted(IDS).logits, base(IDS).logits, atol=1e-3)


def test_kv_cache_decoding_keeps_the_prompt_in_front():
    _, prompted, _ = models(init="random")
    with torch.no_grad():
        cache = prompted.new_kv_cache()
        prompted(IDS[:, :8], kv_cache=cache)
        step = prompted(IDS[:, 8:9], kv_cache=cache).logits[:, -1]
        full = prompted(IDS[:, :9]).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_generation_counts_the_prompt_in_the_model_length():
    """Learned positions, max_seq_len 24: N prompt positions leave 24 - N for the prompt and
    the new tokens; one more is refused before any forward (it ran out of positions mid-way)."""
    _, prompted, _ = models(position="learned")
    ids = IDS[0, :4].tolist()
    fits = GenerationConfig(max_new_tokens=24 - N - len(ids))
    cached = generate(KVCacheDecoder(prompted), ids, fits)[0].tokens
    assert cached == generate(FullForwardDecoder(prompted), ids, fits)[0].tokens
    assert len(cached) == fits.max_new_tokens
    with pytest.raises(ConfigError, match=f"exceeds the model's {24 - N} tokens"):
        generate(KVCacheDecoder(prompted), ids, GenerationConfig(max_new_tokens=25 - N - 4))


def test_expert_statistics_route_the_prompt_positions_and_rank_the_tokens():
    _, prompted, _ = models()
    with ExpertStatsCollector(prompted) as stats, torch.no_grad():
        stats.observe(IDS)
        prompted(IDS)
    B, S = IDS.shape
    K = prompted.cfg.moe.router.top_k
    assert stats.tokens_L.tolist() == [B * (N + S)] * 2  # the experts' work: prompt included
    assert stats.selected_LE.sum(1).tolist() == [B * (N + S) * K] * 2
    assert stats.pairs_LEV.sum((1, 2)).tolist() == [B * S * K] * 2  # preferences: the tokens
    assert stats.token_freq_V.sum() == B * S


def test_bad_settings_are_refused_by_key():
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/default.yaml",
            [
                "model.init_from=ckpt",
                "finetune.method=prompt",
                "model.document_masking=true",
                "model.position=learned",
                "model.max_seq_len=140",
                "data.seq_len=128",
            ],
        )
    assert e.value.problems == [
        "model.document_masking: finetune.method prompt does not support packed documents (a "
        "soft prompt in front of a row would be seen by its first document only); set it false",
        "finetune.prompt.tokens: 20 prompt positions before data.seq_len 128 exceed "
        "model.max_seq_len (140) of the learned position table; use at most 12 tokens",
    ]
    with pytest.raises(ConfigError, match="finetune.prompt.tokens: must be >= 1, got 0"):
        load_config(
            "configs/default.yaml",
            ["model.init_from=ckpt", "finetune.method=prompt", "finetune.prompt.tokens=0"],
        )


@pytest.mark.multiprocess
def test_prompt_run_trains_and_leaves_the_base_unchanged(tiny_data, tmp_path):
    # One step, its loss measured on the batch it trained on: a small step of AdamW down the
    # gradient lowers that loss (a frozen prompt would leave it as it was, a step up the
    # gradient raise it). Measured: 5.598252 -> 5.596061 (-0.0022); -0.00082 at lr 1e-4, nearly
    # in proportion; the first step overshoots from lr 2e-3 (+0.0071), so the lr stays small.
    added, start, end = finetune_over_frozen_base(
        tiny_data,
        tmp_path,
        {"method": "prompt", "prompt": {"tokens": 8}},
        steps=1,
        lr=3e-4,
        min_lr=0.0,
        weight_decay=0.1,
    )
    assert added == {"embed.prompt"}
    assert end < start - 1e-3, (start, end)
