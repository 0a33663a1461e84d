"""moe-plan: the command prints the plan of a config, and fills a null vocabulary from the
prepared data or the tokenizer config."""

import json

import pytest

from launch.plan import main, resolve_vocab_for_planning
from moe.config.run import load_config


def test_moe_plan_prints_parameters_flops_and_memory(capsys):
    main(["configs/mixtral-8x7b.yaml", "--zero", "1"])
    out = capsys.readouterr().out
    assert "46.70B" in out and "12.88B" in out
    assert "ZeRO 1" in out and "optimizer states" in out and "FLOPs per token" in out


def test_moe_plan_prints_the_size_of_a_checkpoint(capsys):
    """The figure a full checkpoint disk is measured against before the first save."""
    main(["configs/default.yaml", "model.vocab_size=4096", "--zero", "2"])
    # 16,533,760 parameters: fp32 weights (4 bytes) and ZeRO's fp32 copy and Adam moments (12)
    assert "  checkpoint        0.25 GiB on disk" in capsys.readouterr().out
    main(["configs/default.yaml", "model.vocab_size=4096", "--json"])
    report = json.loads(capsys.readouterr().out)
    # Without ZeRO: each of the 2 expert-parallel ranks' Adam state (8 bytes a parameter it
    # holds: half the 12,582,912 routed-expert parameters) and rank 0's again.
    held = 16_533_760 - 12_582_912 // 2
    assert [m["checkpoint_bytes"] for m in report["memory"]] == [
        4 * 16_533_760 + 8 * held * 3,
        16 * 16_533_760,
        16 * 16_533_760,
    ]


