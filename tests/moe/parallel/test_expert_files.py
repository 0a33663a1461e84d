"""DeepSpeed's per-expert checkpoint files: where they go (one directory down, ``experts/``, out
of reach of zero_to_fp32's ``*_model_states.pt`` glob, with checkpoints written before the move
still found), and the fingerprint check of the experts a resume loaded."""

import pytest
from deepspeed.runtime.engine import DeepSpeedEngine

from moe.parallel.deepspeed_adapter import EXPERT_DIR, install


@pytest.fixture(autouse=True)
def _installed():
    install()  # what the trainer does before it builds an engine


def test_expert_files_go_into_the_experts_directory(tmp_path):
    name = DeepSpeedEngine._get_expert_ckpt_name(str(tmp_path), 1, 3, "step_0000002")
    assert name == str(
        tmp_path / "step_0000002" / EXPERT_DIR / "layer_1_expert_3_mp_rank_00_model_states.pt"
    )


def test_checkpoints_with_expert_files_beside_the_others_still_load(tmp_path):
    tag = tmp_path / "step_0000002"
    tag.mkdir()
    legacy = tag / "layer_0_expert_1_mp_rank_00_model_states.pt"
    legacy.write_bytes(b"x")
    assert DeepSpeedEngine._get_expert_ckpt_name(str(tmp_path), 0, 1, tag.name) == str(legacy)
    # Once the moved file exists it wins.
    (tag / EXPERT_DIR).mkdir()
    moved = tag / EXPERT_DIR / legacy.name
    moved.write_bytes(b"y")
    assert DeepSpeedEngine._get_expert_ckpt_name(str(tmp_path), 0, 1, tag.name) == str(moved)


def _wrapped_model():
    import torch

    from moe.model.moe_layer import MoEConfig
    from moe.model.transformer import ModelConfig, MoETransformer
    from moe.parallel.deepspeed_adapter import wrap_moe_layers

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(
            vocab_size=32,
            d_model=16,
            n_layers=2,
            n_heads=2,
            max_seq_len=16,
            moe=MoEConfig(num_experts=4, expert_hidden=8),
        )
    )
    return wrap_moe_layers(model, ep_size=1, ep_rank=0)


def test_loaded_experts_are_checked_against_the_saved_fingerprints():
    """The check a resume runs after the engine loaded: each expert id must hold the weights
    recorded under it; identical experts are fine when they were saved identical."""
    import torch

    from moe.parallel.deepspeed_adapter import check_loaded_experts, gather_expert_fingerprints

    model = _wrapped_model()
    saved = gather_expert_fingerprints(model)
    assert len(saved) == 4 and all(len(v) == 4 for v in saved.values())
    assert check_loaded_experts(model, saved) == []
    w_in = model.blocks[0].ffn.deepspeed_moe.experts.w_in
    with torch.no_grad():
        w_in[[0, 1]] = w_in[[1, 0]].clone()  # two experts' weights under each other's ids
    problems = check_loaded_experts(model, saved)
    assert problems == [
        "blocks.0.ffn.experts.w_in: expert 0 holds the weights saved as expert 1, "
        "expert 1 holds the weights saved as expert 0"
    ]
    with torch.no_grad():
        w_in[1] = w_in[0]  # identical experts ...
    assert check_loaded_experts(model, None) != []  # ... refused without fingerprints
    assert check_loaded_experts(model, gather_expert_fingerprints(model)) == []  # saved so: fine
