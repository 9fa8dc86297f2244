"""Issue 76's learned-PRM turn arm and RFT arm on the tool task (``grpo_mega.quickstart.tool_prm``,
``tool_pipeline``, ``rft``): a verified multi-turn rollout becomes SFT segments whose tool turns carry no loss, the
seed's PRM stage runs once for both arms and charges each its own cost, and, end to end on a tiny random policy,
the stage's real commands (turn labels with the oracle's truth beside them, training, the AUROC report) and both
arms' real runs write their report keys."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_mega.data.tool_task import SEGMENTS_FIELD, check_segments, encode_segments
from prm.turn_steps import TURN_STEPS_FIELD


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory):
    """The tool task's data and tokenizer, and its policy's HF config folder (a few hundred problems)."""
    from grpo_mega.quickstart.tool_regime import ToolRegimePlan, build_tool_data_and_model

    root = tmp_path_factory.mktemp("tool_task")
    model, train, heldout = build_tool_data_and_model(root, ToolRegimePlan(num_train=300, num_heldout=16))
    return {"root": root, "model": model, "train": train, "heldout": heldout}


def _tokenizer(tool_task):
    from grpo_mega.data.tokenizer import load_tokenizer

    return load_tokenizer(tool_task["model"])


def rollout_row(tokenizer, row: dict, outcome: float, *, end_on_tool: bool = False) -> dict:
    """A stored turn-split rollout (``prm label --steps turns``'s row) of a demonstration's segments, encoded as the
    turn loop encodes a trajectory: each model turn a step from its first to its last token (the EOS ends the
    last); ``end_on_tool`` cuts it after its first tool turn (a rollout that stopped on a tool turn)."""
    segments = check_segments(row[SEGMENTS_FIELD], where="row")
    if end_on_tool:
        segments = segments[:2]
    ids, mask = [], []
    for index, segment in enumerate(segments):
        piece, piece_mask = encode_segments(tokenizer, [segment], tokenizer.eos_token_id
                                            if index == len(segments) - 1 and not segment.tool else None)
        ids += piece
        mask += [0] * len(piece) if segment.tool else piece_mask
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    ends = [i for i, m in enumerate(mask) if m and (i == len(mask) - 1 or not mask[i + 1])]
    return {"prompt": row["prompt"], "completions": [s.text for s in segments if not s.tool],
            "labels": [outcome > 0.5] * len(ends), "answer": row["answer"], "outcome": outcome,
            TURN_STEPS_FIELD: {"prompt_ids": tokenizer.encode(row["prompt"]), "response_ids": ids,
                               "step_starts": starts, "step_ends": ends}}


def test_a_verified_rollout_becomes_the_segments_it_was_made_of_with_its_tool_turns_masked(tool_task, tmp_path):
    from grpo_mega.config import SFTConfig, load_config
    from grpo_mega.quickstart.rft import turn_segments, write_rft_data
    from grpo_mega.sft import load_sft_data

    tokenizer = _tokenizer(tool_task)
    rows = [json.loads(line) for line in tool_task["train"].read_text().splitlines()[:3]]
    right, wrong, stopped = (rollout_row(tokenizer, rows[0], 1.0), rollout_row(tokenizer, rows[1], 0.0),
                             rollout_row(tokenizer, rows[2], 1.0, end_on_tool=True))
    assert turn_segments(right[TURN_STEPS_FIELD], tokenizer) == rows[0][SEGMENTS_FIELD]
    assert turn_segments(stopped[TURN_STEPS_FIELD], tokenizer) is None  # it never finished its trajectory
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps(row) + "\n" for row in (right, wrong, stopped)))
    out = tmp_path / "rft.jsonl"
    assert write_rft_data(labels, out, tokenizer) == 1
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == [{"prompt": rows[0]["prompt"], SEGMENTS_FIELD: rows[0][SEGMENTS_FIELD]}]
    with pytest.raises(ValueError, match="labels.jsonl:1: a turn-split rollout"):
        write_rft_data(labels, out)  # no tokenizer to decode its turns with

    cfg = load_config(SFTConfig, "configs/quickstart_sft.yaml", [
        f"model.hf_config={tool_task['model']}", f"data.train_file={out}", f"data.segments_field={SEGMENTS_FIELD}",
        "data.max_length=256"])
    _, responses, masks = load_sft_data(cfg, tokenizer)
    tool_ids = [i for i, m in zip(responses[0], masks[0]) if not m]
    assert tokenizer.decode(tool_ids).replace(" ", "") == "".join(
        s["text"] for s in rows[0][SEGMENTS_FIELD] if s["tool"]).replace(" ", "")
    assert responses[0] == right[TURN_STEPS_FIELD]["response_ids"]  # the same tokens, EOS included


def test_the_rft_budget_is_passes_over_the_verified_rollouts():
    from grpo_mega.quickstart.rft import steps_for_epochs

    assert steps_for_epochs(40, 2.0, 64) == 2 and steps_for_epochs(64, 1.0, 64) == 1
    assert steps_for_epochs(65, 1.0, 64) == 2 and steps_for_epochs(3, 0.5, 64) == 1
    with pytest.raises(ValueError, match="each must be positive"):
        steps_for_epochs(0, 2.0, 64)


def _fake_regime(tool_task, tmp_path, checkpoint: Path) -> Path:
    from grpo_mega.quickstart.tool_selection import SELECTION_FILE

    regime = tmp_path / "regime"
    regime.mkdir()
    (regime / "summary.json").write_text(json.dumps({
        "regime": "tools", "model": str(tool_task["model"]), "train_file": str(tool_task["train"]),
        "heldout_file": str(tool_task["heldout"])}))
    (regime / SELECTION_FILE).write_text(json.dumps({"tool_checkpoint": str(checkpoint),
                                                     "text_checkpoint": str(checkpoint), "total_sft_steps": 8}))
    return regime


def test_the_prm_stage_runs_once_for_both_arms_and_each_arm_is_charged_its_own_cost(tool_task, tmp_path,
                                                                                     monkeypatch):
    """The stage's and the training commands replaced by ones that write what the real ones write: the PRM arm
    scores with the seed's PRM and carries labels + training seconds and the AUROCs; RFT fine-tunes from the policy
    on its verified rollouts, GRPO starts from the fine-tuned weights, and it carries labels + fine-tuning."""
    from grpo_mega.quickstart import tool_pipeline, tool_prm
    from grpo_mega.quickstart.tool_pipeline import ToolGRPOPlan, run_tool_seed

    tokenizer = _tokenizer(tool_task)
    rows = [json.loads(line) for line in tool_task["train"].read_text().splitlines()[:3]]
    regime = _fake_regime(tool_task, tmp_path, tmp_path / "sft_tool" / "step_000008")
    commands, stages = {}, []

    def fake_stage(run_dir, regime_summary, start, *, seed, response_length, prm_plan, announce):
        stages.append(seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "prm").mkdir(exist_ok=True)
        (run_dir / "prm_labels.jsonl").write_text("".join(
            json.dumps(rollout_row(tokenizer, row, outcome)) + "\n" for row, outcome in zip(rows, (1.0, 0.0, 1.0))))
        summary = {"policy": start["tool_checkpoint"], "completer": "the policy", "seed": seed,
                   "labels": str(run_dir / "prm_labels.jsonl"), "prm_checkpoint": str(run_dir / "prm"),
                   "eval": {"trained": {"true_step_auroc": 0.8, "step_auroc": 0.7},
                            "untrained": {"true_step_auroc": 0.9}},
                   "seconds": {"label": 100.0, "train": 40.0, "heldout_label": 50.0, "eval": 20.0}}
        (run_dir / tool_prm.SUMMARY_FILE).write_text(json.dumps(summary))
        return summary

    def fake_command(title, command, config, run_dir, steps, shown, overrides, log):
        commands[run_dir.name] = (command, steps, overrides)
        rows_out = [{"step": 0, "time": 1.0, "eval/accuracy": 0.2},
                    {"step": 1, "time": 5.0, "rollout/zero_signal_group_fraction": 0.5},
                    {"step": 2, "time": 9.0, "eval/accuracy": 0.3}]
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_out))
        return 7.0 if command == ["sft"] else 10.0

    monkeypatch.setattr(tool_pipeline, "run_tool_prm_stage", fake_stage)
    monkeypatch.setattr(tool_pipeline, "training_command", fake_command)
    plan = ToolGRPOPlan(sft_run=str(regime), grpo_steps=2, seed=3)
    summary = run_tool_seed(tmp_path / "seed3", plan, ("tool_turn_prm", "rft"))
    assert stages == [3]
    prm_arm, rft = summary["arms"]["tool_turn_prm"], summary["arms"]["rft"]
    assert f"process_reward.prm={tmp_path / 'seed3' / 'prm'}" in commands["grpo_tool_turn_prm"][2]
    assert "process_reward.steps=turns" in commands["grpo_tool_turn_prm"][2]
    assert prm_arm["prm_seconds"] == 140.0 and prm_arm["seconds"] == 150.0  # labels + training, then GRPO
    assert (prm_arm["prm_true_step_auroc"], prm_arm["prm_step_auroc"]) == (0.8, 0.7)
    assert prm_arm["prm_untrained_true_step_auroc"] == 0.9 and prm_arm["prm_completer"] == "the policy"

    sft, steps, overrides = commands["rft"]
    assert sft == ["sft"] and steps == 1 and rft["rft_solutions"] == 2  # 2 verified rollouts, 2 passes of 64
    assert f"model.init_from={tmp_path / 'sft_tool' / 'step_000008'}" in overrides
    assert f"data.segments_field={SEGMENTS_FIELD}" in overrides and "optim.warmup_steps=0" in overrides
    data = [json.loads(line) for line in (tmp_path / "seed3" / "rft_train.jsonl").read_text().splitlines()]
    assert [row[SEGMENTS_FIELD] for row in data] == [rows[0][SEGMENTS_FIELD], rows[2][SEGMENTS_FIELD]]
    grpo_rft = commands["grpo_rft"][2]
    assert f"model.init_from={tmp_path / 'seed3' / 'rft'}" in grpo_rft and "rollout.multi_turn.enable=true" in grpo_rft
    assert not any(o.startswith("algorithm.supervision") for o in grpo_rft)  # outcome supervision
    assert rft["prm_seconds"] == 107.0 and rft["seconds"] == 117.0  # labels + fine-tuning, then GRPO
    assert summary["tool_prm"]["seconds"]["heldout_label"] == 50.0
    assert summary["stage_seconds"]["prm_label"] == 100.0 and summary["stage_seconds"]["rft"] == 7.0
    assert "ps_tool_turn_prm_accuracy" in summary and "rft_accuracy" in summary

    summary = run_tool_seed(tmp_path / "seed3", plan, ("tool_turn_prm_sum",))  # (the real stage's reuse: below)
    assert summary["arms"]["tool_turn_prm_sum"]["prm_seconds"] == 140.0
    assert list(summary["arms"]) == ["tool_turn_prm", "rft", "tool_turn_prm_sum"]


def test_a_prm_stage_of_another_policy_seed_or_size_is_refused(tool_task, tmp_path):
    from grpo_mega.quickstart.tool_prm import FAST_TOOL_PRM, SUMMARY_FILE, run_tool_prm_stage

    from dataclasses import asdict

    ran = {"policy": "sft_tool/step_000275", "seed": 1, "plan": asdict(FAST_TOOL_PRM), "response_length": 200}
    for changed in ({"policy": "sft_tool/step_000300"}, {"seed": 2}, {"plan": asdict(replace(FAST_TOOL_PRM,
                                                                                           label_prompts=99))}):
        (tmp_path / SUMMARY_FILE).write_text(json.dumps({**ran, **changed}))
        with pytest.raises(ValueError, match=f"{SUMMARY_FILE}: a PRM stage of policy .* move it away"):
            run_tool_prm_stage(tmp_path, {}, {"tool_checkpoint": "sft_tool/step_000275"}, seed=1,
                               response_length=200, prm_plan=FAST_TOOL_PRM, announce=print)


@pytest.mark.slow
def test_both_arms_run_end_to_end_from_a_tiny_policy(tool_task, tmp_path, capsys):
    """The real commands at a tiny size from a random tiny policy: turn labels with the oracle's truth stored
    beside them, the PRM's training and report, GRPO with its turn credit; then RFT (a verified rollout added to
    the stage's labels: a random policy verifies none) and tool GRPO from its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.quickstart.tool_pipeline import FAST_TOOL_GRPO, run_tool_seed

    policy = tmp_path / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tool_task["model"])).save_pretrained(policy)
    for tokenizer_file in tool_task["model"].glob("*token*"):  # an HF folder carries its tokenizer
        (policy / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    regime = _fake_regime(tool_task, tmp_path, policy)
    plan = replace(FAST_TOOL_GRPO, sft_run=str(regime), grpo_steps=1, response_length=48, eval_prompts=4,
                   eval_every=None, seed=2)
    seed_dir = tmp_path / "seed2"
    summary = run_tool_seed(seed_dir, plan, ("tool_turn_prm",))
    stage = summary["tool_prm"]
    assert stage["completer"] == "the policy" and Path(stage["prm_checkpoint"]).is_dir()
    assert stage["train_labels"]["solutions"] == 16 and stage["heldout_labels"]["solutions"] == 8
    assert stage["train_labels"]["truth_good_fraction"] is not None  # the oracle's verdicts beside the labels
    labelled = [json.loads(line) for line in (seed_dir / "prm_labels.jsonl").read_text().splitlines()]
    assert all(len(row["true_labels"]) == len(row["labels"]) for row in labelled)
    assert "true_step_auroc" in stage["eval"]["trained"]  # None here: a random policy's turns are all wrong
    report = summary["arms"]["tool_turn_prm"]
    assert report["prm_seconds"] == pytest.approx(stage["seconds"]["label"] + stage["seconds"]["train"], abs=0.2)
    assert report["steps"] == 1 and "ps_tool_turn_prm_minus_os" not in summary  # no tool GRPO arm in this seed
    metrics_file = seed_dir / "grpo_tool_turn_prm" / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    scored = [row for row in metrics if "prm/score_mean" in row]  # the learned PRM scored the rollouts' turns
    assert scored and scored[0]["timing_s/prm"] > 0 and scored[0]["prm/steps_per_completion"] >= 1

    tokenizer = _tokenizer(tool_task)
    row = json.loads(tool_task["train"].read_text().splitlines()[0])
    with (seed_dir / "prm_labels.jsonl").open("a") as labels:
        labels.write(json.dumps(rollout_row(tokenizer, row, 1.0)) + "\n")
    summary = run_tool_seed(seed_dir, plan, ("rft",))
    rft = summary["arms"]["rft"]
    assert rft["rft_solutions"] == 1 and rft["rft_steps"] == 1 and rft["steps"] == 1
    assert rft["prm_seconds"] == pytest.approx(stage["seconds"]["label"] + rft["rft_seconds"], abs=0.2)
    assert list(summary["arms"]) == ["tool_turn_prm", "rft"]
    assert "the seed's PRM stage is done" in capsys.readouterr().out
