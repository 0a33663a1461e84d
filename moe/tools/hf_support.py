"""What each Hugging Face target architecture can represent of our model config.

:data:`TARGETS` states, for every target and for EVERY field of :class:`ModelConfig` (nested MoE
and router fields by dotted path, e.g. ``moe.router.top_k``), how the exported model holds it:

- ``config``: carried by config.json or the weights, any valid value;
- ``training``: changes how the model is trained, not the function a checkpoint computes (noise
  applied in training only, loss coefficients, initialization), so any value exports: exactly
  the fields ModelConfig declares with ``runtime(...)``; a field declared with ``arch(...)``
  must be held (``config``) or refused (``limited``), which tests/moe/config/test_config_fields.py
  checks for every target;
- ``limited``: only some values (or combinations) exist in the target; ``refuse`` says why the
  others cannot be exported.

The exporter refuses a model when any field's rule refuses it, before anything is written, and
names every offending key. A field missing from a target's statement is
refused by name (:func:`problems`) and fails the tests, so a new config option cannot be
exported by accident.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe.core.config_schema import leaf_fields
from moe.model.transformer import ModelConfig

Refusal = Callable[[ModelConfig, dict], "str | None"]
"""(model config, consolidated state dict) -> why this value cannot be exported, or None."""


@dataclass(frozen=True)
class Rule:
    how: typing.Literal["config", "training", "limited"]
    note: str
    """How the target holds the field (or why it may be ignored)."""
    refuse: Refusal | None = None


def value_of(m: ModelConfig, path: str):
    for name in path.split("."):
        m = getattr(m, name)
    return m


def has_moe(m: ModelConfig) -> bool:
    return any(m.is_moe_layer(i) for i in range(m.n_layers))


def has_dense(m: ModelConfig) -> bool:
    return any(not m.is_moe_layer(i) for i in range(m.n_layers))


def _config(note: str) -> Rule:
    return Rule("config", note)


def _training(note: str) -> Rule:
    return Rule("training", note)


def _only(
    path: str, allowed, why: str, when: Callable[[ModelConfig], bool] = lambda m: True
) -> Rule:
    """The field must take one of ``allowed`` wherever ``when(m)`` says it matters."""

    def refuse(m: ModelConfig, state: dict) -> str | None:
        return why if when(m) and value_of(m, path) not in allowed else None

    return Rule("limited", f"{' or '.join(map(repr, allowed))} only; {why}", refuse)


def _nonzero_selection_bias(m: ModelConfig, state: dict) -> str | None:
    if m.moe.router.bias_update_rate <= 0 or not has_moe(m):
        return None  # the bias is not read, or there is no router
    biases = [v for k, v in state.items() if k.endswith("router.score_bias")]
    largest = max((float(b.abs().max()) for b in biases), default=0.0)
    if largest == 0.0:
        return None  # a zero bias selects exactly what the plain scores select
    return (
        f"the learned per-expert selection bias (router.score_bias, largest |bias| "
        f"{largest:.3g}) changes which experts are chosen and has no equivalent"
    )


def _mixtral_normalized(m: ModelConfig, state: dict) -> str | None:
    r = m.moe.router
    if not has_moe(m) or r.order == "topk_then_softmax" or r.renormalize:
        return None
    return (
        f"with model.moe.router.order {r.order!r} the top-k weights do not sum to 1, and "
        "Mixtral always renormalizes them (set renormalize: true or order "
        "'topk_then_softmax', or use qwen2_moe)"
    )


def _mixtral_dense_layers(m: ModelConfig, state: dict, path: str) -> str | None:
    moe = m.moe
    made_dense = (
        moe.first_dense_layers > 0
        if path == "moe.first_dense_layers"
        else moe.every_n_layers > 1 and m.n_layers - moe.first_dense_layers > 1
    )
    if m.ffn != "moe" or not made_dense:
        return None
    dense = [i for i in range(m.n_layers) if not m.is_moe_layer(i)]
    return f"makes layers {dense} dense; every Mixtral layer is MoE (use qwen2_moe)"


def _mixtral_all_moe(path: str) -> Rule:
    return Rule(
        "limited",
        "every layer must be MoE (first_dense_layers 0, every_n_layers 1)",
        lambda m, state: _mixtral_dense_layers(m, state, path),
    )


_COMMON: dict[str, Rule] = {
    "vocab_size": _config("vocab_size"),
    "d_model": _config("hidden_size"),
    "n_layers": _config("num_hidden_layers"),
    "n_heads": _config("num_attention_heads"),
    "head_dim": _config("head_dim (null: d_model / n_heads)"),
    "qk_norm": _only("qk_norm", ("none",), "the target normalizes neither queries nor keys"),
    "n_kv_heads": _config("num_key_value_heads (multi-head, grouped-query, multi-query)"),
    "max_seq_len": _config("max_position_embeddings (RoPE itself has no length limit)"),
    "position": _only("position", ("rope",), "positions are rotary embeddings (rope) only"),
    "rope_theta": _config("rope_parameters.rope_theta"),
    "t5_num_buckets": _config("read only by position t5, which is refused"),
    "t5_max_distance": _config("read only by position t5, which is refused"),
    "norm": _only("norm", ("rmsnorm",), "every norm is an RMSNorm (gain, no bias)"),
    "norm_placement": _only("norm_placement", ("pre",), "blocks are pre-norm with a final norm"),
    "norm_eps": _config("rms_norm_eps"),
    "tie_embeddings": _config("tie_word_embeddings"),
    "document_masking": _training(
        "training only: a plain forward (no document ids), as "
        "evaluation and generation run it, attends causally"
    ),
    "init_std": _training("initialization only (initializer_range)"),
    "attention_backend": _training(
        "kernel choice only: every back end computes the same "
        "attention (tests/moe/model/test_attention_backends.py)"
    ),
    "cross_entropy": _training(
        "training loss only: every setting computes the same loss "
        "(tests/moe/model/test_loss.py); a forward without targets returns "
        "the logits"
    ),
    "qkv_projection": _training(
        "kernel choice only: the same three projection weights, computed as one product or "
        "three (tests/moe/model/test_fused_qkv.py)"
    ),
    "cross_entropy_chunk_tokens": _training("training loss only (block size of the chunked loss)"),
    "init_from": _training("initialization only"),
    "upcycle_noise_std": _training("initialization only"),
    "moe.num_experts": _config("num_local_experts / num_experts"),
    "moe.expert_hidden": _config("intermediate_size of each expert"),
    "moe.activation": _only(
        "moe.activation", ("swiglu",), "experts and dense feed-forwards are SwiGLU (gated SiLU)"
    ),
    "moe.capacity_factor": _only(
        "moe.capacity_factor", (None,), "experts never drop tokens (dropless, null)", has_moe
    ),
    "moe.dense_hidden": _config("intermediate_size of dense layers"),
    "moe.permute": _training(
        "kernel choice only: both settings move and sum the same copies "
        "(tests/moe/model/test_moe_layer.py, the float64 reference)"
    ),
    "moe.router.top_k": _config("num_experts_per_tok"),
    "moe.router.score_func": _only(
        "moe.router.score_func", ("softmax",), "the router scores experts by softmax", has_moe
    ),
    "moe.router.order": _config(
        "softmax over all experts then top-k equals softmax over the top-k logits once renormalized"
    ),
    "moe.router.scaling_factor": _config("folded into the routed experts' output projections"),
    "moe.router.jitter_eps": _training(
        "training only (the router input is jittered in training mode)"
    ),
    "moe.router.logit_noise_std": _training("training only (noise in training mode)"),
    "moe.router.aux_loss_coef": _training("loss only (router_aux_loss_coef)"),
    "moe.router.aux_loss_type": _training("loss only"),
    "moe.router.z_loss_coef": _training("loss only"),
    "moe.router.aux_loss_scope": _training(
        "loss only: which tokens' counts the balancing loss uses"
    ),
    "moe.router.init_std": _training("initialization only"),
    "moe.router.bias_update_rate": Rule(
        "limited",
        "the selection bias must be zero (never updated, or rate 0)",
        _nonzero_selection_bias,
    ),
}

TARGETS: dict[str, dict[str, Rule]] = {
    "llama": {
        **_COMMON,
        "ffn": _only(
            "ffn",
            ("dense",),
            "every Llama layer is a dense feed-forward (use mixtral or qwen2_moe for MoE layers)",
        ),
        "qkv_bias": _only(
            "qkv_bias",
            (False,),
            "Llama's attention_bias would add one to the "
            "output projection too, which ours does not have",
        ),
        "moe.num_shared_experts": _config(
            "with ffn dense, part of the dense width (intermediate_size)"
        ),
        "moe.every_n_layers": _config("read only where there are MoE layers (ffn dense: none)"),
        "moe.first_dense_layers": _config("read only where there are MoE layers"),
        "moe.router.renormalize": _config("read only where there are MoE layers"),
        "moe.shared_expert_gate": _config("read only where there are MoE layers"),
    },
    "mixtral": {
        **_COMMON,
        "ffn": _only("ffn", ("moe",), "every Mixtral layer is MoE (use qwen2_moe for dense)"),
        "moe.num_shared_experts": _only(
            "moe.num_shared_experts", (0,), "Mixtral has no shared experts (use qwen2_moe)", has_moe
        ),
        "moe.every_n_layers": _mixtral_all_moe("moe.every_n_layers"),
        "moe.first_dense_layers": _mixtral_all_moe("moe.first_dense_layers"),
        "qkv_bias": _only(
            "qkv_bias", (False,), "Mixtral's projections have no bias (use qwen2_moe)"
        ),
        "moe.shared_expert_gate": _only(
            "moe.shared_expert_gate",
            (False,),
            "Mixtral has no shared experts (use qwen2_moe)",
            has_moe,
        ),
        "moe.router.renormalize": Rule(
            "limited",
            "the top-k weights must sum to 1 (renormalize or order topk_then_softmax)",
            _mixtral_normalized,
        ),
    },
    "qwen2_moe": {
        **_COMMON,
        "ffn": _config("dense: every layer in mlp_only_layers"),
        "moe.num_shared_experts": _config(
            "shared_expert_intermediate_size (shared expert gate zero, output projection times 2)"
        ),
        "moe.every_n_layers": _config("mlp_only_layers"),
        "moe.first_dense_layers": _config("mlp_only_layers"),
        "moe.router.renormalize": _config("norm_topk_prob"),
        "qkv_bias": _config("qkv_bias"),
        "moe.shared_expert_gate": _config(
            "shared_expert_gate (without ours: a zero gate, the "
            "shared expert's output projection times 2)"
        ),
    },
}
"""Target architecture -> config field -> how the target holds it. ``--arch auto`` tries them
in this order: a model whose every layer is dense goes to Llama, the plain architecture every
tool reads, not to a Qwen2-MoE whose every layer is in mlp_only_layers."""


def problems(m: ModelConfig, arch: str, state: dict[str, torch.Tensor]) -> list[str]:
    """Every field the target cannot hold, as 'model.KEY: VALUE: why' (empty when it can)."""
    rules = TARGETS[arch]
    out = [
        f"model.{path}: {value_of(m, path)!r}: the {arch} export has no rule for this option "
        "yet (moe/tools/hf_support.py)"
        for path, _ in leaf_fields(ModelConfig)
        if path not in rules
    ]
    for path, rule in rules.items():
        why = rule.refuse(m, state) if rule.refuse else None
        if why:
            out.append(f"model.{path}: {value_of(m, path)!r}: {why}")
    return out
