"""Monte-Carlo step labels (prm/labeling.py; the command prm/label_command.py, the policy prm/policy.py): the label
arithmetic by hand, the grouping of continuations back to their steps through a real rollout engine, and
``run_label`` end to end on 2 processes."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from prm.label_command import add_label_arguments, summary_path
from prm.labeling import (
    LabelItem,
    Prefix,
    group_rollouts,
    monte_carlo_labels,
    plan_prefixes,
    prefix_token_ids,
    step_labels,
)
from grpo_mega.rollout.base import SamplingConfig
from tests.dist_utils import run_distributed
from tests.tiny_task import build_tiny_task

T, F = True, False


# ----------------------------------------------------------------------------- label arithmetic, by hand
def test_step_labels_hard_is_any_soft_is_fraction_last_step_is_the_outcome():
    hard, soft = step_labels([[F, F, T, F], [F, F, F, F]], outcome=False)
    assert hard == [T, F, F]
    assert soft == [0.25, 0.0, 0.0]
    hard, soft = step_labels([[T, T], [F, T]], outcome=True)
    assert hard == [T, T, T]
    assert soft == [1.0, 0.5, 1.0]
    # a one-step solution (e.g. a bare answer) is labelled by its outcome alone
    assert step_labels([], outcome=True) == ([T], [1.0])
    assert step_labels([], outcome=False) == ([F], [0.0])


def test_step_labels_rejects_a_prefix_without_continuations():
    with pytest.raises(ValueError, match="prefix 2 has no continuations"):
        step_labels([[T], []], outcome=True)


def test_plan_prefixes_continues_every_step_but_the_last_longest_remainder_first():
    # item 0 has 2 steps (prefix 1, one step to go), item 1 has 3 (prefix 1: two to go, prefix 2: one), item 2 one
    assert plan_prefixes([2, 3, 1]) == [Prefix(1, 1), Prefix(0, 1), Prefix(1, 2)]
    assert plan_prefixes([1, 1]) == []


def test_group_rollouts_puts_each_continuation_back_on_its_item_and_step():
    prefixes = [Prefix(1, 1), Prefix(0, 1), Prefix(1, 2)]  # plan_prefixes([2, 3, 1])
    correct = [T, F,  F, F,  T, T]  # n = 2 per prefix, in plan order
    assert group_rollouts(prefixes, correct, 2, [2, 3, 1]) == [[[F, F]], [[T, F], [T, T]], []]


def test_group_rollouts_rejects_missing_or_surplus_outcomes():
    with pytest.raises(ValueError, match="5 outcomes for 3 prefixes x n=2"):
        group_rollouts([Prefix(1, 1), Prefix(0, 1), Prefix(1, 2)], [T] * 5, 2, [2, 3, 1])
    with pytest.raises(ValueError, match=r"item 1 has no continuations for prefixes \[2\]"):
        group_rollouts([Prefix(1, 1), Prefix(0, 1)], [T] * 4, 2, [2, 3])
    with pytest.raises(ValueError, match="outside 1..1 steps"):
        group_rollouts([Prefix(0, 2)], [T], 1, [2])


def test_default_step_pattern_is_the_synthetic_one_only_for_synthetic_rows():
    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.data.step_split import DOUBLE_NEWLINE_PATTERN, SYNTHETIC_STEP_PATTERN
    from grpo_mega.data.step_split import default_step_pattern

    synthetic = PromptRecord("Q: Start with 2. Add 3. A:", [1], "5", "", "a:1", {"steps": []})
    other = PromptRecord("What is 2 + 3?", [1], "5", "", "b:1", {})
    assert default_step_pattern(r.extra for r in [synthetic, synthetic]) == SYNTHETIC_STEP_PATTERN
    assert default_step_pattern(r.extra for r in [synthetic, other]) == DOUBLE_NEWLINE_PATTERN
    assert default_step_pattern([]) == DOUBLE_NEWLINE_PATTERN


# ----------------------------------------------------------------------------- through a real rollout engine
@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """(HF folder with seeded random weights and the task's tokenizer, train file) of the tiny synthetic task."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("prm_label")
    model_dir, train_file = build_tiny_task(root)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    policy_dir = root / "policy_hf"
    model.save_pretrained(policy_dir)
    load_tokenizer(model_dir).save_pretrained(policy_dir)
    return policy_dir, train_file


def _bad_marker_reward(prompt, completion, answer, **extra):
    """Correct unless the solution contains "BAD": a prefix with a BAD step can never be completed correctly, and
    one without can (a random tiny model does not write "BAD"), whatever the continuation says."""
    return 0.0 if "BAD" in completion else 1.0


def test_monte_carlo_labels_match_hand_labels_through_the_hf_engine(tiny_policy):
    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    policy_dir, _ = tiny_policy
    engine = HFRolloutEngine.from_pretrained(policy_dir, policy_dir, generation_batch_size=2)
    tokenizer = engine.tokenizer
    prompt = "Q: Start with 7. Add 5. A:"
    ids = tokenizer(prompt)["input_ids"]
    items = [
        LabelItem(prompt, ids, [" Step 1: 7 + 5 = 12.", " Step 2: BAD.", " The answer is 1."], "12", source="a"),
        LabelItem(prompt, ids, [" The answer is 12."], "12", source="b"),  # one step: outcome only
        LabelItem(prompt, ids, [" Step 1: BAD.", " The answer is 9."], "12", source="c"),
        LabelItem(prompt, ids, [" Step 1: 7 + 5 = 12.", " The answer is 12."], "12", source="d"),
    ]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    examples = monte_carlo_labels(engine, tokenizer, items, n=3, sampling=sampling, reward_fn=_bad_marker_reward,
                                  seed=5)
    assert [e.source for e in examples] == ["a", "b", "c", "d"]
    assert [e.labels for e in examples] == [[T, F, F], [T], [F, F], [T, T]]
    assert [e.soft_labels for e in examples] == [[1.0, 0.0, 0.0], [1.0], [0.0, 0.0], [1.0, 1.0]]
    assert [e.steps for e in examples] == [item.steps for item in items]
    assert [e.extra["outcome"] for e in examples] == [0.0, 1.0, 0.0, 1.0]


def test_prefix_token_ids_are_the_prompt_ids_then_the_prefix_text_without_special_tokens(tiny_policy):
    from grpo_mega.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_policy[0])
    prompt_ids = [5, 6, 7]  # as the dataset gave them, not re-tokenized
    item = LabelItem("Q: A:", prompt_ids, [" Step 1: 2 + 3 = 5.", " Step 2: 5 * 2 = 10.", " The answer is 10."], "10")
    ids = prefix_token_ids(tokenizer, item, 2)
    assert ids[:3] == prompt_ids
    assert tokenizer.decode(ids[3:]) == " Step 1: 2 + 3 = 5. Step 2: 5 * 2 = 10."


