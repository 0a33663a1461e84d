"""A Hugging Face ``config.json`` turned into our model config: which transformers architectures
we read, how each field maps onto ours (RoPE, per-layer MoE placement, routing), and the refusal
of anything the model cannot express (sliding-window attention, RoPE scaling, biases on the
output projection, quantized weights, ...), naming every field at once. Used by
``moe/weights/hf.py`` before any tensor is read."""

from __future__ import annotations

from moe.core.errors import ConfigError

ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
"""transformers class (config.json ``architectures``) -> model type we read."""
DENSE = ("llama", "mistral", "qwen2")

_IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "output_router_logits",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "chunk_size_feed_forward",
    "problem_type",
    "pretraining_tp",
    "max_window_layers",
    "tokenizer_class",
}


class _Reader:
    """Reads config.json fields once each, collecting every problem."""

    def __init__(self, hf: dict):
        self.hf, self.used, self.problems = hf, set(), []

    def get(self, key: str, default=None):
        self.used.add(key)
        return self.hf.get(key, default)

    def only(self, key: str, allowed: tuple, why: str, default=None):
        value = self.get(key, default)
        if value not in allowed:
            self.problems.append(f"{key}: {value!r}: {why}")
        return value

    def size(self, key: str, required: bool = True, default=None, minimum: int = 1):
        """An integer field (a width, a count) of at least ``minimum``, or None after recording
        a problem: a missing required one too, as transformers would fill in its class default,
        not this model's size."""
        value = self.get(key, default)
        if value is None and not required:
            return None
        if key not in self.hf and required:
            self.problems.append(f"{key}: missing; the model's size cannot be known without it")
        elif isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{key}: {value!r}: must be an integer >= {minimum}")
        else:
            return value
        return None

    def refuse(self, key: str, value, why: str) -> None:
        self.problems.append(f"{key}: {value!r}: {why}")

    def leftovers(self) -> None:
        for key in sorted(set(self.hf) - self.used - _IGNORED):
            self.problems.append(
                f"{key}: {self.hf[key]!r}: not understood by the importer "
                "(moe/weights/hf.py); nothing here says it leaves the model "
                "unchanged"
            )


def _rope(r: _Reader) -> float:
    params, scaling = r.get("rope_parameters") or {}, r.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            r.refuse(key, value, "must be a JSON object")
            return 0.0
    params = {**scaling, **params}
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", r.get("rope_theta", 10000.0))
    if kind != "default":
        r.refuse(
            "rope_parameters.rope_type",
            kind,
            "only plain RoPE (default) is expressible; "
            "scaled RoPE (linear, dynamic, yarn, llama3, ...) is not",
        )
    partial = params.pop("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        r.refuse("partial_rotary_factor", partial, "rotary embeddings cover every channel")
    for key, value in params.items():
        r.refuse(f"rope_parameters.{key}", value, "not read by plain RoPE")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        r.refuse("rope_parameters.rope_theta", theta, "must be a positive number")
        return 0.0
    return float(theta)


def _layers(r: _Reader, n_layers: int) -> tuple[list[int], dict]:
    """Qwen's MoE layers (not in mlp_only_layers, (i + 1) % decoder_sparse_step == 0) as our
    first_dense_layers / every_n_layers, or a problem."""
    step = r.size("decoder_sparse_step", required=False, default=1) or 1
    only = r.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        r.refuse("mlp_only_layers", only, "must be a list of layer indices")
        only = []
    only = set(only)
    moe_layers = [i for i in range(n_layers) if i not in only and (i + 1) % step == 0]
    if not moe_layers:
        return moe_layers, {}
    first = moe_layers[0]
    for every in range(1, n_layers + 1):
        if moe_layers == list(range(first, n_layers, every)):
            return moe_layers, {"first_dense_layers": first, "every_n_layers": every}
    r.refuse(
        "mlp_only_layers",
        sorted(only),
        f"MoE layers {moe_layers} (with "
        f"decoder_sparse_step {step}) are not 'the first N dense, then every k-th' "
        "(model.moe.first_dense_layers, model.moe.every_n_layers)",
    )
    return moe_layers, {}


def hf_model_config(hf: dict, where: str) -> tuple[str, dict]:
    """(model type, our ``model`` config section as a dict) for a transformers config.json, or
    a ConfigError naming every field the model cannot express."""
    archs = hf.get("architectures") or []
    one = isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)
    arch = ARCHITECTURES.get(archs[0]) if one else None
    if arch is None:
        raise ConfigError(
            [f"architectures: {archs!r}: the importer reads one of {', '.join(ARCHITECTURES)}"],
            where,
        )
    r = _Reader(hf)
    d_model, n_heads = r.size("hidden_size"), r.size("num_attention_heads")
    n_layers = r.size("num_hidden_layers")
    head_dim = r.size("head_dim", required=False)
    if d_model and n_heads and head_dim == d_model // n_heads:
        head_dim = None  # the default width
    model = {
        "vocab_size": r.size("vocab_size"),
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": r.size("num_key_value_heads", required=False),
        "head_dim": head_dim,
        "max_seq_len": r.size("max_position_embeddings", required=False, default=2048),
        "position": "rope",
        "rope_theta": _rope(r),
        "norm": "rmsnorm",
        "norm_placement": "pre",
        "norm_eps": r.get("rms_norm_eps", 1e-6),
        "tie_embeddings": r.get("tie_word_embeddings", False),
        "init_std": r.get("initializer_range", 0.02),
    }
    r.only("hidden_act", ("silu",), "feed-forwards are SwiGLU (gated SiLU) only")
    r.only("attention_dropout", (0, 0.0, None), "the model has no attention dropout")
    if arch in ("qwen2", "qwen2_moe", "qwen3_moe"):
        r.only("use_sliding_window", (False, None), "sliding-window attention is not expressible")
        r.get("sliding_window")  # read only with use_sliding_window
        types = r.get("layer_types")
        if types and set(types) != {"full_attention"}:
            r.refuse(
                "layer_types",
                sorted(set(types)),
                "every layer attends to all earlier tokens (full_attention)",
            )
    else:
        r.only("sliding_window", (None,), "sliding-window attention is not expressible")
    if arch == "qwen2":
        model["qkv_bias"] = True  # Qwen2's q/k/v projections always have a bias
    elif arch == "qwen2_moe":
        model["qkv_bias"] = bool(r.get("qkv_bias", True))
    else:
        r.only(
            "attention_bias",
            (False, None),
            "a bias on the attention projections includes "
            "the output projection's, which the model does not have",
        )
    if arch in DENSE:
        r.only("mlp_bias", (False, None), "feed-forwards have no bias")
        model["ffn"] = "dense"
        model["moe"] = {"dense_hidden": r.size("intermediate_size")}
    else:
        model["moe"] = _moe(r, arch, n_layers or 0)
        if not any(model["moe"].pop("_moe_layers")):
            model["ffn"] = "dense"
    if arch == "qwen3_moe":
        model["qk_norm"] = "head"
    elif arch == "olmoe":
        model["qk_norm"] = "projection"
        r.only("clip_qkv", (None,), "queries, keys and values are never clipped")
    r.leftovers()
    if r.problems:
        raise ConfigError(r.problems, where)
    return arch, model


