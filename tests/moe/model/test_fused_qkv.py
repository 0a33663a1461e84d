"""``model.qkv_projection: fused``: the query, key and value projections as one product with
their weights concatenated (moe/model/attention.py). The same function as three products, in
float64 to rounding and in bf16 to its precision; one product instead of three in the forward
and in each gradient; the same three weights (state dict, initialization); projections an
adapter changed are computed separately; compiled blocks take it in one graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moe.model.attention import CausalSelfAttention
from moe.model.moe_layer import MoEConfig
from moe.model.transformer import ModelConfig, MoETransformer

VOCAB, B, S = 96, 2, 24

BASE = ModelConfig(
    vocab_size=VOCAB,
    d_model=48,
    n_layers=2,
    n_heads=4,
    max_seq_len=S,
    moe=MoEConfig(num_experts=4, expert_hidden=32),
)
VARIANTS = {
    "mha": {},
    "gqa": {"n_kv_heads": 2},
    "mqa-bias": {"n_kv_heads": 1, "qkv_bias": True},
    "head-norm-wide-heads": {"qk_norm": "head", "head_dim": 16},
    "projection-norm": {"qk_norm": "projection", "n_kv_heads": 2},
    "dense-alibi": {"ffn": "dense", "position": "alibi"},
}


class _Ops(TorchDispatchMode):
    """Counts the matrix products run, and the widths of their outputs."""

    def __init__(self):
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            self.widths.append(out.shape[-1])
        return out


def _pair(variant: dict, dtype=torch.float64):
    cfg = dataclasses.replace(BASE, **variant)
    models = []
    for mode in ("separate", "fused"):
        torch.manual_seed(0)
        models.append(MoETransformer(dataclasses.replace(cfg, qkv_projection=mode)).to(dtype))
    return models


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_projections_compute_the_same_loss_and_gradients(variant):
    separate, fused = _pair(VARIANTS[variant])
    # The same three weights, initialized alike: checkpoints do not see the setting.
    assert separate.state_dict().keys() == fused.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(separate.parameters(), fused.parameters()))
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(1))
    loss_s, grads_s = _loss_and_grads(separate, ids)
    loss_f, grads_f = _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-12, atol=1e-12)
    assert grads_f.keys() == grads_s.keys()
    for name in grads_s:
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=1e-10, atol=1e-12, msg=name)
    # Some projection gradient is not zero: the comparison covers them.
    assert grads_s["blocks.0.attn.k_proj.weight"].abs().sum() > 0


def test_bf16_losses_and_gradients_agree_to_bf16_precision():
    separate, fused = _pair(VARIANTS["gqa"], torch.bfloat16)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(2))
    loss_s, grads_s = _loss_and_grads(separate, ids)
    loss_f, grads_f = _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss_f.float(), loss_s.float(), rtol=1e-2, atol=0)
    for name in ("blocks.0.attn.q_proj.weight", "blocks.1.attn.v_proj.weight", "embed.weight"):
        a, b = grads_f[name].float(), grads_s[name].float()
        assert (a - b).norm() <= 2e-2 * b.norm(), name


@pytest.mark.parametrize("fused", [False, True])
def test_one_product_for_the_three_projections_and_one_for_each_gradient(fused):
    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 4, 2, fused_qkv=fused).double()
    x = torch.randn(B, S, 48, dtype=torch.float64, requires_grad=True)
    ops = _Ops()
    with ops:
        y = attn._projections(x)
    width = 4 * 12 + 2 * 2 * 12  # query heads, then keys and values (GQA: 2 heads each)
    assert ops.widths == ([width] if fused else [48, 24, 24])
    ops = _Ops()
    with ops:
        torch.autograd.backward(y, [torch.ones_like(t) for t in y])
    # The input's gradient and the weight's: one product each, or one per projection.
    assert len(ops.widths) == (2 if fused else 6)
    assert [t.shape[-1] for t in y] == [48, 24, 24]


@pytest.mark.parametrize("frozen", [False, True], ids=["training", "frozen"])
@pytest.mark.parametrize("qk_norm", ["none", "head", "projection"])
def test_an_attention_layer_keeps_what_three_products_keep(qk_norm, frozen):
    """What one attention layer's forward keeps for its backward, bytes of every saved storage:
    the same with the fused product as with three, also where the query and key norms save
    their inputs (no view keeps the whole product alive), and where the projections are frozen
    (fine-tuning) and keep no input."""
    from moe.model.attention import build_attention_inputs
    from moe.model.positions import RotaryEmbedding
    from moe.model.recompute import saved_activation_bytes

    kept = []
    for fused in (False, True):
        torch.manual_seed(0)
        attn = CausalSelfAttention(48, 4, 2, qk_norm=qk_norm, fused_qkv=fused)
        attn.requires_grad_(not frozen)
        x = torch.randn(B, S, 48, requires_grad=True)
        inputs = build_attention_inputs("sdpa", RotaryEmbedding(12), torch.arange(S)[None], None, B)
        with saved_activation_bytes(exclude=attn) as saved:
            attn(x, inputs).sum()
        kept.append(saved["bytes"])
    assert kept[0] == kept[1] > 0, kept


def test_the_values_do_not_keep_the_whole_product_for_the_backward():
    """The values are saved by the attention core; a copy of their own, not a view of the
    (B, S, 3 x width) product."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 4, 4, fused_qkv=True)
    x = torch.randn(B, S, 48)
    q, k, v = attn._projections(x)
    assert v.is_contiguous() and v.untyped_storage().nbytes() == v.numel() * 4
    assert q.untyped_storage().nbytes() == 3 * q.numel() * 4  # q and k: views, not kept


