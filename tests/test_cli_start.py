"""What the command's own process does before it hands its work off (grpo_mega.cli): every command the suite starts
pays it, so it stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _probe(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)


def test_a_grpo_mega_command_line_is_parsed_without_the_prm_commands_modules_and_the_config_s():
    code = ("import json, sys\nfrom grpo_mega.cli import _parse\n"
            "args = _parse(['train', 'a=1', '--config', 'c.yaml', '--nproc', '2', 'b=2'])\n"
            "print(json.dumps([args.command, args.config, args.nproc, args.overrides,"
            " sorted(m for m in sys.modules if m.startswith(('prm.', 'omegaconf', 'grpo_mega.config')))]))")
    result = _probe(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == ["train", "c.yaml", 2, ["a=1", "b=2"], []]


def test_prm_is_still_named_in_a_mistyped_command_s_usage_and_its_commands_parse():
    code = ("from grpo_mega.cli import _parse\n"
            "args = _parse(['prm', 'train', '--config', 'p.yaml', 'x=1'])\n"
            "print(args.command, args.prm_command, args.config, args.overrides)\n"
            "_parse(['train', '--config', 'c.yaml', '--bogus'])\n")
    result = _probe(code)
    assert result.stdout == "prm train p.yaml ['x=1']\n"
    assert result.returncode == 2
    assert "usage: grpo-mega [-h] {train,sft,eval,quickstart,plan,prm} ..." in result.stderr
    assert "unrecognized arguments: --bogus" in result.stderr