def test_perturbed_copies_keep_the_prefix_change_one_step_and_let_the_policy_finish(tiny_policy):
    from grpo_mega.data.step_split import SYNTHETIC_STEP_PATTERN
    from grpo_mega.rollout.hf_engine import HFRolloutEngine
    from prm.perturb import Perturbation, perturbed_solutions

    policy_dir, _ = tiny_policy
    engine = HFRolloutEngine.from_pretrained(policy_dir, policy_dir, generation_batch_size=2)
    prompt = "Q: Start with 7. Add 5. Double. A:"
    ids = engine.tokenizer(prompt)["input_ids"]
    steps = [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 2 = 24.", " The answer is 24."]
    items = [LabelItem(prompt, ids, steps, "24", extra={"k": 1}, source="train.jsonl:1#0")]
    plans = [Perturbation(0, 0, " Step 1: 7 + 5 = 13."), Perturbation(0, 1, " Step 2: 12 * 2 = 20.")]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    copies = perturbed_solutions(engine, engine.tokenizer, items, plans, sampling=sampling,
                                 step_pattern=SYNTHETIC_STEP_PATTERN, seed=4)
    assert [c.source for c in copies] == ["train.jsonl:1#0~perturbed@1", "train.jsonl:1#0~perturbed@2"]
    assert copies[0].steps[0] == " Step 1: 7 + 5 = 13."
    assert copies[1].steps[:2] == [" Step 1: 7 + 5 = 12.", " Step 2: 12 * 2 = 20."]
    for copy, plan in zip(copies, plans):
        assert (copy.prompt, copy.prompt_ids, copy.answer, copy.extra) == (prompt, ids, "24", {"k": 1})
        assert len(copy.steps) > plan.step + 1  # the policy wrote more (8 tokens of a random model's text)
        assert all(copy.steps)
    again = perturbed_solutions(engine, engine.tokenizer, items, plans, sampling=sampling,
                                step_pattern=SYNTHETIC_STEP_PATTERN, seed=4)
    assert [c.steps for c in again] == [c.steps for c in copies]


# ----------------------------------------------------------------------------- run_label end to end
def even_length_reward(prompt, completion, answer, **extra):
    """A verifier whose verdict on a random model's text is predictable from the text: even length is correct."""
    return float(len(completion) % 2 == 0)


def _label_args(policy: Path, data: Path, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_label_arguments(parser)
    # A random policy rarely writes "Step k:", so steps are cut every 6 characters to have prefixes to continue.
    return parser.parse_args(["--policy", str(policy), "--data", str(data), "--out", str(out), "--n", "2",
                              "--samples-per-prompt", "2", "--max-prompts", "2", "--max-new-tokens", "12",
                              "--step-pattern", ".{6}", "--reward", f"{__name__}:even_length_reward",
                              "--device", "cpu", "--seed", "3"])


def _label_worker(args: argparse.Namespace) -> str:
    from prm.label_command import run_label

    return str(run_label(args))


def test_run_label_on_two_processes_writes_stepwise_rows_and_a_summary(tiny_policy, tmp_path):
    policy_dir, train_file = tiny_policy
    out = tmp_path / "labels.jsonl"
    returned = run_distributed(_label_worker, 2, _label_args(policy_dir, train_file, out), timeout=120)
    assert returned == [str(out), str(out)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(summary_path(out).read_text())
    assert summary["prompts"] == 2
    assert len(rows) == summary["solutions"] == 4 - summary["dropped_empty_solutions"] > 0
    assert summary["steps"] == sum(len(row["completions"]) for row in rows) > len(rows)  # some prefixes continued
    assert summary["generations"] == 4 + 2 * (summary["steps"] - len(rows))
    assert summary["world_size"] == 2 and summary["policy_format"] == "hf"
    train_rows = [json.loads(line) for line in train_file.read_text().splitlines()[:2]]
    for row in rows:
        steps = row["completions"]
        assert steps and all(isinstance(step, str) and step for step in steps)
        assert row["prompt"] in {r["prompt"] for r in train_rows}
        assert len(row["labels"]) == len(row["soft_labels"]) == len(row["true_labels"]) == len(steps)
        # hard = some continuation was right = soft > 0, soft a multiple of 1/n; the last step is the outcome
        assert row["labels"] == [soft > 0 for soft in row["soft_labels"]]
        assert all(soft in (0.0, 0.5, 1.0) for soft in row["soft_labels"])
        outcome = len("".join(steps)) % 2 == 0
        assert row["labels"][-1] is outcome and row["soft_labels"][-1] == float(outcome) == row["outcome"]
        assert row["true_labels"] == row["value_labels"] == [False] * len(steps)  # random text is no synthetic step
    from prm.data import read_examples

    assert [e.soft_labels for e in read_examples(out, "stepwise")] == [row["soft_labels"] for row in rows]
    for prefix, key in (("", "true_labels"), ("value_", "value_labels")):
        assert summary[f"{prefix}label_agreement"] == sum(
            label == truth for row in rows for label, truth in zip(row["labels"], row[key])
        ) / summary["steps"]


# ----------------------------------------------------------------------------- the policy from a checkpoint
def _checkpoint_rollout_worker(hf_dir: Path, model_dir: Path, run_dir: Path):
    """Save the HF policy as a grpo-mega training checkpoint at TP=2, then load that run directory as the
    labelling policy (forward-only engine at TP=2 -> weight sync) and compare the rollout model with the HF weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import init_distributed
    from prm.policy import load_policy_rollout

    init_distributed(2, 1, seed=0, device="cpu")
    trained = build_policy_engine(AutoConfig.from_pretrained(model_dir), optim=OptimConfig(), total_steps=1,
                                  max_tokens_per_micro_batch=1024)
    load_initial_weights(trained, hf_dir)
    CheckpointManager(run_dir).save(trained, 1, config={"model": {"hf_config": str(model_dir)}})
    del trained
    policy = load_policy_rollout(run_dir, generation_batch_size=4)
    state = policy.engine.model.state_dict()
    expected = load_file(str(hf_dir / "model.safetensors"))
    worst = max((state[name] - tensor).abs().max().item() for name, tensor in expected.items())
    return policy.weights_format, str(policy.hf_config), len(expected), worst, policy.engine.weight_version


def test_a_training_run_loads_through_the_engine_and_syncs_the_exact_weights(tiny_policy, tmp_path):
    policy_dir, train_file = tiny_policy
    model_dir = train_file.parent.parent / "model"  # the task's config folder (no weights)
    results = run_distributed(_checkpoint_rollout_worker, 2, policy_dir, model_dir, tmp_path / "run", timeout=120)
    for kind, hf_config, tensors, worst, version in results:
        assert (kind, hf_config, version) == ("training_run", str(model_dir), 1)
        assert tensors > 10 and worst == 0.0


def test_policy_folders_of_an_hf_folder_and_of_a_folder_that_is_no_policy(tiny_policy, tmp_path):
    from prm.policy import policy_folders

    policy_dir, _ = tiny_policy
    source, hf_config, tokenizer = policy_folders(policy_dir)
    assert (source.kind, hf_config, tokenizer) == ("hf", policy_dir, policy_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--policy .*empty: .*none of"):
        policy_folders(tmp_path / "empty")
