"""Replay of earlier labels in PRM training (iterative RL): ``data.replay_files`` / ``data.replay_fraction`` checks,
the rows ``prm.train.training_examples`` picks, and a tiny ``grpo-mega prm train`` run through the quickstart's
``run_train_command`` with the replay overrides ``refresh_prm`` passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_grpo_mega
from grpo_mega.config import ConfigError, load_config
from prm.config import PRMConfig, validate_prm
from prm.data import write_stepwise
from prm.examples import StepExample
from prm.iterative import replay_overrides
from prm.train import training_examples

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_prm.yaml"


def _labels(path: Path, name: str, count: int) -> Path:
    """``count`` labelled stepwise rows whose prompts are ``name0``, ``name1``, ..."""
    return write_stepwise(path, [StepExample(f"{name}{i}", [" a", " b"], labels=[True, i % 2 == 0])
                                 for i in range(count)])


def _config(train: Path, *overrides: str) -> PRMConfig:
    return load_config(PRMConfig, None, ["model.hf_config=unused", f"data.train_file={train}", *overrides],
                       validate_prm)


@pytest.fixture
def files(tmp_path):
    return {"new": _labels(tmp_path / "new.jsonl", "new", 6), "old1": _labels(tmp_path / "old1.jsonl", "first", 12),
            "old2": _labels(tmp_path / "old 2.jsonl", "second", 8)}


# ----------------------------------------------------------------------------- config checks
def test_replay_defaults_to_no_replay_at_ten_percent(files):
    cfg = _config(files["new"])
    assert cfg.data.replay_files == [] and cfg.data.replay_fraction == 0.1


@pytest.mark.parametrize("fraction", ["-0.1", "1.5", "nan"])
def test_replay_fraction_outside_zero_one_is_a_config_error(files, fraction):
    with pytest.raises(ConfigError, match=r"data\.replay_fraction=.* must be in \[0, 1\]"):
        _config(files["new"], f"data.replay_fraction={fraction}")


def test_missing_replay_file_is_named(files, tmp_path):
    missing = tmp_path / "iter0_labels.jsonl"
    with pytest.raises(ConfigError, match=f"data.replay_files: {missing} does not exist"):
        _config(files["new"], f"data.replay_files=[{files['old1']},{missing}]")


def test_replaying_the_train_file_itself_is_refused(files):
    with pytest.raises(ConfigError, match="data.replay_files holds data.train_file"):
        _config(files["new"], f"data.replay_files=[{files['new']}]")


def test_replay_files_must_be_a_list(files):
    with pytest.raises(ConfigError, match="data.replay_files"):
        _config(files["new"], f"data.replay_files={files['old1']}")


def test_the_quickstart_overrides_read_back_as_the_same_list(files):
    """``refresh_prm``'s overrides survive the key=value parser, a path with a space included."""
    cfg = _config(files["new"], *replay_overrides([files["old1"], files["old2"]], 0.25))
    assert cfg.data.replay_files == [str(files["old1"]), str(files["old2"])]
    assert cfg.data.replay_fraction == 0.25


# ----------------------------------------------------------------------------- the rows trained on
def _prompts(examples: list[StepExample]) -> list[str]:
    return [example.prompt for example in examples]


def test_training_set_is_every_new_row_plus_a_seeded_share_of_the_history(files):
    replay = f"data.replay_files=[{files['old1']},{files['old2']}]"
    cfg = _config(files["new"], replay, "data.replay_fraction=0.25", "parallel.seed=7")
    examples, replayed, history = training_examples(cfg)
    assert (replayed, history) == (round(0.25 * 20), 20)
    prompts = _prompts(examples)
    assert len(prompts) == 6 + 5 == len(set(prompts))
    assert {f"new{i}" for i in range(6)} <= set(prompts)
    old = {f"first{i}" for i in range(12)} | {f"second{i}" for i in range(8)}
    assert len(set(prompts) & old) == 5
    # replayed rows keep their labels and their own file:line
    first = next(example for example in examples if example.prompt.startswith("first"))
    index = int(first.prompt.removeprefix("first"))
    assert first.labels == [True, index % 2 == 0] and first.source == f"{files['old1']}:{index + 1}"
    # the same seed (a resumed run) gives the same rows in the same order; another seed other rows
    assert _prompts(training_examples(cfg)[0]) == prompts
    other = _config(files["new"], replay, "data.replay_fraction=0.25", "parallel.seed=8")
    assert _prompts(training_examples(other)[0]) != prompts


