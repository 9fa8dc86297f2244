"""Runs ``grpo-mega`` as a user does, in a child interpreter of the tests' Python (the worktree's code first on
``PYTHONPATH`` reaches it through the environment): the PRM command tests' runner and their config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRM_CONFIG = CONFIGS / "quickstart_prm.yaml"


def run_grpo_mega(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``grpo-mega ARGV...`` to its end (stdout and stderr captured as text); raises subprocess.TimeoutExpired past
    ``timeout`` seconds rather than letting a hung command hold the suite."""
    return subprocess.run([sys.executable, "-m", "grpo_mega.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)
