"""The documentation: the site builds with ``mkdocs build --strict`` (no broken link or anchor, no page left out of
the nav), the config reference under docs/reference/ is what the schema generates today and documents every key,
the README is a front door (<= 200 lines) whose links all resolve, and ``--print-config`` prints the config a run
would use without starting anything."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import config_reference  # noqa: E402
import mkdocs_readme  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs site, built as ``mkdocs build --strict`` builds it."""
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site_dir


def test_the_site_builds_strictly(site):
    assert (site / "reference" / "grpo" / "index.html").is_file()


def test_the_site_s_front_page_is_the_readme_with_its_links_rewritten(site):
    """docs/index.md is no copy of the README (which drifted): the hook mkdocs.yml names gives the front page the
    README's text when the site is built, with its links into docs/ made the site's."""
    readme = (REPO / "README.md").read_text()
    page = mkdocs_readme.site_front_page(readme)
    assert "](docs/" not in page and "](quickstart.md)" in page and "](img/pipeline_seeds_sparse.png)" in page
    changed = [(old, new) for old, new in zip(readme.splitlines(), page.splitlines()) if old != new]
    assert len(page.splitlines()) == len(readme.splitlines()) and changed  # only the lines with links into docs/
    assert all(new == old.replace("](docs/", "](") for old, new in changed)
    stub = (REPO / "docs" / "index.md").read_text()
    front = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    other = SimpleNamespace(file=SimpleNamespace(src_uri="training.md"))
    assert mkdocs_readme.on_page_markdown(stub, front, None, None) == page
    assert mkdocs_readme.on_page_markdown("# Training", other, None, None) == "# Training"
    assert len(stub.splitlines()) <= 5  # a pointer to the README, not a second copy

    built = (site / "index.html").read_text()
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)  # not the commands' comments
    for heading in re.findall(r"^#{1,3} (.+)$", prose, re.MULTILINE):  # every section of the README, as rendered
        assert f">{html.escape(heading.replace('`', ''), quote=False)}<" in re.sub(r"</?code>", "", built), heading
    assert 'href="quickstart/"' in built and 'src="img/pipeline_seeds_sparse.png"' in built
    assert 'href="docs/' not in built


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
