"""The quickstart's GRPO arms: the learned-PRM arms of other ``process_reward.step_reward`` options
(``QuickstartPlan.step_reward_arms``, ``bench/pipeline_seeds.py --step-rewards``) run the process arm's settings with
that option, bear the PRM's cost, and are reported beside it against outcome supervision."""

from __future__ import annotations

import json

import pytest

from grpo_mega.quickstart.arms import ARMS, arm_settings
from grpo_mega.quickstart.report import arm_key, arm_report, arm_title, flat_figures, learned_prm_arm


def test_a_step_reward_arm_is_the_process_arm_with_its_option():
    title, overrides, folder = arm_settings("process_delta")
    assert overrides == (*ARMS["process"][1], "process_reward.step_reward=delta")
    assert folder == "grpo_process_delta" and "step_reward=delta" in title
    assert arm_settings("outcome") == (*ARMS["outcome"], "grpo")
    assert [learned_prm_arm(a) for a in ("outcome", "process", "process_clip", "oracle")] == [False, True, True, False]
    assert (arm_key("process_progress"), arm_key("oracle")) == ("ps_progress", "oracle")
    assert arm_title("process_clip") == "process supervision (learned PRM, clip)"


def test_every_arm_is_set_against_outcome_supervision():
    def report(accuracy):
        return {"accuracy": accuracy, "gain": accuracy - 0.2, "zero_signal_group_fraction": 0.5}

    figures = flat_figures({"outcome": report(0.30), "process": report(0.34), "process_delta": report(0.41),
                            "oracle": report(0.5), "tree_222": report(0.36), "process_completion": report(0.33)})
    assert figures["ps_minus_os"] == pytest.approx(0.04)
    assert figures["ps_delta_minus_os"] == pytest.approx(0.11)
    assert figures["ps_delta_accuracy"] == 0.41 and figures["ps_delta_gain"] == pytest.approx(0.21)
    assert figures["oracle_minus_os"] == pytest.approx(0.2)
    assert figures["tree_222_minus_os"] == pytest.approx(0.06)
    assert figures["ps_completion_minus_os"] == pytest.approx(0.03)
    assert "os_minus_os" not in figures


@pytest.mark.parametrize("arm", ["tree_222", "tree_42", "tree_2222", "tree_82", "tree_222_pooled", "process_completion",
                                 "process_delta_completion", "oracle_completion"])
def test_the_tree_and_completion_baseline_arms_are_valid_runs_of_the_sparse_regime(arm, tmp_path):
    """Issue 57's arms on the quickstart config at the sparse regime's response length pass the config's checks
    (the tree's leaves make the group, its segments leave the last level tokens) and run in folders of their own."""
    from grpo_mega.config import GRPOConfig, load_config, validate
    from grpo_mega.quickstart.arms import arm_settings
    from grpo_mega.quickstart.pipeline import SPARSE

    title, overrides, folder = arm_settings(arm)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    prm = [f"process_reward.prm={tmp_path / 'model'}", "process_reward.layout=classifier"] \
        if arm.startswith("process") else []
    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml",
                      [f"model.hf_config={tmp_path / 'model'}", "data.train_file=train.jsonl",
                       "model.init_from=runs/sft", f"algorithm.response_length={SPARSE.response_length}", *overrides,
                       *prm], validate)
    assert folder == f"grpo_{arm}" and title.startswith("GRPO, ")
    if arm == "tree_222_pooled":
        assert cfg.process_reward.source == "tree" and cfg.algorithm.step_baseline == "pooled_steps"
    elif arm.startswith("tree"):
        assert cfg.process_reward.source == "tree" and cfg.algorithm.step_baseline == "completion"
    else:
        assert cfg.algorithm.step_baseline == "completion"