def test_fraction_zero_and_one_and_no_replay_files(files):
    replay = f"data.replay_files=[{files['old1']}]"
    examples, replayed, history = training_examples(_config(files["new"], replay, "data.replay_fraction=0"))
    assert (replayed, history) == (0, 12) and sorted(_prompts(examples)) == sorted(f"new{i}" for i in range(6))
    examples, replayed, _ = training_examples(_config(files["new"], replay, "data.replay_fraction=1"))
    assert replayed == 12 and len(set(_prompts(examples))) == 18
    plain, replayed, history = training_examples(_config(files["new"]))
    assert (replayed, history) == (0, 0) and _prompts(plain) == [f"new{i}" for i in range(6)]  # file order


# ----------------------------------------------------------------------------- grpo-mega prm train
def test_prm_train_renders_the_replayed_rows(files, tmp_path):
    """A replayed row goes through the same checks as a new one: an unlabelled one stops the run (before any model
    is built) naming its own file and line."""
    old = tmp_path / "unlabelled.jsonl"
    old.write_text(json.dumps({"prompt": "Q", "completions": [" a"]}) + "\n")
    model_dir = _tiny_model_dir(tmp_path)
    result = run_grpo_mega("prm", "train", "--config", str(CONFIG), "--nproc", "1", f"model.hf_config={model_dir}",
                        f"data.train_file={files['new']}", f"data.replay_files=[{old}]", "data.replay_fraction=1",
                        "data.on_bad_row=error", f"trainer.run_dir={tmp_path / 'run'}", "parallel.device=cpu")
    assert result.returncode != 0
    assert f"{old}:1" in result.stderr and "no step labels" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _tiny_model_dir(root: Path) -> Path:
    from tiny_task import build_tiny_task

    return build_tiny_task(root / "task")[0]


@pytest.mark.slow
def test_train_command_replays_earlier_labels_in_a_real_run(tmp_path):
    """The quickstart's refresh path (``run_train_command`` with ``replay_overrides``) trains one step on the new labels
    plus the replayed share, logs the split and records the replay in the run's config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.data.synthetic import read_jsonl
    from prm.pipeline import PRMPlan, run_train_command
    from prm.synthetic import planted_error_examples
    from tiny_task import build_tiny_task

    model_dir, problems_file = build_tiny_task(tmp_path / "task")
    policy = tmp_path / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(policy)
    problems = read_jsonl(problems_file)
    new = write_stepwise(tmp_path / "labels_iter1.jsonl", planted_error_examples(problems[:8], seed=1))
    old = write_stepwise(tmp_path / "labels_iter0.jsonl", planted_error_examples(problems[50:90], seed=2))
    run_dir, log = tmp_path / "prm_iter1", tmp_path / "prm_train_iter1.log"
    run_train_command(model_dir, policy, new, run_dir, PRMPlan(nproc=1), seed=3, steps=1, log=log, show=False,
                      overrides=[*replay_overrides([old], 0.25), "trainer.batch_size=4", "trainer.tensorboard=false",
                                 "parallel.device=cpu"])
    text = log.read_text()
    assert f"training set: 8 rows of {new} plus 10 replayed of the 40 rows of data.replay_files" in text, text[-3000:]
    assert list((run_dir / "checkpoints").glob("step_000001"))
    saved = (run_dir / "config.yaml").read_text()
    assert str(old) in saved and "replay_fraction: 0.25" in saved
