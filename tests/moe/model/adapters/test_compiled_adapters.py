"""Fine-tuning methods under ``train.compile``: a model prepared for each method as training
prepares it (``prepare_finetune``; QLoRA's base quantised; ESFT's expert rows masked by
their gradient hooks), its blocks compiled as training compiles them, gives the eager model's
losses and the same gradients of what trains (fp32: 1e-5) over three steps, with no graph
break and two graphs at most whatever the depth: the first block's input needs no gradient
where the embedding is frozen and the others' do, one recompile, not one per block."""

from __future__ import annotations

import pytest
import torch

from moe.config.run import FinetuneConfig
from moe.core.config_schema import from_dict
from moe.model.compile import compile_blocks
from moe.model.moe_layer import MoEConfig
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import prepare_finetune

CFG = ModelConfig(
    vocab_size=128,
    d_model=64,
    n_layers=4,
    n_heads=4,
    max_seq_len=32,
    moe=MoEConfig(num_experts=4, expert_hidden=32, num_shared_experts=1),
)
METHODS = ("lora", "qlora", "esft", "prompt", "prefix", "adapter")


def _prepared(method: str) -> MoETransformer:
    from moe.model.adapters.esft import mask_expert_rows
    from moe.model.adapters.qlora import quantize_base

    torch.manual_seed(0)
    model = MoETransformer(CFG)
    prepare_finetune(model, from_dict(FinetuneConfig, {"method": method}))
    if method == "qlora":
        quantize_base(model)
    if method == "esft":  # experts 0 and 2 of each layer train, as a selection leaves them
        for layer in model.moe_layers():
            mask_expert_rows(layer.experts, torch.tensor([True, False, True, False]))
    for p in model.parameters():  # zero-initialised factors and gates would hide what flows
        if p.requires_grad and not p.any():  # through the adapters
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    return model


@pytest.mark.parametrize("method", METHODS)
def test_compiled_blocks_train_each_method_as_eager_blocks(method):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _prepared(method), _prepared(method)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    trainable = [n for n, p in eager.named_parameters() if p.requires_grad]
    assert trainable
    for _ in range(3):
        grads = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model(ids[:, :-1], ids[:, 1:]).loss
            loss.backward()
            grads.append(({n: p.grad for n, p in model.named_parameters()}, loss.detach()))
        (want, want_loss), (got, got_loss) = grads
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        for name in trainable:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
        assert all(want[n] is None and got[n] is None for n in want if n not in trainable)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= graphs <= 2, graphs
    if method == "esft":  # the masked rows got no gradient, compiled as eager
        rows = compiled.moe_layers()[0].experts.w_in.grad
        assert not rows[1].any() and not rows[3].any() and rows[0].any()