def test_the_implicit_prm_arm_is_a_valid_run_set_against_outcome_supervision_without_a_prm_cost(tmp_path):
    """``--implicit`` (issue 49): PRIME's settings on the quickstart config are a run the checks accept, its arm is
    compared with outcome supervision, and no learned PRM's labels or training count against it."""
    from grpo_mega.config import GRPOConfig, load_config, validate

    title, overrides, folder = arm_settings("implicit")
    assert folder == "grpo_implicit" and "implicit PRM" in title and not learned_prm_arm("implicit")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml",
                      [f"model.hf_config={tmp_path / 'model'}", "data.train_file=train.jsonl",
                       "model.init_from=runs/sft", *overrides], validate)
    assert cfg.process_reward.source == "implicit" and cfg.algorithm.supervision == "process"
    # PRIME's learning rate: at twice the policy's the quickstart's policy collapsed (arms.py)
    assert cfg.implicit_prm.optim.lr == 1e-6 and cfg.optim.lr == 5e-5
    figures = flat_figures({"outcome": {"accuracy": 0.3, "gain": 0.1, "zero_signal_group_fraction": 0.5},
                            "implicit": {"accuracy": 0.36, "gain": 0.16, "zero_signal_group_fraction": 0.4}})
    assert figures["implicit_minus_os"] == pytest.approx(0.06) and arm_key("implicit") == "implicit"


@pytest.mark.parametrize("arm, setting", [("implicit_all_groups", ("before_dynamic_sampling", True)),
                                           ("implicit_token_steps", ("steps", "tokens"))])
def test_an_implicit_variant_is_the_implicit_arm_with_its_one_setting(tmp_path, arm, setting):
    from grpo_mega.config import GRPOConfig, load_config, validate

    title, overrides, folder = arm_settings(arm)
    assert overrides[:-1] == ARMS["implicit"][1] and folder == f"grpo_{arm}"
    assert arm_title(arm).startswith("process supervision (implicit PRM, ") and arm_key(arm) == arm
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml",
                      [f"model.hf_config={tmp_path / 'model'}", "data.train_file=train.jsonl",
                       "model.init_from=runs/sft", *overrides], validate)
    assert getattr(cfg.implicit_prm, setting[0]) == setting[1]


def test_the_arms_start_from_the_checkpoint_closest_to_the_pass_at_1_ceiling():
    """Checkpoints are measured in step order until one exceeds the ceiling; later ones are never measured (pass@1
    is not monotonic: a dip after the first crossing does not count); of those measured, the closest is chosen."""
    from grpo_mega.quickstart.selection import pick_closest_to_ceiling as pick

    pass_at_1 = {100: 0.05, 200: 0.06, 300: 0.15, 400: 0.35, 500: 0.18, 600: 0.9}
    measured_steps = []

    def measure(step):
        measured_steps.append(step)
        return pass_at_1[step]

    step, measured = pick(list(pass_at_1), measure, 0.20)
    assert step == 300 and measured_steps == [100, 200, 300, 400] and measured == {k: pass_at_1[k] for k in measured_steps}
    assert pick(list(pass_at_1), pass_at_1.get, 0.30)[0] == 400  # 0.35 is closer to 0.30 than 0.15
    assert pick([200, 300, 400], pass_at_1.get, 0.15)[0] == 300  # at the ceiling
    assert pick([400, 600], pass_at_1.get, 0.20) == (400, {400: 0.35})  # none under: the first
    assert pick([100, 200, 300], pass_at_1.get, 1.0)[0] == 300  # none over: the closest, the last
    assert pick([100, 200, 300], {100: 0.125, 200: 0.375, 300: 0.9}.get, 0.25)[0] == 100  # a tie: the one under
    for steps, ceiling in (([], 0.2), ([200, 100], 0.2), ([100], 1.5)):
        with pytest.raises(ValueError):
            pick(steps, pass_at_1.get, ceiling)


