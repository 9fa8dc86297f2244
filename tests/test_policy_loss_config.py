"""``algorithm.policy_loss`` at start-up: what each form is defined for is refused in one line before launch (exit 2
from the CLI), verl's names are not taken silently, and each form trains with its own clip keys."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from grpo_mega.cli import main
from grpo_mega.config import AlgorithmConfig, ConfigError, GRPOConfig, load_config, validate
from grpo_mega.stages.update import loss_settings

BASE = ["data.train_file=x.jsonl", "model.hf_config=m"]
SEQ_MEAN = "algorithm.loss_agg_mode=seq-mean-token-mean"
PROCESS = "algorithm.supervision=process"
STEPS = "reward.function=synthetic_steps"  # a reward function with step rewards, for process supervision
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.policy_loss=gspo"], r"algorithm.policy_loss=gspo is a sequence-level loss \(one ratio per "
                                     r"sequence, a mean over sequences\): set algorithm.loss_agg_mode="
                                     r"seq-mean-token-mean \(got token-mean\)"),
    (["algorithm.policy_loss=gspo_token", "algorithm.loss_agg_mode=seq-mean-token-sum"],
     r"policy_loss=gspo_token is a sequence-level loss.*\(got seq-mean-token-sum\)"),
    (["algorithm.policy_loss=gmpo"], r"policy_loss=gmpo is a sequence-level loss"),
    (["algorithm.policy_loss=gspo", SEQ_MEAN, PROCESS],
     r"algorithm.policy_loss=gspo needs one advantage per sequence and algorithm.supervision=process gives each "
     r"token its own: use policy_loss=gspo_token \(or cispo\)"),
    (["algorithm.policy_loss=gmpo", SEQ_MEAN, PROCESS], r"policy_loss=gmpo needs one advantage per sequence"),
    (["algorithm.policy_loss=vanilla"], r"algorithm.policy_loss='vanilla' is verl's loss_mode name: set "
                                        r"algorithm.policy_loss=ppo"),
    (["algorithm.policy_loss=geo_mean"], r"set algorithm.policy_loss=gmpo"),
    (["algorithm.policy_loss=sapo"], r"algorithm.policy_loss='sapo': expected one of \('ppo', 'gspo', "
                                     r"'gspo_token', 'gmpo', 'cispo'\)"),
    (["algorithm.policy_loss=cispo", "algorithm.dual_clip_loss=3.0"],
     r"algorithm.dual_clip_loss applies to policy_loss=ppo; policy_loss=cispo has no dual clip"),
    (["algorithm.policy_loss=gspo", SEQ_MEAN, "algorithm.gspo_clip_low=-0.1"], r"algorithm.gspo_clip_low=-0.1 must "
                                                                                r"be >= 0"),
])
def test_refused_in_one_line_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, [*BASE, *overrides], validate)


@pytest.mark.parametrize("overrides", [
    ["algorithm.policy_loss=gspo_token", SEQ_MEAN, PROCESS, STEPS],
    ["algorithm.policy_loss=cispo", PROCESS, STEPS],
    ["algorithm.policy_loss=cispo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    ["algorithm.policy_loss=gmpo", SEQ_MEAN],
])
def test_defined_combinations_pass(overrides):
    load_config(GRPOConfig, None, [*BASE, *overrides], validate)


def test_another_forms_clip_keys_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_mega.config.policy_loss_checks"):
        load_config(GRPOConfig, None, [*BASE, "algorithm.policy_loss=gspo", SEQ_MEAN, "algorithm.clip_high=0.28",
                                       "algorithm.cispo_clip_high=0.2"], validate)
    assert ("ignoring algorithm.cispo_clip_high=0.2, clip_high=0.28: policy_loss=gspo clips with "
            "algorithm.gspo_clip_low / gspo_clip_high") in caplog.text


def test_each_form_trains_with_its_own_clip_keys():
    algorithm = AlgorithmConfig(clip_low=0.1, clip_high=0.3, gspo_clip_low=1e-4, gspo_clip_high=2e-4,
                                loss_agg_mode="seq-mean-token-mean")
    expected = {"ppo": (0.1, 0.3), "gspo": (1e-4, 2e-4), "gspo_token": (1e-4, 2e-4), "gmpo": (0.4, 0.4),
                "cispo": (None, 4.0)}
    for form, (low, high) in expected.items():
        algorithm.policy_loss = form
        settings = loss_settings(algorithm, on_policy=False)
        assert (settings.policy_loss, settings.clip_low, settings.clip_high) == (form, low, high)


def test_cli_exits_2_with_the_one_line_before_launch(capsys):
    code = main(["train", "--config", str(CONFIG), *BASE, "algorithm.policy_loss=gspo", SEQ_MEAN, PROCESS])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-mega train: error: algorithm.policy_loss=gspo needs one advantage per sequence")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arm,form", [("ppo_mb4", "ppo"), ("gspo_token_mb4", "gspo_token"), ("cispo_mb4", "cispo")])
def test_the_policy_loss_arms_are_valid_runs_of_the_sparse_regime(arm, form, tmp_path):
    """``bench/pipeline_seeds.py --arms ppo_mb4 gspo_token_mb4 cispo_mb4``: the quickstart's outcome arm with 4
    optimizer steps per GRPO step (where the forms differ) under each loss, in folders and summary keys of their own."""
    from grpo_mega.quickstart.arms import arm_settings
    from grpo_mega.quickstart.pipeline import SPARSE
    from grpo_mega.quickstart.report import arm_key, learned_prm_arm

    title, overrides, folder = arm_settings(arm)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = load_config(GRPOConfig, str(CONFIG), [f"model.hf_config={tmp_path / 'model'}", "data.train_file=t.jsonl",
                                                "model.init_from=runs/sft",
                                                f"algorithm.response_length={SPARSE.response_length}", *overrides],
                      validate)
    alg = cfg.algorithm
    assert (alg.policy_loss, alg.mini_batch_size, alg.rollout_batch_size) == (form, 8, 32)
    assert alg.supervision == "outcome" and not learned_prm_arm(arm)
    assert folder == f"grpo_{arm}" and arm_key(arm) == arm and title.startswith("GRPO, outcome supervision")