def test_moe_plan_json_with_layout_flags(capsys):
    main(["configs/deepseek-moe-16b.yaml", "--world-size", "16", "--ep", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [m["zero_stage"] for m in report["memory"]] == [0, 1, 2]
    assert all(m["expert_parallel_size"] == 16 for m in report["memory"])
    assert report["params"]["total"]["shared_experts"] > 0


def test_moe_plan_rejects_an_impossible_layout(capsys):
    with pytest.raises(SystemExit) as e:
        main(["configs/mixtral-8x7b.yaml", "--world-size", "12", "--ep", "8"])
    assert e.value.code == 2
    assert "expert parallel size 8 must divide the world size (12)" in capsys.readouterr().err


def test_null_vocabulary_comes_from_the_manifest_or_the_tokenizer(tiny_data, tmp_path):
    cfg = load_config("configs/default.yaml", [f"data.dir={tiny_data.dir}"])
    assert resolve_vocab_for_planning(cfg).endswith("manifest.json")
    assert cfg.model.vocab_size == 512
    cfg = load_config("configs/default.yaml", [f"data.dir={tmp_path / 'none'}"])
    assert resolve_vocab_for_planning(cfg) == "data.tokenizer.vocab_size"
    assert cfg.model.vocab_size == 4096


def test_moe_plan_lists_fitting_layouts_best_first(capsys):
    main(
        [
            "configs/mixtral-8x7b.yaml",
            "--gpus",
            "64",
            "--gpu-memory",
            "80",
            "--json",
            "--top",
            "100",
        ]
    )
    r = json.loads(capsys.readouterr().out)
    assert r["fitting"] == len(r["layouts"]) > 0 and r["global_batch"] == 1024
    keys = [
        (round(x["compute_factor"], 4), -x["micro_batch"], x["comm_gib_per_step"], x["zero"])
        for x in r["layouts"]
    ]
    assert keys == sorted(keys)
    for x in r["layouts"]:
        assert 64 % x["ep"] == 0 and 8 % x["ep"] == 0 and x["zero"] in (1, 2)  # bf16: ZeRO 1/2
        assert x["micro_batch"] * x["grad_accum"] * 64 == 1024  # the global batch is kept
        assert x["peak_gib"] <= 0.9 * 80


def test_moe_plan_says_when_nothing_fits(capsys):
    with pytest.raises(SystemExit) as e:
        main(["configs/mixtral-8x7b.yaml", "--gpus", "8", "--gpu-memory", "80"])
    assert e.value.code == 1
    assert "nothing fits: the smallest needs" in capsys.readouterr().out


def test_moe_plan_plans_the_fine_tuning_method(capsys):
    """Mixtral-8x7B on 8 GPUs of 80 GiB: pretraining and full fine-tuning need 16 bytes a
    parameter and nothing fits; LoRA and QLoRA keep a frozen bf16 (or NF4) base with no
    gradient or optimizer state, and fit. The output names the method and its counts."""
    fits = {}
    for method in ("none", "full", "lora", "qlora"):
        argv = ["configs/mixtral-8x7b.yaml", f"finetune.method={method}"]
        argv += ["model.init_from=/tmp/base", "--gpus", "8", "--gpu-memory", "80"]
        try:
            main(argv)
            fits[method] = True
        except SystemExit as e:
            assert e.code == 1
            fits[method] = False
        out = capsys.readouterr().out
        if method in ("lora", "qlora"):
            assert f"finetune.method {method}: 111.67M parameters train (0.239%" in out
            main([*argv, "--json"])
            r = json.loads(capsys.readouterr().out)
            assert r["finetune"]["method"] == method
            assert r["layouts"][0]["peak_gib"] < 0.9 * 80
        else:
            # ZeRO 1 with the gradients folded as produced (CUDA's immediate_grad_update).
            assert "the smallest needs 85.8 GiB per GPU (ep 8, ZeRO 1," in out
    assert fits == {"none": False, "full": False, "lora": True, "qlora": True}


def test_moe_plan_of_a_lora_config_holds_no_state_for_the_frozen_base(capsys):
    main(["configs/default.yaml", "model.vocab_size=4096", "--zero", "2", "--json"])
    (base,) = json.loads(capsys.readouterr().out)["memory"]
    lora = ["configs/finetune-lora.yaml", "model.init_from=/tmp/base", "model.vocab_size=4096"]
    main([*lora, "--zero", "2", "--json"])
    r = json.loads(capsys.readouterr().out)
    (planned,) = r["memory"]
    trainable = r["finetune"]["trainable_params"]
    assert 0 < trainable < 0.01 * r["params"]["total_sum"]
    assert planned["weights_bytes"] > base["weights_bytes"]  # the factors on top of the base
    assert planned["optimizer_bytes"] < 0.02 * base["optimizer_bytes"]
    assert planned["grads_bytes"] < 0.02 * base["grads_bytes"]
    main([*lora, "--zero", "2"])
    assert "finetune.method lora: 159.74K parameters train" in capsys.readouterr().out


def test_more_memory_never_fits_fewer_layouts(capsys):
    counts = []
    for gib in (24, 40, 80):
        main(["configs/moe-125m.yaml", "--gpus", "8", "--gpu-memory", str(gib), "--json"])
        counts.append(json.loads(capsys.readouterr().out)["fitting"])
    assert counts == sorted(counts) and counts[-1] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "-2"], "--world-size must be >= 1, got -2"),
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--ep", "0"], "--ep must be >= 1, got 0"),
        (["--gpus", "0", "--gpu-memory", "80"], "--gpus must be >= 1, got 0"),
        (["--gpus", "8", "--gpu-memory", "nan"], "--gpu-memory must be a finite number of GiB > 0"),
        (["--gpus", "8", "--gpu-memory", "inf"], "--gpu-memory must be a finite number of GiB > 0"),
        (["--gpus", "8", "--gpu-memory", "80", "--top", "0"], "--top must be >= 1, got 0"),
    ],
)
def test_moe_plan_refuses_flags_outside_their_range(argv, message, capsys):
    """A world size of -2 or 0 and an expert-parallel size of 0 once printed a plan, NaN GiB
    printed that nothing fits, and --top 0 said that 72 layouts fit and that nothing fits."""
    with pytest.raises(SystemExit) as e:
        main(["configs/default.yaml", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--gpus", "8", "--gpu-memory", "80", "--world-size", "4"],
            "--world-size: not with --gpus",
        ),
        (["--gpus", "8", "--gpu-memory", "80", "--ep", "2", "--zero", "1"], "--ep, --zero: not"),
        (["--top", "3"], "--top: goes with --gpus and --gpu-memory"),
    ],
)
def test_moe_plan_refuses_flags_the_mode_would_ignore(argv, message, capsys):
    """The layout search tries every expert-parallel size and ZeRO stage, so --world-size,
    --ep and --zero beside --gpus were ignored, as was --top without it."""
    with pytest.raises(SystemExit) as e:
        main(["configs/default.yaml", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_moe_plan_counts_no_bf16_gradients_with_immediate_grad_update(capsys):
    bf16_zero1 = ["train.precision=bf16", "parallel.zero_stage=1", "--zero", "1", "--json"]
    grads = {}
    for immediate in ("false", "true"):
        main(["configs/moe-125m.yaml", f"train.immediate_grad_update={immediate}", *bf16_zero1])
        (memory,) = json.loads(capsys.readouterr().out)["memory"]
        grads[immediate] = memory["grads_bytes"]
    assert grads["false"] > 0 and grads["true"] == 0


def test_moe_plan_counts_what_compiled_blocks_keep(capsys):
    """train.compile: fewer saved activations in the plan of the config and in every layout
    that keeps all activations (recompute none); the recomputing layouts plan as before."""
    saved, layouts = {}, {}
    for compiled in ("false", "true"):
        main(["configs/moe-125m.yaml", f"train.compile={compiled}", "--zero", "2", "--json"])
        (memory,) = json.loads(capsys.readouterr().out)["memory"]
        saved[compiled] = memory["activation_bytes"]
        main(
            [
                "configs/moe-125m.yaml",
                f"train.compile={compiled}",
                *("--gpus", "8", "--gpu-memory", "80", "--top", "500", "--json"),
            ]
        )
        r = json.loads(capsys.readouterr().out)
        layouts[compiled] = {
            (x["ep"], x["zero"], x["recompute"], x["micro_batch"]): x["peak_gib"]
            for x in r["layouts"]
        }
    assert 0.6 * saved["false"] < saved["true"] < 0.9 * saved["false"]
    shared = layouts["false"].keys() & layouts["true"].keys()
    assert any(k[2] == "none" for k in shared) and any(k[2] != "none" for k in shared)
    for k in shared:
        if k[2] == "none":
            assert layouts["true"][k] < layouts["false"][k], k
        else:
            assert layouts["true"][k] == layouts["false"][k], k


def test_moe_plan_plans_the_settings_left_to_the_device_as_that_device_takes_them(capsys):
    """By default a CUDA run (compiled blocks, the chunked loss, the gather permutation,
    gradients folded as produced), named in the output; --device cpu plans the CPU's plain
    settings; a value the config gives is planned whatever the device."""
    bf16_zero1 = ["train.precision=bf16", "parallel.zero_stage=1", "--zero", "1"]
    plans = {}
    for device in ("cuda", "cpu"):
        main(["configs/moe-125m.yaml", *bf16_zero1, "--json", "--device", device])
        r = json.loads(capsys.readouterr().out)
        assert r["device"] == device
        plans[device] = r["memory"][0]
        plans[device + "_settings"] = r["device_settings"]
    assert plans["cuda_settings"]["train.compile"] is True
    assert plans["cuda_settings"]["model.cross_entropy"] == "chunked"
    assert plans["cpu_settings"]["train.compile"] is False
    assert plans["cuda"]["activation_bytes"] < 0.8 * plans["cpu"]["activation_bytes"]
    assert plans["cuda"]["grads_bytes"] == 0 < plans["cpu"]["grads_bytes"]  # folded at once
    main(["configs/moe-125m.yaml", *bf16_zero1])
    assert "settings left to the device, as on cuda: train.compile true" in capsys.readouterr().out
    given = [
        "train.compile=false",
        "model.cross_entropy=full",
        "model.moe.permute=index_add",
        "train.immediate_grad_update=false",
    ]
    main(["configs/moe-125m.yaml", *given, *bf16_zero1, "--json"])
    r = json.loads(capsys.readouterr().out)
    assert "train.compile" not in r["device_settings"]
    assert r["memory"][0] == plans["cpu"]  # what the CPU plans, now given on CUDA


def test_layouts_at_zero_1_take_the_gradients_folded_as_produced(capsys):
    """configs/moe-125m.yaml trains at ZeRO 2, where train.immediate_grad_update does not apply
    (CUDA resolves it false); a layout at ZeRO 1 takes it on CUDA, as the run would, and holds
    no bf16 gradient buffer. The layout search counted that buffer at ZeRO 1 all the same."""

    def peaks(*overrides):
        main(["configs/moe-125m.yaml", *overrides, "--gpus", "8", "--gpu-memory", "80"])
        main(["configs/moe-125m.yaml", *overrides, "--gpus", "8", "--gpu-memory", "80", "--json"])
        out = capsys.readouterr().out
        rows = json.loads(out[out.index("{") :])["layouts"]
        return {(r["ep"], r["zero"], r["recompute"], r["micro_batch"]): r["peak_gib"] for r in rows}

    folded, kept = peaks(), peaks("train.immediate_grad_update=false")
    assert {k: v for k, v in folded.items() if k[1] == 2} == {
        k: v for k, v in kept.items() if k[1] == 2
    }
    stage_1 = [k for k in folded if k[1] == 1 and k in kept]
    assert stage_1 and all(kept[k] > folded[k] for k in stage_1)
    # On one expert-parallel rank every one of the 281M parameters has a bf16 gradient.
    assert kept[(1, 1, "none", 32)] - folded[(1, 1, "none", 32)] == pytest.approx(
        2 * 281.3e6 / 2**30, rel=0.01
    )
