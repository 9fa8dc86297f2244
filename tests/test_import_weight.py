"""What each entry path imports (issue 40): a heavy package a path does not need costs every process that takes it
seconds of start-up (the suite starts hundreds). Each case imports its modules in a fresh interpreter and lists the
packages that must not be loaded; a module-level import that brings one back fails here.

Not checkable here: megatron-core's own ``__init__`` loads torch._dynamo (its fused kernels are decorated with
torch.compile at import), wandb when installed and torch.utils.tensorboard for every rank; see bench/startup.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    # `grpo-mega train|sft|prm ... --nproc N` before it becomes torchrun, and `grpo-mega --help`
    "the command line before the relaunch": (["grpo_mega.cli", "prm.cli"],
                                             ["torch", "transformers", "megatron", "numpy", "yaml"]),
    # a training rank (GRPO, SFT, PRM) with the Megatron engine and HF rollouts: vLLM, DeepSpeed and plotting load
    # only when the config asks for them
    # `grpo-mega quickstart` and the PRM pipeline run grpo-mega's commands as child processes and read their run
    # folders (the folder's names included): the orchestrator itself never loads torch (issue 50)
    "the pipelines' orchestrators": (["grpo_mega.quickstart.pipeline", "grpo_mega.quickstart.selection",
                                      "grpo_mega.run.layout", "grpo_mega.run.commands", "prm.pipeline"],
                                     ["torch", "transformers", "megatron"]),
    # the config's checks and the reward function's pre-launch check: a refused command ends without torch's import;
    # model.init_from / a PRM's folder read there too (checkpoint.training_files), so a launch does not import it
    "the checks before launch": (["grpo_mega.config", "grpo_mega.config.cross_field", "grpo_mega.config.preflight",
                                  "grpo_mega.algo.choices", "grpo_mega.reward.registry", "grpo_mega.reward.compute",
                                  "grpo_mega.checkpoint.training_files"],
                                 ["torch", "transformers", "megatron"]),
    "a training rank": (["grpo_mega.trainer", "grpo_mega.sft", "prm.train", "grpo_mega.rollout",
                         "grpo_mega.engine", "grpo_mega.run.metrics"],
                        ["vllm", "deepspeed", "matplotlib", "trl", "pandas", "sklearn"]),
}


@pytest.mark.parametrize("case", CASES)
def test_an_entry_path_does_not_load_what_it_does_not_need(case):
    modules, absent = CASES[case]
    probe = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert not loaded & set(absent), f"{case} loads {sorted(loaded & set(absent))}"


def _loaded_by(command: list[str], env: dict | None = None) -> set[str]:
    """The top-level packages a command's Python imported, read from ``-X importtime`` on its stderr."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    names = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return {name.split(".")[0] for name in names}


def test_the_cli_parser_loads_no_torch():
    """``grpo-mega train --help`` parses the command line and prints, without torch (issue 50)."""
    loaded = _loaded_by([sys.executable, "-X", "importtime", "-m", "grpo_mega.cli", "train", "--help"])
    assert "grpo_mega" in loaded, "the probe saw no import at all"
    assert not loaded & {"torch", "transformers", "megatron"}, sorted(loaded)


def test_a_setting_refused_before_launch_loads_no_torch(tmp_path):
    """A mistyped option ends the command in one line before torch's import (2-3 s of CPU): the options' names
    (``grpo_mega.algo.choices``) and the reward registry are read without the math that imports it."""
    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo_mega.cli", "train", "--config",
                             str(repo / "configs" / "quickstart_grpo.yaml"), "model.hf_config=x",
                             f"data.train_file={tmp_path / 'train.jsonl'}", f"trainer.run_dir={tmp_path / 'run'}",
                             "algorithm.loss_agg_mode=token-sum"], capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and lines == [
        "grpo-mega train: error: algorithm.loss_agg_mode='token-sum': expected one of ('token-mean', "
        "'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm')"], result.stderr[-2000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()
              if line.startswith("import time:")}
    assert "grpo_mega" in loaded and not loaded & {"torch", "transformers", "megatron"}, sorted(loaded)


def test_launch_local_sh_reads_the_world_size_without_torch(tmp_path):
    """launch/local.sh's own Python (the world size from the config) before torchrun: no torch (issue 50)."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -X importtime \"$@\"\n")
    wrapper.chmod(0o755)
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": str(wrapper)}
    loaded = _loaded_by(["bash", str(repo / "launch" / "local.sh"), "--dry-run", "train", "--config",
                         str(repo / "configs" / "quickstart_grpo.yaml")], env=env)
    assert "omegaconf" in loaded, "the probe saw no import of the helper"
    assert "torch" not in loaded, sorted(loaded)