def test_an_adapted_projection_is_computed_separately():
    """LoRA on the queries and values: those modules are no plain linears any more, so the
    fused setting computes all three separately (the adapter's own products included) and
    gives what the separate setting gives, bit for bit."""
    from moe.model.adapters.lora import LoRAConfig, apply_lora

    outs = []
    for mode in ("separate", "fused"):
        torch.manual_seed(0)
        model = MoETransformer(dataclasses.replace(BASE, qkv_projection=mode))
        apply_lora(model, LoRAConfig(rank=4, targets=["attention.q", "attention.v"]))
        for name, p in model.named_parameters():  # the adapters' B factors start at zero
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(3))
        outs.append(_loss_and_grads(model, ids))
    (loss_s, grads_s), (loss_f, grads_f) = outs
    assert torch.equal(loss_s, loss_f)
    assert all(torch.equal(grads_s[n], grads_f[n]) for n in grads_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_compiled_block_takes_the_fused_projections_in_one_graph(dtype):
    """A block compiled as training compiles it (moe/model/compile.py): no graph break, no
    recompile on a second call, the eager block's output."""
    from moe.model.compile import compile_blocks

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    _, model = _pair(VARIANTS["gqa"], dtype)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(4))
    want = model(ids[:, :-1], ids[:, 1:]).loss.detach()
    compile_blocks(model)
    for _ in range(2):
        got = model(ids[:, :-1], ids[:, 1:])
        got.loss.backward()
    torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # the blocks share one graph
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.loss.detach().float(), want.float(), rtol=tol, atol=tol)


