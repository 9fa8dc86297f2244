"""Error injection for PRM labels (prm/perturb.py): which number changes, which solutions get a copy, by hand."""

import random

import pytest

from prm.perturb import MAX_SHIFT, change_last_number, plan_perturbations


def test_the_last_number_of_a_step_changes_and_nothing_else():
    step = " Step 2: 11 - 2 = 9."
    seen = set()
    for seed in range(200):
        changed = change_last_number(step, random.Random(seed))
        assert changed.startswith(" Step 2: 11 - 2 = ") and changed.endswith(".")
        value = int(changed[len(" Step 2: 11 - 2 = "):-1])
        assert value != 9 and 0 <= value <= 9 + MAX_SHIFT
        seen.add(value)
    assert seen == set(range(0, 9)) | set(range(10, 19))  # every allowed value is drawn, none else


def test_zero_never_goes_negative_and_a_step_without_a_number_is_left_alone():
    assert {change_last_number("= 0.", random.Random(s)) for s in range(100)} == {f"= {v}." for v in range(1, 10)}
    assert change_last_number(" The answer is unknown.", random.Random(0)) is None


def test_plan_copies_every_solution_with_a_numbered_step_before_its_last_at_fraction_one():
    solutions = [
        [" Step 1: 4 + 6 = 10.", " Step 2: 10 * 2 = 20.", " The answer is 20."],
        [" The answer is 7."],  # one step: nothing before the last to change
        [" Think.", " The answer is 3."],  # no number before the last step
        [" Think.", " Step 1: 2 + 2 = 4.", " The answer is 4."],
    ]
    plans = plan_perturbations(solutions, 1.0, seed=3)
    assert [p.item for p in plans] == [0, 3]
    assert plans[0].step in (0, 1) and plans[1].step == 1  # " Think." has no number
    for plan in plans:
        original = solutions[plan.item][plan.step]
        assert plan.step_text != original
        assert plan.step_text.rsplit("=", 1)[0] == original.rsplit("=", 1)[0]
    assert plans == plan_perturbations(solutions, 1.0, seed=3)  # the same on every rank
    assert plan_perturbations(solutions, 0.0, seed=3) == []


def test_plan_fraction_is_the_share_of_solutions_copied():
    solutions = [[" Step 1: 1 + 1 = 2.", " The answer is 2."]] * 2000
    share = len(plan_perturbations(solutions, 0.25, seed=0)) / len(solutions)
    assert 0.22 < share < 0.28


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_zero_one_is_refused_naming_the_flag(fraction):
    with pytest.raises(ValueError, match="--perturb-fraction"):
        plan_perturbations([], fraction, seed=0)

