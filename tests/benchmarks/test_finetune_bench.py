"""The fine-tuning benchmark's pieces: its instruction data trains the answers only and holds the
same functions out every run; its grouped and looped expert LoRA compute the same."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import finetune_bench as bench
from benchmarks.finetune_expert_path import expert_lora_path
from data_pipeline.prepared import PreparedData
from data_pipeline.tokenizer import Tokenizer


def test_rows_train_the_answers_only(tiny_data):
    tok = Tokenizer(PreparedData(tiny_data.dir).tokenizer_file())
    pairs = [
        (f"m.f{i}", f"What does m.f{i}(x) do?", "Return the number of items.") for i in range(20)
    ]
    inputs, targets = bench.pack(pairs, tok, 16)
    assert inputs.shape == targets.shape and inputs.shape[1] == 16
    trained = targets[targets != bench.IGNORE].tolist()
    text = tok.decode([t for t in trained if t != tok.eos_id])
    assert "number of items" in text and "What" not in text and "does" not in text
    assert tok.eos_id in trained  # the answer's end is trained too
    prompt_ids = set(tok.encode("User: What does m.f1(x) do?")) - set(
        tok.encode("Assistant: Return the number of items.")
    )
    assert prompt_ids and not prompt_ids & set(trained)


def test_the_same_functions_are_held_out_every_run():
    pairs = bench.stdlib_pairs()
    assert pairs == bench.stdlib_pairs() and len(pairs) > 1000
    assert not any(" at 0x" in prompt for _, prompt, _ in pairs)
    share = sum(bench.held_out(name) for name, _, _ in pairs) / len(pairs)
    assert 0.05 < share < 0.15


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_and_looped_expert_lora_agree(dtype):
    args = argparse.Namespace(
        experts=8,
        top_k=2,
        d_model=16,
        expert_hidden=8,
        expert_rank=8,
        rounds=2,
        iters=1,
        device="cpu",
        dtype=dtype,
    )
    out = expert_lora_path(args, 64)  # checks the outputs agree before timing
    assert out["rows"] == 128 and len(out["ratios"]) == 2 and min(out["ratios"]) > 0
