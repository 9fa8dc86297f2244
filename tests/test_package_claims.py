"""The package installs and the docs claim only what exists."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Default dependencies used without an import statement of their own in our code, and why.
USED_INDIRECTLY = {
    "tensorboard": "torch.utils.tensorboard.SummaryWriter needs it (grpo_mega/run/metrics.py)",
    "psutil": "megatron-core dist_checkpointing's async writer imports it",
    "sentencepiece": "transformers loads sentencepiece tokenizers (Llama-family) with it",
    "protobuf": "sentencepiece tokenizer files are protobuf",
    "megatron-core": "imported as megatron.core",
    "pyyaml": "imported as yaml",
    "math-verify": "imported as math_verify",
}


def _sources() -> str:
    return "\n".join(p.read_text() for folder in ("grpo_mega", "tools") for p in (ROOT / folder).rglob("*.py"))


def test_every_default_dependency_is_imported_or_needed_by_one_that_is():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sources = _sources()
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        module = name.replace("-", "_")
        imported = re.search(rf"^\s*(import|from) {module}\b", sources, re.MULTILINE)
        assert imported or name in USED_INDIRECTLY, f"{name} is installed by default but nothing imports it"


def test_the_folder_map_names_only_folders_that_exist():
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("## Map of the folders"):]
    table = table[: table.find("\n## ") if "\n## " in table else len(table)]  # the map's section only
    folders = re.findall(r"^\| `([^`]+)`", table, re.MULTILINE)
    assert folders, "docs/design.md has no folder map"
    for folder in folders:
        for part in folder.split("`, `"):
            assert (ROOT / part).is_dir(), f"docs/design.md lists {part}, which does not exist"
