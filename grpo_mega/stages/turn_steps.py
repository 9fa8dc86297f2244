"""Turns as steps on the trainer's side (``process_reward.steps: turns``): which turns are steps, where each ends,
the text a PRM reads for it and the view of the turns a reward function is given.

The convention is ``grpo-mega prm``'s on turn-split data, its functions called here (``prm/turn_steps.py``): step k
of a multi-turn completion is its k-th assistant turn with at least one policy token (``model_turns``: a completion
without one has no step); it ends at the turn's LAST MODEL TOKEN (response index ``turn.end - 1``), where its score
is read and its credit sits; its text for a PRM is the response after step k-1's end through its own end, decoded,
so the tool turn that answered turn k-1 opens step k and the PRM sees every earlier tool output in its context.
Tool tokens carry no credit (their mask is 0).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from grpo_mega.algo.turn_credit import turn_tensors
from grpo_mega.rollout.base import Completion, TurnRecord
from prm.turn_steps import model_turns, step_bounds_of_turns, step_spans


def step_turns(completion: Completion) -> list[TurnRecord]:
    """The turns of ``completion`` that are steps: those with a policy token (``prm.turn_steps.model_turns``)."""
    return model_turns(completion.turns)


def turn_step_ends(completion: Completion) -> list[int]:
    """The response index of each step's last model token (``prm.turn_steps.step_bounds_of_turns``)."""
    return step_bounds_of_turns(completion.turns, len(completion.response_ids))[1]


def turn_step_texts(completion: Completion, decode: Callable[[list[int]], str]) -> list[str]:
    """Each step's text for a PRM: the response tokens after the previous step's end through this step's end
    (earlier tool turns included; ``prm.turn_steps.step_spans``), decoded."""
    ids = completion.response_ids
    return [decode(ids[start:stop]) for start, stop in step_spans(turn_step_ends(completion))]


def turn_views(completion: Completion, decode: Callable[[list[int]], str]) -> list[dict]:
    """What a reward function with ``process_reward.steps: turns`` is given as ``turns`` (one dict per step):
    ``text`` (the turn's model text), ``start`` / ``end`` (its character span in the completion's text, the decoded
    response), ``ended`` (``TurnRecord.ended``) and ``calls`` (``name``, ``arguments``, ``error``, ``reward`` of
    each call)."""
    ids, views = completion.response_ids, []
    for turn in step_turns(completion):
        views.append({
            "text": decode(ids[turn.start:turn.end]),
            "start": len(decode(ids[:turn.start])),
            "end": len(decode(ids[:turn.end])),
            "ended": turn.ended,
            "calls": [{"name": c.name, "arguments": c.arguments, "error": c.error, "reward": c.reward}
                      for c in turn.calls],
        })
    return views


def batch_turn_tensors(completions: Sequence[Completion]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(turn_spans [B, K, 2], answered [B], stopped_at_max_turns [B])`` of ``grpo_mega.algo.turn_tensors`` over the
    steps of each completion (an empty turn is no step; whether it answered or stopped reads every turn)."""
    spans, _, _ = turn_tensors([step_turns(c) for c in completions])
    _, answered, stopped = turn_tensors([c.turns or [] for c in completions])
    return spans, answered, stopped


def turn_steps_of(cfg) -> bool:
    """Whether the rollout stage scores each assistant turn as a step: process supervision with
    ``process_reward.steps: turns`` from the reward function, the tools or a PRM (the implicit PRM makes its turn
    steps itself, after the rollout stage: ``grpo_mega.stages.implicit_prm``)."""
    return (cfg.algorithm.supervision == "process" and cfg.process_reward.steps == "turns"
            and cfg.process_reward.source != "implicit")
