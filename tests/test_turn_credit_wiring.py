"""Turn credit as the trainer wires it (``process_reward.steps=turns``): the rollout stage's per-turn rewards from each
source (the tool task's oracle ``tool_task_turns``, the tools' own verdicts, a PRM reading each turn in context) and
``group_advantages``' turn credit, on hand-built tool-task trajectories (one character a token), for every form x
source (the tree by turns too: each hand-built group read as a tree whose nodes end at the tool turns, rows with the
same turns so far sharing a node): an extra tool call that changes nothing, a void turn, or a turn split in two never
raises a completion's turn-term credit under ``bounded`` (``sum``'s documented hazards are asserted as such); a
missing answer never pays under ``bounded``; a rollout stopped at ``max_turns`` is scored as
``algorithm.max_turns_outcome`` says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_mega.algo import adjusted_outcomes, outcome_advantages, turn_term_credit
from grpo_mega.config import AlgorithmConfig, ProcessRewardConfig, RewardConfig
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.data.tool_format import fallback_tool_turn_text, hermes_call_text
from grpo_mega.reward.tool_task import tool_task_turn_reward
from grpo_mega.rollout.base import Completion, SamplingConfig, ToolCallRecord, TurnRecord
from grpo_mega.stages import group_advantages
from grpo_mega.stages.rollout import RolloutStage
from grpo_mega.stages.turn_credit_metrics import turn_credit_metrics
from grpo_mega.stages.turn_rewards import PRMTurnRewards, ToolTurnRewards
from grpo_mega.stages.turn_steps import batch_turn_tensors, turn_step_texts, turn_views
from grpo_mega.stages.turn_tree import TurnTreeRewards, TurnTreeSampler

STEPS = [{"lhs": 12, "op": "*", "rhs": 3, "result": 36}, {"lhs": 36, "op": "+", "rhs": 5, "result": 41}]
G = 4
SOURCES = ["function", "tool", "prm", "tree"]


def decode(ids):
    return "".join(map(chr, ids))


def call(expression, error=None):
    return (hermes_call_text("calculator", {"expression": expression}),
            ToolCallRecord("calculator", {"expression": expression}, error=error))


def trajectory(*turns):
    """A Completion from turns ``(policy text, ended, call or None, tool output or None)``, a character a token."""
    text, mask, records = "", [], []
    for policy, ended, made, output in turns:
        start = len(text)
        text += policy + (made[0] if made else "")
        record = TurnRecord(start, len(text), ended, calls=[made[1]] if made else [])
        mask += [1] * (len(text) - start)
        if output is not None:
            tool = fallback_tool_turn_text(output)
            text += tool
            mask += [0] * len(tool)
            record.tool_end = len(text)
        records.append(record)
    ids = [ord(ch) for ch in text]
    return Completion(0, [1, 2], ids, [0.0] * len(ids), text, "eos", response_mask=mask, turns=records)


FIRST = (" ", "tool_call", call("12 * 3"), "36")
SECOND = (" Step 1: 12 * 3 = 36. ", "tool_call", call("36 + 5"), "41")
ANSWER = (" Step 2: 36 + 5 = 41. The answer is 41.", "answer", None, None)
RIGHT = [FIRST, SECOND, ANSWER]
GROUP = [
    RIGHT,
    [FIRST, (" Step 1: 12 * 3 = 36. ", "tool_call", call("36 - 5"), "31"),
     (" Step 2: 36 - 5 = 31. The answer is 31.", "answer", None, None)],
    [(" ", "tool_call", call("12 *", error="bad_arguments"), "error"), (" The answer is 40.", "answer", None, None)],
    [(" Step 1: 12 * 3 = 36. ", "tool_call", call("36 + 5"), "41"), ANSWER],
]
PERTURBED = {  # completion 0 changed in a way that must not raise its credit
    "extra_call": [FIRST, FIRST, SECOND, ANSWER],
    "void": [FIRST, SECOND, (" Let me see.", "void", None, None), ANSWER],
    "split": [FIRST, (" Step 1: 12 * 3 = 36.", "length", None, None), (" ", "tool_call", call("36 + 5"), "41"),
              ANSWER],
}


class TurnTextScorer:
    """A PRM stand-in that scores a step by its text (0.9 when it holds the chain's right work, else 0.2) and
    records the step texts it is given."""

    def __init__(self):
        self.steps = []

    def score_steps(self, prompts, steps):
        self.steps.append([list(s) for s in steps])
        right = ("12 * 3", "36 + 5", "= 36.", "= 41.", "is 41")
        return [[0.9 if any(r in step for r in right) and "error" not in step else 0.2 for step in row]
                for row in steps]


def as_tree(completions):
    """The group read as a tree by turns: a node ends at each tool turn (and the last at the response's end), rows
    with the same tokens through a node's end sharing it (``tree_path``, ``segment_ends`` as the sampler sets them)."""
    ids = {}
    for c in completions:
        ends = [t.tool_end - 1 for t in c.turns if t.tool_end is not None and t.tool_end < len(c.response_ids)]
        c.tree_path = [ids.setdefault(tuple(c.response_ids[:end + 1]), len(ids))
                       for end in [*ends, len(c.response_ids) - 1]]
        c.segment_ends = ends
    return completions


def stage_for(source, algorithm):
    settings = ProcessRewardConfig(source=source, steps="turns", prm="unused")
    tree = TurnTreeRewards(TurnTreeSampler([G], 4, decode), dataclasses.replace(settings, step_reward="progress"))
    sources = {"function": None, "tool": ToolTurnRewards(settings),
               "prm": PRMTurnRewards(TurnTextScorer(), settings, decode), "tree": tree}
    reward = RewardConfig(function="tool_task_turns" if source == "function" else "synthetic")
    return RolloutStage(None, None, SamplingConfig(n=G), reward, algorithm, seed=0, decode=decode,
                        step_reward_source=sources[source], turn_steps=True)


def credit(source, form, group, **options):
    """(advantages [G, T], D [G] (turn-term credit), batch) of one group through the rollout stage's scoring and
    ``group_advantages``."""
    alg = AlgorithmConfig(num_return_sequences_in_group=G, supervision="process", turn_credit=form, **options)
    record = PromptRecord("Q", [1, 2], "41", "Q", "test:1", {"steps": STEPS})
    completions = [trajectory(*turns) for turns in group]
    batch, failures = stage_for(source, alg).score([record], as_tree(completions) if source == "tree" else completions)
    assert failures == 0
    advantages = group_advantages(batch, alg)
    spans, answered, stopped = batch_turn_tensors(batch.completions)
    outcome = outcome_advantages(adjusted_outcomes(batch.rewards, answered, stopped,
                                                   max_turns_outcome=alg.max_turns_outcome), G)
    return advantages, turn_term_credit(advantages, spans, outcome), batch


def test_the_oracle_scores_each_turn_of_the_tool_task():
    rewards = [tool_task_turn_reward("Q", c.text, "41", steps=STEPS, turns=turn_views(c, decode)).turn_rewards
               for c in (trajectory(*turns) for turns in GROUP + [PERTURBED["void"], PERTURBED["split"]])]
    assert rewards == [[1, 1, 1], [1, 0, 0], [0, 0], [1, 1], [1, 1, 0, 1], [1, 1, 1, 1]]
    # without turns (the held-out evaluation) it is the outcome verifier
    assert tool_task_turn_reward("Q", trajectory(*RIGHT).text, "41", steps=STEPS) == 1.0
    assert tool_task_turn_reward("Q", trajectory(*GROUP[1]).text, "41", steps=STEPS) == 0.0


def test_each_source_gives_one_reward_per_turn_ending_at_its_last_model_token():
    # the tree's progress: V(first turn, shared with completion 1) 1/2 - the group's mean 1/2, then V(its second
    # turn's node) 1 - 1/2, then its own outcome 1 - 1
    for source, want in (("function", [1.0, 1.0, 1.0]), ("tool", [0.0, 0.0, 0.0]), ("prm", [0.9, 0.9, 0.9]),
                         ("tree", [0.0, 0.5, 0.0])):
        _, _, batch = credit(source, "bounded", GROUP)
        assert batch.step_rewards[0] == want
        turns = batch.completions[0].turns
        assert batch.step_ends[0] == [t.end - 1 for t in turns]
    _, _, batch = credit("tool", "bounded", GROUP)
    assert batch.step_rewards[2] == [-1.0, 0.0]  # the failed call's turn: tool_error_reward
    completion = trajectory(*RIGHT)
    texts = turn_step_texts(completion, decode)  # the PRM's steps: each earlier tool output in its context
    assert "".join(texts) == completion.text and texts[1].startswith("<tool_response>36</tool_response>")
    assert texts[2].startswith("<tool_response>41</tool_response> Step 2")


@pytest.mark.parametrize("source", SOURCES)
def test_tool_tokens_get_no_credit_and_the_bound_keeps_the_outcome_sign(source):
    advantages, _, batch = credit(source, "bounded", GROUP, turn_credit_weight=5.0)
    for row, completion in enumerate(batch.completions):
        mask = torch.tensor(completion.response_mask, dtype=torch.bool)
        values = advantages[row, :len(mask)]
        assert (values[~mask] == 0).all()
        sign = 1.0 if batch.rewards[row] > batch.rewards.mean() else -1.0
        assert (values[mask] * sign > 0).all()


# (source, perturbation) pairs where `sum` raises completion 0's turn-term credit: its hazard, pinned here so that
# docs/training.md's table stays true. `bounded` never raises it (the turn term adds no credit at all).
# The tree: a void turn inside the last node scores 0 (progress within a node), which shrinks the pooled std and so
# enlarges the normalised value gains before it.
SUM_RAISES = {("function", "extra_call"), ("function", "split"), ("prm", "extra_call"), ("prm", "split"),
              ("tool", "extra_call"), ("tool", "split"), ("tree", "void")}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("how", sorted(PERTURBED))
@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_an_extra_call_a_void_turn_or_a_split_turn_never_raises_credit(form, how, source):
    _, before, _ = credit(source, form, GROUP)
    _, after, _ = credit(source, form, [PERTURBED[how]] + GROUP[1:])
    if form == "bounded":
        assert abs(after[0]) < 1e-4 and abs(before[0]) < 1e-4
    elif (source, how) in SUM_RAISES:
        assert after[0] > before[0] + 1e-3
    else:
        assert after[0] <= before[0] + 1e-4


@pytest.mark.parametrize("source", SOURCES)
def test_a_missing_answer_never_pays_more_than_a_wrong_one_under_bounded(source):
    unanswered = [FIRST, SECOND, (" Step 2: 36 + 5 = 41.", "void", None, None)]
    advantages, _, batch = credit(source, "bounded", [unanswered] + GROUP[1:])
    mean = [float(advantages[r, :len(c.response_mask)][torch.tensor(c.response_mask, dtype=torch.bool)].mean())
            for r, c in enumerate(batch.completions)]
    assert mean[0] < 0 and mean[0] <= max(mean[1], mean[2]) + 1e-5


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("form", ["bounded", "sum"])
def test_a_rollout_stopped_at_max_turns_is_scored_as_configured(form, source):
    stopped = GROUP[:3] + [[(" Step 1: 12 * 3 = 36. ", "tool_call", call("36 + 5"), "41"),
                            (" Step 2: 36 + 5 = 41. The answer is 41.", "max_turns", None, None)]]
    as_wrong, _, batch = credit(source, form, stopped)
    as_is, _, _ = credit(source, form, stopped, max_turns_outcome="as_is")
    assert batch.rewards[3] == 1.0  # the verifier read its answer; max_turns_outcome decides what it counts for
    policy = torch.tensor(batch.completions[3].response_mask, dtype=torch.bool)
    assert as_is[3][:len(policy)][policy].mean() > 0
    if form == "bounded":
        assert (as_wrong[3][:len(policy)][policy] < 0).all()
    assert as_wrong[3].sum() < as_is[3].sum()


def test_turn_credit_metrics_count_turns_and_the_flips_the_bound_avoided():
    alg = AlgorithmConfig(num_return_sequences_in_group=G, supervision="process", turn_credit_weight=5.0)
    failed = (" ", "tool_call", call("12 *", error="bad_arguments"), "error")
    right_after_errors = [failed, failed, (" Step 1: 12 * 3 = 36. Step 2: 36 + 5 = 41. The answer is 41.", "answer",
                                           None, None)]
    _, _, batch = credit("function", "bounded", [RIGHT, right_after_errors] + GROUP[1:3], turn_credit_weight=5.0)
    metrics = turn_credit_metrics(batch, alg)
    assert metrics["turn_credit/turns_scored"] == 11 and metrics["turn_credit/turns_per_completion"] == 11 / 4
    assert metrics["turn_credit/turn_reward_mean"] == pytest.approx(5 / 11)
    # `sum` at weight 5 makes the right completion 1's two failed calls negative: the flips the bound avoided
    assert metrics["turn_credit/flips_avoided"] > 0 and metrics["turn_credit/clipped_turn_fraction"] > 0
    summed = turn_credit_metrics(batch, dataclasses.replace(alg, turn_credit="sum"))
    assert summed["turn_credit/flips"] == metrics["turn_credit/flips_avoided"]


def test_the_config_runs_turn_credit_where_it_works_and_refuses_the_rest_in_one_line():
    from grpo_mega.config import ConfigError, GRPOConfig
    from grpo_mega.config.turn_checks import validate_turn_credit

    def cfg(multi_turn=True, supervision="process", **process):
        config = GRPOConfig()
        config.rollout.multi_turn.enable, config.rollout.multi_turn.tools = multi_turn, ["calculator"]
        config.algorithm.supervision = supervision
        config.process_reward = dataclasses.replace(config.process_reward, **{"steps": "turns", **process})
        return config

    for source in ("function", "tool", "prm", "implicit", "tree"):
        validate_turn_credit(cfg(source=source))
    token_steps = cfg(source="implicit")
    token_steps.implicit_prm.steps = "tokens"
    validate_turn_credit(cfg(supervision="outcome", steps="text"))  # outcome GRPO with tools: as before
    bad_bound, bad_form = cfg(), cfg()
    bad_bound.algorithm.turn_credit_bound = 0.5
    bad_form.algorithm.turn_credit = "per_turn_index"
    for config, message in [
        (cfg(multi_turn=False), "needs rollout.multi_turn.enable=true"),
        (cfg(supervision="outcome"), "needs algorithm.supervision=process"),
        (cfg(steps="text"), "needs process_reward.steps=turns"),
        (token_steps, "implicit_prm.steps=tokens with process_reward.steps=turns"),
        (cfg(source="tool", steps="text"), "source=tool scores assistant turns"),
        (cfg(source="prm", max_counted_steps=3), "max_counted_steps"),
        (bad_bound, "turn_credit_bound=0.5 must lie in"),
        (bad_form, "algorithm.turn_credit"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            validate_turn_credit(config)
        assert "\n" not in str(error.value)


def test_the_quickstart_turn_credit_arms_are_valid_configs(tmp_path):
    from pathlib import Path

    from grpo_mega.config import GRPOConfig, load_config, validate
    from grpo_mega.quickstart.arms import ARMS, TURN_CREDIT_ARMS, tool_arm_settings

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"
    names = [name for arm in TURN_CREDIT_ARMS for name in (arm, f"{arm}_sum")]
    assert set(names) <= set(ARMS)
    for name in names:
        _, overrides, folder, start = tool_arm_settings(name)  # the tools regime adds the turn loop
        assert start == "tool"
        prm = [f"process_reward.prm={tmp_path}"] if "prm" in name else []
        cfg = load_config(GRPOConfig, config, [*overrides, *prm, "data.train_file=x.jsonl",
                                               f"model.hf_config={tmp_path}"])
        validate(cfg, world_size=0)
        assert cfg.process_reward.steps == "turns" and cfg.rollout.multi_turn.enable
        assert cfg.algorithm.turn_credit == ("sum" if name.endswith("_sum") else "bounded")
        assert folder == f"grpo_{name}"
