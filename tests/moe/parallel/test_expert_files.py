"""Where DeepSpeed's per-expert checkpoint files go: one directory down (``experts/``), out of
reach of zero_to_fp32's ``*_model_states.pt`` glob, with checkpoints written before the move
(files beside the others) still found."""

from deepspeed.runtime.engine import DeepSpeedEngine

from moe.parallel.deepspeed_adapter import EXPERT_DIR


def test_expert_files_go_into_the_experts_directory(tmp_path):
    name = DeepSpeedEngine._get_expert_ckpt_name(str(tmp_path), 1, 3, "step_0000002")
    assert name == str(tmp_path / "step_0000002" / EXPERT_DIR /
                       "layer_1_expert_3_mp_rank_00_model_states.pt")


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
