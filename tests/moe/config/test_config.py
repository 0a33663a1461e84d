import pytest
import yaml

from moe.config.run import RunConfig, load_config
from moe.core.errors import ConfigError


def write(tmp_path, data):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_default_config_is_valid():
    from moe.parallel.deepspeed_adapter import deepspeed_config

    cfg = load_config("configs/default.yaml")
    moe = cfg.model.moe
    assert (moe.num_experts, moe.router.top_k, moe.num_shared_experts) == (16, 3, 1)
    assert moe.router.renormalize and cfg.train.expert_lr_scale == 2.0  # the measured recipe
    assert cfg.parallel.expert_parallel_size == 2
    ds = deepspeed_config(cfg, 2)
    assert ds["train_batch_size"] == cfg.train.micro_batch_size * 2


def test_the_default_demo_validates_during_training_on_part_of_the_split():
    """The README sends users to TensorBoard: the demo logs validation points before its end,
    each on a bounded part of the split, and the final evaluation on all of it."""
    cfg = load_config("configs/default.yaml")
    every, steps = cfg.eval.every_n_steps, cfg.train.max_steps
    assert every > 0 and steps // every >= 3 and steps % every == 0
    assert cfg.eval.training_max_tokens is not None and cfg.eval.max_tokens is None


def test_validation_during_training_reads_its_own_token_limit():
    cfg = load_config(
        "configs/default.yaml", ["eval.in_training_max_tokens=null", "eval.max_tokens=500"]
    )
    assert cfg.eval.training_max_tokens == 500  # max_tokens bounds every evaluation
    cfg = load_config("configs/default.yaml", ["eval.in_training_max_tokens=300"])
    assert cfg.eval.training_max_tokens == 300 and cfg.eval.max_tokens is None
    cfg = load_config(
        "configs/default.yaml", ["eval.in_training_max_tokens=300", "eval.max_tokens=200"]
    )
    assert cfg.eval.training_max_tokens == 200
    cfg = load_config("configs/default.yaml", ["eval.in_training_max_tokens=null"])
    assert cfg.eval.training_max_tokens is None  # the whole split
    with pytest.raises(ConfigError, match="eval.in_training_max_tokens: must be >= 1, got 0"):
        load_config("configs/default.yaml", ["eval.in_training_max_tokens=0"])


def test_typo_key_is_named_with_suggestion(tmp_path):
    p = write(tmp_path, {"model": {"moe": {"num_expert": 8}}})
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "model.moe.num_expert: unknown key" in msg
    assert "did you mean 'model.moe.num_experts'" in msg


def test_all_problems_reported_at_once(tmp_path):
    p = write(
        tmp_path,
        {
            "train": {"lr": -1, "max_steps": "ten"},
            "model": {"moe": {"router": {"score_func": "relu"}}},
            "parallel": {"world_size": 2, "expert_parallel_size": 3},
        },
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    for expected in (
        "train.max_steps: expected an integer",
        "model.moe.router.score_func",
        "'relu' is not allowed",
        "parallel.expert_parallel_size: 3 must divide",
    ):
        assert expected in msg, msg
    assert str(p) in msg


def test_cross_section_check(tmp_path):
    p = write(
        tmp_path,
        {
            "model": {"moe": {"num_experts": 6}},
            "parallel": {"world_size": 4, "expert_parallel_size": 4},
        },
    )
    with pytest.raises(
        ConfigError, match=r"expert_parallel_size: 4 must divide model.moe.num_experts \(6\)"
    ):
        load_config(p)


def test_overrides(tmp_path):
    cfg = load_config("configs/default.yaml", ["train.max_steps=7", "model.moe.router.top_k=1"])
    assert cfg.train.max_steps == 7 and cfg.model.moe.router.top_k == 1
    with pytest.raises(ConfigError, match="train.max_step: unknown key"):
        load_config("configs/default.yaml", ["train.max_step=7"])


@pytest.mark.parametrize(
    "override, where",
    [("model.d_model=[1", "character 3"), ("launch.slurm.partition='; touch x #", "character 13")],
)
def test_an_override_that_is_not_yaml_is_named(override, where):
    """A config error naming the override, not the parser's traceback."""
    with pytest.raises(ConfigError) as e:
        load_config("configs/default.yaml", ["train.max_steps=7", override])
    assert f"override {override!r}: the value is not valid YAML" in str(e.value)
    assert where in str(e.value)


def test_round_trip_of_resolved_config(tmp_path):
    from moe.config.run import dump_config

    cfg = load_config("configs/default.yaml")
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize(
    "key, text",
    [
        ("train.lr", "inf"),
        ("train.lr", "nan"),
        ("model.moe.router.aux_loss_coef", "nan"),
        ("train.grad_clip", "-inf"),
    ],
)
def test_nan_and_infinite_numbers_are_refused_for_every_float_setting(key, text, tmp_path):
    """Range checks compare, and every comparison with NaN is false: train.lr=inf and an
    auxiliary-loss weight of NaN once passed and trained on them."""
    with pytest.raises(ConfigError, match=f"{key}: expected a finite number, got '{text}'"):
        load_config("configs/default.yaml", [f"{key}={text}"])
    section, name = key.rsplit(".", 1)
    data: dict = {}
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[name] = float(text)  # from YAML (.nan, .inf) as a float, not a string
    with pytest.raises(ConfigError, match=f"{key}: expected a finite number"):
        load_config(write(tmp_path, data))


def test_a_nested_problem_is_reported_once():
    """The router's own check and the MoE and model sections' checks all see a bad top_k."""
    with pytest.raises(ConfigError) as e:
        load_config("configs/default.yaml", ["model.moe.router.top_k=99"])
    assert e.value.problems == [
        "model.moe.router.top_k: 99 must be between 1 and 8",
        "model.moe.router.top_k: 99 must be at most the number of experts (16)",
    ]
