"""bench/seed_curves.py: the arms at equal seconds (a learned PRM's cost counted) and their mean curves."""

from __future__ import annotations

import sys

import pytest

from bench.seed_curves import (accuracy_at_seconds, equal_groups, equal_seconds, gain_curve, mean_curve,
                               plot_seed_curves)


def _arm(curve):
    return {"curve": curve, "accuracy": curve[-1][2]}


def test_an_arm_at_equal_seconds_is_at_its_latest_evaluation_within_the_budget():
    outcome = _arm([[0, 4.0, 0.20], [10, 50.0, 0.22], [20, 100.0, 0.25]])
    fast = _arm([[0, 3.0, 0.20], [10, 40.0, 0.30], [20, 80.0, 0.33], [30, 130.0, 0.40]])
    compared = equal_seconds(fast, outcome)  # budget: the outcome arm's last evaluation, 100 s
    assert compared == {"seconds": 100.0, "accuracy": 0.33, "os_accuracy": 0.25, "minus_os": pytest.approx(0.08)}
    # a learned-PRM arm whose PRM cost more than the whole outcome arm has not trained yet at equal seconds
    costly = _arm([[0, 300.0, 0.20], [10, 340.0, 0.45], [20, 380.0, 0.50]])
    compared = equal_seconds(costly, outcome)
    assert (compared["accuracy"], compared["os_accuracy"]) == (0.20, 0.25)
    assert compared["minus_os"] == pytest.approx(-0.05)
    assert accuracy_at_seconds(outcome["curve"], 49.9) == 0.20
    with pytest.raises(ValueError):
        accuracy_at_seconds([], 1.0)
    # with the PRM's one-off cost (280 s) set aside the same arm has trained: at 100 s it is at its step-20 point
    compared = equal_seconds(costly, outcome, set_aside=280.0)
    assert compared == {"seconds": 100.0, "accuracy": 0.50, "os_accuracy": 0.25, "minus_os": pytest.approx(0.25)}


def test_arms_at_equal_data_are_compared_on_the_groups_they_trained_on():
    """Outcome supervision with dynamic sampling trained on 40 groups in 20 steps, process supervision on 64 in 20:
    at equal data the process arm is at its latest evaluation within 40 groups (step 10, 32 groups)."""
    outcome = {"groups_curve": [[0, 0.0, 0.20], [10, 18.0, 0.24], [20, 40.0, 0.30]]}
    process = {"groups_curve": [[0, 0.0, 0.20], [10, 32.0, 0.28], [20, 64.0, 0.36]]}
    assert equal_groups(process, outcome) == {"groups": 40.0, "accuracy": 0.28, "os_accuracy": 0.30,
                                              "minus_os": pytest.approx(-0.02)}


def test_arms_a_few_tokens_apart_after_the_same_steps_are_compared_at_their_last_evaluations():
    """The tool task's seed 1: after 60 steps the oracle arm had generated 81 tokens more than tool GRPO (1,844,577
    against 1,844,496, ~30,700 a step): at equal tokens both are at step 60, not the oracle arm at step 30; an arm
    a whole step's tokens past the budget is still read at its evaluation within it."""
    outcome = {"tokens_curve": [[0, 0.0, 0.22], [30, 924779.0, 0.39], [60, 1844496.0, 0.50]]}
    oracle = {"tokens_curve": [[0, 0.0, 0.22], [30, 924695.0, 0.343], [60, 1844577.0, 0.453]]}
    compared = equal_groups(oracle, outcome, curve="tokens_curve")
    assert compared == {"tokens": 1844496.0, "accuracy": 0.453, "os_accuracy": 0.50,
                        "minus_os": pytest.approx(-0.047)}
    longer = {"tokens_curve": [[0, 0.0, 0.22], [30, 924695.0, 0.343], [60, 1844496.0 + 40000.0, 0.453]]}
    assert equal_groups(longer, outcome, curve="tokens_curve")["accuracy"] == 0.343


