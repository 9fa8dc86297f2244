"""Issue 51: a command a config header or the docs print runs as printed. configs/small-model_grpo.yaml's header
switches its PRM run to outcome supervision with ``algorithm.supervision=outcome process_reward.source=function``:
the options that shape a PRM's scores (``process_reward.outcome_on_last_step``, ``step_score_weight``) no longer
block it, they are reset with a one-line warning. Validation only (``--print-config``: the paths are placeholders)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from cli_runner import run_grpo_mega

REPO = Path(__file__).resolve().parent.parent
SMALL_GRPO = REPO / "configs" / "small-model_grpo.yaml"


def header_commands(path: Path) -> tuple[list[str], list[str]]:
    """(the header's ``grpo-mega train`` command as argv after ``grpo-mega``, the outcome switch's overrides)."""
    header = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    text = re.sub(r"\s*\\\s+", " ", " ".join(header))  # continuation lines joined
    command = re.search(r"grpo-mega (train --config \S+(?: \S+=\S+)+)", text).group(1)
    switch = re.search(r"Outcome supervision only: ((?:\S+=\S+ ?)+)", text).group(1).rstrip(".").split()
    return shlex.split(command), [item.rstrip(".") for item in switch]


def test_the_small_model_header_s_outcome_switch_runs_with_a_one_line_warning():
    command, switch = header_commands(SMALL_GRPO)
    assert switch == ["algorithm.supervision=outcome", "process_reward.source=function"]
    result = run_grpo_mega(*command, *switch, "--print-config")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ignoring process_reward.outcome_on_last_step=True, " \
        "process_reward.step_score_weight=0.25" in lines[0] and "uses no PRM" in lines[0], result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["algorithm"]["supervision"] == "outcome" and resolved["process_reward"]["source"] == "function"
    assert resolved["process_reward"]["outcome_on_last_step"] is False  # reset: nothing to shape without a PRM
    assert resolved["process_reward"]["step_score_weight"] == 1.0


def test_the_header_s_prm_command_keeps_its_prm_settings():
    command, _ = header_commands(SMALL_GRPO)
    result = run_grpo_mega(*command, "--print-config")
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr[-3000:]
    resolved = yaml.safe_load(result.stdout)
    assert resolved["process_reward"]["outcome_on_last_step"] is True
    assert resolved["process_reward"]["step_score_weight"] == 0.25


def test_the_training_page_s_chat_prompt_command_validates():
    page = (REPO / "docs" / "training.md").read_text()
    block = re.search(r"```bash\n  (grpo-mega train[^`]*data\.messages_field=messages[^`]*?)\n  ```", page).group(1)
    argv = shlex.split(block.replace("\\\n", " "))[1:]
    result = run_grpo_mega(*argv, "--print-config")
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load(result.stdout)["data"]["messages_field"] == "messages"
