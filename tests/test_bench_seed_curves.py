"""bench/seed_curves.py: the arms at equal seconds (a learned PRM's cost counted) and their mean curves."""

from __future__ import annotations

import pytest

from bench.seed_curves import accuracy_at_seconds, equal_seconds, gain_curve, mean_curve, plot_seed_curves


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


def test_mean_curves_over_seeds_keep_the_steps_every_seed_evaluated(tmp_path):
    curves = [[[0, 2.0, 0.1], [10, 20.0, 0.3], [20, 40.0, 0.5]], [[0, 4.0, 0.3], [10, 30.0, 0.1]]]
    assert mean_curve(curves) == [(0, 3.0, pytest.approx(0.2), 0.1, 0.3), (10, 25.0, pytest.approx(0.2), 0.1, 0.3)]
    assert gain_curve(curves[0]) == [[0, 2.0, 0.0], [10, 20.0, pytest.approx(0.2)], [20, 40.0, pytest.approx(0.4)]]
    runs = [{"arms": {"outcome": {"curve": curve}, "process": {"curve": curve}}} for curve in curves]
    png = plot_seed_curves(runs, {"outcome": "outcome", "process": "learned PRM"}, tmp_path / "seeds.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
