"""One rule for turns as steps (``prm.turn_steps.model_turns``), the trainer's (``grpo_mega.stages.turn_steps``) and
``grpo-mega prm``'s alike: a step is an assistant turn with a model token, so a completion without one has no step
(the PRM side used to make a turn-less completion one step over its whole response, and to fail on an empty one),
and the trainer's PRM call on turns scores the other completions of the batch and gives that one no reward."""

from __future__ import annotations

import pytest

from grpo_mega.config import ProcessRewardConfig
from grpo_mega.rollout.base import Completion, TurnRecord
from grpo_mega.stages.turn_rewards import PRMTurnRewards
from grpo_mega.stages.turn_steps import turn_step_ends, turn_step_texts
from prm.turn_steps import TurnSteps, step_bounds_of_turns


def completion(length: int, turns: list[TurnRecord] | None) -> Completion:
    ids = list(range(100, 100 + length))
    return Completion(0, [1, 2], ids, [0.0] * length, "", "eos", response_mask=[1] * length, turns=turns)


def decode(ids):
    return " ".join(map(str, ids))


CASES = {  # name: (response length, turns, each step's (first, last) model token)
    "call then answer": (12, [TurnRecord(0, 5, "tool_call", tool_end=9), TurnRecord(9, 12, "answer")],
                         [(0, 4), (9, 11)]),
    "an empty last turn after a tool turn": (9, [TurnRecord(0, 5, "tool_call", tool_end=9),
                                                 TurnRecord(9, 9, "length")], [(0, 4)]),
    "an empty turn between two": (14, [TurnRecord(0, 5, "tool_call", tool_end=9), TurnRecord(9, 9, "tool_call"),
                                       TurnRecord(9, 14, "answer")], [(0, 4), (9, 13)]),
    "only an empty turn": (0, [TurnRecord(0, 0, "void")], []),
    "no turn records": (7, None, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_trainer_and_the_prm_split_a_rollout_into_the_same_steps(name):
    length, turns, bounds = CASES[name]
    c = completion(length, turns)
    assert step_bounds_of_turns(turns, length) == ([a for a, _ in bounds], [b for _, b in bounds])
    assert turn_step_ends(c) == [b for _, b in bounds]
    assert len(turn_step_texts(c, decode)) == len(bounds)
    if bounds:
        assert TurnSteps.of(c).step_ends == turn_step_ends(c)
    else:
        with pytest.raises(ValueError, match="without an assistant turn that has a model token"):
            TurnSteps.of(c)


class TurnTokenScorer:
    """A PRM stand-in that reads turn steps from the policy's tokens: step k scores 0.1 * (k + 1)."""

    def __init__(self):
        self.calls = []

    def score_steps(self, prompts, steps):
        raise AssertionError("a scorer with score_turn_steps is given the tokens")

    def score_turn_steps(self, turn_steps):
        self.calls.append(list(turn_steps))
        return [[0.1 * (k + 1) for k in range(len(s.step_ends))] for s in turn_steps]


def test_a_completion_without_a_model_token_gets_no_prm_step_and_the_batch_is_scored():
    scorer = TurnTokenScorer()
    rewards_of = PRMTurnRewards(scorer, ProcessRewardConfig(source="prm", steps="turns", prm="unused"), decode)
    length, turns, _ = CASES["call then answer"]
    batch = [completion(length, turns), completion(0, [TurnRecord(0, 0, "void")])]
    rewards, ends, metrics = rewards_of(["Q", "Q"], ["", ""], [1.0, 0.0], [{}, {}], completions=batch)
    assert ends == [[4, 11], []]
    assert rewards[0] == pytest.approx([0.1, 0.2]) and rewards[1] == []
    assert metrics["prm/failures"] == 0.0
    assert [len(call) for call in scorer.calls] == [1]  # the empty completion is not sent to the PRM
