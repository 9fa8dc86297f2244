"""The tree by turns (``process_reward.source: tree`` with ``steps: turns``, grpo_mega/stages/turn_tree.py): a group
sampled through the turn loop with the real calculator, branching only where the policy is asked for its next turn
(after a tool turn), its node values checked by hand on a scripted policy, ``max_turns`` and the response budget
kept, and the step rewards per turn; the config's checks."""

from __future__ import annotations

import dataclasses
import re

import pytest

from grpo_mega.algo import turn_node_values
from grpo_mega.config import ProcessRewardConfig
from grpo_mega.data.tokenizer import train_tokenizer
from grpo_mega.reward import get_reward_function
from grpo_mega.rollout.base import Completion, SamplingConfig, decode_response
from grpo_mega.rollout.stopping import cut_response
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from grpo_mega.stages.turn_steps import turn_step_ends
from grpo_mega.stages.turn_tree import TurnTreeRewards, TurnTreeSampler
from grpo_mega.tools import SandboxConfig, build_toolset

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
PROMPT = "Q: Start with 12. Multiply by 34. Add 5. A:"  # 12 * 34 = 408, + 5 = 413
TEXTS = [PROMPT, CALL % "12 * 34", CALL % "408 + 5", "<tool_response>413</tool_response> The answer is 413."] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=300)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


