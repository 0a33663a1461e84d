"""Prefix tuning (finetune.method prefix): the attention with prefixes against a hand
computation, the back ends and the KV cache against each other, the frozen base, the config
checks, and a real trainer run with expert parallelism 2."""

import math

import pytest
import torch

from moe.config.run import load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.positions import apply_rotary
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import parameter_counts, prepare_finetune
from tests.helpers.finetune import finetune_over_frozen_base

N = 3
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def prefixed(**model) -> MoETransformer:
    torch.manual_seed(0)
    m = MoETransformer(
        from_dict(
            ModelConfig,
            {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "max_seq_len": 24,
                "moe": {"num_experts": 4, "expert_hidden": 16},
                **model,
            },
        )
    )
    cfg = load_config(
        "configs/default.yaml",
        [
            "finetune.method=prefix",
            "model.init_from=x",
            f"finetune.prefix.tokens={N}",
            "finetune.prefix.init_std=0.5",
        ],
    ).finetune
    prepare_finetune(m, cfg)
    return m.eval()


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_attention_with_prefixes_equals_a_hand_computation(backend):
    model = prefixed(attention_backend=backend)
    attn = model.blocks[0].attn
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    _, inputs = model._attention_inputs(IDS, None, None)
    with torch.no_grad():
        got = attn(x, inputs)
        q = attn._heads(attn.q_proj(x), "q_norm", 4)
        k = attn._heads(attn.k_proj(x), "k_norm", 2)
        v = attn.v_proj(x).view(2, 12, 2, 8).transpose(1, 2)
        q, k = apply_rotary(q, inputs.rotary), apply_rotary(k, inputs.rotary)
        # Prefix keys unrotated in front; kv heads shared by pairs of query heads (GQA).
        k = torch.cat((attn.prefix_k.expand(2, -1, -1, -1), k), 2).repeat_interleave(2, 1)
        v = torch.cat((attn.prefix_v.expand(2, -1, -1, -1), v), 2).repeat_interleave(2, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)  # (B, H, S, N + S)
        allowed = torch.cat(
            (torch.ones(12, N, dtype=torch.bool), torch.ones(12, 12, dtype=torch.bool).tril()), 1
        )
        y = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        want = attn.o_proj(y.transpose(1, 2).reshape(2, 12, 32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "alibi", "t5"])
def test_back_ends_and_the_kv_cache_agree(position):
    extra = {"t5_num_buckets": 8, "t5_max_distance": 24} if position == "t5" else {}
    sdpa = prefixed(position=position, attention_backend="sdpa", **extra)
    ref = prefixed(position=position, attention_backend="reference", **extra)
    with torch.no_grad():
        full = ref(IDS).logits
        torch.testing.assert_close(sdpa(IDS).logits, full, rtol=1e-5, atol=1e-5)
        cache = ref.new_kv_cache()
        ref(IDS[:, :7], kv_cache=cache)
        step = ref(IDS[:, 7:9], kv_cache=cache).logits
    torch.testing.assert_close(step, full[:, 7:9], rtol=1e-5, atol=1e-5)


def test_only_prefixes_train():
    model = prefixed().train()
    model(IDS[:, :-1], IDS[:, 1:]).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".prefix_" in name), name
    assert model.blocks[1].attn.prefix_v.grad.abs().sum() > 0
    assert parameter_counts(model)["trainable_params"] == 2 * 2 * (2 * N * 8)  # layers, k/v


def test_unsupported_back_ends_are_refused_by_key():
    def problems(*overrides):
        with pytest.raises(ConfigError) as e:
            load_config(
                "configs/default.yaml",
                ["model.init_from=ckpt", "finetune.method=prefix", *overrides],
            )
        return e.value.problems

    assert problems("model.attention_backend=flex")[0].startswith(
        "model.attention_backend: flex can run flex attention"
    )
    assert problems("model.position=alibi")[0].startswith(
        "model.attention_backend: auto can run flex attention (with position alibi)"
    )
    assert problems("model.document_masking=true") == [
        "model.document_masking: prefix tuning does not support packed documents "
        "(per-document attention); set it false"
    ]
    load_config(
        "configs/default.yaml",
        [
            "model.init_from=ckpt",
            "finetune.method=prefix",
            "model.position=alibi",
            "model.attention_backend=reference",
        ],
    )


@pytest.mark.multiprocess
def test_prefix_run_trains_and_leaves_the_base_unchanged(tiny_data, tmp_path):
    # One step, its loss measured on the batch it trained on: a small step of AdamW down the
    # gradient lowers that loss (frozen prefixes would leave it as it was, a step up the
    # gradient raise it). Measured: 5.590095 -> 5.587679 (-0.0024); -0.00025 at lr 1e-3 and
    # -0.00077 at 3e-3, in proportion to the step. (Over several steps, each on new samples,
    # the loss on all of them barely moved: prefixes in front of a base barely past its start.)
    added, start, end = finetune_over_frozen_base(
        tiny_data,
        tmp_path,
        {"method": "prefix", "prefix": {"tokens": 4}},
        steps=1,
        lr=1e-2,
        weight_decay=0.1,
    )
    assert added == {f"blocks.{i}.attn.prefix_{kv}" for i in (0, 1) for kv in "kv"}
    assert end < start - 1e-3, (start, end)