def _moe(r: _Reader, arch: str, n_layers: int) -> dict:
    top_k = r.size("num_experts_per_tok")
    router = {
        "top_k": top_k,
        "aux_loss_coef": r.get("router_aux_loss_coef", 0.01),
        "score_func": "softmax",
        "order": "softmax_then_topk",
    }
    if arch == "mixtral":
        experts = r.size("num_local_experts")
        moe = {
            "num_experts": experts,
            "expert_hidden": r.size("intermediate_size"),
            "_moe_layers": [1],
        }
        router.update(renormalize=True, jitter_eps=r.get("router_jitter_noise", 0.0) or 0.0)
    else:
        experts = r.size("num_experts" if "num_experts" in r.hf else "num_local_experts")
        r.get("num_local_experts")  # num_experts first, as transformers reads them
        router["renormalize"] = bool(r.get("norm_topk_prob", False))
        if arch == "olmoe":
            moe = {
                "num_experts": experts,
                "expert_hidden": r.size("intermediate_size"),
                "_moe_layers": [1],
            }
        else:
            hidden = r.size("moe_intermediate_size")
            moe_layers, placement = _layers(r, n_layers)
            moe = {
                "num_experts": experts,
                "expert_hidden": hidden,
                **placement,
                "_moe_layers": moe_layers,
            }
            if len(moe_layers) < n_layers:
                moe["dense_hidden"] = r.size("intermediate_size")
            else:
                r.get("intermediate_size")  # the width of dense layers, and there are none
    if arch == "qwen2_moe":
        shared = (
            r.size("shared_expert_intermediate_size", required=False, default=0, minimum=0) or 0
        )
        hidden = moe["expert_hidden"]
        if shared and hidden and shared % hidden:
            r.refuse(
                "shared_expert_intermediate_size",
                shared,
                "the shared expert's width must "
                f"be a multiple of moe_intermediate_size ({hidden}): "
                "model.moe.num_shared_experts * expert_hidden",
            )
        elif shared:
            moe.update(num_shared_experts=shared // hidden, shared_expert_gate=True)
    moe["router"] = router
    return moe


# --- reading safetensors -------------------------------------------------------------------------
