"""Issue 76's tree-by-turns arm on the tool task (``tool_turn_tree``): a valid config of the tools regime, its live
line shows its turn reward and tokens (every turn arm's live line now shows the turn reward it lists), and, end to end
on a tiny random policy through ``run_tool_seed`` (``bench/pipeline_seeds.py --regime tools --add-arms
tool_turn_tree``), one GRPO step whose tree's generated tokens and sampling seconds are what the arm is charged; a
seed without tool GRPO is compared with nothing instead of failing."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from test_quickstart_tool_prm_arms import _fake_regime, tool_task  # noqa: F401 (the module fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_the_tree_arm_is_a_tools_regime_config_with_its_own_live_line(tmp_path):
    from grpo_mega.config import GRPOConfig, load_config, validate
    from grpo_mega.quickstart.arms import TOOL_SHOWN, TURN_CREDIT_ARMS, tool_arm_settings, tool_shown
    from grpo_mega.quickstart.tool_pipeline import ToolGRPOPlan, tool_grpo_overrides

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    regime = {"model": str(tmp_path / "model"), "train_file": "t.jsonl", "heldout_file": "h.jsonl"}
    _, overrides, folder, start = tool_arm_settings("tool_turn_tree")
    cfg = load_config(GRPOConfig, ROOT / "configs" / "quickstart_grpo.yaml",
                      [*tool_grpo_overrides(ToolGRPOPlan(), regime), "model.init_from=x", *overrides], validate)
    assert (start, folder) == ("tool", "grpo_tool_turn_tree")
    assert cfg.process_reward.source == "tree" and cfg.process_reward.steps == "turns"
    assert cfg.rollout.multi_turn.enable and cfg.tree_rollout.branching == [4, 2]
    assert cfg.algorithm.num_return_sequences_in_group == 8  # the tree's leaves are the batch's G
    for arm in TURN_CREDIT_ARMS:  # the turn arms' live lines: the tool figures and the turn reward
        shown = tool_shown(arm)
        assert shown[:len(TOOL_SHOWN)] == TOOL_SHOWN and ("turn reward", "turn_credit/turn_reward_mean") in shown
    assert ("tokens", "rollout/generated_tokens") in tool_shown("tool_turn_tree")
    assert tool_shown("tool_grpo") == TOOL_SHOWN


@pytest.mark.slow
def test_the_tree_arm_runs_end_to_end_and_is_charged_its_trees_tokens(tool_task, tmp_path):  # noqa: F811
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.quickstart.tool_pipeline import FAST_TOOL_GRPO, run_tool_seed

    policy = tmp_path / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tool_task["model"])).save_pretrained(policy)
    for tokenizer_file in tool_task["model"].glob("*token*"):
        (policy / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    regime = _fake_regime(tool_task, tmp_path, policy)
    plan = replace(FAST_TOOL_GRPO, sft_run=str(regime), grpo_steps=1, response_length=48, eval_prompts=4,
                   eval_every=None, seed=2)
    summary = run_tool_seed(tmp_path / "seed2", plan, ("tool_turn_tree",))
    report = summary["arms"]["tool_turn_tree"]
    assert report["steps"] == 1 and report["prm_seconds"] == 0  # no reward model: nothing charged before GRPO
    metrics = [json.loads(line) for line in
               (tmp_path / "seed2" / "grpo_tool_turn_tree" / "metrics.jsonl").read_text().splitlines()]
    step = next(row for row in metrics if "rollout/tree/nodes" in row)
    # the arm is charged what its tree generated: every node's own policy tokens once (its extra rollouts included)
    assert step["rollout/generated_tokens"] == step["rollout/tree/generated_tokens"] > 0
    assert step["timing_s/tree_sampling"] > 0 and report["tokens_curve"][-1][1] == step["rollout/generated_tokens"]
    assert step["rollout/tree/leaves"] >= 1 and "num_turns/mean" in step

    sys.path.insert(0, str(ROOT))
    from bench.pipeline_seeds import with_comparisons

    row = with_comparisons(summary)  # no tool GRPO in this seed: no comparison, and no KeyError
    assert not any(key.endswith("_equal_seconds") for key in row)
