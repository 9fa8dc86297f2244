"""Issue 79 item 6: argument checks that took 8-29 s (the PRM and eval commands imported torch, megatron-core and
transformers before they looked at their paths) are one line, exit status 2, before torch's import: each command
runs here with a ``torch`` on its path that fails when imported, so a check that still needs torch fails the test
whatever the machine's load; the time is asserted with the same margin as the suite's other pre-launch checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fast_checks")
    poison = root / "no_torch" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch imported by an argument check')\n")
    policy = root / "policy"  # what weights_format and the layout check read: config.json and a weights file
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                    "max_position_embeddings": 512, "vocab_size": 306}))
    other = root / "other_model"  # a config of another vocabulary
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 512,
                                                   "vocab_size": 151936}))
    (policy / "model.safetensors").write_bytes(b"")
    (root / "empty").mkdir()
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    return {"root": root, "no_torch": root / "no_torch", "policy": policy, "empty": root / "empty", "other": other,
            "prompts": prompts}


def refused(files, *args: str) -> str:
    """Run ``grpo-mega ARGS`` where importing torch fails; assert one line, exit status 2; return stderr."""
    env = {key: value for key, value in os.environ.items() if key != SHARED_FORK_SERVER_ENV}  # its own imports
    env["PYTHONPATH"] = f"{files['no_torch']}{os.pathsep}{REPO}"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "grpo_mega.cli", *args], capture_output=True, text=True,
                            timeout=120, env=env, cwd=files["root"])
    seconds = time.perf_counter() - start
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert seconds < 10, seconds
    return lines[0]


def test_plan_steps_0(files):
    assert refused(files, "plan", "--config", GRPO, "--steps", "0") == "grpo-mega plan: error: --steps 0 must be >= 1"


def test_prm_label_max_prompts_0(files):
    line = refused(files, "prm", "label", "--policy", str(files["policy"]), "--data", str(files["prompts"]),
                   "--out", "labels.jsonl", "--max-prompts", "0")
    assert line == "grpo-mega prm label: error: --max-prompts 0 must be >= 1"


@pytest.mark.parametrize("flag", ["--n", "--samples-per-prompt"])
def test_prm_label_counts_below_1(files, flag):
    line = refused(files, "prm", "label", "--policy", str(files["policy"]), "--data", str(files["prompts"]),
                   "--out", "labels.jsonl", flag, "0")
    assert line == f"grpo-mega prm label: {flag} must be >= 1, got 0"


@pytest.mark.parametrize("given, message", [
    ((), "give --data (step-labelled rows) and/or --policy with --prompts (best-of-N)"),
    (("--policy", "POLICY"), "--policy needs --prompts (prompts with gold answers)")])
def test_prm_eval_without_its_inputs(files, given, message):
    given = [str(files["policy"]) if word == "POLICY" else word for word in given]
    line = refused(files, "prm", "eval", "--prm", str(files["policy"]), "--layout", "likelihood", *given,
                   "--out", "report.json")
    assert line == f"grpo-mega prm eval: {message}"


def test_prm_score_of_a_causal_lm_without_layout(files):
    line = refused(files, "prm", "score", "--prm", str(files["policy"]), "--data", str(files["prompts"]),
                   "--out", "scores.jsonl")
    assert f"{files['policy']} is a causal LM, which reads as a PRM two ways; choose one with --layout" in line


def test_prm_score_of_a_path_that_is_no_model(files):
    line = refused(files, "prm", "score", "--prm", str(files["prompts"]), "--data", str(files["prompts"]),
                   "--out", "scores.jsonl")
    assert line == f"grpo-mega prm score: --prm {files['prompts']}: {files['prompts']} is not a directory"


def test_prm_score_of_a_file_that_is_no_step_data(files):
    line = refused(files, "prm", "score", "--prm", str(files["policy"]), "--layout", "likelihood",
                   "--data", str(files["prompts"]), "--out", "scores.jsonl")
    assert f"{files['prompts']}:1: a row with fields ['answer', 'prompt'] matches no PRM data format" in line


def test_prm_score_of_a_classifier_prm_checks_its_data_without_torch(files):
    """A classifier PRM (Qwen2.5-Math-PRM's architectures) passes the layout check, read without torch (its
    architecture names came with the conversion tables, which import torch), so the data check is reached."""
    prm = files["root"] / "classifier_prm"
    prm.mkdir(exist_ok=True)
    (prm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForProcessRewardModel"],
                                                 "model_type": "qwen2"}))
    (prm / "model.safetensors").write_bytes(b"")
    line = refused(files, "prm", "score", "--prm", str(prm), "--data", str(files["prompts"]), "--out", "scores.jsonl")
    assert f"{files['prompts']}:1: a row with fields ['answer', 'prompt'] matches no PRM data format" in line


def test_eval_of_an_empty_policy_folder(files):
    line = refused(files, "eval", "--config", GRPO, "--policy", str(files["empty"]),
                   f"model.hf_config={files['policy']}", f"data.train_file={files['prompts']}",
                   f"data.eval_file={files['prompts']}")
    assert f"--policy={files['empty']}: {files['empty']} is none of: a grpo-mega checkpoint" in line


def test_a_causal_lm_as_process_reward_prm(files, tmp_path):
    line = refused(files, "train", "--config", GRPO, f"model.hf_config={files['policy']}",
                   f"data.train_file={files['prompts']}", f"trainer.run_dir={tmp_path / 'run'}",
                   "algorithm.supervision=process", "process_reward.source=prm",
                   f"process_reward.prm={files['policy']}")
    assert "is a causal LM, which reads as a PRM two ways; choose one with process_reward.layout" in line
    assert not (tmp_path / "run").exists()


def test_eval_of_a_policy_of_another_vocabulary_than_the_config(files):
    """It scored 0.000 without a word; train refuses the same pair."""
    line = refused(files, "eval", "--config", GRPO, "--policy", str(files["policy"]),
                   f"model.hf_config={files['other']}", f"data.train_file={files['prompts']}",
                   f"data.eval_file={files['prompts']}")
    assert line == (f"grpo-mega eval: error: --policy {files['policy']} has a vocabulary of 306 tokens and "
                    f"model.hf_config={files['other']} one of 151936: a policy of another model than the config's "
                    "(train refuses this pair); set model.hf_config to the policy's own config folder")


def test_a_prm_as_the_policy_gets_a_note(files, capsys, monkeypatch):
    """An HF process reward model, or a grpo-mega PRM checkpoint (its run config's prm section), as the policy."""
    from grpo_mega.checkpoint import source
    from grpo_mega.config.preflight import note_prm_as_policy

    prm = files["root"] / "hf_prm"
    prm.mkdir()
    (prm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForProcessRewardModel"],
                                                 "model_type": "qwen2"}))
    (prm / "model.safetensors").write_bytes(b"")
    note_prm_as_policy("--policy", str(prm))
    assert capsys.readouterr().err == (
        f"note: --policy={prm} is a process reward model (Qwen2ForProcessRewardModel), loaded here as the policy: a "
        "PRM's weights generate as the LM they started from at best; name the policy's checkpoint if that was meant\n")
    note_prm_as_policy("--policy", str(files["policy"]))  # a causal LM: no note
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(source, "model_path_summary",
                        lambda path: ("training_run", {"prm": {"layout": "classifier"}}, None))
    note_prm_as_policy("model.init_from", "runs/prm")
    assert capsys.readouterr().err.startswith(
        "note: model.init_from=runs/prm is a PRM checkpoint (grpo-mega prm train, layout classifier), loaded here")