def test_the_fused_product_is_f_linear_of_the_concatenated_weights():
    """What the fused path computes, spelled out: one linear of the three weights (and biases)
    stacked in query, key, value order, split by their widths."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 4, 2, qkv_bias=True, fused_qkv=True).double()
    x = torch.randn(B, S, 48, dtype=torch.float64)
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    want = F.linear(
        x, torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs])
    ).split([48, 24, 24], dim=-1)
    got = attn._projections(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.allclose(a, p(x)) for a, p in zip(got, projs))


def test_frozen_weights_get_no_gradient_and_no_product_for_it():
    """A frozen projection weight (adapter fine-tuning freezes them all) gets no gradient; with
    all three frozen, the backward forms only the input's gradient."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(48, 4, 2, fused_qkv=True).double()
    attn.k_proj.weight.requires_grad_(False)
    x = torch.randn(B, S, 48, dtype=torch.float64, requires_grad=True)
    sum(t.square().sum() for t in attn._projections(x)).backward()
    assert attn.k_proj.weight.grad is None
    assert attn.q_proj.weight.grad is not None and attn.v_proj.weight.grad is not None
    ref = CausalSelfAttention(48, 4, 2).double()
    ref.load_state_dict(attn.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    sum(t.square().sum() for t in ref._projections(x_ref)).backward()
    torch.testing.assert_close(attn.q_proj.weight.grad, ref.q_proj.weight.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p in attn.parameters():
        p.requires_grad_(False)
    ops = _Ops()
    y = attn._projections(x)
    with ops:
        torch.autograd.backward(y, [torch.ones_like(t) for t in y])
    assert len(ops.widths) == 1  # the input's gradient only


def test_a_checkpoint_trained_fused_decodes_with_its_cache_as_the_separate_model():
    """A CUDA run's checkpoint records ``fused`` (its resolved config), so evaluation and
    generation build the fused model: KV-cached decoding gives the separate model's tokens and
    log-probabilities, which equal a full forward's."""
    from moe.model.generation import GenerationConfig, KVCacheDecoder, generate

    separate, fused = (m.eval() for m in _pair(VARIANTS["gqa"]))
    gen = GenerationConfig(max_new_tokens=6)
    want = generate(KVCacheDecoder(separate), [3, 1, 4], gen, None)[0]
    got = generate(KVCacheDecoder(fused), [3, 1, 4], gen, None)[0]
    assert got.tokens == want.tokens
    assert abs(got.logprob - want.logprob) < 1e-9
    ids = torch.tensor([[3, 1, 4, *got.tokens]])
    with torch.no_grad():
        full = fused(ids).logits[0, 2:-1].log_softmax(-1)
    assert abs(full.gather(-1, ids[0, 3:, None]).sum().item() - got.logprob) < 1e-5


def _zero2_worker(rank, world, batches, ckpt_dir):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, build_engine
    from tests.helpers.engine_configs import resumed_losses, tiny_engine_dict

    env = DistEnv(rank, world, rank, world)
    my = [[b[rank::world] for b in step] for step in batches]

    def engine(mode: str):
        d = tiny_engine_dict(
            64,
            16,
            {"num_shared_experts": 1},
            {"micro_batch_size": 2, "grad_accum_steps": 2, "seed": 3, "lr": 1e-2},
            world_size=2,
            expert_parallel_size=2,
            zero_stage=2,
        )
        d["model"].update(qkv_projection=mode, n_kv_heads=2)
        return build_engine(from_dict(RunConfig, d), env)[0]

    def train(eng, steps):
        losses = []
        for step in steps:
            for batch in step:
                loss = eng(batch[:, :-1], batch[:, 1:]).loss
                eng.backward(loss)
                eng.step()
            losses.append(loss.item())
        return {"losses": losses}

    out = {mode: train(engine(mode), my)["losses"] for mode in ("separate", "fused")}
    out["fused_resumes_separate"] = resumed_losses(
        engine("separate"), engine("fused"), my, ckpt_dir, train
    )
    return out


@pytest.mark.multiprocess
def test_two_ranks_at_zero_2_with_expert_parallelism_train_as_three_products(tmp_path):
    """Through DeepSpeed's ZeRO 2 (its gradient hooks copy each gradient into its buckets; the
    fused product's weight gradients are row blocks of one tensor), fp32, 2 ranks, expert
    parallelism 2: the losses of three products, and a checkpoint saved with them resumes
    fused as it would separate (the same weights: the setting is not in checkpoints)."""
    from tests.helpers.engine_configs import two_rank_results

    got = two_rank_results(_zero2_worker, tmp_path, 64, 4, 16, 2, 4)
    torch.testing.assert_close(
        torch.tensor(got["fused"]), torch.tensor(got["separate"]), rtol=1e-5, atol=0
    )
    assert got["separate"][-1] < got["separate"][0]
    torch.testing.assert_close(
        torch.tensor(got["fused_resumes_separate"]),
        torch.tensor(got["separate"][2:]),
        rtol=1e-5,
        atol=0,
    )
