"""The tool regime's GRPO arms (``grpo_mega.quickstart.tool_pipeline``) and its sparse start
(``grpo_mega.quickstart.tool_selection``): the arms' overrides are valid runs that differ only where they must, the
selection picks the checkpoint nearest the target the way the text regimes do, and the seed table's floor reads the
figures it should. Single process, no model: under a few seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from grpo_mega.quickstart.arms import ARMS, TOOL_ROLLOUTS, tool_arm_settings
from grpo_mega.quickstart.tool_pipeline import ToolGRPOPlan, tool_flat_figures, tool_grpo_overrides

ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path, arm):
    from grpo_mega.config import GRPOConfig, load_config, validate

    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    regime = {"model": str(tmp_path / "model"), "train_file": "train.jsonl", "heldout_file": "heldout.jsonl"}
    title, overrides, folder, start = tool_arm_settings(arm)
    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml",
                      [*tool_grpo_overrides(ToolGRPOPlan(seed=3), regime), "model.init_from=runs/sft", *overrides],
                      validate)
    return cfg, title, folder, start


def test_text_and_tool_grpo_differ_only_in_the_turn_loop_and_their_start(tmp_path):
    text, text_title, text_folder, text_start = _config(tmp_path, "text_grpo")
    tool, tool_title, tool_folder, tool_start = _config(tmp_path, "tool_grpo")
    assert (text_start, tool_start) == ("text", "tool") and text_folder != tool_folder
    assert not text.rollout.multi_turn.enable
    assert tool.rollout.multi_turn.enable and tool.rollout.multi_turn.tools == ["calculator"]
    assert tool.rollout.multi_turn.format == "hermes"
    for cfg in (text, tool):  # the same prompts, seed, batch, budget and sampled evaluation
        assert cfg.algorithm.response_length == 200 and cfg.data.prompt_length == 48
        assert (cfg.parallel.seed, cfg.data.max_eval_prompts, cfg.trainer.eval_temperature) == (3, 300, 1.0)
        assert (cfg.algorithm.rollout_batch_size, cfg.algorithm.num_return_sequences_in_group) == (32, 8)
        assert cfg.data.eval_file == "heldout.jsonl"


def test_an_arm_of_the_text_regimes_runs_on_the_tool_task_with_the_calculator(tmp_path):
    cfg, title, folder, start = _config(tmp_path, "ppo_mb4")
    assert start == "tool" and cfg.rollout.multi_turn.enable and cfg.algorithm.mini_batch_size == 8
    assert tool_arm_settings("ppo_mb4")[1] == (*TOOL_ROLLOUTS, *ARMS["ppo_mb4"][1]) and title.endswith("calculator")
    with pytest.raises(ValueError, match="unknown arm 'no_such_arm'"):
        tool_arm_settings("no_such_arm")


def _report(accuracy, start, rate_start=None, rate_end=None):
    return {"accuracy": accuracy, "start_accuracy": start, "gain": accuracy - start,
            "zero_signal_group_fraction": 0.4, "tool_call_rate_start": rate_start, "tool_call_rate_end": rate_end}


def test_every_tool_arm_is_set_against_tool_grpo_and_the_floor_reads_tool_minus_text():
    figures = tool_flat_figures({"text_grpo": _report(0.05, 0.02), "tool_grpo": _report(0.40, 0.21, 1.0, 0.9),
                                 "ppo_mb4": _report(0.45, 0.21, 1.0, 0.5)})
    assert figures["tool_minus_text"] == pytest.approx(0.35)
    assert figures["text_minus_os"] == pytest.approx(-0.35) and figures["ppo_mb4_minus_os"] == pytest.approx(0.05)
    assert "tool_minus_os" not in figures
    assert figures["tool_call_rate_over_sft"] == pytest.approx(0.9) and "text_call_rate_over_sft" not in figures
    assert figures["ppo_mb4_call_rate_over_sft"] == pytest.approx(0.5)

    sys.path.insert(0, str(ROOT))
    from bench.pipeline_seeds import tool_floor

    met = tool_floor([{"tool_minus_text": d, "tool_call_rate_over_sft": 0.9} for d in (0.30, 0.34, 0.38)])
    assert met["floor_met"] and met["tool_minus_text"]["mean"] == pytest.approx(0.34)
    collapsed = tool_floor([{"tool_minus_text": d, "tool_call_rate_over_sft": r}
                            for d, r in ((0.30, 0.9), (0.34, 0.7), (0.38, 0.9))])
    assert not collapsed["floor_met"]  # one seed's calls fell under 80 % of the SFT policy's
    noisy = tool_floor([{"tool_minus_text": d, "tool_call_rate_over_sft": 1.0} for d in (0.02, 0.40, -0.05)])
    assert not noisy["floor_met"]


def test_the_sparse_start_is_the_tool_checkpoint_nearest_the_target_and_the_text_one_of_its_step(tmp_path,
                                                                                                   monkeypatch):
    from grpo_mega.quickstart import selection
    from grpo_mega.quickstart.tool_regime import TOOLS
    from grpo_mega.quickstart.tool_selection import SELECTION_FILE, select_sparse_start
    from grpo_mega.run.layout import checkpoint_dir

    for arm in ("tool", "text"):
        for step in range(200, 401, 25):
            (checkpoint_dir(tmp_path / arm, step)).mkdir(parents=True)
            (checkpoint_dir(tmp_path / arm, step) / "complete.json").write_text("{}")
    curve = {200: 0.03, 225: 0.05, 250: 0.12, 275: 0.23, 300: 0.45, 325: 0.6}
    calls = []

    def fake_measure(checkpoint, *, task, prompts_file, prompts, samples, response_length, out, nproc):
        calls.append((checkpoint, task, prompts_file, response_length))
        step = int(checkpoint.name.removeprefix("step_"))
        return curve[step] if checkpoint.parent.parent.name == "tool" else 0.01

    monkeypatch.setattr(selection, "measure_pass_at_1", fake_measure)
    record = select_sparse_start(tmp_path, TOOLS, tool_sft=tmp_path / "tool", text_sft=tmp_path / "text",
                                 task=["parallel.seed=1234"], train_file=Path("train.jsonl"), nproc=2)
    assert record["more_sft_step"] == 275 and record["total_sft_steps"] == 675  # 0.23 is nearer 0.20 than 0.12
    assert list(record["tool_pass_at_1"]) == ["200", "225", "250", "275"]  # measured until one passed 20 %
    assert record["text_checkpoint"] == str(checkpoint_dir(tmp_path / "text", 275))
    assert record["tool_pass_at_1"]["275"]["standard_error"] == pytest.approx((0.23 * 0.77 / 300) ** 0.5)
    tool_calls, text_call = calls[:-1], calls[-1]
    assert all(set(TOOL_ROLLOUTS) <= set(task) for _, task, _, _ in tool_calls)
    assert not set(TOOL_ROLLOUTS) & set(text_call[1])  # the text policy is measured without the tool
    assert {prompts for _, _, prompts, _ in calls} == {Path("train.jsonl")}  # no held-out prompt in the choice
    assert {length for *_, length in calls} == {200}
    assert json.loads((tmp_path / SELECTION_FILE).read_text())["more_sft_step"] == 275


def test_the_more_sft_keeps_the_candidates_and_refuses_steps_it_would_not_save():
    from dataclasses import replace

    from grpo_mega.quickstart.tool_regime import TOOLS, more_sft_saves

    assert more_sft_saves(TOOLS) == ["trainer.save_every=25", "trainer.keep_last=25"]
    with pytest.raises(ValueError, match="selection_steps=\\(210, 400\\)"):
        more_sft_saves(replace(TOOLS, selection_steps=(210, 400)))


def test_a_seed_runs_both_arms_from_their_checkpoints_and_add_arms_keeps_them(tmp_path, monkeypatch):
    """``run_tool_seed`` with the GRPO command replaced by one that writes a metrics log: each arm starts from its SFT
    checkpoint; ``arms=`` (``--add-arms``) runs only those and keeps the seed's other arms; a seed that started
    elsewhere is refused."""
    from grpo_mega.quickstart import tool_pipeline
    from grpo_mega.quickstart.tool_selection import SELECTION_FILE

    sft = tmp_path / "regime"
    sft.mkdir()
    (sft / "summary.json").write_text(json.dumps({"regime": "tools", "model": "m", "train_file": "t.jsonl",
                                                  "heldout_file": "h.jsonl"}))
    start = {"tool_checkpoint": "sft_tool/step_000275", "text_checkpoint": "sft_text/step_000275",
             "total_sft_steps": 675}
    (sft / SELECTION_FILE).write_text(json.dumps(start))
    started_from = {}

    def fake_command(title, command, config, run_dir, steps, shown, overrides, log):
        started_from[run_dir.name] = [o for o in overrides if o.startswith("model.init_from=")]
        tool = "rollout.multi_turn.enable=true" in overrides
        rows = [{"step": 0, "time": 1.0, "eval/accuracy": 0.2 if tool else 0.02},
                {"step": 1, "time": 5.0, "rollout/zero_signal_group_fraction": 0.5,
                 **({"tools/call_rate": 0.9} if tool else {})},
                {"step": 2, "time": 9.0, "eval/accuracy": 0.3 if tool else 0.03,
                 **({"tools/call_rate": 0.8} if tool else {})}]
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return 10.0

    monkeypatch.setattr(tool_pipeline, "training_command", fake_command)
    plan = ToolGRPOPlan(sft_run=str(sft), grpo_steps=2, seed=2)
    summary = tool_pipeline.run_tool_seed(tmp_path / "seed2", plan)
    assert started_from == {"grpo_text": ["model.init_from=sft_text/step_000275"],
                            "grpo_tool": ["model.init_from=sft_tool/step_000275"]}
    assert summary["tool_minus_text"] == pytest.approx(0.27) and summary["policy_sft_step"] == 675
    assert summary["tool_call_rate_over_sft"] == pytest.approx(0.8 / 0.9)
    assert summary["arms"]["tool_grpo"]["tool_call_rate_start"] == 0.9
    assert summary["arms"]["text_grpo"]["tool_call_rate_end"] is None

    summary = tool_pipeline.run_tool_seed(tmp_path / "seed2", plan, ("ppo_mb4",))
    assert list(summary["arms"]) == ["text_grpo", "tool_grpo", "ppo_mb4"] and "ppo_mb4_minus_os" in summary
    (sft / SELECTION_FILE).write_text(json.dumps({**start, "tool_checkpoint": "sft_tool/step_000300"}))
    with pytest.raises(ValueError, match="cannot be compared"):
        tool_pipeline.run_tool_seed(tmp_path / "seed2", plan, ("cispo_mb4",))
