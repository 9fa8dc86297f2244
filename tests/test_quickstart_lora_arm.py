"""The LoRA arm of the quickstart's benchmark (issue 78, ``lora_r16``): its overrides make a run the config's checks
accept (rank 16 on every linear over the arms' SFT checkpoint, 10x the policy's learning rate), it is reported against
outcome supervision, and the parameter and optimizer figures the trainer logs with its first update reach its entry
of ``summary.json``."""

from __future__ import annotations

import json

import pytest

from grpo_mega.quickstart.arms import ARMS, arm_settings
from grpo_mega.quickstart.report import arm_key, arm_report, arm_title, flat_figures, print_table


def test_the_lora_arm_is_a_valid_lora_run_of_the_sparse_regime_from_the_arms_checkpoint(tmp_path):
    from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
    from grpo_mega.quickstart.arm_runs import config_steps
    from grpo_mega.quickstart.pipeline import SPARSE

    title, overrides, folder = arm_settings("lora_r16")
    assert folder == "grpo_lora_r16" and "LoRA rank 16" in title and arm_title("lora_r16").endswith("LoRA rank 16")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    settings = [f"model.hf_config={tmp_path / 'model'}", "data.train_file=train.jsonl",
                f"algorithm.response_length={SPARSE.response_length}"]
    # the frozen base is the checkpoint every arm starts from (grpo_arm's model.init_from)
    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml", [*settings, "model.init_from=runs/sft", *overrides],
                      validate)
    outcome = load_config(GRPOConfig, "configs/quickstart_grpo.yaml",
                          [*settings, "model.init_from=runs/sft", *ARMS["outcome"][1]], validate)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.dropout) == (16, 32.0, 0.0)
    assert sorted(cfg.model.lora.target_modules) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert cfg.optim.lr == pytest.approx(10 * outcome.optim.lr)  # the peers' rule, not tuned on the seeds
    # the only differences from the outcome arm: the adapters and their learning rate
    assert cfg.algorithm == outcome.algorithm and cfg.trainer == outcome.trainer
    assert config_steps("quickstart_grpo.yaml") == cfg.trainer.total_steps
    with pytest.raises(ConfigError, match="init_from"):  # LoRA without its base is refused
        load_config(GRPOConfig, "configs/quickstart_grpo.yaml", [*settings, *overrides], validate)


def test_the_benchmark_takes_the_lora_arm_and_sets_it_against_outcome_supervision():
    from bench.pipeline_seeds import ALL_ARMS

    assert "lora_r16" in ALL_ARMS  # --arms / --add-arms
    figures = flat_figures({"outcome": {"accuracy": 0.30, "gain": 0.1, "zero_signal_group_fraction": 0.5},
                            "lora_r16": {"accuracy": 0.28, "gain": 0.08, "zero_signal_group_fraction": 0.6}})
    assert arm_key("lora_r16") == "lora_r16" and figures["lora_r16_minus_os"] == pytest.approx(-0.02)
    assert figures["lora_r16_accuracy"] == 0.28


def test_the_parameter_and_optimizer_figures_reach_the_arms_report_and_its_table(tmp_path, capsys):
    logged = {"model/trainable_parameters": 139264.0, "model/total_parameters": 1028224.0,
              "memory/parameter_bytes": 3.6e6, "memory/gradient_bytes": 557056.0,
              "memory/optimizer_state_bytes": 1114120.0}
    rows = [{"step": 0, "time": 1.0, "eval/accuracy": 0.2},
            {"step": 1, "time": 5.0, "timing_s/step": 4.0, "rollout/zero_signal_group_fraction": 0.5, **logged},
            {"step": 2, "time": 9.0, "timing_s/step": 4.0, "rollout/zero_signal_group_fraction": 0.25,
             "eval/accuracy": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = arm_report(tmp_path / "metrics.jsonl", grpo_seconds=10.0)
    assert (report["trainable_parameters"], report["total_parameters"]) == (139264, 1028224)
    assert (report["optimizer_state_bytes"], report["gradient_bytes"], report["parameter_bytes"]) == (
        1114120, 557056, 3600000)
    print_table({"regime": "sparse", "steps": 2, "seed": 1, "stage_seconds": {}, "wall_seconds": 10.0,
                 "plot": "p.png", "arms": {"lora_r16": report}})
    assert "outcome supervision, LoRA rank 16: 139,264 of 1,028,224 parameters trained, optimizer state 1.06 MiB" \
        in capsys.readouterr().out
    # a run from before the trainer logged them
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k not in logged})
                                                    + "\n" for row in rows))
    assert arm_report(tmp_path / "metrics.jsonl", grpo_seconds=10.0)["trainable_parameters"] is None