def test_an_arm_reports_where_its_seconds_went_and_what_it_trained_on(tmp_path):
    """Issue 47's cost split and behaviour figures, summed / read from the arm's metrics log."""
    rows = [{"step": 0, "time": 1.0, "eval/accuracy": 0.2},
            {"step": 1, "time": 5.0, "timing_s/step": 4.0, "timing_s/prm": 0.5, "timing_s/old_logprob": 0.2,
             "timing_s/ref": 0.1, "timing_s/update": 1.0, "train/groups": 8, "perf/num_response_tokens": 300,
             "rollout/zero_signal_group_fraction": 0.5, "rollout/kept_group_fraction": 1.0,
             "rollout/pieces_per_completion": 6.0, "rollout/text_after_answer_fraction": 0.0},
            {"step": 2, "time": 9.0, "timing_s/step": 4.0, "timing_s/prm": 0.5, "timing_s/update": 1.2,
             "train/groups": 8, "perf/num_response_tokens": 340, "rollout/zero_signal_group_fraction": 0.25,
             "rollout/kept_group_fraction": 1.0, "rollout/pieces_per_completion": 8.5,
             "rollout/text_after_answer_fraction": 0.75, "eval/accuracy": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = arm_report(tmp_path / "metrics.jsonl", grpo_seconds=10.0, seconds_before=30.0)
    assert report["prm_scoring_seconds"] == 1.0 and report["step_seconds"] == 8.0
    assert report["prm_scoring_share"] == 0.125 and report["update_seconds"] == 2.5
    assert report["trained_groups"] == 16 and report["trained_response_tokens"] == 640
    assert (report["pieces_per_completion_start"], report["pieces_per_completion_end"]) == (6.0, 8.5)
    assert report["text_after_answer_fraction_end"] == 0.75 and report["no_answer_fraction_end"] is None
    assert report["seconds"] == 40.0 and report["gain"] == pytest.approx(0.2)
    assert report["groups_curve"] == [[0, 0.0, 0.2], [2, 16.0, 0.4]]
    assert report["implicit_prm_share"] is None and "implicit_f1_end" not in report  # not an implicit-PRM arm


def test_an_implicit_arm_reports_its_prms_share_of_the_step_and_its_f1_after_the_first_update(tmp_path):
    rows = [{"step": 0, "time": 1.0, "eval/accuracy": 0.2, "eval/implicit_prm/tuned_processbench_f1": 0.0,
             "eval/implicit_prm/step_f1": 0.0},
            {"step": 1, "time": 5.0, "timing_s/step": 4.0, "timing_s/implicit_prm": 1.0, "eval/accuracy": 0.3,
             "eval/implicit_prm/tuned_processbench_f1": 0.25, "eval/implicit_prm/step_f1": 0.5},
            {"step": 2, "time": 9.0, "timing_s/step": 4.0, "timing_s/implicit_prm": 2.0, "eval/accuracy": 0.4,
             "eval/implicit_prm/tuned_processbench_f1": 0.375, "eval/implicit_prm/step_f1": 0.625}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = arm_report(tmp_path / "metrics.jsonl", grpo_seconds=10.0)
    assert report["implicit_prm_share"] == 0.375
    assert (report["implicit_f1_first"], report["implicit_f1_end"]) == (0.25, 0.375)  # step 0 (F1 0 by design) skipped
    assert (report["implicit_step_f1_first"], report["implicit_step_f1_end"]) == (0.5, 0.625)


@pytest.mark.parametrize("regime", ["dense", "sparse"])
def test_the_dense_demo_ends_saying_where_a_prm_pays(regime, capsys):
    from grpo_mega.quickstart.report import print_table

    arm = {"start_accuracy": 0.9, "accuracy": 0.96, "gain": 0.06, "zero_signal_group_fraction": 0.8, "seconds": 90.0}
    print_table({"regime": regime, "steps": 60, "seed": 1, "arms": {"outcome": arm}, "stage_seconds": {"sft": 1.0},
                 "wall_seconds": 100.0, "plot": "runs/quickstart/plot.png"})
    lines = capsys.readouterr().out.strip().splitlines()
    last = lines[-1]
    if regime == "dense":  # make demo: the comparison says nothing about a PRM here; the lines say where it does
        assert lines[-2].startswith("where a PRM pays: not here") and "--regime sparse" in lines[-2]
        assert "README" in lines[-2] and last.startswith("process credit without a trained PRM did not pay there")
    else:
        assert last == "plot: runs/quickstart/plot.png"


def test_the_demo_s_sparse_figures_are_the_recorded_verdict():
    """The demo's last line quotes the 5-seed sparse verdict: its figures must be the result file's (a rerun of
    bench/pipeline_seeds.py that changes them must change the line)."""
    import json
    from pathlib import Path

    from grpo_mega.quickstart.report import DENSE_REGIME_NOTE

    result = json.loads((Path(__file__).resolve().parents[1] / "bench/results/pipeline_seeds_sparse.json").read_text())
    points = lambda key: f"{100 * result[key]['mean']:+.1f}"  # noqa: E731
    steps = [points(f"{arm}_minus_os") for arm in ("ps", "ps_delta")]
    set_aside = sorted(result[f"{arm}_minus_os_equal_seconds_set_aside"]["mean"]
                       for arm in ("ps", "ps_clip", "ps_delta"))
    counted = f"{-100 * result['ps_minus_os_equal_seconds']['mean']:.1f}"
    errors = sorted(f"{100 * result[f'{arm}_minus_os']['standard_error']:.1f}" for arm in ("ps", "ps_delta"))
    assert f"over {len(result['seeds'])} seeds" in DENSE_REGIME_NOTE
    assert f"{steps[0]} (score) to {steps[1]} (delta) points per step, SE {errors[0]}-{errors[1]}" in DENSE_REGIME_NOTE
    assert f"trailed by {counted} with" in DENSE_REGIME_NOTE
    assert f"led by {100 * set_aside[0]:+.1f} to {100 * set_aside[-1]:+.1f} with them set aside" in DENSE_REGIME_NOTE
    tree = json.loads((Path(__file__).resolve().parents[1] / "bench/results/pipeline_seeds_sparse_tree.json").read_text())
    tree_points = lambda key: f"{100 * tree[key]['mean']:+.1f}"  # noqa: E731
    assert tree["seeds"] == [1, 2, 3, 4, 5]
    assert (f"(best plan [8, 2]) {tree_points('tree_82_minus_os')} points per step and "
            f"{tree_points('tree_82_minus_os_equal_seconds')} per second") in DENSE_REGIME_NOTE
    assert f"the implicit PRM {points('implicit_minus_os')} per step, RFT {tree_points('rft_minus_os')}" in DENSE_REGIME_NOTE


def test_rft_fine_tunes_on_the_labelled_solutions_that_were_right_for_the_prm_trainings_seconds(tmp_path):
    """The RFT arm's data: the correct solutions of the PRM's labels file, written whole as SFT rows; its steps: the
    PRM training's seconds at the SFT run's pace."""
    import json

    from grpo_mega.quickstart.rft import steps_for_seconds, write_rft_data

    labels = tmp_path / "prm_labels.jsonl"
    rows = [{"prompt": "Q: 1 + 2 A:", "completions": [" Step 1: 1+2=3.", " The answer is 3."], "labels": [1, 1],
             "outcome": 1.0},
            {"prompt": "Q: 1 + 2 A:", "completions": [" Step 1: 1+2=4.", " The answer is 4."], "labels": [0, 0],
             "outcome": 0.0}]
    labels.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "data" / "rft.jsonl"
    assert write_rft_data(labels, out) == 1
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"prompt": "Q: 1 + 2 A:", "solution": " Step 1: 1+2=3. The answer is 3."}]
    labels.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="no correct solution"):
        write_rft_data(labels, out)
    labels.write_text(json.dumps({"prompt": "Q", "completions": ["a"]}) + "\n")
    with pytest.raises(ValueError, match="prm_labels.jsonl:1: no 'outcome' field"):
        write_rft_data(labels, out)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": step, "time": step * 0.5}) + "\n" for step in (0, 100, 200)))
    assert steps_for_seconds(173.0, metrics) == 346 and steps_for_seconds(0.1, metrics) == 1
    assert arm_settings("rft") == (ARMS["rft"][0], (), "grpo_rft") and not learned_prm_arm("rft")
