"""The one-time parameter / memory figures (``grpo_mega.perf.parameters``) go with a run's first update, once, and
checkpoints keep whether they were logged (``grpo_mega.harness.resume.OneTimeFigures``): a run whose steps up to its
checkpoint all skipped the update still logs them after the resume; a checkpoint saved before the flag existed
resumes as before (taken to follow an update)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_utils import run_distributed
from grpo_mega.config import ConfigError
from grpo_mega.harness.resume import OneTimeFigures, grpo_state, restore, trainer_state
from grpo_mega.run.metrics import read_metrics
from tiny_task import build_tiny_task, tiny_run_overrides

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"
FIGURE = "model/trainable_parameters"
FIRST_INFORMATIVE_STEP = 3


def silent_until_step_3(prompt, completion, answer, **extra):
    """0 for every completion before step 3 (every group filtered: no update), then the share of digits (varies
    within a group even for a random policy)."""
    from grpo_mega.run.failure import POSITION

    if (POSITION["step"] or 0) < FIRST_INFORMATIVE_STEP:  # None: a check before the run
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


def _train(overrides):
    import grpo_mega.trainer as trainer
    from grpo_mega.config import GRPOConfig, load_config, validate

    trainer.train(load_config(GRPOConfig, CONFIG, overrides, validate))


def test_a_run_resumed_before_its_first_update_logs_the_figures_once(tmp_path_factory, tmp_path):
    task = build_tiny_task(tmp_path_factory.mktemp("task"))
    run_dir = tmp_path / "run"
    common = ("parallel.tensor=1", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=1",
              f"reward.function={__name__}:silent_until_step_3", "trainer.save_every=2")
    # steps 1-2: every group filtered, the checkpoint of step 2 saved before any update
    run_distributed(_train, 1, tiny_run_overrides(task, run_dir, *common, "trainer.total_steps=2"), timeout=400)
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    run_distributed(_train, 1, tiny_run_overrides(task, run_dir, *common, "trainer.total_steps=3"), timeout=400)
    rows = {row["step"]: row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] > 0}
    assert sorted(rows) == [1, 2, 3]
    assert all("actor/loss" not in rows[step] for step in (1, 2)), "steps 1-2 must skip the update"
    assert "actor/loss" in rows[3], "step 3 must update"
    assert [step for step, row in rows.items() if FIGURE in row] == [3]
    assert rows[3][FIGURE] > 0


class _Checkpoints:
    """A CheckpointManager's reading side holding one checkpoint of step 4 with ``extra_state``."""

    def __init__(self, extra_state):
        self.extra_state = extra_state

    def find_resume(self, resume):
        return "runs/x/checkpoints/step_000004"

    def load(self, engine, path, *, seed, companions):
        return SimpleNamespace(step=4, extra_state=self.extra_state, config={})


class _Prompts:
    def __init__(self):
        self.state = None

    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        self.state = state


@pytest.mark.parametrize("saved, expected", [({"logged": True}, True), ({"logged": False}, False), (None, None)])
def test_the_flag_comes_back_from_the_checkpoint_and_an_older_checkpoint_without_it_resumes(saved, expected):
    prompts, figures = _Prompts(), OneTimeFigures()
    extra = {"prompts": {"position": 12}, **({"figures": saved} if saved is not None else {})}
    resumed = restore(_Checkpoints(extra), None, grpo_state(prompts, None, figures), resume="auto", seed=0)
    assert resumed.step == 4 and prompts.state == {"position": 12}
    assert figures.logged is expected  # None: the trainer then takes the old rule (resumed after step > 0)
    assert grpo_state(_Prompts(), None, figures).state_dicts()["figures"] == {"logged": bool(expected)}


def test_another_trainers_checkpoint_is_still_refused_naming_it_whatever_the_optional_flag():
    # an SFT checkpoint holds no state; a colocated GRPO one resumed in async mode lacks the feed's
    for saved, saver in (({}, "SFT"), ({"prompts": {}, "figures": {"logged": True}}, "rollout.mode: colocated"),
                         ({"prompts": {}}, "rollout.mode: colocated")):
        with pytest.raises(ConfigError, match=saver):
            restore(_Checkpoints(saved), None, grpo_state(_Prompts(), _Prompts(), OneTimeFigures()),
                    resume="auto", seed=0)
    with pytest.raises(ValueError, match="figures"):  # GRPO's state must name the flag: the table says so
        trainer_state("grpo", prompts=_Prompts())
