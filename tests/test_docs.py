"""The documentation: the site builds with ``mkdocs build --strict`` (no broken link or anchor, no page left out of
the nav), the config reference under docs/reference/ is what the schema generates today and documents every key,
the README is a front door (<= 200 lines) whose links all resolve, and ``--print-config`` prints the config a run
would use without starting anything."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import config_reference  # noqa: E402


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "grpo" / "index.html").is_file()


def test_the_checked_in_config_reference_is_current():
    done = subprocess.run([sys.executable, str(REPO / "tools" / "config_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_every_config_key_has_a_description():
    assert config_reference.undocumented() == []


def test_the_reference_lists_every_key_with_its_default_and_allowed_values():
    from grpo_mega.config import GRPOConfig, config_yaml

    page = (REPO / "docs" / "reference" / "grpo.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.MULTILINE))

    def keys(tree, prefix=""):
        for name, value in tree.items():
            if isinstance(value, dict):
                yield from keys(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    assert listed == set(keys(yaml.safe_load(config_yaml(GRPOConfig()))))
    row = next(line for line in page.splitlines() if line.startswith("| `algorithm.step_credit`"))
    assert "'sum', 'min'" in row and "`'sum'`" in row and "PURE" in row


def test_a_key_without_a_docstring_is_caught(monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: int = 2

    keys = [key for _, _, found in config_reference.collect(Section, {}) for key in found]
    assert [(key.name, bool(key.description)) for key in keys] == [("documented", True), ("bare", False)]


def test_readme_is_a_front_door_whose_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links into docs/"
    assert [link for link in local if not (REPO / link).exists()] == []


@pytest.mark.parametrize("argv, key, value", [
    (["train", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--nproc", "8", "optim.lr=3e-7"], "optim.lr", 3e-7),
    (["sft", "--config", "configs/quickstart_sft.yaml", "model.hf_config=x", "data.train_file=y"], "trainer.run_dir",
     "runs/sft"),
    (["prm", "train", "--config", "configs/quickstart_prm.yaml", "model.hf_config=x", "data.train_file=y"],
     "prm.layout", "likelihood"),
])
def test_print_config_prints_the_resolved_config_and_starts_nothing(capsys, argv, key, value):
    from grpo_mega.cli import main

    assert main([*argv, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    node = printed
    for part in key.split("."):
        node = node[part]
    assert node == value
    if argv[0] == "train":  # resolved: rollout.tensor_parallel null -> parallel.tensor, defaults filled in
        assert printed["rollout"]["tensor_parallel"] == printed["parallel"]["tensor"] == 4
        assert printed["algorithm"]["step_credit"] == "sum" and printed["rollout"]["max_num_seqs"] is None
