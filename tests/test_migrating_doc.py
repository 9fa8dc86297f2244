"""docs/migrating.md maps verl's and TRL's settings to grpo-mega's keys: every grpo-mega key it names exists in the
GRPO schema, the settings a GRPO run sets in verl and TRL each have a row, and its reward examples load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_mega.config import GRPOConfig
from grpo_mega.config.loading import ConfigError, _leaf_keys, load_config
from grpo_mega.config.peer_keys import TRL_KEYS, VERL_KEYS
from grpo_mega.reward.registry import REWARD_FUNCTIONS
from grpo_mega.reward.verl_sources import VERL_MATH_SOURCES

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "migrating.md"
SECTIONS = {name for name in _leaf_keys(OmegaConf.structured(GRPOConfig)) if "." not in name}


def _rows(heading: str) -> list[list[str]]:
    """The cells of the table under ``## heading``."""
    text = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _our_keys(cell: str) -> list[str]:
    """The grpo-mega keys a cell names: `section.key` or `section.key=value` in backquotes."""
    spans = re.findall(r"`([^`]+)`", cell)
    return [span.split("=", 1)[0] for span in spans if span.split(".", 1)[0] in SECTIONS and "." in span]


def test_every_grpo_mega_key_the_doc_names_exists():
    known = set(_leaf_keys(OmegaConf.structured(GRPOConfig)))
    named = [key for heading in ("verl's keys", "TRL's `GRPOConfig`") for row in _rows(heading)
             for key in _our_keys(row[1])]
    prose = DOC.read_text().split("## Reward functions\n", 1)[1].split("\n## ", 1)[0]
    named += _our_keys(prose)  # the reward section's prose: grpo-mega's keys only
    assert len(set(named)) > 40
    assert sorted({key for key in named if key not in known}) == []


@pytest.mark.parametrize("heading, settings", [
    ("verl's keys", ["data.train_files", "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                     "actor_rollout_ref.rollout.n", "algorithm.adv_estimator", "actor_rollout_ref.actor.clip_ratio",
                     "actor_rollout_ref.actor.kl_loss_coef", "custom_reward_function.path",
                     "custom_reward_function.name", "trainer.total_training_steps",
                     "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.optim.lr",
                     "actor_rollout_ref.actor.loss_agg_mode", "algorithm.norm_adv_by_std_in_grpo"]),
    ("TRL's `GRPOConfig`", ["num_generations", "max_completion_length", "beta", "epsilon", "epsilon_high",
                            "learning_rate", "reward_weights", "loss_type", "scale_rewards", "num_iterations",
                            "temperature", "max_steps"]),
])
def test_the_settings_of_a_grpo_run_each_have_a_row(heading, settings):
    theirs = " ".join(row[0] for row in _rows(heading))
    named = set(re.findall(r"`([^`=]+)", theirs))
    # a row may name a key's siblings by their last part (`clip_ratio_low`, `clip_ratio_high`)
    assert [s for s in settings if s not in named and s.rsplit(".", 1)[-1] not in named] == []


def test_the_verl_default_table_is_the_dispatch_table():
    text = DOC.read_text()
    assert "`verl_default`" in text and "verl_default" in REWARD_FUNCTIONS
    assert [source for source in VERL_MATH_SOURCES if f"`{source}`" not in text] == []


def test_the_page_is_linked_from_the_front_page_and_the_site():
    assert "(docs/migrating.md)" in (REPO / "README.md").read_text()
    assert "migrating.md" in (REPO / "mkdocs.yml").read_text()


def _peer_keys(cell: str) -> list[str]:
    """The peer's keys a first cell names: `a.b.c`, then a sibling by its last part (`top_p` after
    `actor_rollout_ref.rollout.temperature`), a value (`=grpo`) dropped; none for a cell that does not start with
    one."""
    if not cell.startswith("`"):
        return []
    keys, prefix = [], ""
    for span in re.findall(r"`([^`]+)`", cell.split(" (")[0]):
        span = span.split("=", 1)[0]
        if "." in span:
            prefix = span.rsplit(".", 1)[0] + "."
            keys.append(span)
        else:
            keys.append(prefix + span)
    return keys


@pytest.mark.parametrize("heading, table", [("verl's keys", VERL_KEYS), ("TRL's `GRPOConfig`", TRL_KEYS)])
def test_the_doc_tables_are_the_code_table(heading, table):
    """Every peer key of the page's table is in peer_keys' table with the grpo-mega keys the row names (or none, for
    a row without), and every key of peer_keys' table has its row: one mapping, the page's notes around it."""
    documented = {}
    for row in _rows(heading):
        row = " | ".join(row).replace("| |", "|  |").split(" | ")  # an empty cell as one
        if "(in the rows)" in row[0]:  # a field of verl's data rows, not a config key
            continue
        for key in _peer_keys(row[0]):
            documented[key] = set(_our_keys(row[1]))
    assert sorted(set(table) - set(documented)) == []
    assert sorted(set(documented) - set(table)) == []
    wrong = {key: (table[key][0], sorted(ours)) for key, ours in documented.items()
             if not set(table[key][0]) <= ours or (not table[key][0]) != (not ours)}
    assert wrong == {}


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.rollout.n=8", "unknown config key 'actor_rollout_ref.rollout.n' (verl's); in grpo-mega: "
                                      "algorithm.num_return_sequences_in_group (G)"),
    ("actor_rollout_ref.actor.clip_ratio=0.2", "in grpo-mega: algorithm.clip_low and algorithm.clip_high (set both)"),
    ("algorithm.use_kl_in_reward=false", "(verl's); grpo-mega has no such setting: no KL in the reward"),
    ("num_generations=8", "unknown config key 'num_generations' (TRL's); in grpo-mega: "
                          "algorithm.num_return_sequences_in_group"),
])
def test_a_peer_key_is_refused_with_its_grpo_mega_key(override, expected):
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, None, [override])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_peer_key_with_no_counterpart_in_the_schema_gets_no_hint():
    """An SFT config has no algorithm section: a verl GRPO key there gets the plain message, not a key it lacks."""
    from grpo_mega.config import SFTConfig

    with pytest.raises(ConfigError) as error:
        load_config(SFTConfig, None, ["actor_rollout_ref.rollout.n=8"])
    assert "in grpo-mega" not in str(error.value)
