"""Issue 60, the command line as users from verl and TRL write it: a text key's override is taken as written (a regex
with ``#`` or brackets), a value that cannot be read is one line naming its key, a config of another command is
named as such, and options may stand among the overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cli_runner import run_grpo_mega
from grpo_mega.cli import _parse
from grpo_mega.config import ConfigError, GRPOConfig
from grpo_mega.config.loading import merge_config

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def _value(*overrides: str, key: str):
    return OmegaConf.select(merge_config(GRPOConfig, None, list(overrides)), key)


@pytest.mark.parametrize("pattern", ["#### -?\\d+", "[.!?]\\s", "The answer is: {x}", "a=b", "true", "12"])
def test_a_text_key_takes_the_value_as_written(pattern):
    assert _value(f"process_reward.answer_pattern={pattern}", key="process_reward.answer_pattern") == pattern


def test_null_still_unsets_and_quotes_still_unquote():
    assert _value("process_reward.answer_pattern=null", key="process_reward.answer_pattern") is None
    assert _value("data.prompt_field='question'", key="data.prompt_field") == "question"


def test_other_keys_are_still_yaml():
    assert _value("optim.lr=1e-6", key="optim.lr") == 1e-6
    assert _value("rollout.stop=[a, b]", key="rollout.stop") == ["a", "b"]
    assert _value("reward.weights=[1, 0.5]", key="reward.weights") == [1.0, 0.5]


@pytest.mark.parametrize("override, key, expected", [
    ("tree_rollout.branching=2,2,2", "tree_rollout.branching", [2, 2, 2]),
    ("tree_rollout.branching=[3, 2]", "tree_rollout.branching", [3, 2]),
    ("reward.functions=m.py:accuracy,m.py:format", "reward.functions", ["m.py:accuracy", "m.py:format"]),
    ("reward.weights=1.0,0.2", "reward.weights", [1.0, 0.2]),
])
def test_a_list_key_reads_comma_separated_values_as_the_list(override, key, expected):
    """Issue 79: `tree_rollout.branching=2,2,2` (Hydra's way to write a list) was OmegaConf's `AnyNode is not a
    ListConfig`."""
    assert list(_value(override, key=key)) == expected


def test_a_value_that_is_not_yaml_names_its_key():
    with pytest.raises(ConfigError, match=r"^override rollout.stop=\[a: the value is not valid YAML"):
        merge_config(GRPOConfig, None, ["rollout.stop=[a"])


def test_an_unreadable_override_is_one_line_and_exit_2():
    result = run_grpo_mega("train", "--config", str(CONFIGS / "quickstart_grpo.yaml"), "rollout.stop=[.!?]\\s")
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("grpo-mega train: error: override rollout.stop=[.!?]\\s: the value is not valid YAML")


@pytest.mark.parametrize("command, config, owner", [
    (["train"], "small-model_prm.yaml", "grpo-mega prm train"),
    (["train"], "quickstart_sft.yaml", "grpo-mega sft"),
    (["plan", "--gpus-per-node", "8", "--gpu-memory-gib", "79.6"], "small-model_sft.yaml", "grpo-mega sft"),
    (["sft"], "quickstart_grpo.yaml", "grpo-mega train"),
    (["prm", "train"], "quickstart_grpo.yaml", "grpo-mega train"),
    (["prm", "train"], "quickstart_sft.yaml", "grpo-mega sft"),
])
def test_a_config_of_another_command_is_named_as_such(command, config, owner):
    result = run_grpo_mega(*command, "--config", str(CONFIGS / config))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert f"this looks like a `{owner}` config" in line and f"run `{owner} --config {CONFIGS / config}`" in line, line
    assert "did you mean" not in line


def test_options_may_stand_among_the_overrides():
    args = _parse(["train", "--config", "c.yaml", "a=b", "--nproc", "2", "c=d", "--print-config", "e=f"])
    assert args.nproc == 2 and args.print_config and args.overrides == ["a=b", "c=d", "e=f"]
    evaluation = _parse(["eval", "a=b", "--config", "c.yaml", "c=d", "--policy", "p", "--nproc", "2"])
    assert evaluation.overrides == ["a=b", "c=d"] and evaluation.policy == "p"
    with pytest.raises(SystemExit):
        _parse(["train", "--config", "c.yaml", "a=b", "--not-an-option", "c=d"])