def test_mean_curves_over_seeds_keep_the_steps_every_seed_evaluated(tmp_path):
    curves = [[[0, 2.0, 0.1], [10, 20.0, 0.3], [20, 40.0, 0.5]], [[0, 4.0, 0.3], [10, 30.0, 0.1]]]
    assert mean_curve(curves) == [(0, 3.0, pytest.approx(0.2), 0.1, 0.3), (10, 25.0, pytest.approx(0.2), 0.1, 0.3)]
    assert gain_curve(curves[0]) == [[0, 2.0, 0.0], [10, 20.0, pytest.approx(0.2)], [20, 40.0, pytest.approx(0.4)]]
    runs = [{"arms": {"outcome": {"curve": curve}, "process": {"curve": curve}}} for curve in curves]
    png = plot_seed_curves(runs, {"outcome": "outcome", "process": "learned PRM"}, tmp_path / "seeds.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_seed_is_compared_at_equal_steps_seconds_and_data_with_its_cost_and_behaviour(capsys):
    """bench/pipeline_seeds.py's per-seed comparisons and per-arm figures (issue 47) from two seeds' summaries."""
    from bench.pipeline_seeds import arm_figures, with_comparisons

    def summary(outcome_end, process_end):
        outcome = {"curve": [[0, 2.0, 0.2], [10, 60.0, outcome_end]], "accuracy": outcome_end, "seconds": 60.0,
                   "groups_curve": [[0, 0.0, 0.2], [10, 40.0, outcome_end]], "prm_seconds": 0.0,
                   "prm_scoring_share": None, "trained_groups": 40, "pieces_per_completion_start": 6.0,
                   "pieces_per_completion_end": 6.1}
        process = {"curve": [[0, 122.0, 0.2], [5, 150.0, 0.33], [10, 200.0, process_end]], "accuracy": process_end,
                   "seconds": 200.0, "groups_curve": [[0, 0.0, 0.2], [5, 32.0, 0.33], [10, 80.0, process_end]],
                   "prm_seconds": 120.0, "prm_scoring_share": 0.12, "trained_groups": 80,
                   "pieces_per_completion_start": 6.0, "pieces_per_completion_end": 6.0}
        return {"arms": {"outcome": outcome, "process": process}, "run_dir": "/nonexistent"}

    rows = [with_comparisons(summary(0.30, 0.36)), with_comparisons(summary(0.25, 0.24))]
    assert rows[0]["ps_minus_os_equal_seconds"] == pytest.approx(-0.1)  # at 60 s the PRM arm has not trained
    assert rows[0]["ps_minus_os_equal_seconds_set_aside"] == pytest.approx(0.03)  # 30 s of GRPO: its step 5
    assert rows[0]["ps_minus_os_equal_groups"] == pytest.approx(0.03)  # 32 of 40 groups: its step 5 again
    figures = arm_figures(rows, ["outcome", "process"])
    assert figures["process"]["prm_cost_in_outcome_runs"] == [2.0, 2.0]
    assert figures["process"]["trained_groups"] == [80, 80] and figures["outcome"]["prm_scoring_share"] == [None, None]
    assert "process supervision (learned PRM)" in capsys.readouterr().out


def test_only_the_arms_every_seed_ran_are_compared():
    from bench.pipeline_seeds import common_arms

    seeds = [{"arms": {"outcome": {}, "process": {}, "implicit": {}, "implicit_all_groups": {}}},
             {"arms": {"outcome": {}, "implicit": {}, "process": {}}}]
    assert common_arms(seeds) == ["outcome", "process", "implicit"]


def test_recorded_arms_join_a_seed_only_from_the_same_start(tmp_path):
    """--recorded: a recorded run's arms fill in what a new run of the same seed lacks, only when both start from
    the same SFT checkpoint and accuracy and agree on every arm both ran; a tree arm is also compared at equal
    generated tokens."""
    import json

    from bench.pipeline_seeds import with_comparisons, with_recorded_arms

    def arm(accuracy, tokens):
        return {"accuracy": accuracy, "gain": accuracy - 0.2, "zero_signal_group_fraction": 0.3,
                "curve": [[0, 0.0, 0.2], [10, 50.0, accuracy]], "groups_curve": [[0, 0, 0.2], [10, 100, accuracy]],
                "tokens_curve": [[0, 0, 0.2], [10, tokens, accuracy]]}

    start = {"regime": "sparse", "seed": 1, "policy_sft_step": 400, "sft_accuracy": 0.2, "run_dir": str(tmp_path)}
    new = {**start, "arms": {"outcome": arm(0.26, 2000), "tree_222": arm(0.30, 1200)}}
    recorded = tmp_path / "summary.json"
    recorded.write_text(json.dumps({**start, "arms": {"outcome": arm(0.26, 2000), "process": arm(0.36, 2000)}}))
    joined = with_recorded_arms(new, recorded)
    assert sorted(joined["arms"]) == ["outcome", "process", "tree_222"]
    assert joined["arms"]["process"]["recorded_from"] == str(recorded) and joined["ps_minus_os"] == pytest.approx(0.1)
    row = with_comparisons(joined)
    # at 1,200 generated tokens the tree is at its end and outcome supervision at its start
    assert row["tree_222_minus_os_equal_tokens"] == pytest.approx(0.30 - 0.2)
    recorded.write_text(json.dumps({**start, "sft_accuracy": 0.21, "arms": {}}))
    with pytest.raises(ValueError, match="sft_accuracy=0.21 but this run has 0.2"):
        with_recorded_arms(new, recorded)
    recorded.write_text(json.dumps({**start, "arms": {"outcome": arm(0.25, 2000)}}))
    with pytest.raises(ValueError, match="arm outcome ended at 0.25 but at 0.26 here"):
        with_recorded_arms(new, recorded)
    # an arm the learned PRM scores may end elsewhere (its forward's rounding changed): both kept, this run's used
    new["arms"]["process"] = arm(0.35, 2000)
    recorded.write_text(json.dumps({**start, "arms": {"outcome": arm(0.26, 2000), "process": arm(0.36, 2000)}}))
    joined = with_recorded_arms(new, recorded)
    assert joined["recorded_differences"] == {"process": {"recorded": 0.36, "here": 0.35}}
    assert joined["ps_accuracy"] == 0.35 and "recorded_from" not in joined["arms"]["process"]


def test_every_arm_of_the_tree_verdict_is_drawn_apart():
    """The 5-seed tree verdict plots 15 arms: matplotlib's default 10-colour cycle drew five pairs alike."""
    import json
    from pathlib import Path

    from bench.seed_curves import arm_styles
    from grpo_mega.quickstart.report import arm_title

    result = json.loads((Path(__file__).resolve().parents[1] / "bench/results/pipeline_seeds_sparse_tree.json").read_text())
    labels = [arm_title(arm) for arm in result["arm_figures"]]
    assert len(labels) == 15
    drawn = [(style["color"], style["linestyle"]) for style in arm_styles(labels)]
    assert len(set(drawn)) == len(drawn)
    styles = {label: style["linestyle"] for label, style in zip(labels, arm_styles(labels))}
    assert styles[arm_title("tree_82")] == "--" and styles[arm_title("oracle")] == ":"
    assert styles[arm_title("implicit")] == "-." and styles[arm_title("outcome")] == "-"


def test_a_run_of_fewer_seeds_does_not_replace_the_recorded_result(tmp_path):
    import json

    from bench.pipeline_seeds import keep_a_larger_record

    record = tmp_path / "pipeline_seeds_sparse.json"
    keep_a_larger_record(record, [1])  # nothing recorded yet
    record.write_text(json.dumps({"seeds": [1, 2, 3, 4, 5]}))
    keep_a_larger_record(record, [1, 2, 3, 4, 5])  # every recorded seed: rewritten
    keep_a_larger_record(record, [1, 2, 3, 4, 5, 6])
    with pytest.raises(SystemExit, match=r"drop seeds \[2, 3, 4, 5\]: pass --result"):
        keep_a_larger_record(record, [1])
    record.write_text("{not json")
    with pytest.raises(SystemExit, match="unreadable"):
        keep_a_larger_record(record, [1])


@pytest.mark.parametrize("arms", [["process_completion"], ["rft"], ["tree_222", "process"]])
def test_no_learned_prm_refuses_arms_that_need_it_before_running_anything(monkeypatch, tmp_path, capsys, arms):
    from bench import pipeline_seeds

    monkeypatch.setattr(sys, "argv", ["pipeline_seeds.py", "--regime", "sparse", "--no-learned-prm", "--out",
                                      str(tmp_path), "--result", str(tmp_path / "r.json"), "--arms", *arms])
    with pytest.raises(SystemExit) as stopped:
        pipeline_seeds.main()
    assert stopped.value.code == 2
    assert "--no-learned-prm" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_add_arms_without_result_leaves_the_recorded_result_alone(tmp_path):
    """Left open from issue 79's notes: `--add-arms` without `--result` overwrote bench/results/pipeline_seeds_*.json
    with the run's report; it reports beside the seeds it added arms to."""
    from argparse import Namespace

    from bench.pipeline_seeds import ROOT, default_result

    args = Namespace(result=None, add_arms=["implicit"], out=tmp_path / "runs", regime="sparse")
    assert default_result(args) == tmp_path / "runs" / "pipeline_seeds_sparse.json"
    assert default_result(Namespace(**{**vars(args), "add_arms": []})) == (
        ROOT / "bench" / "results" / "pipeline_seeds_sparse.json")
    assert default_result(Namespace(**{**vars(args), "result": tmp_path / "r.json"})) == tmp_path / "r.json"


def test_a_seed_without_its_baseline_arm_gets_no_comparisons():
    """A tools seed run with ``--add-arms`` alone has no tool GRPO to be set against: it is compared with nothing
    (it raised KeyError 'tool_grpo')."""
    from bench.pipeline_seeds import with_comparisons

    arm = {"accuracy": 0.3, "curve": [[0, 0.0, 0.2], [10, 50.0, 0.3]], "seconds": 50.0}
    row = with_comparisons({"baseline_arm": "tool_grpo", "arms": {"tool_turn_tree": arm, "oracle": arm},
                            "run_dir": "/nonexistent"})
    assert row["arms"] == {"tool_turn_tree": arm, "oracle": arm}
    assert not [key for key in row if "minus_os" in key]