class TreePolicy:
    """A policy whose turn is a function of its prefix text and of its row's place r in the generate call: turn 1
    calls 12 * 34 (right) when r is even, 12 * 43 (wrong) when odd; turn 2 calls "v + 5" on the tool's answer v,
    except row 3 of its call, which answers v at once; turn 3 answers the last tool answer w when r < 2, else w + 1.
    Cut at stop strings / EOS / the limit like a real engine. Records each call's prompts (texts)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def turn(self, text: str, r: int) -> str:
        values = re.findall(r"<tool_response>(-?\d+)</tool_response>", text)
        if not values:
            return " " + CALL % ("12 * 34" if r % 2 == 0 else "12 * 43")
        if len(values) == 1:
            return f" The answer is {values[0]}.</s>" if r == 3 else " " + CALL % f"{values[0]} + 5"
        return f" The answer is {int(values[-1]) + (0 if r < 2 else 1)}.</s>"

    def generate(self, prompt_ids, sampling: SamplingConfig) -> list[Completion]:
        out, texts = [], [decode_response(self.tokenizer, p) for p in prompt_ids]
        self.prompts.append(texts)
        for index, prompt in enumerate(prompt_ids):
            for sample in range(sampling.n):
                ids = self.tokenizer.encode(self.turn(texts[index], index * sampling.n + sample),
                                            add_special_tokens=False)
                cut = cut_response(ids, eos_token_ids={self.tokenizer.eos_token_id}, stop=sampling.stop,
                                   decode=lambda t: decode_response(self.tokenizer, t),
                                   max_new_tokens=sampling.max_new_tokens)
                kept = ids[:cut.length]
                out.append(Completion(index, list(prompt), kept, [-0.1] * len(kept),
                                      decode_response(self.tokenizer, kept), cut.finish_reason))
        return out


def grow(tokenizer, branching=(2, 2, 2), max_turns=4, budget=120):
    policy = TreePolicy(tokenizer)
    loop = TurnLoopEngine(policy, build_toolset(["calculator"], SandboxConfig()), tokenizer,
                          TurnLoopSettings(max_response_tokens=budget, max_turns=max_turns))
    sampler = TurnTreeSampler(branching, max_turns, lambda ids: decode_response(tokenizer, ids))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    rows = sampler.generate(loop, [prompt], SamplingConfig(temperature=1.0, max_new_tokens=budget, n=8), call_seed=3,
                            tool_kwargs=[{}])
    return sampler, rows, policy


def outcomes_of(rows):
    verify = get_reward_function("synthetic")
    return [float(verify(PROMPT, c.text, "413")) for c in rows]


def test_the_tree_branches_only_where_the_policy_is_asked_for_its_next_turn(tokenizer):
    sampler, rows, policy = grow(tokenizer)
    assert len(rows) == 8 and all(c.prompt_index == 0 for c in rows)
    # every branch point is the end of a tool turn, which the next turn of the row starts right after
    for c in rows:
        assert len(c.segment_ends) == len(c.tree_path) - 1
        for k, end in enumerate(c.segment_ends):
            assert c.turns[k].ended == "tool_call" and c.turns[k].tool_end == end + 1 == c.turns[k + 1].start
            assert c.response_mask[end] == 0 and c.response_mask[end + 1] == 1  # a tool token, then the policy's
    # each continuation call's prompts are whole conversations ending with a tool turn (or the prompt alone)
    assert policy.prompts[0] == [PROMPT, PROMPT]
    for call in policy.prompts[1:]:
        assert all(text.endswith("</tool_response>") for text in call)
    # rows through one node share its whole conversation so far (tokens, log-probs, mask, turns)
    for a in rows:
        for b in rows:
            shared = 0
            while shared < min(len(a.tree_path), len(b.tree_path)) and a.tree_path[shared] == b.tree_path[shared]:
                shared += 1
            if shared:
                end = a.segment_ends[shared - 1] + 1 if shared < len(a.tree_path) else len(a.response_ids)
                assert a.response_ids[:end] == b.response_ids[:end] and a.response_mask[:end] == b.response_mask[:end]
                assert a.response_logprobs[:end] == b.response_logprobs[:end]
    # the tree of TreePolicy's docstring: node 5 (row 3 of level 1's call) answered at once, a leaf for 2 rows
    assert [c.tree_path for c in rows] == [[0, 2, 6], [0, 2, 7], [0, 3, 8], [0, 3, 9], [1, 4, 10], [1, 4, 11],
                                           [1, 5], [1, 5]]
    assert [len(c.turns) for c in rows] == [3, 3, 3, 3, 3, 3, 2, 2]
    assert sampler.metrics["rollout/tree/nodes"] == 12 and sampler.metrics["rollout/tree/leaves"] == 7
    # every node's own policy tokens counted once: fewer than the rows hold
    assert sampler.metrics["rollout/tree/generated_tokens"] < sum(sum(c.response_mask) for c in rows)
    assert sampler.metrics["num_turns/mean"] == pytest.approx(22 / 8)


def test_turn_values_are_the_mean_outcomes_below_each_turns_node(tokenizer):
    _, rows, _ = grow(tokenizer)
    outcomes = outcomes_of(rows)
    assert outcomes == [1, 1, 0, 0, 0, 0, 0, 0]  # 413 twice; 414; 521 / 522 (12 * 43 = 516); 516 at once
    settings = ProcessRewardConfig(source="tree", steps="turns", step_reward="score")
    source = TurnTreeRewards(TurnTreeSampler((2, 2, 2), 4, str), settings)
    rewards, ends, metrics = source([PROMPT] * 8, [c.text for c in rows], outcomes, [{}] * 8, completions=rows)
    # by hand: V(A = 12 * 34) = 2/4, V(A's first child) = 1, V(A's second) = 0, V(B) = 0; the last turn: the outcome
    assert rewards == [[0.5, 1, 1], [0.5, 1, 1], [0.5, 0, 0], [0.5, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0], [0, 0]]
    assert ends == [turn_step_ends(c) for c in rows]
    assert metrics["tree/branched_turns_per_completion"] == pytest.approx((6 * 2 + 2 * 1) / 8)
    progress = TurnTreeRewards(TurnTreeSampler((2, 2, 2), 4, str),
                               dataclasses.replace(settings, step_reward="progress"))
    shaped, _, _ = progress([PROMPT] * 8, [c.text for c in rows], outcomes, [{}] * 8, completions=rows)
    # progress: each turn's value minus its parent's, from the group's mean outcome 2/8; a row's sum is o - 2/8
    assert shaped[0] == pytest.approx([0.25, 0.5, 0.0]) and shaped[2] == pytest.approx([0.25, -0.5, 0.0])
    assert shaped[6] == pytest.approx([-0.25, 0.0])
    assert [sum(row) for row in shaped] == pytest.approx([o - 0.25 for o in outcomes])
    with pytest.raises(ValueError, match="TurnTreeSampler"):
        source([PROMPT], ["x"], [0.0], [{}], completions=[dataclasses.replace(rows[0], tree_path=None)])


def test_turn_node_values_by_hand():
    # nodes end at response indices 9 and 19; turns start at 0, 12 and 25 (two turns in the last node at 25, 30)
    assert turn_node_values([0.5, 0.25, 1.0], [9, 19], [0, 12, 25, 30]) == [0.5, 0.25, 1.0, 1.0]
    assert turn_node_values([0.0], [], [0, 7]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="3 node values need 2 segment ends"):
        turn_node_values([0.5, 0.25, 1.0], [9], [0])


def test_the_tree_keeps_max_turns_and_the_response_budget(tokenizer):
    # max_turns 2: the second turn's call is not run; the third level has nothing left to continue
    sampler, rows, _ = grow(tokenizer, max_turns=2)
    assert len(rows) == 8 and all(len(c.turns) <= 2 for c in rows)
    assert {c.turns[-1].ended for c in rows} <= {"max_turns", "answer"}
    assert max(len(c.tree_path) for c in rows) == 2 and sampler.metrics["rollout/tree/nodes"] == 6
    # a budget that one call and its tool turn fill: no row passes it, tool turns included
    budget = len(tokenizer.encode(" " + CALL % "12 * 34", add_special_tokens=False)) + 12
    _, rows, _ = grow(tokenizer, budget=budget)
    assert len(rows) == 8 and all(len(c.response_ids) <= budget for c in rows)
    assert all(c.finish_reason == "length" for c in rows)


def test_the_config_runs_the_tree_by_turns_with_the_tree_keys(tmp_path):
    from pathlib import Path

    from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"
    base = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]", "algorithm.supervision=process",
            "process_reward.source=tree", "algorithm.response_length=64", "data.train_file=x.jsonl",
            f"model.hf_config={tmp_path}"]
    cfg = load_config(GRPOConfig, config, [*base, "process_reward.steps=turns", "tree_rollout.branching=[4,2]",
                                           "tree_rollout.segment_tokens=100"])
    validate(cfg, world_size=0)  # segments of 100 tokens in a 64-token budget: unused by turns
    for overrides, message in [(["process_reward.steps=turns", "tree_rollout.branching=[4,4]"], "has 16 leaves"),
                               (["tree_rollout.branching=[4,2]"], "needs process_reward.steps=turns")]:
        cfg = load_config(GRPOConfig, config, [*base, *overrides])
        with pytest.raises(ConfigError, match=message) as error:
            validate(cfg, world_size=0)
        assert "\n" not in str(error.value)
