"""Runs ``grpo-mega`` as a user does, in a child interpreter of the tests' Python, from the repository: the tests'
one runner of the command, and the PRM command tests' config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
PRM_CONFIG = CONFIGS / "quickstart_prm.yaml"


def run_grpo_mega(*argv: str, timeout: float = 600, cwd: Path | str = REPO,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``grpo-mega ARGV...`` to its end, run in ``cwd`` (stdout and stderr captured as text); raises
    subprocess.TimeoutExpired past ``timeout`` seconds rather than letting a hung command hold the suite.

    The child imports this checkout's grpo_mega whatever the editable install points at (the repository is put
    first on its ``PYTHONPATH``); ``env`` adds or replaces variables of the tests' environment."""
    path = os.pathsep.join(part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part)
    environment = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run([sys.executable, "-m", "grpo_mega.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=environment)
